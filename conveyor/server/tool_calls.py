"""Tool calls in generated text, in the Hermes / Qwen syntax, for OpenAI chat completions.

A model calls a tool by emitting, anywhere in its output, one or more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` splits a whole output into content and calls; `ToolCallStreamParser` does the
same incrementally for streaming. Both pair each "<tool_call>" with the first "</tool_call>" after
it, and a block whose body is not a valid call stays in the content verbatim, so a model that merely
talks about the syntax loses no text.

The two agree on the calls, and on the content up to surrounding whitespace: `parse_tool_calls`
strips the content, while a stream cannot take back what it has sent. The stream holds whitespace
that follows the start or a call until non-whitespace content arrives, and drops it if none does,
so whitespace between calls or after the last one produces no content delta.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits, unique per call
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


def _reject_constant(name: str) -> None:
    # NaN and Infinity are not JSON: clients could not parse the re-serialized arguments.
    raise ValueError(f"non-JSON constant {name}")


def _loads(text: str) -> object:
    return json.loads(text, parse_constant=_reject_constant)


def _parse_block(body: str) -> ToolCall | None:
    """The call in one block's body, or None when the body is not a valid call."""
    try:
        obj = _loads(body)
        if not isinstance(obj, dict):
            return None
        name, arguments = obj.get("name"), obj.get("arguments")
        # Some models emit the arguments object as a JSON string.
        if isinstance(arguments, str):
            arguments = _loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(
        id="call_" + uuid.uuid4().hex[:24],
        name=name,
        arguments=json.dumps(arguments, ensure_ascii=False),
    )


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole output -> (content, calls).

    content is the text outside the valid tool-call blocks, stripped; None when it is empty and
    calls were found. Invalid blocks and an unterminated final "<tool_call>" stay in the content.
    """
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break
        call = _parse_block(text[start + len(OPEN) : end])
        if call is not None:
            pieces.append(text[pos:start])
            calls.append(call)
        else:
            pieces.append(text[pos : end + len(CLOSE)])
        pos = end + len(CLOSE)
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    if not content and calls:
        return None, calls
    return content, calls


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of OPEN."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class ToolCallStreamParser:
    """Incremental `parse_tool_calls`: feed text deltas as they are generated.

    Content is released as soon as it cannot be the start of "<tool_call>"; a block is held until
    its "</tool_call>" arrives. The streamed content is not stripped (see the module docstring).
    """

    def __init__(self) -> None:
        self._buf = ""  # unresolved text: a partial open tag, or an open block
        self._in_block = False
        self._scan = 0  # where to resume looking for CLOSE in an open block
        self._at_boundary = True  # no non-whitespace content since the start or the last call
        self._held_ws = ""
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def _content(self, text: str) -> str:
        """What to emit for content text, holding whitespace that may turn out to be trailing."""
        if not self._at_boundary:
            return text
        if not text.strip():
            self._held_ws += text
            return ""
        out, self._held_ws, self._at_boundary = self._held_ws + text, "", False
        return out

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content safe to emit now, calls completed by this delta)."""
        self._buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            buf = self._buf
            if not self._in_block:
                start = buf.find(OPEN)
                if start == -1:
                    keep = _partial_open_len(buf)
                    out.append(self._content(buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep :]
                    break
                out.append(self._content(buf[:start]))
                self._buf, self._in_block, self._scan = buf[start:], True, len(OPEN)
                continue
            end = buf.find(CLOSE, self._scan)
            if end == -1:
                # CLOSE may straddle the next delta, so rescan its possible start.
                self._scan = max(len(OPEN), len(buf) - len(CLOSE) + 1)
                break
            call = _parse_block(buf[len(OPEN) : end])
            if call is not None:
                calls.append(call)
                self._num_calls += 1
                self._at_boundary = True
            else:
                out.append(self._content(buf[: end + len(CLOSE)]))
            self._buf, self._in_block = buf[end + len(CLOSE) :], False
        return "".join(out), calls

    def finish(self) -> str:
        """At the end of generation: held-back text (an unterminated block, a partial tag)."""
        out = self._content(self._buf)
        self._buf, self._in_block, self._held_ws = "", False, ""
        return out
