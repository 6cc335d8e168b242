"""Which ``chat_template_kwargs`` a request may send: the one rule the gateway and the LLM
service both apply before a chat template is rendered.

A request's kwargs become variables of the *model's* template (``enable_thinking``,
``reasoning_effort``). Two kinds of key are not variables:

* ``chat_template``: a template of the request's own. Rendering a caller's Jinja is a
  denial-of-service hole (a nested loop holds a CPU for minutes; vLLM shipped it as a CVE and now
  refuses it unless ``--trust-request-chat-template``): refused unless the operator trusts
  request templates (``trust_request_chat_template``).
* the arguments the server itself passes to ``apply_chat_template`` (the messages, tools, the
  generation prompt, tokenizing and its options): a request may not override them.
"""

from __future__ import annotations

from collections.abc import Mapping

REQUEST_TEMPLATE_KEY = "chat_template"
TRUST_SETTING = "--trust-request-chat-template"
# apply_chat_template's own arguments (transformers 4.5x) and what the server renders itself
SERVER_SET_KEYS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


class TemplateKwargsError(ValueError):
    """A request's ``chat_template_kwargs`` the server refuses (-> HTTP 400 naming the key)."""


def check_template_kwargs(kwargs: Mapping[str, object] | None, trust_request_template: bool = False) -> None:
    """Raise ``TemplateKwargsError`` for a key a request may not send (see the module doc)."""
    if not kwargs:
        return
    bad = sorted(SERVER_SET_KEYS & set(kwargs))
    if bad:
        raise TemplateKwargsError(f"chat_template_kwargs: {bad[0]} is set by the server; remove it")
    if REQUEST_TEMPLATE_KEY in kwargs and not trust_request_template:
        raise TemplateKwargsError(
            "chat_template_kwargs: chat_template is refused: this server renders the model's own chat template "
            f"only (its operator can allow request templates with {TRUST_SETTING}); remove it")
