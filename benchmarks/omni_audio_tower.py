"""MiMo-V2.5 omni audio tower at the published geometry (random weights, built in memory): how
long one forward takes per second of audio, and where the time goes (tokenizer vs embedding side).

Geometry: the tokenizer encoder of MiMo-Audio-Tokenizer (d_model 1280, 32 layers, 20 heads,
ffn 5120, skip layer 3, 2x pool, 20 quantizers of 1024/128 codes; V2.5's hybrid local/global
attention, window (128, 0)), and V2.5's audio_config (20 channels, vocab 1280, 6 local layers of
1024 with 16 heads, 2-layer projection to 4096). Weights are random: times, not outputs.

    flock /tmp/mmserve-bench.lock python -m benchmarks.omni_audio_tower --seconds 10 30 --repeat 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from benchmarks import _results
from encoder_svc.models.mimo_audio import MiMoAudioTower
from encoder_svc.models.mimo_audio_config import AudioEncoderConfig, AudioTokenizerConfig

TOKENIZER = AudioTokenizerConfig(
    d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, encoder_skip_layer_id=3,
    encoder_causal=True, window=(128, 0), hybrid_attention=True, swa_per_block=2, stride_size=2, avg_pooler=2,
    num_quantizers=20, codebook_sizes=(1024, 1024) + (128,) * 18, rope_theta=10000.0, sampling_rate=24000,
    n_mels=128, nfft=960, hop_length=240, window_size=960, fmin=0.0, fmax=None)
ENCODER = AudioEncoderConfig(
    audio_channels=20, group_size=4, speech_vocab_sizes=(1280,) * 20, speech_zeroemb_idx=(1024,) * 20,
    input_local_layers=6, input_local_dim=1024, input_local_attn_heads=16, input_local_intermediate_size=4096,
    input_full_attention=True, out_hidden_size=4096, rope_theta=640000.0, projection_layers=2,
    add_post_norm=True, audio_segment_size=6000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=[10.0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    tokenizer, encoder, skipped = TOKENIZER, ENCODER, []
    if args.smoke:  # the same tower code at a narrow geometry: the published one is 900 M params
        args.seconds, args.repeat = [1.0], 1
        tokenizer = dataclasses.replace(TOKENIZER, d_model=64, encoder_layers=4, encoder_attention_heads=4,
                                        encoder_ffn_dim=128, encoder_skip_layer_id=1)
        encoder = dataclasses.replace(ENCODER, input_local_layers=1, input_local_dim=64, input_local_attn_heads=4,
                                      input_local_intermediate_size=128, out_hidden_size=64)
        skipped.append("the published geometry (900 M params, ~30 s per forward here): a narrow tower of the same code")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    tower = MiMoAudioTower(encoder, tokenizer).to(dtype).eval().to(args.device)
    for b in tower.tokenizer.codebooks:
        b.embed.data = torch.randn_like(b.embed.data, dtype=torch.float32)
    params = sum(p.numel() for p in tower.parameters()) / 1e6
    rows = []
    for seconds in args.seconds:
        wave = 0.1 * torch.randn(int(24000 * seconds))
        items = tower.prepare(wave)
        groups = [g.to(args.device) for g in items.groups]
        tower(groups[-1])  # warm-up
        tok, total = [], []
        for _ in range(args.repeat):
            t_tok = t_all = 0.0
            for x in groups:  # one forward per batch group, as the service submits them
                t0 = time.perf_counter()
                codes, n = tower.codes(x)
                t1 = time.perf_counter()
                tower.embed_codes(codes, n)
                t_tok, t_all = t_tok + t1 - t0, t_all + time.perf_counter() - t0
            tok.append(t_tok)
            total.append(t_all)
        med = statistics.median(total)
        rows.append({"audio_s": seconds, "segments": len(items.tokens), "tokens": sum(items.tokens),
                     "forward_s": round(med, 3), "tokenizer_s": round(statistics.median(tok), 3),
                     "realtime_factor": round(seconds / med, 2)})
        print(json.dumps(rows[-1]), flush=True)
    figures = {"params_M": round(params, 1), "dtype": args.dtype, "device": args.device,
               "threads": torch.get_num_threads(), "repeat": args.repeat, "clips": rows}
    _results.record("omni_audio_tower", ap, args, figures, kind="wall-clock",
                    baseline="real time (seconds of audio per second of compute)", skipped=skipped,
                    summary="; ".join(f"{r['audio_s']:g} s clip: {r['forward_s']} s, {r['realtime_factor']}x real time, "
                                      f"tokenizer {r['tokenizer_s'] / max(r['forward_s'], 1e-9):.0%} of it" for r in rows))


if __name__ == "__main__":
    _results.run(main)
