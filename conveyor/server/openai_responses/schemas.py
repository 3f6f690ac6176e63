"""The Responses API's request (POST /v1/responses), and its mapping onto a chat completion request.

`input` is a text (one user message) or a list of items: messages (`role` and `content`, a text or
input_text / output_text parts), `function_call` items (an earlier turn's calls) and
`function_call_output` items (their results); `reasoning` items, an earlier turn's thinking, are
not shown to the model, as chat templates drop past thinking. `instructions` become the system
message of this request only (a later request that continues from it does not inherit them, as
OpenAI's do not). Sampling fields and tools are those of chat completions under their Responses names;
`include: ["message.output_text.logprobs"]` and `top_logprobs` are chat's logprobs, `reasoning.effort` chat's
reasoning_effort (chat_output.EFFORT_BUDGETS). Other `include` values and `reasoning.summary` are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import MAX_LOGPROBS
from conveyor.server.openai_api.chat_schemas import (
    REQUEST_CONFIG,
    FunctionDefinition,
    NamedFunction,
    Text,
    refuse_extra_fields,
)
from conveyor.server.openai_api.request_schemas import ReasoningEffort

_BODY_CONFIG = ConfigDict(extra="allow", strict=True)
_ITEM_CONFIG = ConfigDict(extra="ignore", strict=True)   # items echo back fields (status, annotations) we need not read
# Responses fields that have no effect here, and the values that change nothing.
_UNSUPPORTED = {
    "background": ("background responses are not supported", (False,)),
    "truncation": ("only truncation 'disabled' is supported: a conversation past the context is a 400",
                   ("disabled",)),
    "service_tier": ("there is one service tier: send auto or default", ("auto", "default")),
    "prompt": ("stored prompt templates are not supported", ()),
}


class _Part(BaseModel):
    model_config = _ITEM_CONFIG

    type: Literal["input_text", "output_text", "text"]
    text: Text


class _Message(BaseModel):
    model_config = _ITEM_CONFIG

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[_Part]


class _FunctionCall(BaseModel):
    model_config = _ITEM_CONFIG

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class _FunctionCallOutput(BaseModel):
    model_config = _ITEM_CONFIG

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[_Part]


# `include` values: logprobs of the output text are; the others name outputs conveyor never makes
# (encrypted reasoning for stateless clients, hosted tools' results, input images).
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ReasoningConfig(BaseModel):
    model_config = REQUEST_CONFIG

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None   # summary's old name


_ITEMS: dict[str, type[BaseModel]] = {"message": _Message, "function_call": _FunctionCall,
                                      "function_call_output": _FunctionCallOutput}


class ResponsesTool(FunctionDefinition):
    """A function tool as the Responses API writes it: the function's fields beside its type."""

    type: Literal["function"]


class NamedResponsesTool(NamedFunction):
    type: Literal["function"]


class TextFormat(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = REQUEST_CONFIG

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = _BODY_CONFIG

    model: Text | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedResponsesTool | None = None
    parallel_tool_calls: bool = True
    previous_response_id: Text | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Text] | None = None
    text: TextConfig | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None   # as chat's: prefix caching is automatic, by content
    include: list[Text] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    reasoning: ReasoningConfig | None = None

    def check_fields(self) -> None:
        refuse_extra_fields(self.model_extra, _UNSUPPORTED)
        for index, name in enumerate(self.include or []):
            if name != INCLUDE_LOGPROBS:
                raise InvalidRequest(f"include: {name!r} is not available here (only {INCLUDE_LOGPROBS!r} is: "
                                     "conveyor runs no hosted tools, reads no images and keeps no encrypted "
                                     "reasoning)", param=f"include.{index}")
        summary = self.reasoning and (self.reasoning.summary or self.reasoning.generate_summary)
        if summary:
            raise InvalidRequest(f"reasoning.summary: reasoning summaries are not written (asked for {summary!r}); "
                                 "the reasoning item carries the whole thinking as reasoning_text, with a server "
                                 "started with --reasoning-parser", param="reasoning.summary")

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or []) or self.top_logprobs is not None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (dicts of ChatMessage's fields)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequest("input must not be empty", param="input")
        messages: list[dict[str, Any]] = []
        for index, raw in enumerate(self.input):
            item = _item(raw, index)
            if isinstance(item, _Message):
                messages.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, _FunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                    messages[-1]["tool_calls"].append(call)   # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, _FunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        return messages

    def chat_fields(self) -> dict[str, Any]:
        """Every chat completion field this request sets, but the messages."""
        fields: dict[str, Any] = {"model": self.model, "max_completion_tokens": self.max_output_tokens,
                                  "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
                                  "prompt_cache_key": self.prompt_cache_key}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.wants_logprobs:
            fields["logprobs"], fields["top_logprobs"] = True, self.top_logprobs
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in self.tools]
        if isinstance(self.tool_choice, NamedResponsesTool):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        return fields

    def text_echo(self) -> dict[str, Any]:
        """`text` as the response object repeats it."""
        if self.text is None or self.text.format is None:
            return {"format": {"type": "text"}}
        return {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}


def _item(raw: dict[str, Any], index: int) -> BaseModel:
    kind = raw.get("type", "message")
    if kind == "reasoning":
        return BaseModel()
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidRequest(f"input[{index}]: items of type {kind!r} are not supported (message, function_call, "
                             f"function_call_output, reasoning are)", param=f"input.{index}.type")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise InvalidRequest(f"input[{index}].{where}: {first.get('msg', 'invalid value')}",
                             param=f"input.{index}.{where}".rstrip(".")) from None


def _text(content: str | list[_Part]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)
