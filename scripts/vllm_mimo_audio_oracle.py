"""Run vLLM 0.32's MiMo-V2.5 omni audio side on a checkpoint directory; write what it computes.

Runs in the vLLM venv (``scripts/vllm_venv.sh``), not ours. Everything from the mel magnitude on
is vLLM's code: ``MiMoVLProcessor.preprocess_audio`` (log, layout, placeholder count),
``tokenize_audio_batch`` + the MiMo-Audio-Tokenizer ``AudioEncoder`` (codes) and
``MimoAudioEncoder.get_audio_feature`` (speech embeddings -> transformers ``Qwen2Model`` ->
projection). Two stand-ins, because vLLM's CPU build lacks them:

* ``vllm.vllm_flash_attn.flash_attn_varlen_func`` (a CUDA kernel): replaced by a masked-softmax
  implementation of flash-attn's documented semantics (per ``cu_seqlens`` segment; ``causal``;
  ``window_size=(left, right)``, -1 = unbounded; causal forces right = 0).
* torchaudio's ``MelSpectrogram`` (torchaudio does not import beside vLLM's torch): the caller
  sends the mel magnitude ``[n_mels, frames]``; it is checked against torchaudio in our venv.

With ``MMSERVE_ORACLE_AS_SERVED=1`` everything stays in the dtypes vLLM serves with (tokenizer
and tower in bfloat16, RVQ in float32): a measurement, not the equality test. Otherwise:
the tokenizer is loaded by vLLM's own ``_load_audio_tokenizer`` (which casts it to bfloat16), then
re-read in float32 so both sides compute in float32 (the tiny weights are bfloat16-exact; the
rope ``inv_freq`` buffer, which that cast also rounds, is recomputed).
The main-file tensors are renamed as ``MiMoV2OmniForCausalLM.hf_to_vllm_mapper`` does
(``speech_embeddings.`` -> ``audio_encoder.speech_embeddings.``; ``audio_encoder.*`` as is):
``mimo_v2_omni.py`` itself does not import here (it needs torchvision).

Usage: python vllm_mimo_audio_oracle.py CKPT_DIR IN.safetensors OUT.safetensors [PROMPT.json]
IN holds ``mag.{i}`` [n_mels, frames]; OUT gets ``tokens.{i}`` (processor placeholder count),
``ids.{i}`` (with PROMPT.json ``{"prefix": str, "suffix": str}``: the prompt ids
``MiMoVLProcessor.process`` writes for prefix text + the clip + suffix text, with the
checkpoint's tokenizer and ``processor_config`` token ids),
``feats.{i}`` [T, d] (the tokenizer's continuous output before RVQ), ``codes.{i}`` [T, C]
and ``embeds.{i}`` [tokens, H] (each item alone), ``batch_embeds`` and
``batch_lens`` (all items in one ``get_audio_feature`` call).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, window_size=(-1, -1), softmax_scale=None, **_):
    """q, k, v [total, heads, hd] -> [total, heads, hd]."""
    left, right = window_size
    if causal:
        right = 0
    out = torch.empty_like(q)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    for s, e in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        qs, ks, vs = (t[s:e].transpose(0, 1).float() for t in (q, k, v))  # [h, n, hd]
        n = e - s
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        ok = torch.ones(n, n, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        att = (qs @ ks.transpose(1, 2)) * scale
        att = att.masked_fill(~ok, float("-inf")).softmax(-1)
        out[s:e] = (att @ vs).transpose(0, 1).to(q.dtype)
    return out


def main(ckpt: str, inp: str, outp: str, prompt_path: str | None = None) -> None:
    import types

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    # the package itself refuses to import without its CUDA extension
    stand_in = types.ModuleType("vllm.vllm_flash_attn")
    stand_in.flash_attn_varlen_func = flash_attn_varlen_func
    sys.modules["vllm.vllm_flash_attn"] = stand_in
    from vllm.model_executor.models.mimo_audio import MimoAudioEncoder, tokenize_audio_batch
    from vllm.transformers_utils.processors.mimo_v2_omni import MiMoVLProcessor

    cfg = json.load(open(f"{ckpt}/config.json"))
    enc = MimoAudioEncoder(cfg["audio_config"], model_path=ckpt)
    assert enc.audio_tokenizer is not None, "vLLM found no audio_tokenizer/"
    tok = enc.audio_tokenizer
    as_served = os.environ.get("MMSERVE_ORACLE_AS_SERVED") == "1"  # vLLM's own dtypes: bf16 tower
    if not as_served:
        tok = tok.float()
        missing, unexpected = tok.load_state_dict(load_file(f"{ckpt}/audio_tokenizer/model.safetensors"), strict=False)
        assert not missing and all(n.startswith("decoder.") for n in unexpected), (missing, unexpected)
        # the bfloat16 cast also rounded the rope's inv_freq buffer (not in the file): recompute it
        pe, c = tok.encoder.position_embedding, tok.config
        pe.inv_freq, _ = pe.rope_init_fn(device=None, base=c.rope_theta, dim=c.d_model // c.encoder_attention_heads)
        pe.original_inv_freq = pe.inv_freq
    sd = {}
    with safe_open(f"{ckpt}/model.safetensors", "pt") as h:
        for name in h.keys():
            if name.startswith("speech_embeddings."):
                sd[name] = h.get_tensor(name)
            elif name.startswith("audio_encoder."):
                sd[name[len("audio_encoder."):]] = h.get_tensor(name)
    missing, unexpected = enc.load_state_dict(sd, strict=False)
    missing = [n for n in missing if not n.startswith("audio_tokenizer.")]
    assert not unexpected and set(missing) == {"input_local_transformer.embed_tokens.weight"}, (missing, unexpected)
    enc = (enc.to(torch.bfloat16) if as_served else enc.float()).eval()  # encode() floats the quantizer

    sr = cfg["audio_config"].get("sampling_rate") or 24000  # MiMoOmniProcessor.from_hf_config
    pc = cfg.get("processor_config") or {}
    tokenizer = None
    if prompt_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ckpt)
    ids = {k: pc.get(k) for k in ("audio_token_id", "audio_start_token_id", "audio_end_token_id")}
    one = 1
    proc = MiMoVLProcessor(tokenizer=tokenizer, audio_sampling_rate=sr, image_min_pixels=one, image_max_pixels=one,
                           video_min_pixels=one, video_max_pixels=one, video_total_max_pixels=one, fps=2.0,
                           pad_token_id=getattr(tokenizer, "pad_token_id", None), **ids)
    mags = load_file(inp)
    out, specs = {}, []
    with torch.no_grad():
        for i in range(len(mags)):
            mag = mags[f"mag.{i}"]
            proc._mel_spectrogram = lambda w, mag=mag: mag[None]  # [1, n_mels, frames]
            n_samples = (mag.shape[1] - 1) * proc.audio_hop_length
            spec, tok_len = proc.preprocess_audio((torch.zeros(n_samples), sr))  # [frames, n_mels]
            specs.append(spec)
            codes = tokenize_audio_batch([spec], tok.encoder, segment_size=enc.audio_segment_size)[0]
            seg = enc.audio_segment_size
            lens_t = torch.tensor([seg] * (spec.shape[0] // seg) + ([spec.shape[0] % seg] if spec.shape[0] % seg else []))
            out[f"feats.{i}"] = tok.encoder.encode(spec, input_lens=lens_t, use_quantizer=False)[1].contiguous()
            emb, lens = enc.get_audio_feature([spec])
            assert lens == [emb.shape[0]], lens
            out[f"tokens.{i}"] = torch.tensor([tok_len])
            if prompt_path:
                from vllm.transformers_utils.processors.mimo_v2_omni import AudioInput, Content

                prompt = json.load(open(prompt_path))
                contents = [Content(type="text", content=prompt["prefix"]),
                            Content(type="audio", content=AudioInput(audio=(torch.zeros(n_samples), sr))),
                            Content(type="text", content=prompt["suffix"])]
                out[f"ids.{i}"] = torch.as_tensor(proc.process(contents).input_ids).long()
            out[f"codes.{i}"] = codes[:, : enc.audio_channels].contiguous()
            out[f"embeds.{i}"] = emb.contiguous()
        emb, lens = enc.get_audio_feature(specs)
        out["batch_embeds"] = emb.contiguous()
        out["batch_lens"] = torch.tensor(lens)
    save_file(out, outp)


if __name__ == "__main__":
    main(*sys.argv[1:5])
