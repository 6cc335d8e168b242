"""Load the bundle's language model with transformers (both backends start from this)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.bundle import BundleSpec, load_bundle_spec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedLM:
    """The HF model plus what the service needs to know about it, read once at load time."""

    spec: BundleSpec
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module  # the HF *ForCausalLM / *ForConditionalGeneration
    arch: str  # "mimo" | "gemma3" | other HF causal LM
    hidden_size: int
    vocab_size: int
    eos_token_ids: list[int]
    pad_ids: dict[str, int] = field(default_factory=dict)  # modality -> placeholder pad token id
    bidirectional_media: bool = False  # Gemma 3: an image's tokens attend to each other
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    @property
    def text_config(self):
        return self.model.config.get_text_config()

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


def load_lm(model_dir: str, device: str = "cpu", dtype: str = "float32") -> LoadedLM:
    """Read the bundle spec, the tokenizer and the LM weights from ``model_dir``."""
    import transformers

    spec = load_bundle_spec(model_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    tdtype = _DTYPES[dtype]
    tokenizer = AutoTokenizer.from_pretrained(spec.lm_dir)
    cls = getattr(transformers, spec.lm_architecture, None)
    if cls is None:
        raise ValueError(f"transformers has no class {spec.lm_architecture!r}")
    kwargs = {"dtype": tdtype}
    if spec.lm_architecture.startswith("MiMoV2Flash"):
        kwargs["attn_implementation"] = "eager"  # sdpa has no sink API
        arch = "mimo"
    elif spec.lm_architecture.startswith("Gemma3"):
        kwargs["attn_implementation"] = "eager"
        arch = "gemma3"
    else:
        arch = "other"
    model = cls.from_pretrained(spec.lm_dir, **kwargs).to(device).eval()
    model.requires_grad_(False)
    tcfg = model.config.get_text_config()
    pad_ids = {}
    for modality, ph in spec.placeholders.items():
        tid = tokenizer.convert_tokens_to_ids(ph.pad)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"placeholder pad token {ph.pad!r} is not in the tokenizer")
        pad_ids[modality] = int(tid)
    return LoadedLM(
        spec=spec,
        tokenizer=tokenizer,
        model=model,
        arch=arch,
        hidden_size=int(tcfg.hidden_size),
        vocab_size=int(tcfg.vocab_size),
        eos_token_ids=_eos_ids(model, tokenizer),
        pad_ids=pad_ids,
        bidirectional_media=(arch == "gemma3"),
        device=torch.device(device),
        dtype=tdtype,
    )
