"""The audio encoder's part of the tiny MiMo-V2.5 omni checkpoint (owned by the audio side).

``audio_part(lm_hidden, seed)`` returns the ``audio_config`` / processor keys / tensors to add,
or None for a checkpoint without an audio encoder (then the directory serves image and video).
"""

from __future__ import annotations

from shared.tiny.omni_part import OmniPart


def audio_part(lm_hidden: int, seed: int) -> OmniPart | None:
    return None
