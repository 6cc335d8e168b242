"""The engine core's transfer thread (``HandoverLink``): hand-overs sent and kept by request id,
a stalled receiver timed out and counted, unclaimed hand-overs expired, nothing left running."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest

from llm_svc.disagg.link import HandoverLink
from llm_svc.disagg.messages import FULL_PAGE, WINDOW_PAGE, Handover, KVPage
from llm_svc.disagg.transport import NONCE_BYTES, auth_tag, handover_address

pytestmark = pytest.mark.unit


def _handover(rid: str, page_bytes: int = 64) -> Handover:
    pages = [KVPage.of(FULL_PAGE, 0, 4, bytes(range(256)) * (page_bytes // 256) + bytes(page_bytes % 256)),
             KVPage.of(WINDOW_PAGE, 0, 4, b"w" * 16)]
    return Handover(rid, [1, 2, 3, 4], 9, "fp", 4, 4, pages)


def _answer(s: socket.socket, key: bytes) -> bytes:
    """The answer to the receiver's challenge, read off ``s``, made with ``key``."""
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        nonce += s.recv(NONCE_BYTES - len(nonce))
    return auth_tag(key, nonce)


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_sent_hand_over_is_kept_under_its_id_until_claimed():
    threads = threading.active_count()
    rx, tx = HandoverLink(("127.0.0.1", 0), ttl_s=60), HandoverLink(None)
    try:
        assert rx.port > 0 and tx.port == 0
        h = _handover("t1", 1 << 20)
        assert tx.send("127.0.0.1", rx.port, h).result(10) >= 0
        _until(lambda: rx.num_held == 1)
        assert rx.take("other") is None
        got = rx.take("t1")
        assert got == h and all(p.intact() for p in got.pages)
        assert rx.take("t1") is None and rx.num_held == 0
        assert tx.stats["handover_sent"] == 1 and tx.stats["handover_sent_bytes"] == h.kv_bytes
        assert rx.stats["handover_received"] == 1 and rx.stats["handover_received_bytes"] == h.kv_bytes
    finally:
        rx.close()
        tx.close()
    assert threading.active_count() == threads  # both transfer threads ended


def test_a_stalled_receiver_times_the_send_out_and_it_is_counted():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)  # accepts, never reads: the send fills the socket buffers and stalls
    tx = HandoverLink(None, timeout_s=0.5)
    try:
        fut = tx.send("127.0.0.1", srv.getsockname()[1], _handover("t2", 64 << 20))
        with pytest.raises(TimeoutError, match="longer than 0.5 s"):
            fut.result(10)
        assert tx.stats["handover_send_timeouts"] == 1 and tx.stats["handover_send_failures"] == 1
        assert tx.stats["handover_sent"] == 0
        closed = HandoverLink(None, timeout_s=2.0)
        try:
            port = srv.getsockname()[1]
            srv.close()  # nothing listens now: refused at once, a failure but not a timeout
            with pytest.raises(OSError):
                closed.send("127.0.0.1", port, _handover("t3")).result(10)
            assert closed.stats["handover_send_failures"] == 1 and closed.stats["handover_send_timeouts"] == 0
        finally:
            closed.close()
    finally:
        srv.close()
        tx.close()


def test_unclaimed_hand_overs_expire_and_a_cut_one_is_kept_as_it_came():
    rx = HandoverLink(("127.0.0.1", 0), ttl_s=0.2)
    try:
        tx = HandoverLink(None)
        try:
            tx.send("127.0.0.1", rx.port, _handover("old")).result(10)
        finally:
            tx.close()
        _until(lambda: rx.num_held == 1)
        time.sleep(0.3)
        assert rx.expire() == 1 and rx.num_held == 0 and rx.stats["handover_expired"] == 1
        # a connection cut inside the pages: the hand-over arrives with its cut page short
        h = _handover("cut", 4096)
        head = msgspec.msgpack.encode(msgspec.structs.replace(h, pages=[msgspec.structs.replace(p, data=b"")
                                                                          for p in h.pages]))
        with socket.create_connection(("127.0.0.1", rx.port)) as s:
            s.sendall(_answer(s, b"") + len(head).to_bytes(8, "big") + head + h.pages[0].data[:100])
        _until(lambda: rx.num_held == 1)
        got = rx.take("cut")
        assert len(got.pages[0].data) == 100 and got.pages[1].data == b""
    finally:
        rx.close()


def test_only_a_peer_holding_the_token_hands_over():
    rx = HandoverLink(("127.0.0.1", 0), key=b"token-a")
    try:
        right, wrong = HandoverLink(None, key=b"token-a"), HandoverLink(None, key=b"token-b")
        try:
            right.send("127.0.0.1", rx.port, _handover("ok")).result(10)
            try:  # its bytes go out unread, or the refusal's reset reaches the sender first
                wrong.send("127.0.0.1", rx.port, _handover("forged")).result(10)
            except OSError:
                pass
        finally:
            right.close()
            wrong.close()
        _until(lambda: rx.stats["handover_auth_failures"] == 1)
        # a raw peer answering with no key: refused too, before its head is read
        with socket.create_connection(("127.0.0.1", rx.port)) as s:
            h = _handover("raw")
            head = msgspec.msgpack.encode(msgspec.structs.replace(h, pages=[msgspec.structs.replace(p, data=b"")
                                                                              for p in h.pages]))
            s.sendall(_answer(s, b"") + len(head).to_bytes(8, "big") + head)
        _until(lambda: rx.stats["handover_auth_failures"] == 2)
        _until(lambda: rx.num_held == 1)
        assert rx.take("forged") is None and rx.take("raw") is None and rx.take("ok") is not None
        assert rx.stats["handover_received"] == 1
    finally:
        rx.close()


def test_auto_binds_every_interface_and_advertises_this_hosts_address():
    bind, advertised = handover_address("auto")
    assert bind == "0.0.0.0" and socket.inet_aton(advertised)
    assert handover_address("decode-0.example") == ("decode-0.example", "decode-0.example")
