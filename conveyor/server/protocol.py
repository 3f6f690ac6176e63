"""Pydantic schemas of the OpenAI-compatible API: requests, responses, stream chunks and the error body.

Requests are validated strictly (a bool or a float is not an integer, "1" is not a number, text
must be valid Unicode) and every sampling field declares its range here, so the OpenAPI document
states it and a bad value is a 400 naming the field. `SamplingParams` checks the same ranges for
the offline API, plus those that span fields (min_tokens <= max_tokens); checks that need the
model (token ids inside the vocabulary, the context length) are admission's. Unknown request
fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    SamplingParams,
)

FinishReason = Literal["stop", "length"]


# ---------------------------------------------------------------------------------------------
# Requests

_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1


def _valid_unicode(text: str) -> str:
    """JSON can carry a lone surrogate (\\ud800) that no tokenizer can encode; refuse it here."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints, named as OpenAI and vLLM name them, with their ranges."""

    model_config = _REQUEST_CONFIG

    model: Text | None = Field(None, description="the served model name; may be omitted")
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = Field(
        1.0, description=f"0 = greedy; at most {MAX_TEMPERATURE:g}")
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = Field(1.0, description="in (0, 1]")
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = Field(
        0, description="0 or -1 = off, as is any value at or past the vocabulary size")
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(0.0, description="in [0, 1]")
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = Field(None, description="a 64-bit integer")
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="token ids inside the vocabulary")
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = 0.0
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                               allow_inf_nan=False)] | None = (
        Field(1.0, description=f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]; 1 = off"))
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, Field(ge=MIN_INT64, le=MAX_INT64)] = Field(
        0, description="lower runs first; FCFS among equals; a 64-bit integer")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="only 1 is supported")
    user: Text | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Map to SamplingParams; a null field means the default. Raises InvalidRequest naming the field."""
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
        )


def _default(value: float | int | None, default: float | int) -> float | int:
    return default if value is None else value


Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of such lists")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(16, description="default 16, as OpenAI")
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
        if self.best_of not in (None, 1):
            raise InvalidRequest("only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image or audio part gets one plain sentence, not the union's every complaint."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported by this model, "
                                     f"which reads text only")
        return content

    def as_template_input(self) -> dict[str, str | None]:
        """Text parts are joined with newlines, as vLLM does, since templates expect a string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, str | None] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="default: up to the model length")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="takes precedence over max_tokens")
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
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


# ---------------------------------------------------------------------------------------------
# Responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; the usage-only last chunk has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    """Only the fields a chunk carries: the role in the first chunk, then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
