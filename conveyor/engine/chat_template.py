"""Chat templates: a checkpoint's Jinja template rendered the way transformers renders it.

The environment matches transformers' chat_template_utils (sandboxed, `tojson` without HTML
escaping, `raise_exception`, `strftime_now`, `{% generation %}`), so a template gives the same
prompt text here as there.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conveyor.errors import InvalidRequest


def pick_chat_template(value: Any) -> str | None:
    """A chat template is a string or, in older configs, a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise ValueError(f"unrecognized chat_template entry: {type(value).__name__}")



def read_chat_template(value: str) -> str:
    """--chat-template as vLLM takes it: the path of a Jinja file, or the template text itself."""
    path = Path(value).expanduser()
    if "{" not in value and "\n" not in value:
        if not path.is_file():
            raise ValueError(f"chat template file not found: {value}")
        return path.read_text(encoding="utf-8")
    return value


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """Raised by a template's own `raise_exception(...)`: its message is meant for the caller."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's built-in tojson escapes HTML characters, which changes what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` marker and renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc



def takes_tools(source: str) -> bool:
    """Whether a template reads the `tools` variable (else tools are shown to the model another way)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.exceptions.TemplateSyntaxError:
        return False


def render_chat_template(template: jinja2.Template, messages: list[dict], *, add_generation_prompt: bool,
                         bos_token: str | None, eos_token: str | None, tools: list[dict] | None = None) -> str:
    """Render like transformers' apply_chat_template(tokenize=False); a template's own complaint -> InvalidRequest."""
    # Like transformers: drop None fields, since OpenAI clients send content=None and templates choke on it.
    chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
    try:
        return template.render(messages=chat, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)
    except _TemplateRaised as exc:
        raise InvalidRequest(exc.message or "chat template rejected the messages") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequest(f"chat template failed on these messages: {exc}") from exc
