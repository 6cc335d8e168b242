"""``shared.rawwire``: torch-free safetensors, byte-compatible with ``shared.wire`` both ways."""

from __future__ import annotations

import pytest
import torch

from shared.rawwire import RawTensor, RawWireError, pack_raw, unpack_raw
from shared.schemas import EncodeResult, GenerateRequest, PromptMessage, PromptText
from shared.wire import pack, unpack

pytestmark = pytest.mark.unit

RESULT = EncodeResult(modality="image", content_hash="ab" * 32, model="m", num_tokens=3, hidden_size=2, key="k")


def test_what_wire_packs_rawwire_reads_and_back():
    t = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    b16 = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    raw, header = unpack_raw(pack({"embeds": t, "b": b16}, RESULT), EncodeResult)
    assert header == RESULT
    assert (raw["embeds"].dtype, raw["embeds"].shape, raw["embeds"].data) == ("F32", (3, 2), t.numpy().tobytes())
    assert raw["b"].dtype == "BF16" and raw["b"].shape == (1, 2)
    tensors, back = unpack(pack_raw(raw, RESULT), EncodeResult)
    assert back == RESULT and torch.equal(tensors["embeds"], t) and torch.equal(tensors["b"], b16)


def test_header_only_messages():
    gen = GenerateRequest(request_id="r", messages=[PromptMessage(role="user", content=[PromptText(text="hi")])])
    body = pack_raw({}, gen)
    assert unpack(body, GenerateRequest) == ({}, gen)
    assert unpack_raw(body, GenerateRequest) == ({}, gen)


@pytest.mark.parametrize("bad", [b"", b"\x05", (10**9).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"[]"])
def test_malformed_bytes_are_refused(bad):
    with pytest.raises(RawWireError):
        unpack_raw(bad, EncodeResult)


def test_wrong_header_type_and_bad_offsets_are_refused():
    body = pack_raw({"embeds": RawTensor("F32", (1, 1), b"\0" * 4)}, RESULT)
    with pytest.raises(RawWireError, match="expected header GenerateRequest"):
        unpack_raw(body, GenerateRequest)
    with pytest.raises(RawWireError, match="outside"):
        unpack_raw(body[:-2], EncodeResult)
    with pytest.raises(RawWireError, match="do not hold"):
        RawTensor("F32", (2, 2), b"\0" * 4)
