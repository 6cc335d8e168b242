"""Engines and steps the prefill / decode hand-over tests share (``tests/integration/test_disagg*.py``):
tiny real engines, a prefill side, the loopback TCP transport, a decode side, and the checks that
nothing leaked."""

from __future__ import annotations

import asyncio

import torch

from llm_svc.core.convert import request_from_core, to_core_add
from llm_svc.disagg.decode import DecodeSide
from llm_svc.disagg.prefill import PrefillConfig, PrefillSide, kv_fingerprint
from llm_svc.disagg.transport import GREETING_BYTES, TcpReceiver, TcpSender, answer, frames
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.engine.spec import SpeculativeConfig
from llm_svc.engine.speculate import Speculator
from llm_svc.models import build_model
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from tests.conftest import SMALL_W

W = SMALL_W
PAGE = 16
LENGTHS = (101, 40, 7)  # past the window by several windows (a short last page), past it, inside it


def make_engine(lm, num_full=700, extra_swa=40, spec: dict | None = None) -> Engine:
    model = build_model(lm.arch, lm.model)
    cfg = SchedulerConfig(window=model.window, max_batch_tokens=48, max_running=6)
    num_swa = cfg.min_swa_slots() + extra_swa
    runner = ModelRunner(model, num_full, num_swa)
    sc = SpeculativeConfig.parse(spec)
    speculator = None
    if sc is not None:
        mtp = None
        if sc.method == "mtp":
            from llm_svc.engine.mtp_runner import MTPRunner

            sc = sc.with_mtp_layers(len(lm.model.mtp))
            mtp = MTPRunner(runner, lm.model.mtp[:sc.num_speculative_tokens], lm.model.get_input_embeddings(),
                            lm.model.get_output_embeddings(), model.window)
        speculator = Speculator(sc, lm.eos_token_ids, mtp)
    return Engine(runner, Scheduler(cfg, num_full, num_swa), lm.eos_token_ids, speculator=speculator)


def preps(lm, seed=0, max_tokens=10) -> list[PreparedRequest]:
    g = torch.Generator().manual_seed(seed)
    return [PreparedRequest(request_id=f"r{i}", prompt_ids=torch.randint(20, lm.vocab_size, (n,), generator=g).tolist(),
                            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, n in enumerate(LENGTHS)]


def request(engine: Engine, prep: PreparedRequest):
    return request_from_core(to_core_add(prep, epoch=0), engine.runner.device, None, engine.eos_token_ids)


def drain(engine: Engine, step=None, max_steps=2000) -> dict[str, list[int]]:
    """Step until idle; request id -> its emitted token ids (the integrity checked every step)."""
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for t in (step or engine.step)():
            assert t.error is None, t.error
            if t.token_id is not None:
                out.setdefault(t.request_id, []).append(t.token_id)
        engine.scheduler.check_integrity()
    raise AssertionError("engine did not finish")


def unified(lm, reqs, spec: dict | None = None) -> dict[str, list[int]]:
    e = make_engine(lm, spec=spec)
    for p in reqs:
        e.add(request(e, p))
    return drain(e)


def prefill_all(lm, reqs, engine: Engine | None = None):
    e = engine or make_engine(lm)
    side = PrefillSide(e, PrefillConfig(PAGE, kv_fingerprint(e)))
    for p in reqs:
        side.add(request(e, p))
    handovers = []
    for _ in range(2000):
        if not side.has_work():
            break
        got = side.step()
        assert not got.failed
        handovers.extend(got.handovers)
        e.scheduler.check_integrity()
    assert sorted(h.request_id for h in handovers) == sorted(p.request_id for p in reqs)
    return e, side, handovers


async def through_tcp(handovers, cut: dict[str, int] | None = None):
    """Every hand-over over one loopback connection; ``cut``: request id -> bytes of its frames
    to send before closing the connection (a transfer that stops half-way)."""
    rx = await TcpReceiver.listen("127.0.0.1", 0)
    try:
        if cut:
            (rid, keep), = cut.items()
            h = next(h for h in handovers if h.request_id == rid)
            reader, writer = await asyncio.open_connection("127.0.0.1", rx.port)
            greeting = await reader.readexactly(GREETING_BYTES)  # the receiver's challenge, answered first
            writer.write(answer(b"", greeting) + b"".join(frames(h))[:keep])
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            handovers = [h for h in handovers if h.request_id != rid]
            got = [await asyncio.wait_for(rx.receive(), 10)]
        else:
            got = []
        tx = await TcpSender.connect("127.0.0.1", rx.port)
        for h in handovers:
            await tx.send(h)
        got += [await asyncio.wait_for(rx.receive(), 10) for _ in handovers]
        await tx.close()
        return got, tx.bytes_sent
    finally:
        await rx.close()


def decode_all(lm, reqs, handovers, spec: dict | None = None):
    e = make_engine(lm, spec=spec)
    side = DecodeSide(e, kv_fingerprint(e))
    by_id = {p.request_id: p for p in reqs}
    adopted = {h.request_id: side.add(request(e, by_id[h.request_id]), h) for h in handovers}
    step, cached = recording_step(side)
    return e, side, adopted, drain(e, step), cached


def recording_step(side):
    """``side.step`` that notes each request's cached prompt tokens (from its first output), and
    that note: {request id: cached tokens}."""
    cached: dict[str, int] = {}

    def step():
        outs = side.step()
        for t in outs:
            cached.setdefault(t.request_id, t.num_cached_tokens)
        return outs

    return step, cached


def assert_clean(*engines: Engine, sides: tuple[DecodeSide, ...] = ()) -> None:
    assert all(side.num_held == 0 for side in sides)  # every adopted prefix's lock released
    for e in engines:
        e.scheduler.check_integrity()
        st = e.scheduler.stats()
        assert st["running"] == st["waiting"] == 0 and e.num_live == 0
        assert st["full_free"] + st["full_cached"] == st["full_total"], st  # no slot leaked
        assert st["swa_free"] + st["swa_cached"] == st["swa_total"], st
