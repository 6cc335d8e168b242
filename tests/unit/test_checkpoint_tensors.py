"""``weights.CheckpointTensors`` reads one entry of a stored tensor alone (an expert of a stacked
experts tensor: its bytes only) and a tensor's shape and dtype without reading it."""

import pytest
import torch
from safetensors.torch import save_file

from llm_svc.models.weights import CheckpointTensors

pytestmark = pytest.mark.unit


def test_one_entry_and_the_shape_without_reading(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randint(0, 256, (3, 4, 5), generator=g, dtype=torch.uint8),
             "b": torch.randn(2, 3, generator=g), "c": torch.randn(4, 2, generator=g).bfloat16()}
    save_file(state, str(tmp_path / "model.safetensors"))
    src = CheckpointTensors(tmp_path)
    for name, t in state.items():
        assert torch.equal(src.read(name), t)
        for i in range(t.shape[0]):
            assert torch.equal(src.read(name, i), t[i])
        m = src.meta(name)
        assert m.is_meta and (m.shape, m.dtype) == (t.shape, t.dtype)
    with pytest.raises(IndexError, match="entry 3 of 3"):
        src.read("a", 3)
