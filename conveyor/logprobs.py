"""A sampled token's log-probability and its row's best alternatives: what the core sends the front.

Kept apart from the sampler, which needs torch: the front unpickles these and must not import it.
"""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI reports an impossible token as -9999.0; JSON has no -inf (and NaN must not reach it either).
IMPOSSIBLE_LOGPROB = -9999.0


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]         # top-N (token_id, logprob), N = params.logprobs, best first

    def __reduce__(self) -> tuple:
        return (TokenLogprobs, (self.token_id, self.logprob, self.top))   # positional: one per token, pickled fast


@dataclass(slots=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it (vLLM's prompt_logprobs), its rank in the
    vocabulary (1 = the most likely) and the position's top-N (token_id, logprob), best first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]
