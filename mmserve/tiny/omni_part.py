"""What a tower writer adds to a tiny MiMo-V2.5 omni checkpoint (see ``mimo_omni.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OmniPart:
    """``config``: top-level ``config.json`` keys (e.g. ``{"audio_config": {...}}``);
    ``processor_config``: keys merged into ``config.json["processor_config"]``;
    ``tensors``: published tensor name -> tensor, written into ``model.safetensors`` as is;
    ``files``: path relative to the checkpoint directory -> bytes, written as is (the audio side's
    ``audio_tokenizer/config.json`` and ``audio_tokenizer/model.safetensors``)."""

    config: dict = field(default_factory=dict)
    processor_config: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
