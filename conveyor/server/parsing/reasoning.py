"""Reasoning models' thinking, split from their answer: `<think>...</think>` -> `reasoning_content`.

The parsers are named as vLLM's `--reasoning-parser`:

- `deepseek_r1`: the output begins inside the thinking (DeepSeek-R1's template opens `<think>` in the
  prompt); a leading `<think>` the model writes itself is dropped; everything up to `</think>` is
  reasoning, the rest is the answer. Without `</think>` (cut short by max_tokens) all of it is reasoning.
- `qwen3`: the output is the answer unless it opens with `<think>` (leading whitespace aside); then
  the same split.

Both look at the rendered prompt first (`starts_in_reasoning`): a prompt that ends with an open
`<think>` (Qwen3 thinking templates, R1) puts the output inside the thinking whichever parser; one
that ends with `</think>` (Qwen3 with `enable_thinking: false`) puts it in the answer. Whitespace
between `</think>` and the answer is dropped. `ReasoningStream` splits text deltas as they are
generated, tags split across tokens included; a whole output is split by feeding it in one piece,
so streamed and non-streamed replies agree exactly.
"""

from __future__ import annotations

import enum

from conveyor.server.parsing.tool_calls import partial_len

THINK_START = "<think>"
THINK_END = "</think>"


class _State(enum.Enum):
    START = "start"            # nothing decided yet: a leading <think> may follow
    REASONING = "reasoning"
    AFTER_END = "after_end"    # after </think>: whitespace before the answer is held, then dropped
    CONTENT = "content"


def starts_in_reasoning(parser: str, prompt_text: str) -> bool:
    """Whether the output of this prompt begins inside the thinking (see the module docstring)."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_START):
        return True
    if tail.endswith(THINK_END):
        return False
    return parser == "deepseek_r1"


class ReasoningStream:
    """Feed text deltas; get (reasoning, content) text safe to emit now. `finish` releases what was held."""

    def __init__(self, in_reasoning: bool) -> None:
        self._fallback = _State.REASONING if in_reasoning else _State.CONTENT   # if no <think> opens the output
        self._state = _State.START
        self._buf = ""
        self._saw_end = False

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would (still) be thinking: the tokens counted as reasoning tokens."""
        return self._state is _State.REASONING or (self._state is _State.START
                                                   and self._fallback is _State.REASONING)

    @property
    def ended(self) -> bool:
        """Whether `</think>` has been seen."""
        return self._saw_end

    @property
    def thought(self) -> bool:
        """Whether the output has a thinking part (possibly empty, possibly cut short)."""
        return self._saw_end or self.in_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state is _State.START:
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf, self._state = stripped[len(THINK_START):], _State.REASONING
                elif THINK_START.startswith(stripped):
                    break   # whitespace or a part of <think>: wait for more
                else:
                    self._state = self._fallback
                continue
            if self._state is _State.REASONING:
                end = buf.find(THINK_END)
                if end == -1:
                    keep = partial_len(buf, THINK_END)
                    reasoning.append(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    break
                reasoning.append(buf[:end])
                self._buf, self._state, self._saw_end = buf[end + len(THINK_END):], _State.AFTER_END, True
                continue
            if self._state is _State.AFTER_END:
                stripped = buf.lstrip()
                if not stripped:
                    break
                self._buf, self._state = stripped, _State.CONTENT
                continue
            content.append(buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the end of generation: held text (a partial tag, leading whitespace) where it belongs."""
        held, self._buf = self._buf, ""
        state = self._fallback if self._state is _State.START else self._state
        if state is _State.REASONING:
            return held, ""
        if state is _State.CONTENT:
            return "", held
        return "", ""


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole output -> (reasoning, or None when the model did not think; the answer)."""
    stream = ReasoningStream(in_reasoning)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.thought else None), content + more_content
