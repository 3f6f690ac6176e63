"""Pydantic schemas of the OpenAI-compatible API's requests (responses.py has the answers).

This layer parses types and shapes only, strictly (a bool or a float is not an integer, "1" is not
a number, text must be valid Unicode), and converts a request to SamplingParams. Ranges are checked
by SamplingParams, and what needs the model (vocabulary, context length) by admission, so the
offline API refuses the same values with the same message and `param`. A request field conveyor does
not act on is a 400 naming it, never silently ignored: OpenAI fields it does not support say why,
unknown fields say so (docs/api.md has the table of every field). The fields both endpoints share are
in sampling_request.py; a chat's messages and tools have their schemas in chat_schemas.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from conveyor.server.openai_api.chat_schemas import ChatMessage, NamedToolChoice, Text, ToolDefinition
from conveyor.server.parsing.chat_tools import tool_choice_constraint
from conveyor.server.http.request_limits import bounded_messages
from conveyor.server.openai_api.sampling_request import SamplingRequest, TokenId, ints

Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]
NumLogprobs = Annotated[int, ints(minimum=0, maximum=MAX_LOGPROBS)]


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of such lists")
    max_tokens: Annotated[int, ints(minimum=0)] | None = Field(
        16, description="default 16, as OpenAI; 0 only with echo (the prompt alone, scored with logprobs)")
    logprobs: NumLogprobs | None = Field(None, description="return the sampled token's logprob and the top N")
    echo: bool = Field(False, description="the prompt before the completion; with logprobs, its tokens scored too "
                                          "(the first one's logprob is null)")
    best_of: int | None = None
    suffix: Text | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch form: one entry per choice."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs is not supported with stream; send echo with logprobs",
                                 param="prompt_logprobs")
        # max_tokens 0 with echo: one token is run (the step that scores the prompt samples one) and dropped;
        # without echo SamplingParams refuses it, as offline.
        params = self._sampling_params(1 if self.drops_output else self.max_tokens, self.logprobs, self.best_of)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = max(self.logprobs, params.prompt_logprobs or 0)
        return params

    @property
    def drops_output(self) -> bool:
        """max_tokens 0 with echo: the answer is the prompt alone."""
        return self.max_tokens == 0 and self.echo


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, ints(minimum=1)] | None = Field(None, description="default: up to the model length")
    max_completion_tokens: Annotated[int, ints(minimum=1)] | None = Field(
        None, description="takes precedence over max_tokens")
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="further variables for the chat template, such as enable_thinking")
    thinking_token_budget: Annotated[int, ints(minimum=0)] | None = Field(
        None, description="with --reasoning-parser: at most this many tokens of thinking, then </think> is forced")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="none/minimal: no thinking; low, medium: a thinking budget; high: the model's own "
                          "(see EFFORT_BUDGETS)")

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, messages: Any) -> Any:
        return bounded_messages(messages)

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str]:
        """Besides the constraint fields, tool_choice required or a named function is a grammar."""
        constraint, param = super().structured_output()
        forced = tool_choice_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        if forced is None:
            return constraint, param
        if constraint is not None:
            raise InvalidRequest(f"tool_choice {self.effective_tool_choice!r} cannot be combined with {param}",
                                 param="tool_choice")
        return forced, "tool_choice"

    @property
    def effective_tool_choice(self) -> str:
        """none, auto, required, or the forced function's name."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(tool.function.name for tool in self.tools or [])

    @property
    def forces_tool_calls(self) -> bool:
        """required or a named function: the grammar admits only calls, so the reply has no content."""
        return bool(self.tools) and self.effective_tool_choice not in ("none", "auto")

    def sampling_params(self) -> SamplingParams:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                tool.function.name for tool in self.tools or []}:
            raise InvalidRequest(f"tool_choice names the function {self.tool_choice.function.name!r}, "
                                 f"which is not in tools", param="tool_choice")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs is not supported with stream", param="prompt_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except InvalidRequest as exc:
            if exc.param == "logprobs":  # chat spells the count top_logprobs
                exc.param = "top_logprobs"
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise
