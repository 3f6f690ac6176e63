"""The forms in which models write tool calls, and the `--tool-call-parser` names (vLLM's) that pick them.

Every parser reads the Hermes / Qwen block (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
the form conveyor's own tools prompt teaches and tool_choice's grammar writes; a fenced JSON block
(```json {"name": ..., "arguments": {...}} ```) naming one of the request's tools, as Qwen2.5-Coder
writes under `auto`; and a whole output that is such call objects (`arguments` or `parameters`, several
separated by `;`), as Llama 3 writes without its tag. Beyond those:

- `llama3_json`: Llama 3's `<|python_tag|>` followed by calls.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of calls (`[{"name": ..., "arguments": {...}}]`)
  or by `name[ARGS]{...}` calls, or an output that is such a list naming given tools.

`auto` picks from the chat template: the parser whose markers it writes, else `hermes`.
A body whose calls do not parse is content, verbatim: a model talking about the syntax loses no text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import TOOL_CALL_PARSERS


@dataclass(slots=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits, unique per call (9 hex digits under the mistral parser)
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


# A body and the request's tool names (None: any name) -> its calls, or None when it is not calls.
BodyParser = Callable[[str, "frozenset[str] | None"], "list[ToolCall] | None"]


@dataclass(frozen=True, slots=True)
class CallSyntax:
    open: str                 # the text that begins a block
    close: str | None         # the text that ends it; None: the block runs to the end of the output
    parse: BodyParser
    keep_open: bool = False   # the opening text is part of the body (a JSON object's own start)
    at_start: bool = False    # only at the start of the output (leading whitespace aside)


def _reject_constant(name: str) -> None:
    # NaN and Infinity are not JSON: clients could not parse the re-serialized arguments.
    raise ValueError(f"non-JSON constant {name}")


def _loads(text: str) -> object:
    return json.loads(text, parse_constant=_reject_constant)


def _call(obj: object, names: frozenset[str] | None,
          argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """The call an object describes, or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = next((obj[key] for key in argument_keys if key in obj), None)
    try:
        if isinstance(arguments, str):   # some models write the arguments object as a JSON string
            arguments = _loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    if names is not None and name not in names:
        return None
    return ToolCall(id="call_" + uuid.uuid4().hex[:24], name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _objects(body: str) -> list[object] | None:
    """The JSON values of a body: one, or several separated by ';' or whitespace; None if any is not JSON."""
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    values, pos, body = [], 0, body.strip()
    try:
        while pos < len(body):
            value, pos = decoder.raw_decode(body, pos)
            values.append(value)
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
    except (ValueError, RecursionError):
        return None
    return values


def _calls(values: list[object] | None, names: frozenset[str] | None,
           argument_keys: tuple[str, ...] = ("arguments",)) -> list[ToolCall] | None:
    if not values:
        return None
    calls = [_call(value, names, argument_keys) for value in values]
    return calls if all(call is not None for call in calls) else None   # type: ignore[return-value]


def parse_hermes(body: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    """One call object; any name (the tag says it is a call)."""
    try:
        call = _call(_loads(body), None)
    except (ValueError, RecursionError):
        return None
    return [call] if call is not None else None


def parse_fenced(body: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    """A code block's body (after its language tag) of call objects, each naming a given tool."""
    language, _, rest = body.partition("\n")
    if language.strip() not in ("", "json", "tool_call", "tool_code"):
        return None
    return _calls(_objects(rest), names if names is not None else frozenset(), ("arguments", "parameters"))


def parse_llama3(body: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    return _calls(_objects(body), names, ("parameters", "arguments"))


def parse_bare(body: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    """A whole output of call objects (no marker): each must name a given tool."""
    return _calls(_objects(body), names if names is not None else frozenset(), ("arguments", "parameters"))


_MISTRAL_CALL = re.compile(r"\s*(?:\[TOOL_CALLS\]\s*)?([A-Za-z0-9_.-]{1,64})\s*(?:\[ARGS\])?\s*")


def parse_mistral(body: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    """A JSON list of call objects, or `name[ARGS]{...}` calls one after another."""
    stripped = body.strip()
    if stripped.startswith("["):
        values = _objects(stripped)
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return None
        return _calls(values[0], names)
    decoder, calls, pos = json.JSONDecoder(parse_constant=_reject_constant), [], 0
    while pos < len(stripped):
        match = _MISTRAL_CALL.match(stripped, pos)
        if match is None:
            return None
        try:
            arguments, pos = decoder.raw_decode(stripped, match.end())
        except (ValueError, RecursionError):
            return None
        call = _call({"name": match.group(1), "arguments": arguments}, names)
        if call is None:
            return None
        calls.append(call)
        pos = len(stripped) - len(stripped[pos:].lstrip())
    return calls or None


def _mistral_ids(form: CallSyntax) -> CallSyntax:
    """The form with Mistral's call ids: 9 letters and digits, which Mistral's chat templates insist on
    when the calls come back in the conversation."""
    def parse(body: str, names: frozenset[str] | None) -> list[ToolCall] | None:
        calls = form.parse(body, names)
        for call in calls or []:
            call.id = uuid.uuid4().hex[:9]
        return calls

    return CallSyntax(form.open, form.close, parse, form.keep_open, form.at_start)


HERMES = CallSyntax("<tool_call>", "</tool_call>", parse_hermes)
FENCED = CallSyntax("```", "```", parse_fenced)
BARE = CallSyntax("{", None, parse_bare, keep_open=True, at_start=True)
_SYNTAXES: dict[str, tuple[CallSyntax, ...]] = {
    "hermes": (HERMES, FENCED, BARE),
    "llama3_json": (HERMES, FENCED, BARE, CallSyntax("<|python_tag|>", None, parse_llama3)),
    "mistral": tuple(_mistral_ids(form) for form in (
        HERMES, FENCED, BARE, CallSyntax("[TOOL_CALLS]", None, parse_mistral),
        CallSyntax("[", None, lambda body, names: parse_mistral(body, names or frozenset()),
                   keep_open=True, at_start=True))),
}
assert set(_SYNTAXES) | {"auto"} == set(TOOL_CALL_PARSERS)


def resolve_tool_call_parser(name: str, chat_template: str | None) -> str:
    """`auto` -> the parser whose markers the chat template writes (hermes when none); other names as they are."""
    if name != "auto":
        return name
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def syntaxes(parser: str) -> tuple[CallSyntax, ...]:
    return _SYNTAXES[parser]
