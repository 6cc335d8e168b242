"""Persistent slot tables: the device tables (runner) and the host mirror (simulator) agree on a
random stream of appends, resets, drops and re-admissions; a step that does not continue the
table without a reset is refused."""

from __future__ import annotations

import random

import pytest
import torch

from llm_svc.types.request import ForwardBatch, SeqForward
from llm_svc.attention.slot_tables import DeviceSlotTables, HostSlotTables, TableProtocolError

pytestmark = pytest.mark.unit
W = 8


def _seq(rid, start, n, rng, reset: bool, truth) -> SeqForward:
    s0 = max(0, start - W + 1)
    full = truth.setdefault(rid, ([], []))[0]
    swa = truth[rid][1]
    if reset:  # the view was rewritten: every old position moves to new slots
        full[:] = [rng.randrange(10**6) for _ in range(start)]
        swa[:] = [-1] * s0 + [rng.randrange(10**6) for _ in range(start - s0)]
    out_f = [rng.randrange(10**6) for _ in range(n)]
    out_s = [rng.randrange(10**6) for _ in range(n)]
    full.extend(out_f)
    swa.extend(out_s)
    return SeqForward(rid, [1] * n, start, out_f, out_s, s0, True,
                      reset_full=full[:start] if reset else None, reset_swa=swa[s0:start] if reset else None)


@pytest.mark.parametrize("seed", range(4))
def test_device_tables_match_host_tables(seed):
    rng = random.Random(seed)
    dev, host = DeviceSlotTables(rows=2, capacity=4), HostSlotTables()  # tiny: rows and capacity grow
    truth: dict[str, tuple[list[int], list[int]]] = {}
    length: dict[str, int] = {}
    for step in range(60):
        dropped = [r for r in list(length) if rng.random() < 0.1]
        for r in dropped:
            del length[r]
            truth.pop(r)
        seqs = []
        for i in range(rng.randint(1, 6)):
            rid = f"r{i}"
            if rid in length:
                n = 1 if rng.random() < 0.7 else rng.randint(2, 20)
                seqs.append(_seq(rid, length[rid], n, rng, reset=rng.random() < 0.1, truth=truth))
            else:  # (re-)admission: a reset, maybe with a cached prefix
                start = rng.choice([0, rng.randint(1, 40)])
                seqs.append(_seq(rid, start, rng.randint(1, 12), rng, reset=True, truth=truth))
            length[rid] = seqs[-1].end
        batch = ForwardBatch(seqs, dropped=dropped)
        st = dev.apply(batch)
        host.apply(batch)
        for sf, row in zip(seqs, st.rows):
            full, swa = truth[sf.req_id]
            assert host.ctx_full(sf) == full[: sf.end] == st.full[row, : sf.end].tolist()
            assert host.ctx_swa(sf) == swa[sf.swa_ctx_start: sf.end] == st.swa[row, sf.swa_ctx_start: sf.end].tolist()
    assert set(dev.row_of) == set(length)
    assert len(set(dev.row_of.values())) == len(dev.row_of)  # no row shared


def test_a_gap_without_reset_is_refused():
    for tables in (DeviceSlotTables(), HostSlotTables()):
        tables.apply(ForwardBatch([SeqForward("a", [1, 2], 0, [5, 6], [5, 6], 0, True)]))
        with pytest.raises(TableProtocolError):
            tables.apply(ForwardBatch([SeqForward("a", [3], 3, [7], [7], 0, True)]))  # position 2 missing
        with pytest.raises(TableProtocolError):  # a request the runner has never seen must start at 0
            tables.apply(ForwardBatch([SeqForward("b", [3], 4, [7], [7], 0, True)]))


def test_dropped_rows_are_reused():
    tables = DeviceSlotTables(rows=1, capacity=2)
    tables.apply(ForwardBatch([SeqForward("a", [1], 0, [3], [3], 0, True)]))
    st = tables.apply(ForwardBatch([SeqForward("b", [1, 2, 3], 0, [4, 5, 6], [4, 5, 6], 0, True)], dropped=["a"]))
    assert st.rows == [0] and tables.full.shape == (1, 4)
    assert st.full[0, :3].tolist() == [4, 5, 6] and torch.equal(st.full, tables.full)
