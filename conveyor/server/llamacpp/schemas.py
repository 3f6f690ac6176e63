"""llama.cpp's /completion request, as llama-server names its fields, mapped to SamplingParams.

Defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, n_predict -1 = up
to the context), so a llama.cpp front-end gets the sampling it expects. Fields of samplers conveyor
does not have are accepted at the value that turns them off (what front-ends send by default) and
refused, naming them, at any other; unknown fields are refused, as on the OpenAI endpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import SamplingParams, StructuredOutputsParams

# llama.cpp sampler settings conveyor has no sampler for: the values at which each does nothing.
_INERT_FIELDS: dict[str, tuple[object, ...]] = {
    "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,), "mirostat_tau": (5, 5.0),
    "mirostat_eta": (0.1,), "dry_multiplier": (0, 0.0), "dry_base": (1.75,), "dry_allowed_length": (2,),
    "dry_penalty_last_n": (-1,), "dry_sequence_breakers": (), "xtc_probability": (0, 0.0),
    "xtc_threshold": (0.1,), "top_n_sigma": (-1, -1.0), "dynatemp_range": (0, 0.0),
    "dynatemp_exponent": (1, 1.0), "n_keep": (0, -1), "n_discard": (0,), "min_keep": (0,),
    "penalize_nl": (False,), "id_slot": (-1,), "timings_per_token": (False,), "post_sampling_probs": (False,),
    "t_max_predict_ms": (0,), "t_max_prompt_ms": (0,), "lora": ([],), "n_indent": (0,), "n_cmpl": (1,),
    "samplers": (), "backend_sampling": (False,), "adaptive_target": (), "adaptive_decay": (),
}
# Always accepted whatever the value: they change no output here.
_ANY_VALUE = frozenset({"dry_sequence_breakers", "samplers", "adaptive_target", "adaptive_decay"})

LlamaPrompt = str | dict[str, Any] | list[Any]


class LlamaCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: LlamaPrompt = Field(description="a text, token ids (texts may be mixed in), {prompt_string: ...}, "
                                            "or a list of those: one result per prompt")
    n_predict: int = Field(-1, description="tokens to generate; -1: up to the context")
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = Field(1.0, description="over the whole context (repeat_last_n -1)")
    repeat_last_n: int = Field(-1, description="-1 (the whole context); 64, its default, only while "
                                               "repeat_penalty is 1")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = Field(-1, description="-1 (or 2**32 - 1): random")
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    cache_prompt: bool = Field(True, description="false: the prompt is computed in full, no prefix cache hit")
    n_probs: int = Field(0, description="each generated token's top N logprobs (completion_probabilities)")
    ignore_eos: bool = False
    return_tokens: bool = False
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    grammar: str | None = Field(None, description="GBNF")
    json_schema: dict[str, Any] | None = None
    response_fields: list[str] | None = Field(None, description="only these fields of the result ('a/b' nested)")

    def check_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in _INERT_FIELDS:
                if name not in _ANY_VALUE and value is not None and value not in _INERT_FIELDS[name]:
                    raise InvalidRequest(f"{name}: this sampler is not supported; send {_INERT_FIELDS[name][0]!r} "
                                         f"(off) or leave it out", param=name)
            elif value is not None:
                raise InvalidRequest(f"{name}: unknown field; conveyor does not support it", param=name)
        if self.repeat_last_n not in (-1, 64) or (self.repeat_last_n == 64 and self.repeat_penalty != 1.0):
            raise InvalidRequest("repeat_last_n: the repeat penalty covers the whole context here; send -1",
                                 param="repeat_last_n")

    def sampling_params(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """`encode`: text -> token ids without special tokens, for logit_bias keyed by text."""
        self.check_fields()
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidRequest("send grammar or json_schema, not both", param="grammar")
        structured = (StructuredOutputsParams(grammar=self.grammar) if self.grammar is not None else
                      StructuredOutputsParams(json=self.json_schema) if self.json_schema is not None else None)
        if self.n_predict < -1:
            raise InvalidRequest(f"n_predict must be -1 (up to the context) or at least 0, got {self.n_predict}",
                                 param="n_predict")
        return SamplingParams(
            max_tokens=None if self.n_predict == -1 else max(self.n_predict, 1),
            temperature=max(self.temperature, 0.0),   # llama.cpp: a temperature <= 0 is greedy
            top_k=max(self.top_k, 0),
            top_p=self.top_p if 0 < self.top_p <= 1 else 1.0,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=None if self.seed in (-1, 2**32 - 1) else self.seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            logprobs=self.n_probs if self.n_probs > 0 else None,
            logit_bias=self._logit_bias(encode),
            structured_outputs=structured,
            use_prefix_cache=self.cache_prompt,
        )

    def _logit_bias(self, encode: Callable[[str], list[int]]) -> dict[int, float] | None:
        """[[id or text, bias], ...] or {"id or text": bias}; a text's every token gets the bias; false bans
        the token (-100 here, OpenAI's floor)."""
        pairs = (list(self.logit_bias.items()) if isinstance(self.logit_bias, dict)
                 else [tuple(p) for p in self.logit_bias or []])
        bias: dict[int, float] = {}
        for pair in pairs:
            if len(pair) != 2:
                raise InvalidRequest("logit_bias entries are [token id, bias]", param="logit_bias")
            token, value = pair
            if isinstance(token, str) and token.isascii() and token.isdigit():
                token = int(token)
            if isinstance(token, bool) or not isinstance(token, (int, str)):
                raise InvalidRequest(f"logit_bias keys are token ids or texts, got {token!r}", param="logit_bias")
            if value is False:
                value = -100.0
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InvalidRequest(f"a logit_bias is a number or false, got {value!r}", param="logit_bias")
            for token_id in encode(token) if isinstance(token, str) else [token]:
                bias[token_id] = max(-100.0, min(100.0, float(value)))
        return bias or None
