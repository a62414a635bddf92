"""Chat templates: render a list of messages into the prompt string a model was trained on.

Owns: the jinja2 environment that HF-style chat templates expect (sandboxed, `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a pass-through `{% generation %}` block, the
`raise_exception` and `strftime_now` helpers and a `tojson` filter with HF's signature), and turning
every template failure into `ValueError` (an HTTP 400 upstream).
Does not know: where a template came from (tokenizer_config.json, chat_template.jinja, GGUF) or
how the rendered prompt is tokenized.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part in templates written for
    training (HF uses it to build an assistant mask). For inference the body renders unchanged;
    without this extension such templates fail to parse."""

    tags = frozenset({"generation"})

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    # templates call this to reject a conversation (e.g. roles that do not alternate)
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own `tojson` escapes <, >, & and ' for HTML and takes only `indent`; chat templates
    # (tool schemas in particular) are written against HF's plain json.dumps, so we provide that
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to."""

    __slots__ = ("_special_tokens", "_template", "source")

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self._special_tokens = special_tokens
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from e

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        """The prompt string. `kwargs` (tools, documents, enable_thinking, ...) reach the template
        as variables and may override the special-token strings."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts")
        variables = {**self._special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            # a template indexing into a message field that is not there, or adding str to None
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
