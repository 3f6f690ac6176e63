"""SamplingParams: the user-facing, per-request generation settings, validated on creation.

This is the one home of every check that needs no model: the offline API and the server both build
a SamplingParams, so a bad value gets the same message and `param` from both. Checks that need the
model (vocabulary, context length, KV cache) are admission's (front/admission.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from conveyor.errors import InvalidRequest

MAX_LOGPROBS = 20
DEFAULT_MAX_STRING_TOKENS = 1024   # a JSON string's tokens before its closing quote is forced
# Sane ranges, checked here only; the HTTP schema (server/openai_api/request_schemas.py) declares them for its document.
MAX_TEMPERATURE = 100.0               # past it every distribution is flat to float32 precision anyway
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0   # logit / penalty stays finite in float32
MAX_TOP_K = 2**31 - 1                 # values at or past the vocabulary size mean off, as -1 and 0 do
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1   # what torch.Generator.manual_seed accepts
MAX_LOGIT_BIAS = 100.0                # OpenAI's range for logit_bias values
MAX_CHOICES = 128                     # n: choices per prompt
MAX_STOP_STRINGS = 64                 # each new piece of text is checked against every stop string
MAX_STOP_CHARS = 1024                 # per stop string; text this long is held back until it cannot match
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64                    # each is checked against the output's tail at every step
MAX_ALLOWED_TOKEN_IDS = 262_144       # the largest vocabularies (Gemma 3); the list becomes a mask every step


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, as vLLM's StructuredOutputsParams: exactly one field set.

    json: a JSON schema (a dict or its text); json_object: any JSON object; regex; choice: one of
    these strings; grammar: EBNF (GBNF, as llama.cpp writes it); structural_tag: xgrammar's
    structural tag (its JSON text). `strict` makes a schema's objects closed (no properties it does
    not list), as OpenAI's strict json_schema does.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    strict: bool = False
    # A reasoning model's thinking comes first, unconstrained: "open" when the output begins inside it
    # (any text up to </think>), "optional" when it may begin with a <think>...</think> block.
    after_thinking: str | None = None
    # JSON strings end after this many tokens: the closing quote is forced where the grammar allows it
    # (engine/json_strings.py; a schema's larger maxLength raises it). 0 = unbounded. Not part of the grammar.
    max_string_tokens: int = DEFAULT_MAX_STRING_TOKENS

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if not _is_int(self.max_string_tokens, minimum=0):
            raise InvalidRequest(f"max_string_tokens must be an integer >= 0, got {self.max_string_tokens!r}",
                                 param="structured_outputs")
        if self.after_thinking not in (None, "open", "optional"):
            raise InvalidRequest(f"after_thinking must be open or optional, got {self.after_thinking!r}",
                                 param="structured_outputs")
        if len(kinds) != 1:
            raise InvalidRequest("structured outputs take exactly one of json, json_object, regex, choice, "
                                 f"grammar, structural_tag; got {kinds or 'none'}", param="structured_outputs")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest("choice must be a non-empty list of non-empty strings", param="structured_outputs")

    @property
    def key(self) -> str:
        """The cache key of the compiled grammar: the kind and its canonical text."""
        if self.after_thinking is not None:
            return f"{replace(self, after_thinking=None).key}:after_thinking:{self.after_thinking}"
        if self.json_object:
            return "json_object"
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return f"json:{int(self.strict)}:{schema}"
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                return f"{name}:{value}"
        return "choice:" + json.dumps(self.choice)


@dataclass(slots=True, frozen=True)
class ThinkingBudget:
    """At most max_tokens tokens of thinking, then the end tag is forced (a reasoning model's budget)."""

    max_tokens: int
    starts_inside: bool                 # the prompt opened the thinking; else it starts if the output opens it
    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens, minimum=0):
            raise InvalidRequest(f"thinking_token_budget must be an integer >= 0, got {self.max_tokens!r}",
                                 param="thinking_token_budget")
        if not self.end_token_ids or not self.start_token_ids:
            raise InvalidRequest("thinking_token_budget needs the thinking tags in the vocabulary",
                                 param="thinking_token_budget")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16           # None = up to the model length
    temperature: float = 1.0              # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None           # None = off; N = the sampled token's and the top N
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1                            # choices per prompt (LLM.generate; the server's `n`)
    best_of: int | None = None            # only None or n: no hidden extra choices
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None
    thinking_budget: ThinkingBudget | None = None
    prompt_logprobs: int | None = None    # None = off; N = each prompt token's logprob and the top N (vLLM's)
    allowed_token_ids: list[int] | None = None   # only these may be sampled
    bad_words: list[str] = field(default_factory=list)   # never written: their last token is blocked after the rest
    bad_words_token_ids: list[list[int]] | None = None   # bad_words tokenized, by the front
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last N tokens (-1: the model length)
    spaces_between_special_tokens: bool = False  # shown special tokens set apart by spaces in the text
    use_prefix_cache: bool = True         # False: the prompt is computed in full (llama.cpp's cache_prompt)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens is not None and not _is_int(self.max_tokens, minimum=1):
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens!r}", param="max_tokens")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}",
                                 param="temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not _is_int(self.top_k, minimum=-1) or self.top_k > MAX_TOP_K:
            raise InvalidRequest(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}",
                                 param="top_k")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value!r}", param=name)
        if (not _is_number(self.repetition_penalty)
                or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequest(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                                 f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}",
                                 param="repetition_penalty")
        if self.seed is not None and not (_is_int(self.seed, minimum=MIN_SEED) and self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be a 64-bit integer, got {self.seed!r}", param="seed")
        if not _is_int(self.min_tokens, minimum=0):
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens!r}", param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                                 param="min_tokens")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                                 param="stop")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequest(f"a stop string has at most {MAX_STOP_CHARS} characters, got one of "
                                 f"{max(len(s) for s in self.stop)}", param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                                 f"are allowed", param="stop_token_ids")
        if not all(_is_int(t, minimum=0) for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers", param="stop_token_ids")
        if self.logprobs is not None and not (_is_int(self.logprobs, minimum=0) and self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}",
                                 param="logprobs")
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs, minimum=0)
                                                     and self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs!r}",
                                 param="prompt_logprobs")
        _check_vllm_fields(self)
        if not _is_int(self.n, minimum=1) or self.n > MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}, got {self.n!r}", param="n")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(f"best_of must equal n ({self.n}): choosing the best of more choices is not "
                                 f"supported", param="best_of")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t, minimum=0) and _is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias.items()):
                raise InvalidRequest(f"logit_bias maps token ids (>= 0) to biases in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}]", param="logit_bias")
            self.logit_bias = dict(self.logit_bias) or None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequest("structured_outputs must be a StructuredOutputsParams",
                                     param="structured_outputs")
            if self.ignore_eos:
                # The grammar's end is the end of the output: past it the only allowed token is eos.
                raise InvalidRequest("ignore_eos cannot be combined with structured outputs", param="ignore_eos")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of the n: one sequence; a seeded request's choice j samples with seed + j,
        so the choices differ and each is reproducible. Only choice 0 scores the prompt: the choices share it."""
        seed = self.seed if self.seed is None or index == 0 else (self.seed + index) % 2**64
        return replace(self, n=1, best_of=None, seed=seed,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)


def _check_vllm_fields(params: SamplingParams) -> None:
    """vLLM's extra fields; ids are checked against the vocabulary by admission."""
    allowed = params.allowed_token_ids
    if allowed is not None:
        if not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS or not all(_is_int(t, minimum=0) for t in allowed):
            raise InvalidRequest(f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} non-negative token ids",
                                 param="allowed_token_ids")
        params.allowed_token_ids = list(allowed)
    params.bad_words = list(params.bad_words)
    if len(params.bad_words) > MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS
                                                        for w in params.bad_words):
        raise InvalidRequest(f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings of at most "
                             f"{MAX_STOP_CHARS} characters", param="bad_words")
    truncate = params.truncate_prompt_tokens
    if truncate is not None and not (_is_int(truncate, minimum=-1) and truncate != 0):
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 (the model length) or at least 1, got {truncate!r}",
                             param="truncate_prompt_tokens")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
