"""How far bfloat16 serving moves the MiMo-V2.5 omni audio tower: vLLM 0.32 in its serving
dtypes (tokenizer and tower bf16, RVQ float32) vs ours in bf16 and float32, on the tiny omni
checkpoint. Codes are discrete, so a near-tied RVQ decision that bf16 flips changes a whole
4-frame group's embedding: this reports the share of equal codes and the relative L2 error of
the embeddings per clip. (In float32 both sides agree exactly: tests/integration/test_vllm_omni_audio.py.)

    python -m benchmarks.omni_audio_dtype
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks import _results
from encoder_svc.models.mimo_audio_weights import load_mimo_audio
from encoder_svc.preprocess.mimo_mel import mel_magnitude
from mmserve.tiny.mimo_omni import write_mimo_omni
from mmserve.testing.audio import chirp

REPO = Path(__file__).resolve().parents[1]
CLIPS = (2.0, 0.75, 1.01, 1999 * 240 / 24000, 20.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_mode_args(ap)
    args = ap.parse_args()
    clips = CLIPS[1:2] if args.smoke else CLIPS  # smoke: one 0.75 s clip through both sides
    vllm_py = subprocess.run(["bash", str(REPO / "scripts" / "vllm_venv.sh")], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
    d = Path(tempfile.mkdtemp(prefix="omni-audio-dtype-"))
    ckpt = write_mimo_omni(d / "ckpt", seed=3)
    hidden = json.loads((ckpt / "config.json").read_text())["hidden_size"]
    waves = [chirp(s, seed=i) for i, s in enumerate(clips)]
    save_file({f"mag.{i}": mel_magnitude(w, sr=24000, n_fft=960, win_length=960, hop=240, n_mels=128)
               for i, w in enumerate(waves)}, str(d / "in.safetensors"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1", "MMSERVE_ORACLE_AS_SERVED": "1"}
    subprocess.run([vllm_py, str(REPO / "scripts" / "vllm_mimo_audio_oracle.py"), str(ckpt), str(d / "in.safetensors"),
                    str(d / "out.safetensors")], check=True, capture_output=True, env=env)
    ref = load_file(str(d / "out.safetensors"))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        tower = load_mimo_audio(ckpt, dtype, hidden)
        equal = total = 0
        rel = []
        for i, w in enumerate(waves):
            items = tower.prepare(w)
            emb = items.kept([tower(g) for g in items.groups]).float()
            codes = []
            for x in items.groups:
                c, n = tower.codes(x)
                codes += [c[k, : n[k]] for k in range(len(n))]
            want = ref[f"codes.{i}"]
            equal += int((torch.cat(codes) == want).sum())
            total += want.numel()
            r = ref[f"embeds.{i}"].float()
            rel.append(round(float((emb - r).norm() / r.norm()), 3))
        rows.append({"ours": str(dtype).removeprefix("torch."), "vllm": "as served (bf16)",
                     "codes_equal": round(equal / total, 4), "codes": total, "embeds_rel_l2_per_clip": rel})
        print(json.dumps(rows[-1]), flush=True)
    _results.record("omni_audio_dtype", ap, args, {"clips_s": list(clips), "by_dtype": rows}, kind="wall-clock",
                    baseline="vLLM 0.32 in its serving dtypes (tower bf16, RVQ float32)",
                    summary="; ".join(f"ours {r['ours']}: {r['codes_equal']:.2%} of codes equal, embeddings rel. L2 "
                                      f"{max(r['embeds_rel_l2_per_clip'])} at most" for r in rows))


if __name__ == "__main__":
    _results.run(main)
