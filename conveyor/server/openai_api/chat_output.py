"""One chat choice's generated text, split as it arrives: thinking, answer text, tool calls.

The thinking is split first (reasoning.py, when the server has a reasoning parser), then tool calls
are parsed from the answer only (tool_calls.py, when the request may call tools), so a model that
thinks about calling a tool before it calls one yields one call. Reasoning tokens are counted per
delta: the tokens of a delta fed while the output is still thinking (the end tag's included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import SamplingParams, ThinkingBudget
from conveyor.server.parsing.reasoning import THINK_END, THINK_START, ReasoningStream, starts_in_reasoning
from conveyor.server.openai_api.responses import FunctionCallDelta, FunctionCallOut, ToolCallDelta, ToolCallOut
from conveyor.server.parsing.tool_calls import ToolCall, ToolCallStreamParser
from conveyor.server.parsing.tool_syntaxes import CallSyntax

if TYPE_CHECKING:
    from conveyor.text.tokenizer import Tokenizer
    from conveyor.server.openai_api.request_schemas import ChatCompletionRequest
    from conveyor.server.openai_api.prompt_group import PromptGroup


class ChatOutputSplitter:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStreamParser | None,
                 forces_tool_calls: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.forces_tool_calls = forces_tool_calls
        self.num_reasoning_tokens = 0

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def split_thinking(self, text: str, num_tokens: int, finished: bool,
                       steps: list[tuple[int, int]] | None = None) -> tuple[str, str]:
        """(thinking, answer text) of one delta; without a reasoning parser all of it is answer. `steps`:
        the delta's steps as (characters, tokens) where it merges several (RequestOutput.steps), so the
        tokens of the step that ends the thinking count as its, and those after as the answer's."""
        if self.reasoning is None:
            return "", text
        thinking = content = ""
        start = 0
        for chars, tokens in steps or [(len(text), num_tokens)]:
            if self.reasoning.in_reasoning:
                self.num_reasoning_tokens += tokens
            more_thinking, more_content = self.reasoning.feed(text[start:start + chars])
            thinking, content, start = thinking + more_thinking, content + more_content, start + chars
        if finished:
            more_thinking, more_content = self.reasoning.finish()
            thinking, content = thinking + more_thinking, content + more_content
        return thinking, content

    def feed(self, text: str, num_tokens: int, finished: bool,
             steps: list[tuple[int, int]] | None = None) -> tuple[str, str, list[ToolCall]]:
        """(thinking, answer text safe to emit now, tool calls completed by this delta)."""
        thinking, content = self.split_thinking(text, num_tokens, finished, steps)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
            if self.forces_tool_calls:   # the grammar admits only calls: other text is a call cut short
                content = ""
        return thinking, content, calls


# reasoning_effort (chat) and reasoning.effort (Responses) as a budget of thinking tokens, as vLLM maps an
# effort onto its thinking budget: none and minimal turn thinking off (the template's enable_thinking false;
# a model that opens <think> anyway is cut at once), low and medium cap it, high leaves it to the model.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 1024, "medium": 8192, "high": None}


def effort_settings(effort: str | None, parser: str | None, template_kwargs: dict[str, Any] | None,
                    budget: int | None) -> tuple[dict[str, Any] | None, int | None]:
    """(chat template variables, thinking budget) of a request with this effort; what the request sets
    itself (chat_template_kwargs, thinking_token_budget) wins. The template also sees reasoning_effort."""
    if effort is None:
        return template_kwargs, budget
    effort_budget = EFFORT_BUDGETS[effort]
    if parser is None and effort_budget != 0:
        raise InvalidRequest(f"reasoning effort {effort!r} needs a server started with --reasoning-parser (this "
                             "one does not tell thinking from the answer); none and minimal are accepted",
                             param="reasoning_effort")
    off = {"enable_thinking": False} if effort_budget == 0 else {}
    kwargs = {"reasoning_effort": effort, **off, **(template_kwargs or {})}
    return kwargs, budget if budget is not None or parser is None else effort_budget


@dataclass(frozen=True, slots=True)
class Thinking:
    """What the server's reasoning parser makes of one rendered chat prompt."""

    parser: str | None                 # None: no reasoning parser, all output is answer
    in_reasoning: bool = False         # the output begins inside the thinking
    budget: ThinkingBudget | None = None

    @classmethod
    def of(cls, parser: str | None, prompt_text: str, tokenizer: Tokenizer, budget: int | None) -> Thinking:
        if parser is None:
            if budget is not None:
                raise InvalidRequest("thinking_token_budget needs a server started with --reasoning-parser",
                                     param="thinking_token_budget")
            return cls(None)
        in_reasoning = starts_in_reasoning(parser, prompt_text)
        spec = None
        if budget is not None:
            # The tags as the model writes them alone: one special token each in reasoning models' vocabularies.
            spec = ThinkingBudget(max_tokens=budget, starts_inside=in_reasoning,
                                  start_token_ids=tuple(tokenizer.encode(THINK_START, False)),
                                  end_token_ids=tuple(tokenizer.encode(THINK_END, False)))
        return cls(parser, in_reasoning, spec)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The request's params with the budget, and its output constraint applied after the thinking only."""
        if self.parser is None:
            return params
        constraint = params.structured_outputs
        if constraint is not None:
            constraint = dataclasses.replace(constraint, after_thinking="open" if self.in_reasoning else "optional")
        return dataclasses.replace(params, structured_outputs=constraint, thinking_budget=self.budget)

    def splitter(self, body: ChatCompletionRequest, tool_forms: tuple[CallSyntax, ...]) -> ChatOutputSplitter:
        reasoning = ReasoningStream(self.in_reasoning) if self.parser is not None else None
        tools = (ToolCallStreamParser(tool_forms, body.tool_names) if body.effective_tool_choice != "none"
                 else None)
        return ChatOutputSplitter(reasoning, tools, body.forces_tool_calls)


@dataclass(slots=True)
class ChatRun:
    """A started chat request: its engine requests, prompts, and one splitter per choice."""

    group: PromptGroup
    prompts: list[list[int]]
    thinking: Thinking
    splitters: list[ChatOutputSplitter]

    @property
    def num_reasoning_tokens(self) -> int | None:
        """None without a reasoning parser (usage then has no completion_tokens_details)."""
        return sum(s.num_reasoning_tokens for s in self.splitters) if self.thinking.parser else None


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI says tool_calls when the model ended its turn by calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
            for call in calls]


def tool_call_deltas(calls: list[ToolCall], first_index: int) -> list[ToolCallDelta]:
    """A call is complete when it is parsed, so each goes out whole in one delta."""
    return [ToolCallDelta(index=first_index + i, id=call.id, type="function",
                          function=FunctionCallDelta(name=call.name, arguments=call.arguments))
            for i, call in enumerate(calls)]
