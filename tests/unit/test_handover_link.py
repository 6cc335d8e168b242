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
from llm_svc.disagg.transport import GREETING_BYTES, answer, handover_address

pytestmark = pytest.mark.unit


def _handover(rid: str, page_bytes: int = 64) -> Handover:
    pages = [KVPage.of(FULL_PAGE, 0, 4, bytes(range(256)) * (page_bytes // 256) + bytes(page_bytes % 256)),
             KVPage.of(WINDOW_PAGE, 0, 4, b"w" * 16)]
    return Handover(rid, [1, 2, 3, 4], 9, "fp", 4, 4, pages)


def _answer(s: socket.socket, key: bytes) -> bytes:
    """The answer to the receiver's challenge, read off ``s``, made with ``key``."""
    greeting = b""
    while len(greeting) < GREETING_BYTES:
        greeting += s.recv(GREETING_BYTES - len(greeting))
    return answer(key, greeting)


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


# ---------------------------------------------------------------- the pages by NIXL (kv_transport nixl)
def test_a_hand_over_by_nixl_arrives_whole_and_its_buffer_is_reused_once_dropped():
    from llm_svc.disagg.nixl_agent import nixl_available

    assert nixl_available()  # installed by scripts/setup.sh --test (the nixl extra)
    rx, tx = HandoverLink(("127.0.0.1", 0), transport="nixl"), HandoverLink(None, transport="nixl")
    try:
        pool = rx._nixl.pool
        h = _handover("n1", 3 << 20)
        tx.send("127.0.0.1", rx.port, h).result(30)
        _until(lambda: rx.num_held == 1)
        got = rx.take("n1")
        assert got == h and all(p.intact() for p in got.pages)
        assert isinstance(got.pages[0].data, memoryview)  # landed in the registered buffer, not copied
        assert tx.stats["handover_sent_nixl"] == 1 and rx.stats["handover_received_bytes"] == h.kv_bytes
        assert pool.in_use == 1 and pool.free_bytes == 0
        del got  # the last user lets go: the buffer goes back to the pool
        tx.send("127.0.0.1", rx.port, _handover("n2", 1 << 20)).result(30)
        _until(lambda: rx.num_held == 1)
        second = rx.take("n2")
        assert all(p.intact() for p in second.pages)
        assert pool.in_use == 1 and pool.free_bytes == 0  # the first buffer again, no second one
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("rx_transport,tx_transport", [("nixl", "tcp"), ("tcp", "nixl")])
def test_a_peer_without_nixl_hands_over_on_the_stream(rx_transport, tx_transport):
    rx, tx = HandoverLink(("127.0.0.1", 0), transport=rx_transport), HandoverLink(None, transport=tx_transport)
    try:
        h = _handover("mixed", 1 << 20)
        tx.send("127.0.0.1", rx.port, h).result(30)
        _until(lambda: rx.num_held == 1)
        got = rx.take("mixed")
        assert got == h and all(p.intact() for p in got.pages)
        assert tx.stats["handover_sent"] == 1 and tx.stats["handover_sent_nixl"] == 0
    finally:
        rx.close()
        tx.close()


def _nixl_head(s: socket.socket, h: Handover) -> bytes:
    """As a NIXL sender: answer the challenge asking for mode N, send ``h``'s head; the
    receiver's reply (its metadata and descriptors)."""
    greeting = b""
    while len(greeting) < GREETING_BYTES:
        greeting += s.recv(GREETING_BYTES - len(greeting))
    assert greeting.endswith(b"N")  # the receiver offers NIXL
    head = msgspec.msgpack.encode(msgspec.structs.replace(h, pages=[msgspec.structs.replace(p, data=b"")
                                                                      for p in h.pages]))
    s.sendall(answer(b"", greeting, b"N") + len(head).to_bytes(8, "big") + head)
    n = int.from_bytes(s.recv(8, socket.MSG_WAITALL), "big")
    return s.recv(n, socket.MSG_WAITALL)


@pytest.mark.parametrize("end", ["cut", "failed"])
def test_a_nixl_sender_that_stops_before_its_write_is_done_leaves_empty_pages_and_no_reused_buffer(end):
    rx = HandoverLink(("127.0.0.1", 0), transport="nixl")
    try:
        h = _handover(f"stop-{end}", 1 << 20)
        with socket.create_connection(("127.0.0.1", rx.port)) as s:
            metadata, descs = msgspec.msgpack.decode(_nixl_head(s, h), type=tuple[bytes, bytes])
            assert metadata and descs
            if end == "failed":
                s.sendall(b"E")  # its WRITE failed
        _until(lambda: rx.num_held == 1)
        got = rx.take(h.request_id)
        assert [p.data for p in got.pages] == [b"", b""] and not any(p.intact() for p in got.pages)
        pool = rx._nixl.pool
        assert pool.in_use == 0 and pool.free_bytes == 0  # deregistered: a late WRITE lands nowhere reused
    finally:
        rx.close()


def test_a_tcp_only_receiver_refuses_a_peer_asking_for_nixl():
    rx = HandoverLink(("127.0.0.1", 0), transport="tcp")
    try:
        with socket.create_connection(("127.0.0.1", rx.port)) as s:
            greeting = s.recv(GREETING_BYTES, socket.MSG_WAITALL)
            assert greeting.endswith(b"T")
            s.sendall(answer(b"", greeting, b"N"))
        _until(lambda: rx.stats["handover_receive_errors"] == 1)
        assert rx.num_held == 0
    finally:
        rx.close()


# ---------------------------------------------------------------- the hand-over port's limits
def test_a_silent_peer_is_cut_after_the_idle_limit_and_a_stalled_transfer_arrives_cut():
    rx = HandoverLink(("127.0.0.1", 0), timeout_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", rx.port)) as s:  # connects, never answers
            _until(lambda: rx.stats["handover_receive_errors"] == 1, 5)
            s.settimeout(5)
            assert s.recv(4096, socket.MSG_WAITALL)[GREETING_BYTES:] == b""  # closed by the receiver
        h = _handover("stalled", 4096)
        head = msgspec.msgpack.encode(msgspec.structs.replace(h, pages=[msgspec.structs.replace(p, data=b"")
                                                                          for p in h.pages]))
        with socket.create_connection(("127.0.0.1", rx.port)) as s:  # stops inside its first page
            s.sendall(_answer(s, b"") + len(head).to_bytes(8, "big") + head + h.pages[0].data[:100])
            _until(lambda: rx.num_held == 1, 5)
        got = rx.take("stalled")
        assert len(got.pages[0].data) == 100 and not got.pages[0].intact() and got.pages[1].data == b""
        _until(lambda: rx._receiver.gate.open == 0, 5)  # both connections' places given back
    finally:
        rx.close()


def test_connections_past_the_limit_are_refused_and_the_port_still_serves_once_they_close():
    rx = HandoverLink(("127.0.0.1", 0), max_connections=2)
    tx = HandoverLink(None)
    try:
        held = [socket.create_connection(("127.0.0.1", rx.port)) for _ in range(2)]
        _until(lambda: rx._receiver.gate.open == 2)
        extra = socket.create_connection(("127.0.0.1", rx.port))
        _until(lambda: rx.stats["handover_receive_errors"] == 1)
        extra.settimeout(5)
        assert extra.recv(64) == b""  # refused: closed without a challenge
        extra.close()
        for s in held:
            s.close()
        _until(lambda: rx._receiver.gate.open == 0)
        tx.send("127.0.0.1", rx.port, _handover("after")).result(10)
        _until(lambda: rx.num_held == 1)
        assert all(p.intact() for p in rx.take("after").pages)
    finally:
        rx.close()
        tx.close()
