"""Load the bundle's language model with transformers (both backends start from this)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.bundle import BundleSpec, CheckpointError, load_bundle_spec

from .context_len import DEFAULT_CONTEXT_LEN, context_length
from .media_layout import TimestampLayout
from .prompt_bound import TokenBound

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedLM:
    """The HF model plus what the service needs to know about it, read once at load time."""

    spec: BundleSpec
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module | None  # the HF *ForCausalLM / *ForConditionalGeneration (None: front only)
    arch: str  # "mimo" | "gemma3" | other HF causal LM
    hidden_size: int
    vocab_size: int
    eos_token_ids: list[int]
    pad_ids: dict[str, int] = field(default_factory=dict)  # modality -> placeholder pad token id
    layouts: dict[str, TimestampLayout] = field(default_factory=dict)  # modality -> timestamped layout (MiMo video)
    bidirectional_media: bool = False  # Gemma 3: an image's tokens attend to each other
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    # lower bounds on a text's tokens (longest entry, byte changes), so a prompt that cannot fit
    # is refused before it is tokenized whole
    bound: TokenBound = TokenBound(max_bytes=64)
    context_len: int = DEFAULT_CONTEXT_LEN  # the checkpoint's (llm_svc.loading.context_len): max_model_len's default

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def max_token_bytes(self) -> int:
        """Longest vocabulary entry in UTF-8 bytes: ``bytes / this`` lower-bounds a text's tokens."""
        return self.bound.max_bytes

    def min_tokens(self, text_bytes: int) -> int:
        """A lower bound on the tokens of ``text_bytes`` bytes of text."""
        return text_bytes // max(1, self.max_token_bytes)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ids (Gemma's are scaled by sqrt(hidden) inside the module)."""
        return self.model.get_input_embeddings()(ids)


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config.get_text_config(), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        for x in [e] if isinstance(e, int) else list(e):
            if x not in ids:
                ids.append(int(x))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def _arch_of(architecture: str) -> tuple[str, dict]:
    """Our model family of an HF architecture name, and the from_pretrained kwargs it needs."""
    if architecture in ("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM"):
        return "mimo", {"attn_implementation": "eager"}  # sdpa has no sink API
    if architecture.startswith("Gemma3"):
        return "gemma3", {"attn_implementation": "eager"}
    if architecture == "GptOssForCausalLM":
        return "gpt_oss", {"attn_implementation": "eager"}  # sdpa has no sink API
    return "other", {}


def load_lm(model_dir: str, device: str = "cpu", dtype: str = "float32", weights: bool = True,
            keep_packed: bool = True, parallel=None, group=None) -> LoadedLM:
    """Read the bundle spec, the tokenizer and the LM weights from ``model_dir``.

    ``keep_packed``: a published MiMo's FP8 linears (``mimo_native.load_mimo``) and gpt-oss'
    MXFP4 experts (``gpt_oss_moe``) stay packed in their stored width on the CPU; False
    dequantizes them at load as before.

    ``weights=False`` (the HTTP front of the engine-core split) reads only the config: the
    returned ``model`` is None, everything else is filled in.

    ``parallel`` (``llm_svc.parallel.ParallelConfig``) with ``group`` (this process's
    ``RankGroup``): load only this rank's part (``mimo_tp``); the model's forward all-reduces over
    ``group``. Published-dialect MiMo checkpoints only, so far."""
    import transformers

    spec = load_bundle_spec(model_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    tdtype = DTYPES[dtype]
    # never run a checkpoint's own code (auto_map), never prompt for it: the tokenizer files suffice
    tokenizer = AutoTokenizer.from_pretrained(spec.lm_dir, trust_remote_code=False)
    arch, kwargs = _arch_of(spec.lm_architecture)
    geometry = _mimo_geometry(spec.lm_dir) if arch == "mimo" else None
    scheme = _gpt_oss_scheme(spec.lm_dir) if arch == "gpt_oss" else None
    shard = None
    if parallel is not None and parallel.world_size > 1 and weights:
        if geometry is None or geometry.dialect != "published":
            raise ValueError(f"tensor_parallel_size {parallel.tensor_parallel_size} serves MiMo checkpoints in Xiaomi's "
                             f"published layout so far; {spec.lm_architecture} in {spec.lm_dir} is served by one rank "
                             "(tensor_parallel_size 1)")
        from llm_svc.models.mimo_tp import MiMoShard

        try:
            shard = MiMoShard(geometry, parallel, group.rank)
        except ValueError as e:
            raise ValueError(f"{spec.lm_dir}/config.json: {e}") from e
    if geometry is not None and geometry.dialect == "published":
        model, config, eos_src = _load_native_mimo(spec.lm_dir, geometry, tdtype, device, weights, keep_packed,
                                                   shard)
        if shard is not None:
            model.rank_group = group
    else:
        cls = getattr(transformers, spec.lm_architecture, None)
        if cls is None:
            raise ValueError(f"transformers has no class {spec.lm_architecture!r}")
        if weights and scheme is not None:
            model = _load_dequantized_hf(cls, spec.lm_dir, scheme, tdtype, device, kwargs, keep_packed)
            config, eos_src = model.config, model
        elif weights:
            model = cls.from_pretrained(spec.lm_dir, dtype=tdtype, **kwargs).to(device).eval()
            model.requires_grad_(False)
            if geometry is not None:
                model.geometry = geometry
            config, eos_src = model.config, model
        else:
            model = None
            config = transformers.AutoConfig.from_pretrained(spec.lm_dir)
            eos_src = _ConfigOnly(config, spec.lm_dir)
    tcfg = config.get_text_config()
    pad_ids = {}
    for modality, ph in spec.placeholders.items():
        tid = tokenizer.convert_tokens_to_ids(ph.pad)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"placeholder pad token {ph.pad!r} is not in the tokenizer")
        pad_ids[modality] = int(tid)
    layouts = {m: _timestamp_layout(tokenizer, ph, pad_ids[m]) for m, ph in spec.placeholders.items()
               if ph.layout == "timestamps"}
    return LoadedLM(
        spec=spec,
        tokenizer=tokenizer,
        model=model,
        arch=arch,
        hidden_size=int(tcfg.hidden_size),
        vocab_size=int(tcfg.vocab_size),
        eos_token_ids=_eos_ids(eos_src, tokenizer),
        pad_ids=pad_ids,
        layouts=layouts,
        bidirectional_media=(arch == "gemma3"),
        device=torch.device(device if weights else "cpu"),  # the front keeps media on the CPU
        dtype=tdtype,
        bound=TokenBound.of(tokenizer),
        context_len=context_length(_config_json(spec.lm_dir)[0], tokenizer.model_max_length),
    )


def _timestamp_layout(tokenizer, ph, pad: int) -> TimestampLayout:
    ids = {}
    for name in ("start", "end", "outer_start", "outer_end"):
        tok = getattr(ph, name)
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"placeholder token {tok!r} is not in the tokenizer")
        ids[name] = int(tid)
    return TimestampLayout(pad=pad, **ids)


def _config_json(lm_dir: Path) -> tuple[dict, Path]:
    """The checkpoint's ``config.json`` as written, and its path."""
    path = Path(lm_dir) / "config.json"
    try:
        return json.loads(path.read_text()), path
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


def _mimo_geometry(lm_dir: Path):
    from llm_svc.models.geometry import mimo_geometry

    return mimo_geometry(*_config_json(lm_dir))


def _gpt_oss_scheme(lm_dir: Path):
    """openai/gpt-oss-* store their experts MXFP4-packed (``*_blocks`` / ``*_scales``,
    ``quantization_config.quant_method = "mxfp4"``): the scheme that dequantizes them at load."""
    from llm_svc.models.quant import scheme_for

    raw, path = _config_json(lm_dir)
    return scheme_for(raw.get("quantization_config"), path, allowed=("mxfp4",))


_GPT_OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _gpt_oss_convert(target: str, t: torch.Tensor, quantized: bool) -> list[tuple[str, torch.Tensor]]:
    """MXFP4 experts dequantize to ``[E, out, in]``; transformers' GptOssExperts hold ``[E, in, out]``."""
    if not quantized:
        return [(target, t)]
    if not target.endswith(_GPT_OSS_EXPERTS):
        raise ValueError("is MXFP4-packed, but gpt-oss packs only mlp.experts.{gate_up_proj,down_proj}")
    return [(target, t.transpose(-1, -2))]


def _load_dequantized_hf(cls, lm_dir: Path, scheme, dtype: torch.dtype, device: str, kwargs: dict,
                         keep_packed: bool = True):
    """A quantized checkpoint of a transformers class: the float model built from its config, its
    weights dequantized by mmserve at load (``models/quant.py``) instead of transformers' quantizer.
    gpt-oss' MXFP4 experts instead stay packed where ``keep_packed`` and the CPU kernel builds
    (``gpt_oss_moe``): the model is built on the meta device, its experts modules replaced by
    packed ones, and every tensor read replaces its placeholder (no float experts, ever)."""
    import transformers

    from llm_svc.models.gpt_oss_moe import PackedGptOssExperts, mxfp4_experts_pack_here
    from llm_svc.models.weights import load_strict

    config = transformers.AutoConfig.from_pretrained(lm_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    from transformers.initialization import no_init_weights

    packed = keep_packed and scheme.method == "mxfp4" and mxfp4_experts_pack_here(device)
    with no_init_weights(), torch.device("meta" if packed else "cpu"):  # every parameter is read from the file
        model = cls._from_config(config, dtype=dtype, **kwargs)
        if packed:
            for layer in model.model.layers:
                layer.mlp.experts = PackedGptOssExperts.like(layer.mlp.experts, dtype)
    if packed:  # the rope tables are computed, not read
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    load_strict(model, lm_dir, dtype, scheme=scheme, convert=_gpt_oss_convert,
                pack=_pack_gpt_oss_experts(model) if packed else None)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors not loaded: {left[:5]}")
    if packed:
        nbytes = sum(layer.mlp.experts.nbytes for layer in model.model.layers)
        log.info("MXFP4 experts kept packed: %d layers, %.2f GiB", len(model.model.layers), nbytes / 2**30)
    elif scheme.method == "mxfp4":
        log.info("MXFP4 experts dequantized to %s at load (%s)", dtype, "keep_packed off" if not keep_packed else
                 "not on the CPU, or the packed kernel's MXFP4 build unavailable")
    model.generation_config = _ConfigOnly(config, lm_dir).generation_config or model.generation_config
    return model.to(device).eval().requires_grad_(False)


def _pack_gpt_oss_experts(model):
    """``load_strict``'s ``pack``: a stored MXFP4 experts tensor packed into its layer's
    ``PackedGptOssExperts`` as read (``[E, out, in / 32, 16]`` blocks, read and packed one expert
    at a time: never the whole stored tensor at once)."""
    from llm_svc.models.quant import check_mxfp4
    from llm_svc.models.weights import malloc_trim

    def pack(src, name: str, target: str) -> list[str] | None:
        group = src.groups[name]
        if "blocks" not in group or not target.endswith(_GPT_OSS_EXPERTS):
            return None
        owner, _, attr = target.rpartition(".")
        try:
            experts = model.get_submodule(owner)
        except AttributeError:
            return None  # not part of the model: the read path words the error
        bname, where = group["blocks"], src.where(group["blocks"])
        blocks, scales = src.meta(bname), src.read(group["scales"])  # the blocks are read expert by expert
        try:
            check_mxfp4(blocks, scales, repr(bname))
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e
        try:
            experts.set_packed(attr, blocks, expert=lambda e: (src.read(bname, e), scales[e]))
        except ValueError as e:
            raise CheckpointError(f"{where}: tensor {bname!r} {e}") from e
        del scales
        malloc_trim()  # the packing's temporaries, given back before the next tensor
        return [target]

    return pack


def _load_native_mimo(lm_dir: Path, geometry, dtype: torch.dtype, device: str, weights: bool,
                      keep_packed: bool = True, shard=None):
    """A published-dialect MiMo: our modules, built from its geometry (transformers would derive
    other layer shapes from this file); ``config`` carries the sizes and token ids."""
    from transformers import PretrainedConfig

    from llm_svc.models.mimo_native import load_mimo

    raw = json.loads((Path(lm_dir) / "config.json").read_text())
    config = PretrainedConfig(
        vocab_size=geometry.vocab_size, hidden_size=geometry.hidden_size,
        **{k: raw[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id", "architectures") if k in raw})
    holder = _ConfigOnly(config, lm_dir)
    if not weights:
        return None, config, holder
    model = load_mimo(lm_dir, geometry, config, dtype, device, bool(raw.get("tie_word_embeddings", False)),
                      raw.get("quantization_config"), Path(lm_dir) / "config.json", keep_packed, shard)
    model.generation_config = holder.generation_config
    return model, config, model


class _ConfigOnly:
    """What ``_eos_ids`` reads of a model (config + generation config), without weights."""

    def __init__(self, config, model_dir: str):
        from transformers import GenerationConfig

        self.config = config
        try:
            self.generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:  # no generation_config.json
            self.generation_config = None
