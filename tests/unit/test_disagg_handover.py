"""The hand-over's checks and wire without a model: every way a hand-over can be wrong is caught
by ``decode.check`` with its reason, the TCP wire round-trips and yields a cut transfer as short
pages (never as a wrong hand-over), and the bytes a hand-over moves on MiMo-V2.5-Pro's geometry."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from llm_svc.disagg.decode import check
from llm_svc.disagg.messages import (FULL_PAGE, WINDOW_PAGE, Handover, KVPage, full_attention_bytes,
                                     handover_bytes)
from llm_svc.disagg.transport import GREETING_BYTES, HandoverProtocol, TransferError, answer, frames
from llm_svc.types.request import Request

pytestmark = pytest.mark.unit

F, S, W, P, N = 6, 4, 4, 4, 10  # bytes per token of the full / sliding layers, window, page, prompt
FP = "fp"


def handover(n: int = N) -> Handover:
    pages = [KVPage.of(FULL_PAGE, a, min(P, n - a), bytes((a + i) % 251 for i in range(min(P, n - a) * F)))
             for a in range(0, n, P)]
    w0 = max(0, n - W)
    pages.append(KVPage.of(WINDOW_PAGE, w0, n - w0, bytes(range(7, 7 + (n - w0) * S))))
    return Handover("r", list(range(100, 100 + n)), 5, FP, P, W, pages)


def req(n: int = N) -> Request:
    return Request("r", list(range(100, 100 + n)))


def why(h: Handover, r: Request | None = None) -> str | None:
    return check(h, r or req(len(h.prompt_ids)), FP, W, F, S)


def with_page(h: Handover, i: int, **changes) -> Handover:
    pages = list(h.pages)
    pages[i] = msgspec.structs.replace(pages[i], **changes)
    return msgspec.structs.replace(h, pages=pages)


def test_an_intact_handover_passes_and_moves_the_full_layers_and_one_window():
    h = handover()
    assert why(h) is None
    assert [(p.kind, p.start, p.tokens) for p in h.pages] == [
        (FULL_PAGE, 0, 4), (FULL_PAGE, 4, 4), (FULL_PAGE, 8, 2), (WINDOW_PAGE, 6, 4)]
    assert h.kv_bytes == handover_bytes(N, F, S, W) == N * F + W * S
    assert why(handover(3)) is None  # a prompt inside the window: its window is the whole prompt


@pytest.mark.parametrize("change, reason", [
    (lambda h: msgspec.structs.replace(h, request_id="other"), "mismatch"),
    (lambda h: msgspec.structs.replace(h, prompt_ids=h.prompt_ids[:-1] + [1]), "mismatch"),
    (lambda h: msgspec.structs.replace(h, fingerprint="another model"), "fingerprint"),
    (lambda h: msgspec.structs.replace(h, window=W + 1), "fingerprint"),
    (lambda h: msgspec.structs.replace(h, pages=[]), "no_kv"),
    (lambda h: msgspec.structs.replace(h, pages=h.pages[:1] + h.pages[2:]), "layout"),  # a page missing
    (lambda h: msgspec.structs.replace(h, pages=h.pages[:-1]), "layout"),  # the window missing
    (lambda h: msgspec.structs.replace(h, pages=[h.pages[1], h.pages[0], *h.pages[2:]]), "layout"),
    (lambda h: with_page(h, 0, nbytes=P * F - 1), "length"),
    (lambda h: with_page(h, 3, nbytes=W * S + 2), "length"),
    (lambda h: with_page(h, 1, data=h.pages[1].data[:-1]), "truncated"),
    (lambda h: with_page(h, 3, data=b""), "truncated"),
    (lambda h: with_page(h, 1, data=bytes(P * F)), "digest"),  # zeroed
    (lambda h: with_page(h, 3, data=h.pages[3].data[::-1]), "digest"),
])
def test_every_defect_is_named(change, reason):
    assert why(change(handover())) == reason


def test_a_page_relabelled_onto_other_positions_fails_its_digest():
    h = handover()
    a, b = h.pages[0], h.pages[1]  # same size: swap their bytes, keep the headers
    h = with_page(with_page(h, 0, data=b.data, digest=b.digest), 1, data=a.data, digest=a.digest)
    assert why(h) == "digest"


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


def read_all(blob: bytes, chunk: int = 7, key: bytes = b"", answer_key: bytes | None = None,
             **limits) -> list[Handover | str]:
    """What the receiver's protocol (its token ``key``) makes of ``blob`` arriving ``chunk``
    bytes at a time, after the sender's answer to its challenge (made with ``answer_key``,
    by default ``key``), then the connection closing: hand-overs, or ``error: ...``."""
    q: asyncio.Queue = asyncio.Queue()
    proto = HandoverProtocol(q, key=key, **limits)
    t = _Transport()
    proto.connection_made(t)
    assert len(t.written) == GREETING_BYTES and t.written.endswith(b"T")  # the challenge goes out first
    blob = answer(key if answer_key is None else answer_key, t.written) + blob
    for i in range(0, len(blob), chunk):
        part = blob[i:i + chunk]
        while part:
            buf = proto.get_buffer(len(part))
            n = min(len(buf), len(part))
            buf[:n] = part[:n]
            proto.buffer_updated(n)
            part = part[n:]
    proto.connection_lost(None)
    out = []
    while not q.empty():
        got = q.get_nowait()
        out.append(f"error: {got}" if isinstance(got, TransferError) else got)
    return out


def test_a_peer_without_the_token_is_refused_before_its_head_is_read():
    h = handover()
    blob = b"".join(frames(h))
    assert read_all(blob, key=b"secret") == [h]
    for wrong in (b"", b"secret2"):
        (got,) = read_all(blob, key=b"secret", answer_key=wrong)
        assert got.startswith("error: a hand-over peer did not answer the challenge")
    q: asyncio.Queue = asyncio.Queue()
    a, b = HandoverProtocol(q), HandoverProtocol(q)
    ta, tb = _Transport(), _Transport()
    a.connection_made(ta)
    b.connection_made(tb)
    assert ta.written != tb.written  # a fresh challenge per connection: an answer cannot be replayed


def test_the_wire_round_trips_and_a_cut_is_short_pages_or_an_error():
    h, h2 = handover(), handover(3)
    two = b"".join(frames(h)) + b"".join(frames(h2))
    for chunk in (1, 7, len(two)):
        assert read_all(two, chunk) == [h, h2]
    assert read_all(b"") == []  # a connection closed between hand-overs
    head, *pages = frames(h)
    for cut in range(1, len(head)):  # inside the length or the head: an error, no hand-over
        (got,) = read_all(head[:cut])
        assert got.startswith("error: ")
    blob = b"".join([head, *pages])
    for cut in range(len(head), len(blob)):
        (got,) = read_all(blob[:cut])
        assert isinstance(got, Handover) and got.prompt_ids == h.prompt_ids
        assert why(got) == ("truncated" if cut < len(blob) else None)


def test_a_head_too_big_or_malformed_is_an_error():
    (got,) = read_all((1 << 40).to_bytes(8, "big") + b"x" * 100)
    assert got.startswith("error: hand-over head of")
    (got,) = read_all((5).to_bytes(8, "big") + b"\xc1\xc1\xc1\xc1\xc1")
    assert got.startswith("error: hand-over head unreadable")


def test_mimo_v25_pro_moves_under_a_fifth_of_a_full_attention_transfer():
    from benchmarks.kv_capacity import geometry_from_config

    g = geometry_from_config()  # 10 full + 60 sliding layers, W = 128
    f, s = g.full_token_bytes, g.swa_token_bytes

    def ratio(n):
        return handover_bytes(n, f, s, g.window) / full_attention_bytes(n, f, s)

    assert ratio(g.window) == 1.0  # a prompt inside the window: nothing to leave out
    assert ratio(4096) == pytest.approx(0.1696, abs=1e-4) and ratio(4096) <= 0.2
    assert ratio(32768) == pytest.approx(0.1462, abs=1e-4)
    assert ratio(1 << 24) == pytest.approx(f / (f + s), abs=1e-4)  # the geometry's limit, 1/7


def test_a_head_announcing_more_than_the_bound_is_refused_before_anything_is_allocated():
    h = handover()
    blob = b"".join(frames(h))
    assert read_all(blob, max_bytes=h.kv_bytes) == [h]
    (got,) = read_all(blob, max_bytes=h.kv_bytes - 1)
    assert got == f"error: hand-over of {h.kv_bytes} bytes (at most {h.kv_bytes - 1})"
    huge = with_page(h, 0, nbytes=1 << 50)  # a head may claim anything: no 1 PiB buffer follows
    (got,) = read_all(frames(huge)[0])
    assert got.startswith("error: hand-over of")
