"""A checkpoint's chat template (tokenizer_config.json's "chat_template", a Jinja template)
rendered as transformers renders it: a sandboxed environment with trim_blocks and lstrip_blocks,
the messages, add_generation_prompt, the tokenizer's special tokens and `raise_exception`."""

from __future__ import annotations

import functools

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(template)


def render_chat(template: str, messages: list[dict], tokenizer) -> str:
    """The prompt text of `messages` ([{"role", "content"}, ...]) ending where the assistant's
    answer begins (add_generation_prompt). The template places BOS itself where it wants one."""
    special, backend = {}, getattr(tokenizer, "backend", None)
    for name in ("bos", "eos"):
        token = getattr(tokenizer, f"{name}_id", None)
        text = backend.id_to_token(token) if token is not None and backend is not None else None
        special[f"{name}_token"] = text or ""
    return _compile(template).render(messages=messages, add_generation_prompt=True, **special)
