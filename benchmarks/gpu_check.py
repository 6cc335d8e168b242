"""The one prepared script for a lent GPU (H200): is our engine right and how fast is it there.

    python -m benchmarks.gpu_check [--device cuda] [--quick]

Parts (each in its own try/except; an error is recorded in the JSON and the next part runs):

* ``logits``: the tiny MiMo and the tiny Gemma 3 (``mmserve.tiny_model``), float32 on the device.
  Three greedy requests (prompts 40/150/300 tokens, past the window of 128) run together
  through ``build_engine`` + ``submit``/``step``; every step's logits (captured around
  ``engine.runner.run``) are compared with one teacher-forced transformers forward of
  prompt + output on the same device: max abs diff, and how many greedy tokens agree with the
  reference argmax and with ``generate``.
* ``sampling``: the sampler on the device (greedy + seeded + unseeded rows, B=64, V=32768): time
  per call, and through the engine a mixed batch (greedy, seeded, unseeded) on the tiny MiMo:
  no step fails, the seeded request repeats across runs, the greedy one equals the greedy run.
* ``throughput``: a random text-only MiMo (hidden 1024, 16 layers = 2 x (1 full + 7 sliding),
  16 q / 4 kv heads of 128, dense MLP 4096, vocab 32768, ~350 M parameters; bfloat16 on cuda):
  output tok/s at 1 / 16 / 64 concurrent greedy requests (prompts 128 tokens, 128 output
  tokens, ``ignore_eos``), and the median decode step time.
* ``bandwidth``: each decode step against the memory-bandwidth bound of reading the weights
  (all parameters but the input embedding) + the KV the step attends to (full layers: the whole
  context; sliding layers: the window), at ``--hbm-tbps`` (4.8 for an H200).
* ``paged_attention`` (CUDA only; on the cpu it is skipped with the reason recorded): the
  ``triton_paged`` attention backend against ``sdpa``, each set on the engine's runner
  (``runner.attn``, what ``LLMSettings.attention_backend`` selects at start). (1) The tiny MiMo and Gemma 3
  (float32, the ``logits`` prompts): every step's logits of the two backends, max abs diff and
  whether the greedy tokens agree. (2) The ``throughput`` model (bfloat16): median decode step
  time per backend at ``--paged-seqs`` sequences x ``--paged-ctx`` tokens of context (16 x 4096),
  and one full layer's attention alone (prepare once, forward timed) at the same shape.
* ``cuda_graphs`` (CUDA only): decode steps replayed from CUDA graphs (``cuda_graphs``,
  ``llm_svc.engine.decode_graphs``) against the same engine eager, both on ``triton_paged``:
  every step's logits on the tiny MiMo and Gemma 3 (float32) and the tiny MiMo in bfloat16 (its
  MoE on grouped GEMMs inside the graph), whether the graphs were recorded (and why not), how
  many steps they served; the ``throughput`` model's decode step time and output tok/s at 1 / 16 /
  64 sequences, eager and graphs alternated, and whether their greedy tokens agree.
* ``fp8`` (CUDA only): the FP8 block-scaled Triton GEMM (``llm_svc.models.triton_fp8``, W8A16,
  128x128 scales as MiMo-V2-Flash publishes them) against ``F.linear`` on the same weight
  dequantized to bfloat16: max relative difference, and time per call at 1 / 16 / 2,048 rows
  for a [4096 -> 4096] projection and one expert's [4096 -> 2 x 2048] gate-up, with the bytes
  each reads (FP8: 1 per weight; bf16: 2) as GB/s; and 8 experts' SiLU-gated product
  (``fp8_block_experts``) against the dense loop on 16 tokens, top 2.

``--quick``: fewer output tokens; on the cpu also a small "big" model (hidden 256, 4 layers,
vocab 4096), so ``--device cpu --quick`` checks the script itself (about a minute on 2 cores).
On an H200 the full run should take 3-5 minutes (estimated: no GPU was lent when this was
written; ``paged_attention`` adds about a minute); run it with a timeout that leaves room for one
rerun, e.g. ``--skip logits,sampling`` (``--skip logits,sampling,throughput``: the kernel only).
The last line of output is a JSON object with every number and every error.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import _results
from llm_svc.types.request import GenOutput, RequestStream
from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from shared.settings import LLMSettings


class _Collect(RequestStream):
    def __init__(self, rid: str):
        self.request_id, self.outs = rid, []

    def put(self, out: GenOutput) -> None:
        self.outs.append(out)

    @property
    def done(self) -> bool:
        return bool(self.outs) and self.outs[-1].final

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outs for t in o.token_ids]

    @property
    def error(self) -> str | None:
        return next((o.error for o in self.outs if o.error), None)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _make_engine(lm, device: str, max_running: int, kv_bytes: int, **settings_kw):
    from llm_svc.backends.swa import build_engine

    settings = LLMSettings(model_dir=str(lm.spec.root), backend="swa", device=device, kv_bytes=kv_bytes,
                           max_batch_tokens=512, max_running=max_running, enable_prefix_cache=False, **settings_kw)
    engine = build_engine(settings, lm)
    if not hasattr(engine, "submit"):  # the bare core Engine (add/step -> CoreToken): add the front's half
        from mmserve.testing.in_process import InProcessEngine

        engine = InProcessEngine(engine, lm.tokenizer)
    return engine


def _run(engine, reqs: list[tuple[str, list[int], SamplingParams]], device: str, step_times: list | None = None,
         max_steps: int = 100_000) -> dict[str, _Collect]:
    """Submit all, step until every stream is final; ``step_times`` gets (seconds, decode_only)."""
    streams = {rid: _Collect(rid) for rid, _, _ in reqs}
    for rid, ids, sp in reqs:
        engine.submit(PreparedRequest(rid, ids, sp), streams[rid])
    for _ in range(max_steps):
        if all(s.done for s in streams.values()):
            break
        decode_only = all(s.outs and not s.done for s in streams.values())
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        if step_times is not None:
            step_times.append((time.perf_counter() - t0, decode_only))
    else:
        raise RuntimeError(f"not finished after {max_steps} steps")
    return streams


def _prompts(n: int, lengths: list[int] | int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lens = lengths if isinstance(lengths, list) else [lengths] * n
    return [[rng.randrange(20, vocab) for _ in range(k)] for k in lens]


# ------------------------------------------------------------------ (a) logits vs transformers
def check_logits(arch: str, device: str, tmp: Path, max_tokens: int, dtype: str) -> dict:
    from mmserve.tiny_model import write_tiny_model

    lm = load_lm(str(write_tiny_model(tmp / f"tiny-{arch}", arch=arch)), device=device, dtype=dtype)
    engine = _make_engine(lm, device, max_running=8, kv_bytes=64 * 1024 * 1024)
    captured: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def capture(batch, *a, **kw):
        out = run(batch, *a, **kw)
        if isinstance(out, dict):  # {req_id: logits [V]} today; anything else: tokens only
            for rid, row in out.items():
                captured.setdefault(rid, []).append(row.detach().float().cpu())
        return out

    engine.runner.run = capture
    prompts = _prompts(3, [40, 150, 300], lm.vocab_size, seed=1)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    streams = _run(engine, [(f"q{i}", p, sp) for i, p in enumerate(prompts)], device)
    res = {"model": lm.spec.lm_architecture, "dtype": dtype, "requests": len(prompts), "max_tokens": max_tokens,
           "max_abs_diff": 0.0, "max_abs_logit": 0.0, "tokens_agree": 0, "tokens": 0, "generate_match": 0}
    m, diffs = lm.model, []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            s = streams[f"q{i}"]
            if s.error:
                raise RuntimeError(f"request q{i}: {s.error}")
            toks = s.tokens
            full = torch.tensor([p + toks[:-1]], device=device)
            ref = m(input_ids=full, attention_mask=torch.ones_like(full)).logits[0, len(p) - 1:].float().cpu()
            if f"q{i}" in captured:
                got = torch.stack(captured[f"q{i}"])  # [N, V], one row per output token
                assert got.shape == ref.shape, (got.shape, ref.shape)
                diffs.append(float((got - ref).abs().max()))
            res["max_abs_logit"] = max(res["max_abs_logit"], float(ref.abs().max()))
            res["tokens_agree"] += sum(a == b for a, b in zip(toks, ref.argmax(-1).tolist()))
            res["tokens"] += len(toks)
            ids = torch.tensor([p], device=device)
            gen = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=[], pad_token_id=0)[0, len(p):].tolist()
            res["generate_match"] += int(gen == toks)
    res["max_abs_diff"] = max(diffs) if len(diffs) == len(prompts) else None  # None: logits not captured
    engine.scheduler.check_integrity()
    return res


# ------------------------------------------------------------------ sampling on the device
def check_sampling(device: str, tmp: Path, max_tokens: int) -> dict:
    from llm_svc.engine.sampler import make_generator, sample

    B, V = 64, 32768
    logits = torch.randn(B, V, device=device)
    params = [SamplingParams(temperature=0.0) if i % 4 == 0 else
              SamplingParams(temperature=0.8, top_k=50 if i % 4 == 1 else -1, top_p=0.9 if i % 4 == 2 else 1.0,
                             seed=i if i % 2 else None) for i in range(B)]
    gens = [make_generator(p, device) for p in params]
    for _ in range(3):
        sample(logits, params, gens)
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        out = sample(logits, params, gens)
    res = {"sample_ms_b64_v32768": round((time.perf_counter() - t0) / n * 1e3, 3)}
    res["greedy_rows_ok"] = all(out[i] == int(logits[i].argmax()) for i in range(0, B, 4))

    path = tmp / "tiny-mimo"
    if not path.exists():
        from mmserve.tiny_model import write_tiny_model

        write_tiny_model(path, arch="mimo")
    lm = load_lm(str(path), device=device, dtype="float32")
    prompt = _prompts(1, 60, lm.vocab_size, seed=2)[0]
    kinds = {"greedy": SamplingParams(max_tokens=max_tokens, ignore_eos=True),
             "seeded": SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9, top_k=40, seed=123),
             "unseeded": SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, top_p=0.9)}
    runs = []
    for _ in range(2):
        engine = _make_engine(lm, device, max_running=8, kv_bytes=32 * 1024 * 1024)
        streams = _run(engine, [(k, prompt, sp) for k, sp in kinds.items()], device)
        errs = {k: s.error for k, s in streams.items() if s.error}
        if errs:
            raise RuntimeError(f"engine sampling on {device}: {errs}")
        runs.append({k: s.tokens for k, s in streams.items()})
    alone = _run(_make_engine(lm, device, 8, 32 * 1024 * 1024), [("seeded", prompt, kinds["seeded"])], device)
    res["engine_seeded_repeats"] = runs[0]["seeded"] == runs[1]["seeded"]
    res["engine_seeded_same_alone"] = alone["seeded"].tokens == runs[0]["seeded"]
    res["engine_greedy_repeats"] = runs[0]["greedy"] == runs[1]["greedy"]
    res["engine_unseeded_differs"] = runs[0]["unseeded"] != runs[1]["unseeded"]
    return res


# ------------------------------------------------------------------ (b) throughput, (c) bandwidth
def write_big_model(out: Path, hidden: int, layers: int, vocab: int, dtype: torch.dtype, device: str) -> Path:
    """A random text-only MiMo (plain HF layout): (1 full + 7 sliding) blocks, dense MLPs."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    from mmserve.tiny_model import CHATML_SPECIALS, CHATML_TEMPLATE, build_tokenizer

    tok = build_tokenizer(CHATML_SPECIALS, 640, CHATML_TEMPLATE, eos="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens([f"<x{i}>" for i in range(vocab - len(tok))])  # a realistic lm_head size
    block = min(8, layers)
    layer_types = (["full_attention"] + ["sliding_attention"] * (block - 1)) * (layers // block)
    layer_types += ["sliding_attention"] * (layers - len(layer_types))
    heads = max(1, hidden // 64)
    cfg = MiMoV2FlashConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, layer_types=layer_types, mlp_layer_types=["dense"] * layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128 if hidden >= 1024 else 64,
        v_head_dim=128 if hidden >= 1024 else 64, n_routed_experts=8, num_experts_per_tok=2, sliding_window=128,
        max_position_embeddings=8192, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False,
    )
    cfg.architectures = ["MiMoV2FlashForCausalLM"]
    if cfg.head_dim == 64:  # MiMo's 0.334 of 64 is 21 rotary dims, odd: the loader refuses it
        for rope in cfg.rope_parameters.values():
            rope["partial_rotary_factor"] = 0.5
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds, not minutes
        model = MiMoV2FlashForCausalLM(cfg).to(dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def weight_bytes(lm) -> int:
    """Bytes a decode step reads of the weights: every parameter except the input embedding
    (only B rows of it are read), unless it is tied to the output head."""
    emb = lm.model.get_input_embeddings().weight
    head = lm.model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    total = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    return total if tied else total - emb.numel() * emb.element_size()


def kv_token_bytes(engine) -> tuple[int, int, int]:
    """(full bytes/token over the full layers, sliding bytes/token over the sliding layers,
    window), from the runner's model layer specs and its KV pool dtype."""
    from llm_svc.attention import FULL

    runner = engine.runner
    size = runner.kv[0].k.element_size() if getattr(runner, "kv", None) else torch.finfo(runner.dtype).bits // 8
    full = swa = 0
    for spec in runner.model.layers:
        b = spec.kv_heads * (spec.qk_dim + spec.v_dim) * size
        full, swa = (full + b, swa) if spec.kind == FULL else (full, swa + b)
    return full, swa, runner.model.window


def check_throughput(args, tmp: Path, result: dict) -> None:
    small = args.device == "cpu" and args.quick
    hidden = args.hidden or (256 if small else 1024)
    layers = args.layers or (4 if small else 16)
    vocab = args.vocab or (4096 if small else 32768)
    dtype = "float32" if args.device == "cpu" else args.dtype
    prompt_len = 32 if small else 128
    out_len = args.max_tokens or (16 if small else (64 if args.quick else 128))
    path = write_big_model(tmp / "big", hidden, layers, vocab, getattr(torch, dtype), args.device)
    lm = load_lm(str(path), device=args.device, dtype=dtype)
    n_params = sum(p.numel() for p in lm.model.parameters())
    conc = [1, 16, 64]
    engine = _make_engine(lm, args.device, max_running=max(conc), kv_bytes=int(args.kv_gib * 2**30))
    try:
        full_b, swa_b, window = kv_token_bytes(engine)
    except Exception as e:  # the runner's internals moved: the bound then counts weights only
        result["errors"]["kv_geometry"] = f"{type(e).__name__}: {e}"
        full_b, swa_b, window = 0, 0, 0
    wbytes = weight_bytes(lm)
    _run(engine, [("warm", _prompts(1, prompt_len, vocab, 99)[0], SamplingParams(max_tokens=4))], args.device)
    tp = {"model": {"hidden": hidden, "layers": layers, "vocab": vocab, "params_m": round(n_params / 1e6, 1),
                    "dtype": dtype, "window": window},
          "prompt_tokens": prompt_len, "output_tokens": out_len, "runs": {}}
    bw = {"hbm_tbps": args.hbm_tbps, "weight_bytes": wbytes, "kv_full_bytes_per_token": full_b,
          "kv_swa_bytes_per_token": swa_b, "runs": {}}
    result["throughput"], result["bandwidth"] = tp, bw
    for n in conc:
        sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
        reqs = [(f"c{n}-{i}", p, sp) for i, p in enumerate(_prompts(n, prompt_len, vocab, seed=n))]
        steps: list[tuple[float, bool]] = []
        t0 = time.perf_counter()
        streams = _run(engine, reqs, args.device, steps)
        wall = time.perf_counter() - t0
        errs = [s.error for s in streams.values() if s.error]
        if errs:
            raise RuntimeError(f"{len(errs)} of {n} requests failed: {errs[0]}")
        decode = [t for t, d in steps if d]
        med = statistics.median(decode) if decode else float("nan")
        tp["runs"][str(n)] = {"output_tok_s": round(n * out_len / wall, 1), "wall_s": round(wall, 3),
                              "steps": len(steps), "decode_steps": len(decode),
                              "decode_step_ms_p50": round(med * 1e3, 3),
                              "decode_tok_s": round(n / med, 1) if decode else None}
        ctx = prompt_len + out_len / 2  # mean context over the decode steps
        step_bytes = wbytes + n * (ctx * full_b + min(ctx, window) * swa_b)
        bound = step_bytes / (args.hbm_tbps * 1e12)
        bw["runs"][str(n)] = {"bytes_per_step": int(step_bytes), "bound_ms": float(f"{bound * 1e3:.4g}"),
                              "measured_ms": round(med * 1e3, 3), "fraction_of_bound": float(f"{bound / med:.3g}")}
    engine.scheduler.check_integrity()


# ------------------------------------------------------------------ paged attention kernel
def _set_attention(engine, name: str, device: str) -> None:
    from llm_svc.attention import create_attention_backend

    engine.runner.attn = create_attention_backend(name, device)
    engine.runner.attn.bind_pools(engine.runner.kv_dtype)


def _paged_logits(arch: str, device: str, tmp: Path, max_tokens: int) -> dict:
    """Every step's logits of ``triton_paged`` vs ``sdpa`` on a tiny model (float32)."""
    from mmserve.tiny_model import write_tiny_model

    path = tmp / f"tiny-{arch}"
    if not path.exists():
        write_tiny_model(path, arch=arch)
    lm = load_lm(str(path), device=device, dtype="float32")
    prompts = _prompts(3, [40, 150, 300], lm.vocab_size, seed=1)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    logits, tokens = {}, {}
    for name in ("sdpa", "triton_paged"):
        engine = _make_engine(lm, device, max_running=8, kv_bytes=64 * 1024 * 1024)
        _set_attention(engine, name, device)
        got: dict[str, list[torch.Tensor]] = {}
        run = engine.runner.run

        def capture(batch, *a, _run=run, _got=got, **kw):
            out = _run(batch, *a, **kw)
            if isinstance(out, dict):  # {req_id: logits [V]}, as in check_logits
                for rid, row in out.items():
                    _got.setdefault(rid, []).append(row.detach().float().cpu())
            return out

        engine.runner.run = capture
        streams = _run(engine, [(f"q{i}", p, sp) for i, p in enumerate(prompts)], device)
        errs = {k: s.error for k, s in streams.items() if s.error}
        if errs:
            raise RuntimeError(f"{name}: {errs}")
        engine.scheduler.check_integrity()
        logits[name], tokens[name] = got, {k: s.tokens for k, s in streams.items()}
    diff, max_logit = 0.0, 0.0
    for rid, rows in logits["sdpa"].items():
        other = logits["triton_paged"].get(rid, [])
        for a, b in zip(rows, other):  # same steps while the greedy tokens agree
            diff = max(diff, float((a - b).abs().max()))
            max_logit = max(max_logit, float(a.abs().max()))
    same = sum(tokens["sdpa"][r] == tokens["triton_paged"][r] for r in tokens["sdpa"])
    return {"model": lm.spec.lm_architecture, "max_abs_diff": diff, "max_abs_logit": max_logit,
            "requests_same_tokens": same, "requests": len(prompts)}


def _attention_alone(device: str, seqs: int, ctx: int, iters: int = 50) -> dict:
    """One full layer (16 q / 4 kv heads of 128, bfloat16) at ``seqs`` decodes of ``ctx``
    context: ms per forward (K/V write + attention) of each backend, and their max abs diff."""
    from llm_svc.attention import FULL, AttentionParams, LayerKV, create_attention_backend
    from llm_svc.attention.slot_tables import DeviceSlotTables
    from llm_svc.types.request import ForwardBatch, SeqForward

    hq, hkv, d = 16, 4, 128
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(seqs * ctx, generator=gen).tolist()  # scattered slots
    batch = ForwardBatch([SeqForward(f"s{i}", [1], ctx - 1, [perm[i * ctx + ctx - 1]], [perm[i * ctx + ctx - 1]],
                                     0, True, reset_full=perm[i * ctx:i * ctx + ctx - 1],
                                     reset_swa=perm[i * ctx:i * ctx + ctx - 1]) for i in range(seqs)])
    q = torch.randn(seqs, hq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(seqs, hkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(seqs, hkv, d, device=device, dtype=torch.bfloat16)
    params = AttentionParams(scale=d ** -0.5)
    res, outs = {}, {}
    cache = LayerKV.empty(seqs * ctx, hkv, d, d, torch.bfloat16, device)  # both write the same K/V
    cache.k.normal_()
    cache.v.normal_()
    for name in ("sdpa", "triton_paged"):
        be = create_attention_backend(name, device)
        meta = be.prepare(batch, DeviceSlotTables(device).apply(batch), 128, torch.device(device))
        for _ in range(3):
            outs[name] = be.forward(FULL, q, k, v, cache, meta, params)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            be.forward(FULL, q, k, v, cache, meta, params)
        _sync(device)
        res[f"{name}_ms"] = round((time.perf_counter() - t0) / iters * 1e3, 4)
    res["max_abs_diff"] = float((outs["sdpa"].float() - outs["triton_paged"].float()).abs().max())
    kv_bytes = seqs * ctx * hkv * 2 * d * 2
    res["kv_gb_s_triton"] = round(kv_bytes / (res["triton_paged_ms"] * 1e-3) / 1e9, 1)
    return res


def check_paged_attention(args, tmp: Path, small_out: int) -> dict:
    if not args.device.startswith("cuda"):
        return {"skipped": "needs CUDA: the Triton kernel (the CPU unit tests run it under TRITON_INTERPRET=1)"}
    res: dict = {"seqs": args.paged_seqs, "ctx": args.paged_ctx}
    for arch in ("mimo", "gemma3"):
        res[f"logits_{arch}"] = _paged_logits(arch, args.device, tmp, small_out)
    res["attention_alone_full_layer"] = _attention_alone(args.device, args.paged_seqs, args.paged_ctx)
    out_len = 32
    path = tmp / "paged-big"
    if not path.exists():
        write_big_model(path, 1024, 16, 32768, getattr(torch, args.dtype), args.device)
    lm = load_lm(str(path), device=args.device, dtype=args.dtype)
    prompt_len = args.paged_ctx - out_len  # the context ends at paged_ctx (<= max_model_len 4096)
    prompts = _prompts(args.paged_seqs, prompt_len, lm.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    toks = {}
    for name in ("sdpa", "triton_paged"):
        engine = _make_engine(lm, args.device, max_running=args.paged_seqs, kv_bytes=int(args.kv_gib * 2**30))
        _set_attention(engine, name, args.device)
        _run(engine, [("warm", prompts[0][:128], SamplingParams(max_tokens=4))], args.device)
        steps: list[tuple[float, bool]] = []
        streams = _run(engine, [(f"p{i}", p, sp) for i, p in enumerate(prompts)], args.device, steps)
        errs = [s.error for s in streams.values() if s.error]
        if errs:
            raise RuntimeError(f"{name}: {len(errs)} requests failed: {errs[0]}")
        decode = [t for t, d in steps if d]
        res[f"decode_step_ms_p50_{name}"] = round(statistics.median(decode) * 1e3, 3) if decode else None
        res[f"decode_steps_{name}"] = len(decode)
        toks[name] = {k: s.tokens for k, s in streams.items()}
        del engine
        torch.cuda.empty_cache()
    res["big_model_same_tokens"] = sum(toks["sdpa"][r] == toks["triton_paged"][r] for r in toks["sdpa"])
    return res


# ------------------------------------------------------------------ CUDA graphs
def _capture_logits(engine) -> dict[str, list[torch.Tensor]]:
    got: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def capture(batch, *a, **kw):
        out = run(batch, *a, **kw)
        if isinstance(out, dict):
            for rid, row in out.items():
                got.setdefault(rid, []).append(row.detach().float().cpu())
        return out

    engine.runner.run = capture
    return got


def _graph_logits(arch: str, device: str, tmp: Path, max_tokens: int, dtype: str) -> dict:
    """Every step's logits of ``triton_paged`` eager vs the same with ``cuda_graphs`` (tiny model)."""
    from mmserve.tiny_model import write_tiny_model

    path = tmp / f"tiny-{arch}"
    if not path.exists():
        write_tiny_model(path, arch=arch)
    lm = load_lm(str(path), device=device, dtype=dtype)
    prompts = _prompts(5, [40, 150, 300, 20, 90], lm.vocab_size, seed=3)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    logits, tokens, res = {}, {}, {"model": lm.spec.lm_architecture, "dtype": dtype}
    for graphs in (False, True):
        engine = _make_engine(lm, device, max_running=8, kv_bytes=64 * 1024 * 1024, attention_backend="triton_paged",
                              cuda_graphs=graphs, cuda_graph_max_batch=8)
        name = "graphs" if graphs else "eager"
        if graphs:
            g = engine.runner.graphs
            res["graphs_on"] = g is not None
            res["graphs_error"] = getattr(engine.runner, "graphs_error", None)
        got = _capture_logits(engine)
        streams = _run(engine, [(f"q{i}", p, sp) for i, p in enumerate(prompts)], device)
        errs = {k: s.error for k, s in streams.items() if s.error}
        if errs:
            raise RuntimeError(f"{name}: {errs}")
        engine.scheduler.check_integrity()
        if graphs and engine.runner.graphs is not None:
            res["graph_steps"] = engine.runner.graphs.replays
        logits[name], tokens[name] = got, {k: s.tokens for k, s in streams.items()}
    diff = max((float((a - b).abs().max()) for rid, rows in logits["eager"].items()
                for a, b in zip(rows, logits["graphs"].get(rid, []))), default=None)
    res.update(max_abs_diff=diff, requests=len(prompts),
               requests_same_tokens=sum(tokens["eager"][r] == tokens["graphs"][r] for r in tokens["eager"]))
    return res


def check_cuda_graphs(args, tmp: Path, small_out: int) -> dict:
    """Decode steps replayed from CUDA graphs (``cuda_graphs``) against the same engine eager
    (both on ``triton_paged``): logits on the tiny models, decode step time on the big one."""
    if not args.device.startswith("cuda"):
        return {"skipped": "needs CUDA (the CPU unit tests run the same static buffers without a graph)"}
    res: dict = {}
    for arch in ("mimo", "gemma3"):
        res[f"logits_{arch}"] = _graph_logits(arch, args.device, tmp, small_out, "float32")
    res["logits_mimo_bf16"] = _graph_logits("mimo", args.device, tmp, small_out, "bfloat16")  # MoE: grouped GEMMs
    path = tmp / "graphs-big"
    if not path.exists():
        write_big_model(path, 1024, 16, 32768, getattr(torch, args.dtype), args.device)
    lm = load_lm(str(path), device=args.device, dtype=args.dtype)
    out_len = 32 if args.quick else 64
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    engines = {g: _make_engine(lm, args.device, max_running=64, kv_bytes=int(args.kv_gib * 2**30),
                               attention_backend="triton_paged", cuda_graphs=g, cuda_graph_max_batch=64)
               for g in (False, True)}
    res["big_graphs_on"] = engines[True].runner.graphs is not None
    res["big_graphs_error"] = getattr(engines[True].runner, "graphs_error", None)
    runs: dict = {}
    for n in (1, 16, 64):
        prompts = _prompts(n, 128, lm.vocab_size, seed=40 + n)
        toks = {}
        for rep, g in enumerate((False, True, True, False)):  # alternated
            name = "graphs" if g else "eager"
            steps: list[tuple[float, bool]] = []
            t0 = time.perf_counter()
            streams = _run(engines[g], [(f"g{n}-{rep}-{i}", p, sp) for i, p in enumerate(prompts)], args.device, steps)
            wall = time.perf_counter() - t0
            decode = [t for t, d in steps if d]
            r = runs.setdefault(str(n), {}).setdefault(name, {"decode_step_ms_p50": [], "output_tok_s": []})
            r["decode_step_ms_p50"].append(round(statistics.median(decode) * 1e3, 3) if decode else None)
            r["output_tok_s"].append(round(n * out_len / wall, 1))
            toks.setdefault(name, [s.tokens for s in streams.values()])
        runs[str(n)]["same_tokens"] = sum(a == b for a, b in zip(toks["eager"], toks["graphs"]))
    for e in engines.values():
        e.scheduler.check_integrity()
    if engines[True].runner.graphs is not None:
        res["big_graph_steps"] = engines[True].runner.graphs.replays
    res["big_runs"] = runs
    return res


def check_fp8(args) -> dict:
    """The FP8 block GEMM on the device against bf16 ``F.linear`` (see the module docstring)."""
    from llm_svc.models.quant import dequant_fp8_block
    from llm_svc.models.triton_fp8 import fp8_block_experts, fp8_block_linear

    if not args.device.startswith("cuda"):
        return {"skipped": "the FP8 Triton kernel runs on CUDA (its CPU test runs it under the interpreter)"}
    dev, block = torch.device(args.device), (128, 128)
    gen = torch.Generator(device=dev).manual_seed(0)

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(n, k, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn)
        sc = torch.rand(-(-n // 128), -(-k // 128), device=dev, generator=gen) * 0.02 + 0.001
        return w, sc

    def timed(fn, iters: int) -> float:
        fn()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / iters * 1000

    out: dict = {"shapes": {}}
    for name, (n, k) in {"proj_4096x4096": (4096, 4096), "expert_gate_up_4096x4096": (2 * 2048, 4096)}.items():
        w, sc = weight(n, k)
        dense = dequant_fp8_block(w, sc, block).to(torch.bfloat16)
        rows = {}
        for m in (1, 16, 2048):
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            got, want = fp8_block_linear(x, w, sc, block=block).float(), torch.nn.functional.linear(x, dense).float()
            rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            iters = 200 if m < 2048 else 50
            fp8_ms = timed(lambda: fp8_block_linear(x, w, sc, block=block), iters)
            bf16_ms = timed(lambda: torch.nn.functional.linear(x, dense), iters)
            rows[m] = {"max_rel_diff": round(rel, 5), "fp8_ms": round(fp8_ms, 4), "bf16_ms": round(bf16_ms, 4),
                       "fp8_weight_gbps": round(n * k / fp8_ms / 1e6, 1),
                       "bf16_weight_gbps": round(2 * n * k / bf16_ms / 1e6, 1),
                       "fp8_over_bf16_speed": round(bf16_ms / fp8_ms, 3)}
        out["shapes"][name] = rows
    e, h, inter, t, top = 8, 4096, 2048, 16, 2
    gu, gus = zip(*(weight(2 * inter, h) for _ in range(e)))
    dn, dns = zip(*(weight(h, inter) for _ in range(e)))
    gate_up, gate_up_scale, down, down_scale = torch.stack(gu), torch.stack(gus), torch.stack(dn), torch.stack(dns)
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, e, (t, top), device=dev, generator=gen)
    wts = torch.rand(t, top, device=dev, generator=gen)
    got = fp8_block_experts(x, idx, wts, gate_up, gate_up_scale, down, down_scale, block=block).float()
    want = torch.zeros(t, h, device=dev)
    for i in range(t):
        for j in range(top):
            ex = int(idx[i, j])
            g = x[i].float() @ dequant_fp8_block(gate_up[ex], gate_up_scale[ex], block).T
            a = torch.nn.functional.silu(g[:inter]) * g[inter:]
            want[i] += wts[i, j] * (a @ dequant_fp8_block(down[ex], down_scale[ex], block).T)
    out["experts_max_rel_diff"] = round(((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item(), 5)
    out["experts_ms"] = round(timed(lambda: fp8_block_experts(x, idx, wts, gate_up, gate_up_scale, down, down_scale,
                                                              block=block), 20), 3)
    return out


def check_tensor_parallel(args, tmp: Path, small_out: int) -> dict:
    """TP = 2 against one rank on a published-form tiny MiMo-V2.5 (fused ``qkv_proj``): the same
    greedy tokens, and each side's output tok/s. On CUDA it needs two GPUs (NCCL, one per rank);
    on the CPU it runs two gloo ranks (the path CI checks)."""
    from llm_svc.core.build import build_engine
    from llm_svc.core.ranks import start_group
    from llm_svc.loading.loader import load_lm
    from llm_svc.parallel import ParallelConfig
    from mmserve.testing.in_process import InProcessEngine
    from mmserve.tiny import mimo_published as mp
    from shared.settings import LLMSettings

    if args.device.startswith("cuda") and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU here: tensor parallelism needs two"}
    model = mp.write_mimo_published(tmp / "tp-v25", mp.V25, layout="fused_qkv")
    dtype = "float32" if args.device == "cpu" else args.dtype
    prompts = _prompts(4, [40, 70, 33, 90], 600, seed=5)
    out: dict = {"dtype": dtype}
    for tp in (1, 2):
        settings = LLMSettings(model_dir=str(model), device=args.device, dtype=dtype, tensor_parallel_size=tp,
                               kv_bytes=64 << 20, max_model_len=1024, warmup=False)
        workers, group, device = (None, None, args.device) if tp == 1 else \
            start_group(settings, ParallelConfig.of(settings), pin_self=False)
        try:
            lm = load_lm(str(model), device, dtype, parallel=ParallelConfig.of(settings), group=group)
            engine = InProcessEngine(build_engine(settings, lm, **({"group": group} if group else {})), lm.tokenizer)
            reqs = [(f"tp{tp}-{i}", ids, SamplingParams(max_tokens=small_out, ignore_eos=True))
                    for i, ids in enumerate(prompts)]
            t0 = time.perf_counter()
            toks = {rid: c.tokens for rid, c in _run(engine, reqs, device).items()}
            wall = time.perf_counter() - t0
        finally:
            if workers is not None:
                engine.runner.stop()
                workers.stop()
                group.close()
        out[f"tp{tp}"] = {"output_tok_s": round(sum(map(len, toks.values())) / wall, 1),
                          "tokens": [toks[f"tp{tp}-{i}"] for i in range(len(prompts))]}
    a, b = out["tp1"].pop("tokens"), out["tp2"].pop("tokens")
    out["requests_same_tokens"] = sum(x == y for x, y in zip(a, b))
    out["requests"] = len(prompts)
    return out


# ------------------------------------------------------------------ main
def _part(result: dict, name: str, fn, *a) -> None:
    t0 = time.perf_counter()
    try:
        out = fn(*a)
        if out is not None:
            result[name] = out
    except Exception as e:  # recorded, and the next part runs
        result["errors"][name] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    result["part_s"][name] = round(time.perf_counter() - t0, 1)


def _print_table(r: dict) -> None:
    print(f"\n== gpu_check on {r['device']} ({r.get('gpu', 'no gpu')}), torch {r['torch']}")
    for arch in ("mimo", "gemma3"):
        x = r.get(f"logits_{arch}")
        if x:
            diff = "n/a" if x["max_abs_diff"] is None else f"{x['max_abs_diff']:.2e}"
            print(f"logits {arch:7s}: max|diff| {diff} (max|logit| {x['max_abs_logit']:.2f})  "
                  f"greedy agree {x['tokens_agree']}/{x['tokens']}  generate match {x['generate_match']}/{x['requests']}")
    if "sampling" in r:
        print("sampling      : " + "  ".join(f"{k} {v}" for k, v in r["sampling"].items()))
    tp, bw = r.get("throughput"), r.get("bandwidth")
    if tp:
        m = tp["model"]
        print(f"big model     : hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}, {m['params_m']} M params, "
              f"{m['dtype']}; prompts {tp['prompt_tokens']}, {tp['output_tokens']} output tokens each")
        print(f"{'seqs':>6} {'out tok/s':>10} {'decode ms':>10} {'bound ms':>10} {'of bound':>9} {'steps':>6}")
        for n, x in tp["runs"].items():
            b = (bw or {}).get("runs", {}).get(n, {})
            print(f"{n:>6} {x['output_tok_s']:>10} {x['decode_step_ms_p50']:>10} {b.get('bound_ms', '-'):>10} "
                  f"{b.get('fraction_of_bound', '-'):>9} {x['steps']:>6}")
    pa = r.get("paged_attention")
    if pa:
        if "skipped" in pa:
            print(f"paged attn    : skipped ({pa['skipped']})")
        else:
            for arch in ("mimo", "gemma3"):
                x = pa.get(f"logits_{arch}", {})
                print(f"paged {arch:7s}: triton_paged vs sdpa max|diff| {x.get('max_abs_diff', float('nan')):.2e}  "
                      f"same tokens {x.get('requests_same_tokens')}/{x.get('requests')}")
            al = pa.get("attention_alone_full_layer", {})
            print(f"paged decode  : {pa['seqs']} x {pa['ctx']}: step ms sdpa {pa.get('decode_step_ms_p50_sdpa')} "
                  f"triton_paged {pa.get('decode_step_ms_p50_triton_paged')}; one full layer ms sdpa "
                  f"{al.get('sdpa_ms')} triton_paged {al.get('triton_paged_ms')}")
    cg = r.get("cuda_graphs")
    if cg:
        if "skipped" in cg:
            print(f"cuda graphs   : skipped ({cg['skipped']})")
        else:
            for key in ("logits_mimo", "logits_gemma3", "logits_mimo_bf16"):
                x = cg.get(key, {})
                print(f"graphs {key[7:]:11s}: on {x.get('graphs_on')} ({x.get('graph_steps')} graph steps) max|diff| "
                      f"{x.get('max_abs_diff')} same tokens {x.get('requests_same_tokens')}/{x.get('requests')}"
                      + (f" error: {x['graphs_error']}" if x.get("graphs_error") else ""))
            for n, x in cg.get("big_runs", {}).items():
                print(f"graphs decode : {n:>3} seqs step ms eager {x['eager']['decode_step_ms_p50']} graphs "
                      f"{x['graphs']['decode_step_ms_p50']}; same tokens {x['same_tokens']}/{n}")
    f8 = r.get("fp8")
    if f8:
        if "skipped" in f8:
            print(f"fp8 gemm      : skipped ({f8['skipped']})")
        else:
            for name, rows in f8["shapes"].items():
                for m, x in rows.items():
                    print(f"fp8 {name:26s} {m:>5} rows: fp8 {x['fp8_ms']} ms ({x['fp8_weight_gbps']} GB/s) bf16 "
                          f"{x['bf16_ms']} ms; {x['fp8_over_bf16_speed']}x; max rel diff {x['max_rel_diff']}")
            print(f"fp8 experts   : {f8['experts_ms']} ms, max rel diff {f8['experts_max_rel_diff']}")
    tpr = r.get("tensor_parallel")
    if tpr:
        if "skipped" in tpr:
            print(f"tensor par.   : skipped ({tpr['skipped']})")
        else:
            print(f"tensor par.   : TP 2 {tpr['tp2']['output_tok_s']} tok/s vs TP 1 {tpr['tp1']['output_tok_s']} "
                  f"({tpr['dtype']}); same tokens {tpr['requests_same_tokens']}/{tpr['requests']}")
    for k, v in r["errors"].items():
        print(f"ERROR {k}: {v}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the big model's dtype on cuda (the cpu always uses float32)")
    ap.add_argument("--logits-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the tiny models in the logits check (float32: exactness)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request of the big model")
    ap.add_argument("--kv-gib", type=float, default=None, help="KV budget of the big model's engine")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="memory bandwidth for the bound (H200: 4.8)")
    ap.add_argument("--paged-seqs", type=int, default=16, help="paged_attention: concurrent decodes timed")
    ap.add_argument("--paged-ctx", type=int, default=4096, help="paged_attention: their context (<= 4096)")
    ap.add_argument("--skip", default="",
                    help="comma-separated parts to skip: logits,sampling,throughput,paged_attention,cuda_graphs,fp8,tp")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:  # every part at its smallest: a narrow "big" model, a few output tokens
        args.quick, args.vocab, args.max_tokens = True, 512, 4  # --quick's cpu model (hidden 256, 4 layers)
    if args.kv_gib is None:
        args.kv_gib = 0.5 if args.device == "cpu" else 4.0
    skip = set(filter(None, args.skip.split(",")))
    result = {"benchmark": "gpu_check", "device": args.device, "quick": args.quick, "torch": torch.__version__,
              "cuda": torch.version.cuda, "errors": {}, "part_s": {}}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    t_all = time.perf_counter()
    small_out = 4 if args.smoke else 12 if args.quick else 24
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "logits" not in skip:
            for arch in ("mimo", "gemma3"):
                _part(result, f"logits_{arch}", check_logits, arch, args.device, tmp, small_out, args.logits_dtype)
        if "sampling" not in skip:
            _part(result, "sampling", check_sampling, args.device, tmp, small_out)
        if "throughput" not in skip:
            _part(result, "throughput", check_throughput, args, tmp, result)
        if "paged_attention" not in skip:
            _part(result, "paged_attention", check_paged_attention, args, tmp, small_out)
        if "cuda_graphs" not in skip:
            _part(result, "cuda_graphs", check_cuda_graphs, args, tmp, small_out)
        if "fp8" not in skip:
            _part(result, "fp8", check_fp8, args)
        if "tp" not in skip:
            _part(result, "tensor_parallel", check_tensor_parallel, args, tmp, small_out)
    if args.device.startswith("cuda"):
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    _print_table(result)
    tp, bw = result.get("throughput", {}), result.get("bandwidth", {})
    runs = ", ".join(f"{n} seqs {x['output_tok_s']} tok/s" for n, x in tp.get("runs", {}).items())
    of_bound = ", ".join(str(x.get("fraction_of_bound")) for x in bw.get("runs", {}).values())
    agree = ", ".join(f"{a} {x['tokens_agree']}/{x['tokens']} greedy tokens agree"
                      for a in ("mimo", "gemma3") if (x := result.get(f"logits_{a}")))
    _results.record("gpu_check", ap, args, result, kind="wall-clock", baseline="transformers logits; the HBM bound",
                    summary=f"{result['device']} ({result.get('gpu', 'no gpu')}): {agree}; {runs}; of the bound {of_bound}"
                            + (f"; errors in {sorted(result['errors'])}" if result["errors"] else ""))
    return 1 if args.smoke and result["errors"] else 0  # a smoke run fails on any part's error


if __name__ == "__main__":
    _results.run(main)
