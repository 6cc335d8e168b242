"""Tensor and expert parallelism on CPU ranks: TP = 1, TP = 2 and EP = 2 over gloo, the same
requests through the same engine.

Workload: a published-form MiMo-V2.5 FP8 checkpoint (fused ``qkv_proj``, 8 layers: 2 full + 6
sliding, hidden 512, 16 experts of 256, top 2; written once into the cache), ``--requests``
prompts of ``--prompt`` random tokens, each generating ``--output`` tokens greedily, all
submitted at once; the engine stepped to the end in the benchmark's process (rank 0; rank 1 is
the process the engine core spawns). Each layout runs in a fresh process of its own (ranks are
pinned to their cores, so one process cannot hold two layouts), the layouts alternated over
``--reps`` rounds. Reported per layout, medians over the rounds: output tok/s, ms per engine
step, and the collectives' share of rank 0's step time (``all_reduce``, plus the pickled
broadcast of each step's inputs).

**On this 2-core machine it is a correctness and overhead figure, not a scaling one**: TP = 1
runs its GEMMs on both cores already, so a second rank adds the collectives and the second
process's overheads and splits nothing that was idle. The device script measures TP on a lent
multi-GPU machine.

    python -m benchmarks.tp_scaling [--quick | --smoke]

The last line of output is a JSON object."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import _results
from shared.cache_dir import cache_root

LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "ep2": (2, True)}


def bundle(smoke: bool) -> Path:
    from mmserve.tiny import mimo_published as mp

    name = "tp-scaling-v25-fp8" + ("-smoke" if smoke else "")
    out = cache_root() / name
    if not (out / ".done").exists():
        spec = mp.V25 if smoke else replace(mp.V25, hidden=512, heads=8, kv_heads=4, swa_heads=8, swa_kv_heads=4,
                                            head_dim=64, v_head_dim=64, intermediate=1024, moe_intermediate=256,
                                            experts=16, top_k=2, mtp_layers=0)
        mp.write_mimo_published(out, spec, sliding_window=128, layout="fused_qkv", quant="fp8")
        (out / ".done").write_text("ok")
    return out


def worker(layout: str, model: str, n_req: int, prompt: int, output: int) -> dict:
    """One layout's run in this process: build, warm up, time the workload."""
    from llm_svc.core.build import build_engine
    from llm_svc.core.ranks import start_group
    from llm_svc.loading.loader import load_lm
    from llm_svc.parallel import SINGLE, ParallelConfig
    from llm_svc.types.request import PreparedRequest
    from mmserve.testing.in_process import InProcessEngine
    from shared.schemas import SamplingParams
    from shared.settings import LLMSettings

    tp, ep = LAYOUTS[layout]
    settings = LLMSettings(model_dir=model, tensor_parallel_size=tp, enable_expert_parallel=ep,
                           kv_bytes=256 << 20, max_model_len=4096)
    par = ParallelConfig.of(settings)
    workers, group, device = (None, SINGLE, "cpu") if tp == 1 else start_group(settings, par)
    import torch

    from llm_svc.core.process import core_threads, step_threads

    torch.set_num_threads(core_threads(settings))
    t0 = time.perf_counter()
    lm = load_lm(model, device, settings.dtype, parallel=par, group=group)
    load_s = time.perf_counter() - t0
    engine = InProcessEngine(build_engine(settings, lm, threads=step_threads(settings), group=group), lm.tokenizer)
    rng = random.Random(0)

    class Sink:
        def __init__(self):
            self.n, self.done = 0, False

        def put(self, out):
            self.n += len(out.token_ids)
            self.done = self.done or out.final

    def run(tag: str, n: int) -> tuple[float, int, list[float]]:
        sinks = []
        for i in range(n):
            ids = [rng.randrange(20, lm.vocab_size) for _ in range(prompt)]
            sinks.append(Sink())
            engine.submit(PreparedRequest(f"{tag}{i}", ids, SamplingParams(max_tokens=output, ignore_eos=True)),
                          sinks[-1])
        steps: list[float] = []
        start = time.perf_counter()
        while not all(s.done for s in sinks):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        return time.perf_counter() - start, sum(s.n for s in sinks), steps

    run("warm", 2)
    group.take_comm_s()
    wall, tokens, steps = run("r", n_req)
    comm = group.take_comm_s()
    if workers is not None:
        engine.runner.stop()
        workers.stop()
        group.close()
    return {"tok_s": tokens / wall, "step_ms": 1e3 * statistics.mean(steps), "steps": len(steps),
            "comm_share": comm / sum(steps), "load_s": load_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about a minute: 2 rounds, fewer tokens")
    _results.add_mode_args(ap)
    ap.add_argument("--reps", type=int, default=None, help="rounds over the layouts (default 3; quick 2; smoke 1)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; quick 128; smoke 16)")
    ap.add_argument("--output", type=int, default=None, help="output tokens (default 64; quick 32; smoke 4)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    mode = _results.mode_of(args)
    prompt = args.prompt or {"smoke": 16, "quick": 128, "full": 256}[mode]
    output = args.output or {"smoke": 4, "quick": 32, "full": 64}[mode]
    n_req = 2 if mode == "smoke" else args.requests
    model = str(bundle(mode == "smoke"))
    if args.worker:
        print(json.dumps(worker(args.worker, model, n_req, prompt, output)))
        return 0
    reps = args.reps or {"smoke": 1, "quick": 2, "full": 3}[mode]
    runs: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    order = list(LAYOUTS)
    for rep in range(reps):
        for layout in order if rep % 2 == 0 else order[::-1]:  # alternate which side goes first
            cmd = [sys.executable, "-m", "benchmarks.tp_scaling", "--worker", layout, "--requests", str(n_req),
                   "--prompt", str(prompt), "--output", str(output)] + (["--smoke"] if mode == "smoke" else [])
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[layout].append(r)
            print(f"round {rep} {layout}: {r['tok_s']:.1f} tok/s, {r['step_ms']:.1f} ms/step, "
                  f"collectives {100 * r['comm_share']:.1f}% of the step, loaded in {r['load_s']:.2f} s", flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("tok_s", "step_ms", "comm_share", "load_s")}
           for k, v in runs.items()}
    figures = {"layouts": med, "ratios": {f"{k}_over_tp1_tok_s": med[k]["tok_s"] / med["tp1"]["tok_s"]
                                          for k in ("tp2", "ep2")},
               "requests": n_req, "prompt": prompt, "output": output, "reps": reps}
    summary = (f"TP 2 {figures['ratios']['tp2_over_tp1_tok_s']:.2f}x and EP 2 "
               f"{figures['ratios']['ep2_over_tp1_tok_s']:.2f}x TP 1's output tok/s on 2 CPU cores (gloo); "
               f"collectives {100 * med['tp2']['comm_share']:.0f}% / {100 * med['ep2']['comm_share']:.0f}% of a step")
    _results.record("tp_scaling", ap, args, figures, kind="wall-clock", baseline="one rank (TP 1) on both cores",
                    summary=summary)
    return 0


if __name__ == "__main__":
    _results.run(main)
