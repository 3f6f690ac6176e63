"""Chat templates: a checkpoint's Jinja template rendered the way transformers renders it, on a budget.

The environment matches transformers' chat_template_utils (sandboxed, `tojson` without HTML
escaping, `raise_exception`, `strftime_now`, `{% generation %}`), so a template gives the same
prompt text here as there.

A template comes with the model file, so it is input like any other: a nested loop or a
recursive macro would otherwise run for hours, and a doubling string fill the memory. Each render
has a budget (RENDER_TIMEOUT_S of wall time, MAX_RENDER_OPS steps, max_chars of output and of any
one value) that the sandbox's hooks spend: every loop iteration (each `for` is compiled with a
counting filter around its iterable), call, filter, attribute and item lookup, and every `*`
and `**`; sizes are checked on a call's arguments and result, a filter's, a namespace attribute
set and each piece of output. Past the budget the render raises `ChatTemplateLimit`, a 400 as vLLM answers any
template failure: the same messages would fail again, so the client must not retry them as it
would a 5xx. A pure-Python loop cannot be stopped from outside its thread; this one stops itself.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
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


RENDER_TIMEOUT_S = 10.0
MAX_RENDER_OPS = 20_000_000
MAX_RENDER_CHARS = 16 * 1024 * 1024   # of the output and of any one string or list made on the way
_CLOCK_EVERY_OPS = 1024               # ops between two looks at the clock
_FORMAT_WIDTHS = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")
_MAX_EXPONENT = 4096                  # `**` past it: huge integers take minutes in C, unstoppable


class ChatTemplateLimit(InvalidRequest):
    """A render that ran past its budget; it stopped itself, and the request gets a 400."""

    code = "chat_template_limit"


@dataclass(slots=True)
class _Budget:
    deadline_s: float
    max_chars: int
    num_ops: int = 0

    def spend(self) -> None:
        self.num_ops += 1
        if self.num_ops % _CLOCK_EVERY_OPS:
            return
        if self.num_ops > MAX_RENDER_OPS:
            raise ChatTemplateLimit(f"the chat template ran past {MAX_RENDER_OPS} steps on these messages; "
                                    f"it was stopped")
        if time.monotonic() > self.deadline_s:
            raise ChatTemplateLimit(f"the chat template did not finish rendering these messages within "
                                    f"{RENDER_TIMEOUT_S:g} s; it was stopped")

    def check_count(self, value: Any) -> None:
        """An integer argument that could size a string (a width, a repeat count)."""
        if isinstance(value, int) and abs(value) > self.max_chars:
            raise ChatTemplateLimit(f"the chat template passed {value} as an argument; the limit is "
                                    f"{self.max_chars}")

    def check_size(self, value: Any) -> None:
        if isinstance(value, (str, list, tuple, dict, bytes)) and len(value) > self.max_chars:
            raise ChatTemplateLimit(f"the chat template made a value of {len(value)} items on these messages; "
                                    f"the limit is {self.max_chars}")


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _spend() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend()
    return budget


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """Wraps every `for` loop's iterable: one step per iteration."""
    for item in iterable:
        _spend()
        yield item


def _budgeted_filter(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)   # keeps jinja's pass_context / pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        budget = _spend()
        if budget is not None:
            for value in (*args, *kwargs.values()):   # center(10**9), indent(10**9)
                budget.check_count(value)
        result = function(*args, **kwargs)
        if budget is not None:
            budget.check_size(result)
        return result

    return run


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every hook it offers spending the render's budget."""

    intercepted_binops = frozenset({"*", "**", "%"})
    _COUNT_FILTER = "conveyor_counted"

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _spend()
        if budget is not None:   # a macro handed a doubled string on each call; 'x'.ljust(10**9)
            for value in (*args, *kwargs.values()):
                budget.check_size(value)
                budget.check_count(value)
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            budget.check_size(result)
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _spend()
        if budget is not None:
            if operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
                raise ChatTemplateLimit(f"the chat template raised a number to the power {right}; the limit is "
                                        f"{_MAX_EXPONENT}")
            if operator == "%" and isinstance(left, str):   # '%1000000000s' % x, '%*s' % (10**9, x)
                widths = [int(group) for groups in _FORMAT_WIDTHS.findall(left) for group in groups if group]
                if "*" in left:
                    widths += [a for a in (right if isinstance(right, tuple) else (right,)) if isinstance(a, int)]
                for width in widths:
                    budget.check_count(width)
            if operator == "*":   # check the size before a repeated string or list is made
                for sequence, times in ((left, right), (right, left)):
                    if (isinstance(sequence, (str, list, tuple)) and isinstance(times, int)
                            and len(sequence) * times > budget.max_chars):
                        raise ChatTemplateLimit(f"the chat template repeated a value {times} times; the result "
                                                f"would pass the limit of {budget.max_chars} items")
        result = super().call_binop(context, operator, left, right)
        if budget is not None:
            budget.check_size(result)
        return result

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, self._COUNT_FILTER, [], [], None, None,
                                            lineno=loop.iter.lineno)
        return tree


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
        budget = _spend()
        if budget is not None:
            budget.check_size(value)
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
    env = _BudgetedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(f) for name, f in env.filters.items()}
    env.filters[_BudgetedEnvironment._COUNT_FILTER] = _counted
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    # Jinja folds constant expressions while compiling (`'x' | center(10**9)`): on the same budget.
    token = _BUDGET.set(_Budget(time.monotonic() + RENDER_TIMEOUT_S, MAX_RENDER_CHARS))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc
    finally:
        _BUDGET.reset(token)



def takes_tools(source: str) -> bool:
    """Whether a template reads the `tools` variable (else tools are shown to the model another way)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.exceptions.TemplateSyntaxError:
        return False


_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


def render_chat_template(template: jinja2.Template, messages: list[dict], *, add_generation_prompt: bool,
                         bos_token: str | None, eos_token: str | None, tools: list[dict] | None = None,
                         max_chars: int = MAX_RENDER_CHARS, template_kwargs: dict | None = None) -> str:
    """Render like transformers' apply_chat_template(tokenize=False), within the budget; a template's
    own complaint -> InvalidRequest, a render past its budget -> ChatTemplateLimit. `template_kwargs`
    are further variables (a request's chat_template_kwargs, such as enable_thinking)."""
    reserved = sorted(set(template_kwargs or ()) & _TEMPLATE_VARIABLES)
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(reserved)}: the request sets it",
                             param="chat_template_kwargs")
    # Like transformers: drop None fields, since OpenAI clients send content=None and templates choke on it.
    chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
    budget = _Budget(time.monotonic() + RENDER_TIMEOUT_S, max_chars)
    token = _BUDGET.set(budget)
    try:
        pieces, num_chars = [], 0
        for piece in template.generate(**(template_kwargs or {}), messages=chat, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                                       eos_token=eos_token):
            num_chars += len(piece)
            if num_chars > max_chars:
                raise ChatTemplateLimit(f"the chat template wrote more than {max_chars} characters for these "
                                        f"messages; it was stopped")
            pieces.append(piece)
        return "".join(pieces)
    except _TemplateRaised as exc:
        raise InvalidRequest(exc.message or "chat template rejected the messages") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequest(f"chat template failed on these messages: {exc}") from exc
    except RecursionError as exc:
        raise ChatTemplateLimit("the chat template recursed too deeply on these messages; it was stopped") from exc
    finally:
        _BUDGET.reset(token)
