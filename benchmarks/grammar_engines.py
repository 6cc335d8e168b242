"""xgrammar (our grammar engine, ``llm_svc/engine/grammar.py``) against llguidance, in process,
on the same schemas and the same tokenizer: compile time, next-token mask time along a valid
path, and which schemas each engine accepts. Wall-clock on this machine's CPU, no simulation.

Tokenizers: the benchmark checkpoint's (``ensure_checkpoint(MiMoSpec())``: a pseudo-word
byte-level BPE of 4096 tokens, model vocab padded to a multiple of 64) and, unless
``--no-large``, a byte-level BPE trained here to ~32K tokens on seeded synthetic text
(pseudo-words, digits, JSON punctuation and the corpus' key names; cached under
``~/.cache/mmserve/bench/``) as a stand-in for a real LLM vocabulary's size, not its contents.

* compile (a): every schema of ``schema_corpus(--schemas)`` (100; 40 --quick) and
  ``wide_schema(200)``, cold: xgrammar a fresh ``GrammarCompiler(cache_enabled=False,
  max_threads=1)`` per repeat (the ``TokenizerInfo`` is built once, as a server builds it at
  start-up); llguidance ``grammar_from_json_schema`` + ``LLMatcher(...)`` (its token trie, the
  ``LLTokenizer``, built once likewise). "first mask" adds the first ``fill`` (llguidance builds
  its lexer states lazily, so its cost moves there). Both get what each engine is given in
  serving: our ``json_safe_lengths`` rewrite of the schema (both engines see the identical
  text), whitespace allowed (xgrammar ``any_whitespace=True`` + ``strict_mode=True`` as ours;
  llguidance ``whitespace_flexible=True`` as vLLM's guidance backend).
* mask (b): for each schema both matchers walk the same token path: each step both fill their
  bitmask row, the next token is a seeded random pick among the tokens BOTH allow (stop tokens
  only when nothing else is), and both accept it; at most ``--tokens`` (48) steps. The timed
  call is the fill alone (and separately the accept). Batch 1: one matcher, microseconds per
  token; batch 16: 16 schemas' matchers filled serially into one [16, V/32] bitmask per step
  (as our engine and vLLM's backends do), microseconds per step and per row. Median and p99.
  Masks are compared bit for bit on the way (``mask_agreement``).
* accepts (c): schemas an engine fails to compile (or whose matcher is in error at once).

Each repeat (``--repeats``: 3; 2 --quick) runs both engines in the order A-B, B-A, ... per
measurement. The table goes to stdout; the LAST line is one JSON object
``{"kind": "grammar_engines", "xgrammar": {...}, "llguidance": {...}, "vocab": ...}`` (per
vocabulary under ``by_vocab``).

    python -m benchmarks.grammar_engines [--quick] [--schemas N] [--repeats R] [--tokens T]
                                         [--no-large] [--large-vocab V] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import _results
from benchmarks._bench_host import bench_lock
from benchmarks._stats import percentile
from mmserve.tiny.schemas import schema_corpus, wide_schema

ENGINES = ("xgrammar", "llguidance")


# ---- the two engines behind one small interface ------------------------------------------------
class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, stops: list[int]):
        import xgrammar

        self.x, self.vocab = xgrammar, vocab
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stops)
        self.fresh()

    def fresh(self) -> None:
        self.compiler = self.x.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=True)

    def matcher(self, compiled):
        return self.x.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, tok: int) -> bool:
        return bool(m.accept_token(tok))

    def done(self, m) -> bool:
        return bool(m.is_terminated())


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, stops: list[int]):
        import llguidance
        import llguidance.hf

        self.ll, self.vocab = llguidance, vocab
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=stops)

    def fresh(self) -> None:  # no compiler state is shared between grammars
        pass

    def compile(self, schema: str):
        g = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        m = self.ll.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)  # = llguidance.torch.fill_next_token_bitmask

    def accept(self, m, tok: int) -> bool:
        return bool(m.consume_token(tok))

    def done(self, m) -> bool:
        return bool(m.is_stopped())


# ---- tokenizers --------------------------------------------------------------------------------
# The stock benchmark tokenizer (``_vs_vllm_servers.build_tokenizer``) learnt its alphabet from
# pseudo-words and ".,?!" alone: it has no '{', '"', ':' or digit, so no JSON document can be
# written with it (xgrammar's first mask is all zeros). Both benchmarks here use the same
# checkpoint weights with a tokenizer retrained at the same size on pseudo-words *and* JSON text.
_ASCII = [chr(c) for c in (9, 10, 13, *range(32, 127))]


def json_bpe(vocab: int, seed: int = 0, full_bytes: bool = False):
    """A byte-level BPE of ``vocab`` tokens trained on seeded pseudo-word sentences and JSON-ish
    text (keys, numbers, punctuation), ChatML specials first (ids 0-9, as the checkpoint's).
    ``full_bytes``: all 256 byte tokens (as real LLM vocabularies); else printable ASCII + tab /
    newline only, so every token decodes to whole characters on its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks._vs_vllm_servers import _CHATML_NAMES, word_list
    from mmserve.tiny_model import CHATML_SPECIALS

    rng = random.Random(seed)
    words = word_list(60000 if vocab > 8000 else 6000, seed)
    keys = ["id", "name", "tag", "val", "item", "note", "field", "true", "false", "null", "yes", "no", "x", "y"]
    lines = []
    for _ in range(120000 if vocab > 8000 else 30000):
        parts = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.7:
                parts.append(rng.choice(words))
            elif r < 0.82:
                parts.append(str(rng.randint(-999, 99999)) + rng.choice(["", ".5", ".25", "e3"]))
            elif r < 0.94:
                parts.append(f'"{rng.choice(keys)}_{rng.randint(0, 199)}": ')
            else:
                parts.append(rng.choice(["{", "}", "[", "]", ", ", '": "', '",', "\n  ", ".", "-", "\t"]))
        lines.append(" ".join(parts) + rng.choice(".,?!"))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not full_bytes:
        byte_char = {b: c for b, c in zip(range(256), _byte_chars())}
        alphabet = [byte_char[ord(ch)] for ch in _ASCII]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=CHATML_SPECIALS,
                                                        initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                                        show_progress=False))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, **_CHATML_NAMES)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet), in byte order."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def json_checkpoint() -> Path:
    """The MiMo benchmark checkpoint (``ensure_checkpoint(MiMoSpec())``) with a JSON-capable
    4096-token tokenizer: the weights are linked, not copied; the specials keep ids 0-9, whose
    embedding / LM-head rows are zero (greedy never picks one)."""
    from benchmarks._vs_vllm_servers import MiMoSpec, ensure_checkpoint
    from mmserve.cli import CACHE_DIR
    from mmserve.tiny_model import CHATML_SPECIALS, CHATML_TEMPLATE

    src = ensure_checkpoint(MiMoSpec())
    out = CACHE_DIR / "bench" / (src.name + "-jsontok")
    if (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    for f in ("config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(src / f, tmp / f)
    os.link(src / "model.safetensors", tmp / "model.safetensors")
    tok = json_bpe(vocab, seed=0)
    assert len(tok) <= vocab and tok.convert_tokens_to_ids(CHATML_SPECIALS) == list(range(len(CHATML_SPECIALS)))
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def checkpoint_tokenizer():
    from transformers import AutoTokenizer

    d = json_checkpoint()
    tok = AutoTokenizer.from_pretrained(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    return tok, vocab, [tok.convert_tokens_to_ids("<|im_end|>")], \
        f"benchmark checkpoint, JSON-capable BPE ({len(tok)} tokens, ASCII alphabet)"


def large_tokenizer(target: int, seed: int = 0):
    """A full-byte BPE of ``target`` tokens on the same synthetic text (cached)."""
    from transformers import PreTrainedTokenizerFast

    from mmserve.cli import CACHE_DIR

    d = CACHE_DIR / "bench" / f"bpe-json-{target}-s{seed}"
    if not (d / "tokenizer.json").exists():
        json_bpe(target, seed, full_bytes=True).save_pretrained(d)
    fast = PreTrainedTokenizerFast.from_pretrained(d)
    vocab = -(-len(fast) // 64) * 64
    return fast, vocab, [fast.convert_tokens_to_ids("<|im_end|>")], \
        f"synthetic full-byte BPE trained here ({len(fast)} tokens: pseudo-words, numbers, JSON keys)"


# ---- measurements ------------------------------------------------------------------------------
def ms(x):
    return None if x is None else round(1000 * x, 3)


def us(x):
    return None if x is None else round(1e6 * x, 1)


def compile_all(eng, schemas: list[str]) -> tuple[list[float], list[float], dict[int, str]]:
    """Per schema: compile seconds and compile + first mask seconds; failures by index."""
    eng.fresh()
    bm = torch.zeros((1, (eng.vocab + 31) // 32), dtype=torch.int32)
    comp, first, fails = [], [], {}
    for i, s in enumerate(schemas):
        t0 = time.perf_counter()
        try:
            c = eng.compile(s)
            t1 = time.perf_counter()
            eng.fill(eng.matcher(c), bm, 0)
            t2 = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - a schema an engine refuses is a result
            fails[i] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            continue
        comp.append(t1 - t0)
        first.append(t2 - t0)
    return comp, first, fails


def allowed(bm_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token ids a bitmask row [V/32] int32 allows."""
    bits = (bm_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.reshape(-1)[:vocab]).flatten()


def walk(engines: dict, compiled: dict[str, list], order: list[str], steps: int, seed: int, stops: set[int]) -> dict:
    """All matchers (one per schema, both engines) walk one shared seeded path per schema; the
    whole batch's rows are filled each step. Returns per engine the fill time of every step and
    accept times, plus how many rows' masks agreed bit for bit."""
    rng = random.Random(seed)
    n = len(next(iter(compiled.values())))
    ms_ = {e: [engines[e].matcher(c) for c in compiled[e]] for e in engines}
    vocab = next(iter(engines.values())).vocab
    bms = {e: torch.zeros((n, (vocab + 31) // 32), dtype=torch.int32) for e in engines}
    live = list(range(n))
    fill_t = {e: [] for e in engines}
    acc_t = {e: [] for e in engines}
    same = differ = tokens = 0
    for _ in range(steps):
        if not live:
            break
        for e in order:
            eng, m, bm = engines[e], ms_[e], bms[e]
            t0 = time.perf_counter()
            for i in live:
                eng.fill(m[i], bm, i)
            fill_t[e].append((time.perf_counter() - t0, len(live)))
        nxt = []
        for i in live:
            a, b = (allowed(bms[e][i], vocab) for e in ENGINES)
            same += torch.equal(a, b)
            differ += not torch.equal(a, b)
            both = sorted(set(a.tolist()) & set(b.tolist()))
            pick = [t for t in both if t not in stops] or both
            if not pick:
                continue  # the engines disagree on every token: this row's walk ends
            tok = rng.choice(pick)
            ok = True
            for e in order:
                t0 = time.perf_counter()
                ok &= engines[e].accept(ms_[e][i], tok)
                acc_t[e].append(time.perf_counter() - t0)
            tokens += 1
            if ok and not any(engines[e].done(ms_[e][i]) for e in ENGINES):
                nxt.append(i)
        live = nxt
    return {"fill": fill_t, "accept": acc_t, "mask_same": same, "mask_differ": differ, "tokens": tokens}


def run_vocab(args, tok, vocab: int, stops: list[int], label: str) -> dict:
    print(f"\n== vocabulary: {label}; model vocab {vocab}", flush=True)
    t0 = time.perf_counter()
    engines, setup = {}, {}
    for cls in (Xgr, Llg):
        t = time.perf_counter()
        engines[cls.name] = cls(tok, vocab, stops)
        setup[cls.name] = round(time.perf_counter() - t, 3)
    from llm_svc.engine.grammar import json_safe_lengths

    corpus = [json.dumps(json_safe_lengths(s)) for s in schema_corpus(args.schemas, args.seed)]
    wide = json.dumps(json_safe_lengths(wide_schema(200)))
    comp = {e: {"compile": [], "first": [], "wide": [], "wide_first": [], "fails": {}} for e in ENGINES}
    for r in range(args.repeats):
        order = list(ENGINES) if r % 2 == 0 else list(ENGINES[::-1])
        for e in order:
            c, f, fails = compile_all(engines[e], corpus)
            comp[e]["compile"] += c
            comp[e]["first"] += f
            comp[e]["fails"] = fails
            wc, wf, wfail = compile_all(engines[e], [wide])
            comp[e]["wide"] += wc
            comp[e]["wide_first"] += wf
            comp[e]["wide_fail"] = wfail.get(0)
    # matchers for the walks: only schemas both engines compile
    ok = [i for i in range(len(corpus)) if all(i not in comp[e]["fails"] for e in ENGINES)]
    compiled = {e: [] for e in ENGINES}
    for e in ENGINES:
        engines[e].fresh()
        compiled[e] = [engines[e].compile(corpus[i]) for i in ok]
    stop_set = set(stops)
    mask = {}
    for batch in (1, 16):
        fills = {e: [] for e in ENGINES}
        accepts = {e: [] for e in ENGINES}
        same = differ = tokens = 0
        groups = [ok[k:k + batch] for k in range(0, len(ok), batch)]
        if batch == 16:
            groups = [g for g in groups if len(g) == 16] or groups[:1]
        for r in range(args.repeats):
            for gi, g in enumerate(groups):
                order = list(ENGINES) if (r + gi) % 2 == 0 else list(ENGINES[::-1])
                sub = {e: [compiled[e][ok.index(i)] for i in g] for e in ENGINES}
                w = walk(engines, sub, order, args.tokens, args.seed * 7919 + 31 * gi + r, stop_set)
                for e in ENGINES:
                    fills[e] += w["fill"][e]
                    accepts[e] += w["accept"][e]
                same, differ, tokens = same + w["mask_same"], differ + w["mask_differ"], tokens + w["tokens"]
        mask[batch] = {"fills": fills, "accepts": accepts, "mask_same": same, "mask_differ": differ, "tokens": tokens}
    out = {}
    for e in ENGINES:
        c = comp[e]
        rec = {
            "setup_s": setup[e],
            "compile_ms": {"median": ms(percentile(c["compile"], 50)), "p90": ms(percentile(c["compile"], 90)),
                           "p99": ms(percentile(c["compile"], 99)), "max": ms(max(c["compile"], default=None)),
                           "mean": ms(statistics.fmean(c["compile"]) if c["compile"] else None)},
            "compile_plus_first_mask_ms": {"median": ms(percentile(c["first"], 50)), "p99": ms(percentile(c["first"], 99))},
            "wide_schema_200_compile_ms": ms(percentile(c["wide"], 50)),
            "wide_schema_200_compile_plus_first_mask_ms": ms(percentile(c["wide_first"], 50)),
            "wide_schema_200_failed": c.get("wide_fail"),
            "schemas": len(corpus), "compile_failures": len(c["fails"]),
            "failed": {str(i): m for i, m in list(c["fails"].items())[:8]},
        }  # fmt: skip
        for batch, m in mask.items():
            steps = [t for t, _ in m["fills"][e]]
            per_row = [t / k for t, k in m["fills"][e]]
            key = f"batch{batch}"
            rec[key] = {"fill_us_per_step_median": us(percentile(steps, 50)), "fill_us_per_step_p99": us(percentile(steps, 99)),
                        "fill_us_per_row_median": us(percentile(per_row, 50)), "fill_us_per_row_p99": us(percentile(per_row, 99)),
                        "accept_us_median": us(percentile(m["accepts"][e], 50)),
                        "accept_us_p99": us(percentile(m["accepts"][e], 99)), "steps": len(steps)}  # fmt: skip
        out[e] = rec
    out["walk"] = {f"batch{b}": {"tokens": m["tokens"], "mask_rows_identical": m["mask_same"],
                                 "mask_rows_different": m["mask_differ"]} for b, m in mask.items()}  # fmt: skip
    out["vocab"] = {"label": label, "model_vocab": vocab, "tokenizer_tokens": len(tok)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    table(out)
    return out


def table(r: dict) -> None:
    def f(x, unit: str, w: int = 8, d: int = 1) -> str:
        return f"{'-':>{w}s}" if x is None else f"{x:{w - len(unit)}.{d}f}{unit}"

    print(f"{'engine':11s} {'compile med':>11s} {'p99':>9s} {'1st mask':>10s} {'wide200':>10s} {'fails':>7s} | "
          f"{'b1 fill med':>11s} {'p99':>8s} | {'b16 step med':>12s} {'p99':>9s} {'/row':>8s} | {'accept':>8s}")
    for e in ENGINES:
        x = r[e]
        b1, b16 = x["batch1"], x["batch16"]
        print(f"{e:11s} {f(x['compile_ms']['median'], 'ms', 11, 2)} {f(x['compile_ms']['p99'], 'ms', 9, 2)} "
              f"{f(x['compile_plus_first_mask_ms']['median'], 'ms', 10, 2)} {f(x['wide_schema_200_compile_ms'], 'ms', 10)} "
              f"{x['compile_failures']:>3d}/{x['schemas']:<3d} | {f(b1['fill_us_per_step_median'], 'us', 11)} "
              f"{f(b1['fill_us_per_step_p99'], 'us')} | {f(b16['fill_us_per_step_median'], 'us', 12)} "
              f"{f(b16['fill_us_per_step_p99'], 'us', 9)} {f(b16['fill_us_per_row_median'], 'us')} | "
              f"{f(b1['accept_us_median'], 'us')}")  # fmt: skip
    w = r["walk"]
    print("walks: " + "; ".join(f"{k}: {v['tokens']} tokens, mask rows identical {v['mask_rows_identical']}"
                                f" / differ {v['mask_rows_different']}" for k, v in w.items()), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--schemas", type=int, default=None, help="schemas of the corpus (100; 40 --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats, engine order alternating (3; 2 --quick)")
    ap.add_argument("--tokens", type=int, default=48, help="steps of each mask walk")
    ap.add_argument("--no-large", action="store_true", help="only the checkpoint's 4096-token vocabulary")
    ap.add_argument("--large-vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock-timeout", type=float, default=600.0)
    _results.add_mode_args(ap)
    args = ap.parse_args()
    skipped = []
    if args.smoke:  # both engines, every measurement, on a few schemas with the checkpoint's vocabulary
        args.schemas, args.repeats, args.tokens = 3, 1, 4
        if not args.no_large:
            skipped.append(f"the {args.large_vocab}-token vocabulary (training its BPE takes minutes): --quick runs it")
            args.no_large = True
    args.schemas = args.schemas or (40 if args.quick else 100)
    args.repeats = args.repeats or (2 if args.quick else 3)
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    vocabs = [checkpoint_tokenizer]
    if not args.no_large:
        vocabs.append(lambda: large_tokenizer(args.large_vocab, args.seed))
    result = {"kind": "grammar_engines", "benchmark": "grammar_engines", "quick": args.quick, "wall_clock": True,
              "schemas": args.schemas, "repeats": args.repeats, "walk_tokens": args.tokens, "by_vocab": {}}
    with bench_lock(args.lock_timeout) as locked:
        result["bench_lock_held"] = locked
        for make in vocabs:
            tok, vocab, stops, label = make()
            result["by_vocab"][str(vocab)] = run_vocab(args, tok, vocab, stops, label)
    first = next(iter(result["by_vocab"].values()))
    # the headline: the checkpoint's vocabulary; every vocabulary's figures are under by_vocab
    result.update({e: first[e] for e in ENGINES})
    result["vocab"] = first["vocab"]
    result["vocabs"] = [v["vocab"] for v in result["by_vocab"].values()]
    result["versions"] = versions()
    result["total_s"] = round(time.perf_counter() - t0, 1)
    xg, ll = (result[e] for e in ENGINES)
    _results.record("grammar_engines", ap, args, result, kind="wall-clock", baseline="llguidance", skipped=skipped,
                    summary=f"{result['vocab']['label']}: fill {xg['batch1']['fill_us_per_step_median']} vs "
                            f"{ll['batch1']['fill_us_per_step_median']} us, compile {xg['compile_ms']['median']} vs "
                            f"{ll['compile_ms']['median']} ms")
    return 0


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("xgrammar", "llguidance")}


if __name__ == "__main__":
    sys.exit(main())
