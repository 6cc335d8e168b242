"""The tiny MiMo-V2.5 omni checkpoint served as is by the whole stack (gateway + encoder + LLM
processes), through the official ``openai`` client: an image, a video and an audio request answer
200 with a completion whose prompt counts the size-dependent image tokens, the timestamped video
layout and one audio pad per group of 4 RVQ code frames."""

from __future__ import annotations

import openai
import pytest

from benchmarks._stack_util import audio_part, image_part, make_mp4, make_png, make_wav, user, video_part
from mmserve.launcher import LocalStack, StackSpec
from mmserve.tiny_model import write_tiny_model
from tests.e2e.conftest import stream_chat

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni-e2e")
    model_dir = write_tiny_model(root / "omni", arch="mimo-v2.5-omni")
    with LocalStack(StackSpec(model_dir=str(model_dir), gateway_port=0, encoders=1), log_dir=root / "logs") as s:
        s.wait_ready(timeout=300)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=180, max_retries=0)


def _ask(client, stack, part) -> tuple[str, int]:
    messages = [user("What is shown here?", part)]
    r = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    text, finish, _ = stream_chat(client, stack.model_name, messages, 6)
    assert (text, finish) == (r.choices[0].message.content, "length")  # streamed == plain, greedy
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_image_tokens_follow_the_image_size(client, stack):
    _, small = _ask(client, stack, image_part(make_png(64, 64, seed=1)))  # 64x64 -> 2x2 merged tokens
    _, large = _ask(client, stack, image_part(make_png(256, 128, seed=2)))  # -> 4x8
    assert large - small == 32 - 4


def test_video_answers_with_timestamped_layout(client, stack):
    from transformers import AutoTokenizer

    from encoder_svc.video.sampling import sample_indices
    from llm_svc.loading.media_layout import format_timestamp
    from shared.settings import EncoderSettings

    mp4 = make_mp4(seconds=3.0, fps=8, seed=5)  # 24 frames, 64x64
    _, video_tokens = _ask(client, stack, video_part(mp4))
    _, image_tokens = _ask(client, stack, image_part(make_png(64, 64, seed=1)))  # 2x2 merged tokens
    s = EncoderSettings(model_dir=stack.spec.model_dir)  # the defaults the stack runs with
    starts = sample_indices(24, 8.0, s.video_fps, s.video_max_frames)[::2]  # one temporal group per pair
    tok = AutoTokenizer.from_pretrained(stack.spec.model_dir)
    ts = sum(len(tok.encode(format_timestamp(i / 8.0), add_special_tokens=False)) for i in starts)
    # <|mimo_video_start|> + per group (MM:SS + <|vision_start|> + 4 pads + <|vision_end|>) + <|mimo_video_end|>
    # in place of the image's <|vision_start|> + 4 pads + <|vision_end|>
    assert len(starts) >= 2
    assert video_tokens - image_tokens == 2 + ts + 6 * len(starts) - 6


def test_audio_answers_with_one_pad_per_code_group(client, stack):
    from tests.unit.test_omni_audio import vllm_token_len

    wav = make_wav(seconds=2.0, rate=16000, freq=300.0)  # resampled to 24 kHz: 48000 samples
    messages = [user("What is shown here?", audio_part(wav))]
    r = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1  # random LM: may stop
    text, finish, _ = stream_chat(client, stack.model_name, messages, 6)
    assert (text, finish) == (r.choices[0].message.content, r.choices[0].finish_reason)  # streamed == plain
    _, image_tokens = _ask(client, stack, image_part(make_png(64, 64, seed=1)))  # 2x2 merged tokens
    # <|mimo_audio_start|> + 13 pads + <|mimo_audio_end|> in place of <|vision_start|> + 4 pads + <|vision_end|>
    assert r.usage.prompt_tokens - image_tokens == vllm_token_len(1 + 48000 // 240) - 4 == 13 - 4
