"""Tool calls in generated text, for OpenAI chat completions, in the forms tool_syntaxes.py lists.

A model calls a tool by emitting blocks such as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` splits a whole output into content and calls; `ToolCallStreamParser` does the
same incrementally for streaming. Both pair each block's opening text with the first closing text
after it (a block without one runs to the end of the output), and a block whose body is not a valid
call stays in the content verbatim, so a model that merely talks about the syntax loses no text.

The two agree on the calls, and on the content up to surrounding whitespace: `parse_tool_calls`
strips the content, while a stream cannot take back what it has sent. The stream holds whitespace
that follows the start or a call until non-whitespace content arrives, and drops it if none does,
so whitespace between calls or after the last one produces no content delta.
"""

from __future__ import annotations

from conveyor.server.parsing.tool_syntaxes import HERMES, CallSyntax, ToolCall

__all__ = ["ToolCall", "ToolCallStreamParser", "parse_tool_calls", "partial_len"]


def parse_tool_calls(text: str, forms: tuple[CallSyntax, ...] = (HERMES,),
                     tool_names: frozenset[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Whole output -> (content, calls).

    content is the text outside the valid tool-call blocks, stripped; None when it is empty and
    calls were found. Invalid blocks and an unterminated final block stay in the content.
    """
    parser = ToolCallStreamParser(forms, tool_names)
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content, calls = (content + rest).strip(), calls + more
    if not content and calls:
        return None, calls
    return content, calls


def partial_len(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStreamParser:
    """Incremental `parse_tool_calls`: feed text deltas as they are generated.

    Content is released as soon as it cannot be the start of a block; a block is held until its
    closing text arrives (or the output ends). The streamed content is not stripped (see the module docstring).
    """

    def __init__(self, forms: tuple[CallSyntax, ...] = (HERMES,), tool_names: frozenset[str] | None = None) -> None:
        self._forms = forms
        self._names = tool_names
        self._buf = ""  # unresolved text: a partial opening, or an open block
        self._form: CallSyntax | None = None  # the open block's form
        self._scan = 0  # where to resume looking for the close in an open block
        self._at_boundary = True  # no non-whitespace content since the start or the last call
        self._started = False  # any content or call so far: forms that only open an output no longer apply
        self._held_ws = ""
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def _content(self, text: str) -> str:
        """What to emit for content text, holding whitespace that may turn out to be trailing."""
        if text.strip():
            self._started = True
        if not self._at_boundary:
            return text
        if not text.strip():
            self._held_ws += text
            return ""
        out, self._held_ws, self._at_boundary = self._held_ws + text, "", False
        return out

    def _live_forms(self) -> list[CallSyntax]:
        return [form for form in self._forms if not (form.at_start and self._started)]

    def _find_open(self, buf: str) -> tuple[int, CallSyntax | None, int]:
        """(where the earliest block opens, its form, how much of buf's end to hold as a possible opening)."""
        best, best_form, keep = -1, None, 0
        for form in self._live_forms():
            if form.at_start:
                stripped = buf.lstrip()
                start = len(buf) - len(stripped) if stripped.startswith(form.open) else -1
                if start == -1 and form.open.startswith(stripped):
                    keep = max(keep, len(stripped))
            else:
                start = buf.find(form.open)
                keep = max(keep, partial_len(buf, form.open))
            if start != -1 and (best == -1 or start < best
                                or (start == best and len(form.open) > len(best_form.open))):
                best, best_form = start, form
        if best_form is not None:
            tail = buf[best:]
            if any(len(form.open) > len(tail) and form.open.startswith(tail) for form in self._live_forms()):
                return -1, None, len(tail)   # a longer opening ("[TOOL_CALLS]" after "[") may still follow
        return best, best_form, keep

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content safe to emit now, calls completed by this delta)."""
        self._buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            buf = self._buf
            form = self._form
            if form is None:
                start, form, keep = self._find_open(buf)
                if form is None:
                    out.append(self._content(buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep :]
                    break
                out.append(self._content(buf[:start]))
                self._buf, self._form, self._scan = buf[start:], form, len(form.open)
                continue
            if form.close is None:
                break   # the block runs to the end of the output: resolved by finish
            end = buf.find(form.close, self._scan)
            if end == -1:
                # The close may straddle the next delta, so rescan its possible start.
                self._scan = max(len(form.open), len(buf) - len(form.close) + 1)
                break
            out.append(self._resolve(buf[: end + len(form.close)], buf[len(form.open) : end], form, calls))
            self._buf, self._form = buf[end + len(form.close) :], None
        return "".join(out), calls

    def _resolve(self, block: str, body: str, form: CallSyntax, calls: list[ToolCall]) -> str:
        """The block's calls into `calls`, or its text back as content."""
        found = form.parse(form.open + body if form.keep_open else body, self._names)
        if not found:
            return self._content(block)
        calls += found
        self._num_calls += len(found)
        self._at_boundary = self._started = True
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of generation: held-back text (an unterminated block, a partial opening), and the
        calls of a block that runs to the end of the output."""
        form, buf = self._form, self._buf
        self._buf, self._form = "", None
        calls: list[ToolCall] = []
        if form is not None and form.close is None:
            out = self._resolve(buf, buf[len(form.open):], form, calls)
        else:
            out = self._content(buf)
        self._held_ws = ""
        return out, calls
