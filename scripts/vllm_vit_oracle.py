"""Run vLLM 0.32's MiMo-V2.5 vision tower (``MiMoVisionTransformer``) on patch rows; write its output.

Runs under the vLLM venv's python (``bash scripts/vllm_venv.sh``), imports nothing of mmserve.
vLLM's window blocks call a Triton kernel (``context_attention_fwd``); on a CPU it runs in
Triton's interpreter (``TRITON_INTERPRET=1``, set here before anything imports triton), so the
oracle is vLLM's own code end to end: patch embed, 2-D rope, row/column reordering, GQA, the
band window with sinks, full blocks (``MMEncoderAttention``), merger.

Pixels go through vLLM's own ``MiMoVLProcessor`` (``process_image`` / ``process_video`` +
``_flatten_visual``, built from ``processor_config`` as ``from_hf_config`` does), and with
``PROMPT.json`` its ``process`` builds each video's prompt ids (timestamps) with the checkpoint's
tokenizer.

    VENV_PY scripts/vllm_vit_oracle.py MODEL_DIR IN.safetensors OUT.safetensors [PROMPT.json]
    IN:   "img.{i}" uint8 [3, H, W]; "vid.{j}" uint8 [n, 3, H, W] + "vts.{j}" float [n] (seconds)
    OUT:  "patches.{k}" [N_k, C*tp*ps*ps], "grid.{k}" [3] (t, h, w), "y.{k}" [N_k / merge^2, out],
          k = "img.i" / "vid.j" (one tower forward over all items at once: varlen sequences);
          "ids.vid.j" [L] with PROMPT.json {"prefix": str, "suffix": str}: the prompt
          prefix + video j + suffix as vLLM's processor writes it
"""

from __future__ import annotations

import json
import os
import sys


def _stub_qwen2vl_image_processing() -> None:
    """``mimo_v2_omni`` imports ``smart_resize`` from transformers' Qwen2-VL image processor,
    which needs torchvision (absent beside vLLM's CPU torch); the tower never calls it."""
    import types

    mod = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")

    def smart_resize(*a, **k):
        raise RuntimeError("not available in the oracle")

    mod.smart_resize = smart_resize
    sys.modules[mod.__name__] = mod


def _interpreted_prefill_kernel() -> None:
    """vLLM disables Triton on a CPU build (no CPU backend); re-execute its own
    ``triton_prefill_attention.py`` source against the real triton, in interpreter mode, and
    point the module at it (only the import line differs)."""
    import importlib

    mod = importlib.import_module("vllm.v1.attention.ops.triton_prefill_attention")
    src = open(mod.__file__).read()
    old = "from vllm.triton_utils import tl, triton"
    assert old in src, "vLLM's prefill kernel moved; update the oracle"
    ns: dict = {"__name__": mod.__name__ + "_interpreted"}
    exec(compile(src.replace(old, "import triton\nimport triton.language as tl"), mod.__file__, "exec"), ns)
    mod.context_attention_fwd = ns["context_attention_fwd"]


def main(model_dir: str, in_path: str, out_path: str, prompt_path: str | None = None) -> int:
    prompt = json.loads(open(prompt_path).read()) if prompt_path else None
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _stub_qwen2vl_image_processing()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.mimo_v2_omni import MiMoVisionTransformer
    from vllm.transformers_utils.configs.mimo_v2_omni import Mimo_VLVisionConfig

    _interpreted_prefill_kernel()

    cfg = json.loads(open(os.path.join(model_dir, "config.json")).read())
    vcfg = Mimo_VLVisionConfig.from_dict(cfg["vision_config"])
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.float32)
        model = MiMoVisionTransformer(vcfg, norm_eps=1e-6, prefix="visual")  # as MiMoV2OmniForCausalLM builds it
        weights = []
        with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                name = k.removeprefix("model.")
                if name.startswith("visual."):
                    weights.append((name.removeprefix("visual."), f.get_tensor(k)))
        loaded = model.load_weights(weights)
        want = {n for n, _ in model.named_parameters()}
        if want - set(loaded):
            raise SystemExit(f"vLLM did not load {sorted(want - set(loaded))[:5]}")
        for module in model.modules():  # what vLLM's loader does after load_weights (CPU gemm setup)
            qm = getattr(module, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(module)
        model.eval()
        inp = load_file(in_path)
        proc = _processor(cfg, model_dir)
        names, patches, grids, out = [], [], [], {}
        for name in sorted(k for k in inp if k.startswith(("img.", "vid."))):
            if name.startswith("img."):
                from vllm.transformers_utils.processors.mimo_v2_omni import ImageInput

                p, thw = proc._flatten_visual(proc.process_image(ImageInput(image=inp[name])), "image")
            else:
                from vllm.transformers_utils.processors.mimo_v2_omni import VideoInput

                video = (inp[name].float(), inp["vts." + name[4:]].float())
                p, thw, _, _ = proc.process_video(VideoInput(video=video))
                if prompt is not None:
                    out["ids." + name] = _prompt_ids(proc, video, prompt)
            names.append(name)
            patches.append(p)
            grids.append(thw)
        with torch.inference_mode():
            y = model(torch.cat(patches).float(), grid_thw=torch.stack(grids).long())
        merge = cfg["vision_config"]["spatial_merge_size"] ** 2
        for name, ys, p, thw in zip(names, y.split([int(g.prod()) // merge for g in grids]), patches, grids):
            out["patches." + name], out["grid." + name], out["y." + name] = p.contiguous(), thw, ys.contiguous()
    save_file(out, out_path)
    return 0


def _processor(cfg: dict, model_dir: str):
    from transformers import AutoTokenizer

    from vllm.transformers_utils.processors.mimo_v2_omni import MiMoVLProcessor

    pc, vc = cfg["processor_config"], cfg["vision_config"]
    keys = ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels", "video_total_max_pixels",
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
            "video_start_token_id", "video_end_token_id")
    tok = AutoTokenizer.from_pretrained(model_dir)
    return MiMoVLProcessor(tokenizer=tok, patch_size=vc["patch_size"], merge_size=vc["spatial_merge_size"],
                           temporal_patch_size=vc["temporal_patch_size"], fps=2.0, pad_token_id=tok.pad_token_id,
                           **{k: pc[k] for k in keys})


def _prompt_ids(proc, video, prompt: dict):
    import torch

    from vllm.transformers_utils.processors.mimo_v2_omni import Content, VideoInput

    contents = [Content(type="text", content=prompt["prefix"]), Content(type="video", content=VideoInput(video=video)),
                Content(type="text", content=prompt["suffix"])]
    return torch.as_tensor(proc.process(contents).input_ids).long()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
