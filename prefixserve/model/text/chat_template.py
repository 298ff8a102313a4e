"""Rendering of HF-style Jinja chat templates in a sandbox.

The environment follows what HF ``apply_chat_template`` offers a template: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text
and does not HTML-escape, and the globals ``raise_exception(message)`` and
``strftime_now(format)``. Templates run in an immutable sandbox: they cannot touch attributes
that start with an underscore nor mutate the messages they are given.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """Raised by a template through ``raise_exception``, or when a template does not compile."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` once (cached by its text) in the sandboxed environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str | None],
    **extra: Any,
) -> str:
    """Render ``messages`` with template ``source``.

    ``special_tokens`` provides ``bos_token``/``eos_token`` (and any other names) as template
    variables; ``extra`` passes further variables such as ``tools``.
    """
    template = compile_chat_template(source)
    return template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens, **extra
    )
