"""The fields both OpenAI request bodies share (completions and chat), as OpenAI and vLLM name them,
and their conversion to SamplingParams; request_schemas.py adds each endpoint's own fields.

Types and shapes are parsed strictly here; ranges are SamplingParams' to check (the ranges declared
with `ints` and `numbers` are for the OpenAPI document only). Unknown fields are kept on the model
so that `check_fields` can refuse each by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, WithJsonSchema

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
from conveyor.server.openai_api.chat_schemas import REQUEST_CONFIG, Text, refuse_extra_fields

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
    "verbosity": ("this model has no verbosity setting", ()),
    "web_search_options": ("web search is not supported", ()),
    "functions": ("the deprecated functions field is not supported: send tools instead", ()),
    "function_call": ("the deprecated function_call field is not supported: send tool_choice instead", ()),
    "service_tier": ("there is one service tier: send auto or default", ("auto", "default")),
    "guided_decoding_backend": ("xgrammar is the only structured output backend", ("xgrammar",)),
}
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1


TokenId = Annotated[int, Field(ge=0)]


def ints(**bounds: int) -> WithJsonSchema:
    """An integer's range, for the OpenAPI document; SamplingParams checks it."""
    return WithJsonSchema({"type": "integer", **bounds})


def numbers(**bounds: float) -> WithJsonSchema:
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


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints, named as OpenAI and vLLM name them, with their ranges."""

    model_config = _BODY_CONFIG

    model: Text | None = Field(None, description="the served model name; may be omitted")
    max_tokens: Annotated[int, ints(minimum=1)] | None = None
    temperature: Annotated[float, numbers(minimum=0, maximum=MAX_TEMPERATURE)] | None = Field(
        1.0, description=f"0 = greedy; at most {MAX_TEMPERATURE:g}")
    top_p: Annotated[float, numbers(exclusiveMinimum=0.0, maximum=1)] | None = Field(1.0, description="in (0, 1]")
    top_k: Annotated[int, ints(minimum=-1, maximum=MAX_TOP_K)] | None = Field(
        0, description="0 or -1 = off, as is any value at or past the vocabulary size")
    min_p: Annotated[float, numbers(minimum=0, maximum=1)] | None = Field(0.0, description="in [0, 1]")
    seed: Annotated[int, ints(minimum=MIN_SEED, maximum=MAX_SEED)] | None = Field(None, description="a 64-bit integer")
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, ints(minimum=0)]] | None = Field(
        None, description="token ids inside the vocabulary")
    presence_penalty: Annotated[float, numbers(minimum=-2, maximum=2)] | None = 0.0
    frequency_penalty: Annotated[float, numbers(minimum=-2, maximum=2)] | None = 0.0
    repetition_penalty: Annotated[float, numbers(minimum=MIN_REPETITION_PENALTY,
                                                  maximum=MAX_REPETITION_PENALTY)] | None = (
        Field(1.0, description=f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]; 1 = off"))
    ignore_eos: bool = False
    min_tokens: Annotated[int, ints(minimum=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, Field(ge=MIN_INT64, le=MAX_INT64)] = Field(
        0, description="lower runs first; FCFS among equals; a 64-bit integer")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, ints(minimum=1, maximum=MAX_CHOICES)] = Field(
        1, description="choices per prompt; each samples on its own (a seed gives choice j seed + j)")
    user: Text | None = Field(None, description="the tenant the request is counted for in fair sharing, unless an "
                                                "X-Tenant header names one; it does not change the output")
    logit_bias: dict[str, Annotated[float, numbers(minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100], added to its logit")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    prompt_cache_key: Text | None = Field(None, description="accepted: prefix caching is automatic, by content")
    # QVAC's per-request cache (server/prompt_cache/cache_keys.py); its camelCase spelling is accepted too
    cache_key: Text | None = Field(None, validation_alias=AliasChoices("cache_key", "cacheKey"), description=(
        "restore the prompt prefix saved under this name first (needs --prefix-cache-dir)"))
    save_cache_to_disk: bool = Field(False, validation_alias=AliasChoices("save_cache_to_disk", "saveCacheToDisk"),
                                     description="at the end, save this prompt's prefix under cache_key, across "
                                                 "restarts")
    # vLLM's extra fields
    prompt_logprobs: Annotated[int, ints(minimum=0, maximum=MAX_LOGPROBS)] | None = Field(
        None, description="each prompt token's logprob (the first's is null), its rank, and the top N")
    allowed_token_ids: list[Annotated[int, ints(minimum=0)]] | None = Field(
        None, description="only these tokens may be sampled")
    bad_words: list[Text] | None = Field(None, description="words never written: a word's last token is refused "
                                                           "where the output ends with the tokens before it")
    truncate_prompt_tokens: Annotated[int, ints(minimum=-1)] | None = Field(
        None, description="keep only the prompt's last N tokens; -1: the model length")
    add_special_tokens: bool | None = Field(
        None, description="add the tokenizer's special tokens (BOS) to a text prompt; default true for completions, "
                          "false for chat (its template writes them)")
    return_tokens_as_token_ids: bool = Field(False, description="logprobs name each token 'token_id:N'")
    spaces_between_special_tokens: bool = Field(
        False, description="with skip_special_tokens false, special tokens in the text set apart by spaces")
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
            prompt_logprobs=self.prompt_logprobs,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


def _structured(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequest as exc:
        exc.param = param
        raise


def _default(value: float | int | None, default: float | int) -> float | int:
    return default if value is None else value
