"""The published-layout LMs served by the whole stack (gateway + encoder + LLM processes),
answered through the official ``openai`` client: MiMo-V2-Flash in Xiaomi's layout and gpt-oss,
and the hub's quantized forms (MiMo-V2.5 fused QKV + block FP8, gpt-oss MXFP4 experts)."""

from __future__ import annotations

import openai
import pytest

from mmserve.launcher import LocalStack, StackSpec
from mmserve.tiny_model import write_tiny_model
from tests.e2e.conftest import stream_chat

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("arch, variant", [("mimo-v2-flash", {}), ("gpt-oss", {}),
                                           ("mimo-v2.5", {"layout": "fused_qkv", "quant": "fp8"}),
                                           ("gpt-oss", {"quant": "mxfp4"})],
                         ids=["mimo-v2-flash", "gpt-oss", "mimo-v2.5-fused-fp8", "gpt-oss-mxfp4"])
def test_openai_client_gets_text(arch, variant, tmp_path):
    """A text-only LM runs without an encoder (``mmserve up`` starts none for it)."""
    model_dir = write_tiny_model(tmp_path / arch, arch=arch, **variant)
    with LocalStack(StackSpec(model_dir=str(model_dir), gateway_port=0, encoders=0), log_dir=tmp_path / "logs") as stack:
        stack.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)
        assert [m.id for m in client.models.list().data] == [stack.model_name]
        messages = [{"role": "user", "content": "hello, what is in this picture?"}]
        r = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=8, temperature=0)
        text, finish, usage = stream_chat(client, stack.model_name, messages, 8)
        assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
        assert (text, finish) == (r.choices[0].message.content, "length")  # streamed == plain, greedy
        assert usage.completion_tokens == 8 and usage.prompt_tokens > 5
