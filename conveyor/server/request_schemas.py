"""Pydantic schemas of the OpenAI-compatible API's requests (responses.py has the answers).

This layer parses types and shapes only, strictly (a bool or a float is not an integer, "1" is not
a number, text must be valid Unicode), and converts a request to SamplingParams. Ranges are checked
by SamplingParams, and what needs the model (vocabulary, context length) by admission, so the
offline API refuses the same values with the same message and `param`; the ranges are still
declared here (`_ints`, `_numbers`), for the OpenAPI document only. A request field conveyor does
not act on is a 400 naming it, never silently ignored: OpenAI fields it does not support say why,
unknown fields say so (the README has the table of every field). A chat's messages and tools have
their schemas in chat_schemas.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, WithJsonSchema, field_validator

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    SamplingParams,
    StructuredOutputsParams,
)
from conveyor.server.chat_schemas import (
    REQUEST_CONFIG,
    ChatMessage,
    NamedToolChoice,
    Text,
    ToolDefinition,
    refuse_extra_fields,
)
from conveyor.server.chat_tools import tool_choice_constraint
from conveyor.server.request_limits import bounded_messages

# ---------------------------------------------------------------------------------------------
# Requests

# Top-level request bodies keep unknown fields so that each can be refused by name (check_fields).
_BODY_CONFIG = ConfigDict(extra="allow", strict=True)

# OpenAI (and vLLM) fields conveyor does not support, why, and the values that change nothing (null always).
_UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[object, ...]]] = {
    "audio": ("audio output is not supported: this model writes text only", ()),
    "modalities": ("only the text modality is supported", (["text"],)),
    "prediction": ("predicted outputs are not supported (--speculative ngram drafts from the prompt instead)",
                   ()),
    "store": ("stored completions are not supported", (False,)),
    "metadata": ("metadata is only kept with stored completions, which are not supported", ()),
    "reasoning_effort": ("this model does not reason before answering", ()),
    "verbosity": ("this model has no verbosity setting", ()),
    "web_search_options": ("web search is not supported", ()),
    "functions": ("the deprecated functions field is not supported: send tools instead", ()),
    "function_call": ("the deprecated function_call field is not supported: send tool_choice instead", ()),
    "service_tier": ("there is one service tier: send auto or default", ("auto", "default")),
    "guided_decoding_backend": ("xgrammar is the only structured output backend", ("xgrammar",)),
}
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1


TokenId = Annotated[int, Field(ge=0)]


def _ints(**bounds: int) -> WithJsonSchema:
    """An integer's range, for the OpenAPI document; SamplingParams checks it."""
    return WithJsonSchema({"type": "integer", **bounds})


def _numbers(**bounds: float) -> WithJsonSchema:
    """A number's range, for the OpenAPI document; SamplingParams checks it."""
    return WithJsonSchema({"type": "number", **bounds})


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = REQUEST_CONFIG

    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs object: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints, named as OpenAI and vLLM name them, with their ranges."""

    model_config = _BODY_CONFIG

    model: Text | None = Field(None, description="the served model name; may be omitted")
    max_tokens: Annotated[int, _ints(minimum=1)] | None = None
    temperature: Annotated[float, _numbers(minimum=0, maximum=MAX_TEMPERATURE)] | None = Field(
        1.0, description=f"0 = greedy; at most {MAX_TEMPERATURE:g}")
    top_p: Annotated[float, _numbers(exclusiveMinimum=0.0, maximum=1)] | None = Field(1.0, description="in (0, 1]")
    top_k: Annotated[int, _ints(minimum=-1, maximum=MAX_TOP_K)] | None = Field(
        0, description="0 or -1 = off, as is any value at or past the vocabulary size")
    min_p: Annotated[float, _numbers(minimum=0, maximum=1)] | None = Field(0.0, description="in [0, 1]")
    seed: Annotated[int, _ints(minimum=MIN_SEED, maximum=MAX_SEED)] | None = Field(None, description="a 64-bit integer")
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, _ints(minimum=0)]] | None = Field(
        None, description="token ids inside the vocabulary")
    presence_penalty: Annotated[float, _numbers(minimum=-2, maximum=2)] | None = 0.0
    frequency_penalty: Annotated[float, _numbers(minimum=-2, maximum=2)] | None = 0.0
    repetition_penalty: Annotated[float, _numbers(minimum=MIN_REPETITION_PENALTY,
                                                  maximum=MAX_REPETITION_PENALTY)] | None = (
        Field(1.0, description=f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]; 1 = off"))
    ignore_eos: bool = False
    min_tokens: Annotated[int, _ints(minimum=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, Field(ge=MIN_INT64, le=MAX_INT64)] = Field(
        0, description="lower runs first; FCFS among equals; a 64-bit integer")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, _ints(minimum=1, maximum=MAX_CHOICES)] = Field(
        1, description="choices per prompt; each samples on its own (a seed gives choice j seed + j)")
    user: Text | None = Field(None, description="the tenant the request is counted for in fair sharing, unless an "
                                                "X-Tenant header names one; it does not change the output")
    logit_bias: dict[str, Annotated[float, _numbers(minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100], added to its logit")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    prompt_cache_key: Text | None = Field(None, description="accepted: prefix caching is automatic, by content")
    _constraint_field: str = PrivateAttr("structured_outputs")   # set by sampling_params, for compile errors

    @property
    def constraint_field(self) -> str:
        """The field the request's output constraint came from (valid after sampling_params)."""
        return self._constraint_field

    def check_fields(self) -> None:
        """400 for a field conveyor would otherwise ignore: an unsupported OpenAI field, or an unknown one."""
        refuse_extra_fields(self.model_extra, _UNSUPPORTED_FIELDS)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str]:
        """The request's one output constraint and the field it came from; 400 if it names several."""
        found: list[tuple[StructuredOutputsParams, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequest("response_format of type json_schema needs json_schema.schema",
                                     param="response_format")
            found.append((StructuredOutputsParams(json=fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict)),
                          "response_format"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((_structured(name, **{kind: value}), name))
        so = self.structured_outputs
        if so is not None:
            fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                      "json_object": bool(so.json_object), "structural_tag": so.structural_tag}
            found.append((_structured("structured_outputs", **fields), "structured_outputs"))
        if len(found) > 1:
            raise InvalidRequest(f"only one output constraint per request; got {', '.join(n for _, n in found)}",
                                 param=found[1][1])
        return found[0] if found else (None, "structured_outputs")

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequest(f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         best_of: int | None = None) -> SamplingParams:
        """Map to SamplingParams; a null field means the default. Raises InvalidRequest naming the field."""
        self.check_fields()
        structured, param = self.structured_output()
        self._constraint_field = param
        try:
            return self._make_params(max_tokens, logprobs, structured, best_of)
        except InvalidRequest as exc:
            if exc.param == "structured_outputs":
                exc.param = param
            raise

    def _make_params(self, max_tokens: int | None, logprobs: int | None,
                     structured: StructuredOutputsParams | None, best_of: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, 0),
            min_p=_default(self.min_p, 0.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            n=self.n,
            best_of=best_of,
            logit_bias=self._logit_bias(),
            structured_outputs=structured,
        )


def _structured(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequest as exc:
        exc.param = param
        raise


def _default(value: float | int | None, default: float | int) -> float | int:
    return default if value is None else value


Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]
NumLogprobs = Annotated[int, _ints(minimum=0, maximum=MAX_LOGPROBS)]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of such lists")
    max_tokens: Annotated[int, _ints(minimum=1)] | None = Field(16, description="default 16, as OpenAI")
    logprobs: NumLogprobs | None = Field(None, description="return the sampled token's logprob and the top N")
    echo: bool = False
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
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        return self._sampling_params(self.max_tokens, self.logprobs, self.best_of)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, _ints(minimum=1)] | None = Field(None, description="default: up to the model length")
    max_completion_tokens: Annotated[int, _ints(minimum=1)] | None = Field(
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
    thinking_token_budget: Annotated[int, _ints(minimum=0)] | None = Field(
        None, description="with --reasoning-parser: at most this many tokens of thinking, then </think> is forced")

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
