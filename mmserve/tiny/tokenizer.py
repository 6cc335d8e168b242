"""The tiny models' tokenizers: a byte-level BPE trained on a small synthetic corpus, and the
ChatML specials and template MiMo's checkpoints use."""

from __future__ import annotations

import random

CHATML_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
]
GEMMA_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# MiMo's tool rendering (MiMo-V2-Flash's template): the tool list in a system turn of its own
# ahead of the conversation, assistant calls in its compact XML (``<parameter=K>V</parameter>``,
# string values verbatim, others as JSON), tool results as user turns of ``<tool_response>``s,
# an assistant's ``reasoning_content`` as its ``<think>`` block. Without tools, tool calls, tool
# messages, reasoning_content or enable_thinking the template renders as plain ChatML.
CHATML_TOOLS_SYSTEM = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
    "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, output the function name and arguments in the following "
    "format:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>value_1"
    "</parameter>\n<parameter=example_parameter_2>This is the value for the second parameter\nthat can "
    "span\nmultiple lines</parameter>\n</function>\n</tool_call><|im_end|>\n' }}{% endif %}"
)
CHATML_TOOL_CALLS = (
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '\n<tool_call>\n<function=' + fn['name'] + '>\n' }}"
    "{% if fn['arguments'] is mapping %}{% for key, value in fn['arguments'] | items %}"
    "{{ '<parameter=' + key + '>' }}{{ value if value is string else value | tojson }}{{ '</parameter>\n' }}"
    "{% endfor %}{% elif fn['arguments'] %}{{ fn['arguments'] + '\n' }}{% endif %}"
    "{{ '</function>\n</tool_call>' }}{% endfor %}{% endif %}"
)
CHATML_TOOL_RESPONSE = (
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' }}{{ message['content'] if message['content'] is string else '' }}"
    "{{ '\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
)


# Media parts are rendered by the chat template as the placeholder's start+pad+end; the LLM
# service expands the single pad into one pad per embedding row.
def chatml_template(audio_start: str = "<|audio_start|>", audio_end: str = "<|audio_end|>") -> str:
    """ChatML with Qwen-VL style media placeholders; the audio markers differ per checkpoint."""
    return (
        CHATML_TOOLS_SYSTEM
        + "{% for message in messages %}"
        "{% if message['role'] == 'tool' %}" + CHATML_TOOL_RESPONSE + "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' and message['reasoning_content'] is string %}"
        "{{ '<think>' + message['reasoning_content'] + '</think>' }}{% endif %}"
        "{% if message['content'] is none %}"
        "{% elif message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
        f"{{% elif part['type'] == 'audio' %}}{{{{ '{audio_start}<|audio_pad|>{audio_end}' }}}}"
        "{% endif %}{% endfor %}{% endif %}"
        + CHATML_TOOL_CALLS
        + "{{ '<|im_end|>\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% if enable_thinking is defined and enable_thinking is true %}{{ '<think>' }}"
        "{% elif enable_thinking is defined and enable_thinking is false %}{{ '<think></think>' }}{% endif %}"
        "{% endif %}"
    )


CHATML_TEMPLATE = chatml_template()
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'video') %}{{ '<start_of_image><image_soft_token><end_of_image>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

_WORDS = (
    "the a an image video audio picture photo frame sound model answer question what is in this "
    "describe show me please thanks hello hi world cat dog red green blue color shape square "
    "circle line text token window attention cache prefix memory fast serve request user "
    "assistant system you are helpful small tiny random one two three four five yes no and or "
    "of to for with on at by from it that there here can will would should could do does"
).split()


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        k = rng.randint(3, 14)
        words = [rng.choice(_WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(specials: list[str], vocab_size: int, chat_template: str, eos: str, **named):
    """A byte-level BPE trained on a small synthetic corpus, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, **named)
    fast.chat_template = chat_template
    return fast
