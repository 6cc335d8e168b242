"""Train the tiny published-layout MiMo (its LM and all its MTP layers together) on the Python
standard library's own sources, so its greedy output is text-like and its MTP drafts mean
something (issue 23). Seeded and deterministic on one machine (same torch, same thread count).

    python scripts/train_tiny_mimo.py --out DIR [--spec flash|flash-qkv] [--steps 400] [--threads 2]

Data: the top-level ``*.py`` files of this interpreter's stdlib directory, sorted by name; every
10th file is held out. Tokenized with the tiny checkpoint's own byte-level BPE (ChatML
specials), documents joined by ``<|endoftext|>``. Model (``--spec``): ``TinyMiMoSpec`` ``FLASH``
(8 layers: 2 full + 6 sliding of window 128 with sinks, 7 MoE; 3 MTP layers; qk head dim 32, v
head dim 16 as MiMo-V2-Flash's 192 / 128: ``mmserve/tiny/trained_mimo``) or ``FLASH_QKV`` (the
same with v head dim 32, which vLLM 0.32's CPU build also serves: ``mmserve/tiny/trained_mimo_qkv``),
trained in float32 with
loss = LM + 0.3 x the mean of the MTP layers' losses (DeepSeek-V3's weighting), the routers'
``e_score_correction_bias`` balanced without a loss (its aux-loss-free update). ``DIR`` gets the
published-layout checkpoint in bfloat16 (as the hub stores it) and ``training.json`` with the
run's settings and its held-out figures measured on the written checkpoint (``evaluate``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's packages, wherever it runs from

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HELD_OUT_EVERY = 10
MTP_WEIGHT = 0.3
BIAS_UPDATE = 1e-3  # aux-loss-free balancing: the router bias step per update
SPECS = {"flash": "FLASH", "flash-qkv": "FLASH_QKV"}  # --spec -> mmserve.tiny.mimo_published geometry


def stdlib_files(limit: int | None = None) -> list[Path]:
    """The corpus: this interpreter's top-level stdlib ``*.py`` files, sorted (``limit``: the first N)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return files[:limit] if limit else files


def tokenize(tok, files: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams [N]: files joined by ``<|endoftext|>``, every 10th held out."""
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    parts: tuple[list[int], list[int]] = ([], [])
    for i, doc in enumerate(ids):
        parts[i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1].extend(doc + [sep])
    return torch.tensor(parts[0]), torch.tensor(parts[1])


def batches(stream: torch.Tensor, n: int, seq: int, batch: int, seed: int):
    """``n`` batches [B, seq] of windows at seeded random offsets."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, len(stream) - seq, (batch,), generator=g)
        yield torch.stack([stream[s:s + seq] for s in start.tolist()])


def losses(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """LM loss and each MTP layer's loss on ids [B, T] (layer i predicts ids[t+i+2] at t)."""
    from llm_svc.models.mimo_reference import lm_hidden
    from llm_svc.models.mimo_mtp import chain

    h = lm_hidden(model, ids)
    vocab = model.lm_head.out_features
    lm = F.cross_entropy(model.lm_head(h[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
    mtp = []
    for i, out in enumerate(chain(model.mtp, model.model.embed_tokens, h, ids)):
        n = ids.shape[1] - i - 2
        mtp.append(F.cross_entropy(model.lm_head(out[:, :n]).reshape(-1, vocab), ids[:, i + 2:].reshape(-1)))
    return lm, mtp


class RouterBalance:
    """DeepSeek-V3's aux-loss-free balancing: after each step every router's
    ``e_score_correction_bias`` moves by ``BIAS_UPDATE`` towards under-loaded experts."""

    def __init__(self, model):
        self.load: dict[torch.nn.Module, torch.Tensor] = {}
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        for r in self.routers:
            r.register_forward_hook(self._count)

    def _count(self, router, _inp, out) -> None:
        idx = out[0]
        self.load[router] = self.load.get(router, 0) + torch.bincount(idx.reshape(-1), minlength=router.weight.shape[0])

    @torch.no_grad()
    def update(self) -> None:
        for r, load in self.load.items():
            r.e_score_correction_bias += BIAS_UPDATE * torch.sign(load.float().mean() - load.float())
        self.load.clear()


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(args) -> dict:
    from llm_svc.loading.loader import load_lm
    from mmserve.tiny import mimo_published as mp

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    mp.write_mimo_published(out, getattr(mp, SPECS[args.spec]), seed=args.seed)  # config, tokenizer, random init
    lm = load_lm(str(out))
    model = lm.model.train().requires_grad_(True)
    files = stdlib_files(args.files)
    train_ids, held_ids = tokenize(lm.tokenizer, files)
    if min(len(train_ids), len(held_ids)) <= args.seq:
        raise SystemExit(f"{len(files)} files give {len(train_ids)} train / {len(held_ids)} held-out tokens: "
                         f"fewer than --seq {args.seq} (use more --files)")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    balance = RouterBalance(model)
    for r in balance.routers:
        r.e_score_correction_bias.requires_grad_(False)  # moved by the balance rule only
    log, t0 = [], time.time()
    for step, ids in enumerate(batches(train_ids, args.steps, args.seq, args.batch, args.seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        lm_loss, mtp = losses(model, ids)
        loss = lm_loss + MTP_WEIGHT * torch.stack(mtp).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance.update()
        if step % args.log_every == 0 or step == args.steps - 1:
            row = {"step": step, "lm": round(lm_loss.item(), 4), "mtp": [round(x.item(), 4) for x in mtp],
                   "s": round(time.time() - t0, 1)}
            log.append(row)
            print(json.dumps(row), flush=True)
    write_weights(model, out)
    return {"log": log, "train_s": round(time.time() - t0, 1), "files": files, "held_out": held_ids,
            "train_tokens": len(train_ids)}


def write_weights(model, out: Path) -> None:
    """The state in the published names, bfloat16 (the hub's dtype); config.json says so."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@torch.no_grad()
def evaluate(model, held: torch.Tensor, seq: int, rows: int, seed: int, prompts: int = 8, prompt_len: int = 64,
             gen: int = 96) -> dict:
    """Held-out figures of a loaded checkpoint.

    * ``lm_loss``: the LM's cross-entropy (nats / token) on ``rows`` held-out windows;
    * ``agreement_text[i]``: how often MTP layer i's top-1 equals the LM's greedy next token,
      teacher-forced on the held-out text;
    * on greedy continuations (``gen`` tokens) of ``prompts`` held-out prompts, what a greedy
      MTP chain of all layers reaches (every layer's KV teacher-forced on committed tokens):
      ``agreement_greedy[i]`` (layer i alone), ``acceptance_per_position[j]`` (drafts at
      position j accepted per verify step, vLLM's meaning), ``mean_acceptance_length``
      (tokens per verify step: 1 + accepted drafts)."""
    from llm_svc.models.mimo_reference import lm_hidden
    from llm_svc.models.mimo_mtp import chain

    model.eval()
    head, embed = model.lm_head, model.model.embed_tokens
    ids = next(batches(held, 1, seq, rows, seed + 1))
    h = lm_hidden(model, ids)
    logits = head(h)
    lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    greedy = logits.argmax(-1)  # [B, T]: the LM's choice for token t+1
    text = []
    for i, o in enumerate(chain(model.mtp, embed, h, ids)):
        n = ids.shape[1] - i - 2
        text.append(float((head(o[:, :n]).argmax(-1) == greedy[:, i + 1:i + 1 + n]).float().mean()))

    x = next(batches(held, 1, prompt_len, prompts, seed + 2))
    for _ in range(gen):
        x = torch.cat([x, head(lm_hidden(model, x)[:, -1]).argmax(-1, keepdim=True)], dim=1)
    drafts = [head(o).argmax(-1) for o in chain(model.mtp, embed, lm_hidden(model, x), x)]  # [i][b, t]: token t+i+2
    n, start = x.shape[1], prompt_len - 1
    agree = [float((d[:, start:n - i - 2] == x[:, start + i + 2:]).float().mean()) for i, d in enumerate(drafts)]
    return {"lm_loss": round(float(lm_loss), 4), "agreement_text": [round(a, 4) for a in text],
            "agreement_greedy": [round(a, 4) for a in agree], **chain_acceptance(drafts, x, start)}


def chain_acceptance(drafts: list[torch.Tensor], x: torch.Tensor, start: int) -> dict:
    """Greedy speculative decoding of ``x [B, N]`` (greedy from ``start + 1`` on) with the chain's
    drafts (``drafts[i][b, t]``: layer i's guess for ``x[b, t+i+2]``, teacher-forced): each verify
    step at p (the LM's hidden of p just computed, ``x[p+1]`` its token) accepts drafts while they
    equal the greedy tokens and advances by accepted + 1. Steps whose drafts would pass the end of
    ``x`` are not taken."""
    k, n = len(drafts), x.shape[1]
    accepted, lengths = [0] * k, []
    for b in range(x.shape[0]):
        p = start
        while p + k + 2 <= n - 1:
            a = 0
            while a < k and int(drafts[a][b, p]) == int(x[b, p + a + 2]):
                accepted[a] += 1
                a += 1
            lengths.append(a + 1)
            p += a + 1
    steps = max(1, len(lengths))
    return {"acceptance_per_position": [round(a / steps, 4) for a in accepted],
            "mean_acceptance_length": round(sum(lengths) / steps, 3), "verify_steps": len(lengths)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to write the trained checkpoint to")
    ap.add_argument("--spec", choices=sorted(SPECS), default="flash",
                    help="geometry: flash (qk 32 != v 16) or flash-qkv (qk = v = 32, servable by vLLM's CPU build)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (the sliding window is 128)")
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    ap.add_argument("--files", type=int, default=None, help="only the first N stdlib files (tests)")
    ap.add_argument("--eval-rows", type=int, default=32, help="held-out rows of --seq tokens: loss, agreement")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts continued greedily")
    ap.add_argument("--eval-prompt-len", type=int, default=64)
    ap.add_argument("--eval-gen", type=int, default=96, help="greedy tokens per prompt")
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args(argv)
    run = train(args)
    from llm_svc.loading.loader import load_lm

    lm = load_lm(args.out)  # the written bfloat16 checkpoint, as served
    figures = evaluate(lm.model, run["held_out"], args.seq, args.eval_rows, args.seed, args.eval_prompts,
                       args.eval_prompt_len, args.eval_gen)
    digest = hashlib.sha256("\n".join(f.name for f in run["files"]).encode()).hexdigest()[:16]
    report = {"command": "python scripts/train_tiny_mimo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "python": sys.version.split()[0], "torch": torch.__version__, "threads": args.threads,
              "files": len(run["files"]), "files_sha256_16": digest, "train_tokens": run["train_tokens"],
              "held_out_tokens": len(run["held_out"]), "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "train_s": run["train_s"], "log": run["log"], "held_out": figures}
    (Path(args.out) / "training.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"train_s": run["train_s"], **figures}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
