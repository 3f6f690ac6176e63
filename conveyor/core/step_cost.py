"""Step cost model: how long a step of a given shape takes, fitted online from measured steps.

    step_time_s ~= fixed_s + per_token_s * num_tokens + per_context_token_s * num_context_tokens
                   + per_sampling_row_s * num_sampling_rows

`num_context_tokens` counts the key positions the step's new tokens attend to: a decode at context
length L adds L, a chunk of n prompt tokens starting at position s adds n*s + n(n+1)/2. A sampled
row also pays for the output layer and the sampler (on a small model the output layer is a quarter
of a token's work), so a decode row costs more than a prompt token, and chunk sizes are not taken
from decode-heavy fits that put the output layer into every token's price. The model
is pure data: the engine passes in each step's shape and measured duration, and the scheduler asks
for a `PrefillBudget`. No clock, no threads, no torch.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from conveyor.core.plan import ScheduledRow, StepPlan

# Features are scaled so that a typical step's are of order one; the prior's weight then reads as
# "worth about this many steps".
_TOKEN_SCALE = 256.0
_CONTEXT_SCALE = 65536.0


def context_tokens(start_position: int, num_tokens: int) -> int:
    """Key positions attended by `num_tokens` new tokens placed after `start_position` cached ones."""
    return num_tokens * start_position + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepShape:
    num_tokens: int
    num_context_tokens: int
    num_prefill_tokens: int = 0
    num_sampling_rows: int = 0     # positions whose logits are computed and sampled

    @classmethod
    def from_rows(cls, rows: tuple[ScheduledRow, ...] | list[ScheduledRow]) -> StepShape:
        return cls(num_tokens=sum(row.num_tokens for row in rows),
                   num_context_tokens=sum(context_tokens(row.start_position, row.num_tokens) for row in rows),
                   num_prefill_tokens=sum(row.num_tokens for row in rows if row.is_prefill),
                   num_sampling_rows=sum(row.num_logits for row in rows))

    @classmethod
    def from_plan(cls, plan: StepPlan) -> StepShape:
        return cls.from_rows(plan.rows)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Fitted coefficients, all >= 0."""

    fixed_s: float
    per_token_s: float
    per_context_token_s: float
    per_sampling_row_s: float = 0.0

    def predict_s(self, num_tokens: int, num_context_tokens: int, num_sampling_rows: int = 0) -> float:
        return (self.fixed_s + self.per_token_s * num_tokens + self.per_context_token_s * num_context_tokens
                + self.per_sampling_row_s * num_sampling_rows)

    def chunk_s(self, start_position: int, num_tokens: int) -> float:
        """What adding one prompt chunk to a step costs on top of the step's fixed part."""
        return self.per_token_s * num_tokens + self.per_context_token_s * context_tokens(start_position, num_tokens)

    def max_chunk(self, start_position: int, time_s: float) -> int | None:
        """Largest chunk at `start_position` whose cost fits in `time_s`; None when chunks are free."""
        if time_s <= 0:
            return 0
        b, c = self.per_token_s, self.per_context_token_s
        if c > 0:
            # c/2 n^2 + (b + c (s + 1/2)) n <= time_s
            linear = b + c * (start_position + 0.5)
            n = int((-linear + math.sqrt(linear * linear + 2 * c * time_s)) / c)
        elif b > 0:
            n = int(time_s / b)
        else:
            return None
        while n > 0 and self.chunk_s(start_position, n) > time_s:  # float rounding at the boundary
            n -= 1
        return max(n, 0)


# A small model on a couple of CPU cores; the fit replaces it within a few dozen steps.
DEFAULT_PRIOR = StepCost(fixed_s=0.02, per_token_s=0.002, per_context_token_s=1e-7, per_sampling_row_s=0.0005)


class StepCostModel:
    """Weighted least squares over recent steps, pulled towards a prior, coefficients kept >= 0.

    Two windows of recent steps, one for steps with prefill tokens and one for decode-only steps,
    so a long run of decodes never pushes out what the chunks taught. The fit minimises relative
    error (weights 1/t^2), since both a 30 ms decode and a 1 s chunk matter. It is robust to noise
    from other processes: after a first fit, steps whose relative residual is far from the median
    (beyond `outlier_mads` median absolute deviations) are dropped and the fit is redone. A lasting
    change of speed becomes the majority of the window within `window` steps and is then followed.
    """

    def __init__(self, prior: StepCost = DEFAULT_PRIOR, window: int = 32, prior_weight: float = 0.01,
                 outlier_mads: float = 4.0) -> None:
        if window < 4 or prior_weight <= 0 or outlier_mads <= 0:
            raise ValueError(f"window >= 4, prior_weight > 0 and outlier_mads > 0 required, got "
                             f"{window}, {prior_weight}, {outlier_mads}")
        self.prior = prior
        self.prior_weight = prior_weight
        self.outlier_mads = outlier_mads
        self._prefill_steps: deque[tuple[float, ...]] = deque(maxlen=window)
        self._decode_steps: deque[tuple[float, ...]] = deque(maxlen=window)
        self._cost: StepCost | None = prior
        self.num_samples = 0

    def observe(self, shape: StepShape, step_time_s: float) -> None:
        """Record one measured step; non-finite or non-positive durations are ignored."""
        if shape.num_tokens <= 0 or not math.isfinite(step_time_s) or step_time_s <= 0:
            return
        window = self._prefill_steps if shape.num_prefill_tokens else self._decode_steps
        window.append((shape.num_tokens / _TOKEN_SCALE, shape.num_context_tokens / _CONTEXT_SCALE,
                       shape.num_sampling_rows / _TOKEN_SCALE, step_time_s))
        self.num_samples += 1
        self._cost = None

    @property
    def cost(self) -> StepCost:
        if self._cost is None:
            self._cost = self._fit()
        return self._cost

    def _fit(self) -> StepCost:
        samples = list(self._prefill_steps) + list(self._decode_steps)
        theta = self._solve(samples)
        if len(samples) >= 8:
            ratios = [sample[-1] / max(_predict(theta, sample), 1e-9) - 1.0 for sample in samples]
            median = _median(ratios)
            spread = max(_median([abs(r - median) for r in ratios]), 0.02)  # floor: clean data is not trimmed
            kept = [sample for sample, r in zip(samples, ratios) if abs(r - median) <= self.outlier_mads * spread]
            theta = self._solve(kept, weigh_by=theta)
        return StepCost(theta[0], theta[1] / _TOKEN_SCALE, theta[2] / _CONTEXT_SCALE, theta[3] / _TOKEN_SCALE)

    def _solve(self, samples: list[tuple[float, ...]], weigh_by: tuple[float, ...] | None = None) -> tuple[float, ...]:
        """Ridge-to-prior weighted least squares; exact non-negative solution over the 15 active sets.

        The prior gives the split between the three parts; its overall scale is fitted first, so a
        machine 20x faster than the prior is not held back, and the ridge only settles directions
        the recent steps leave undetermined.
        """
        p = self.prior
        prior = (p.fixed_s, p.per_token_s * _TOKEN_SCALE, p.per_context_token_s * _CONTEXT_SCALE,
                 p.per_sampling_row_s * _TOKEN_SCALE)
        k = len(prior)
        typical_s = sum(prior)
        if samples:
            num = sum(_predict(prior, x) / x[-1] for x in samples)      # weights 1/y^2 on (y - scale * pred)
            den = sum((_predict(prior, x) / x[-1]) ** 2 for x in samples)
            scale = num / den if den > 0 else 1.0
            prior = tuple(c * scale for c in prior)
            typical_s = _median([x[-1] for x in samples])
        # Each coefficient's pull weighs like prior_weight steps of typical size (features are ~1).
        a = [[0.0] * k for _ in range(k)]
        rhs = [0.0] * k
        w = self.prior_weight / typical_s ** 2
        for i in range(k):
            a[i][i] += w
            rhs[i] += w * prior[i]
        for sample in samples:
            x, y = (1.0, *sample[:-1]), sample[-1]
            # Relative error: 1/t^2, with t from an earlier fit when there is one, as 1/measured^2
            # favours the steps that happened to run fast.
            t = y if weigh_by is None else max(_predict(weigh_by, sample), 1e-9)
            wy = 1.0 / (t * t)
            for i in range(k):
                rhs[i] += wy * x[i] * y
                for j in range(k):
                    a[i][j] += wy * x[i] * x[j]
        best: tuple[float, ...] = (0.0,) * k
        best_loss = 0.0   # the all-zero solution's loss, relative to the constant term
        for free in itertools.chain.from_iterable(itertools.combinations(range(k), r) for r in range(k, 0, -1)):
            sub = _solve_linear([[a[i][j] for j in free] for i in free], [rhs[i] for i in free])
            if sub is None or min(sub) < 0:
                continue
            if len(free) == k:
                return tuple(sub)   # the unconstrained minimum is non-negative: it is the optimum
            theta = [0.0] * k
            for i, v in zip(free, sub):
                theta[i] = v
            loss = sum(theta[i] * a[i][j] * theta[j] for i in range(k) for j in range(k)) - 2 * _dot(theta, rhs)
            if loss < best_loss:
                best, best_loss = tuple(theta), loss
        return best


class PrefillBudget:
    """One step's allowance for prompt chunks, after its decodes were placed.

    With decodes in the step, chunks get what the cost model says fits under `target_s`, but never
    less than `min_tokens` in all (so prompts keep moving while decodes alone miss the target).
    Chunks of long prompts (`take(..., is_long=True)`) share a second, smaller allowance: at most
    `long_slowdown` times the step's predicted decode time, and at least one token a step, so a long
    prefill lengthens every decoding step by a bounded fraction instead of stalling the streams.
    With no decodes nobody waits on this step's latency yet, only whoever arrives while it runs:
    chunks of long prompts share `long_chunk_tokens`, others are limited only by the caller. (A
    token count, not a time: small chunks are slower per token than the fitted cost says, and a time
    cap would shrink them further on every step.)
    """

    def __init__(self, cost: StepCost | None = None, target_s: float | None = None, min_tokens: int = 0,
                 decodes: StepShape | None = None, long_slowdown: float | None = None,
                 long_chunk_tokens: int | None = None) -> None:
        self.cost = cost
        self.is_limited = cost is not None and target_s is not None and decodes is not None and decodes.num_tokens > 0
        decode_s = cost.predict_s(decodes.num_tokens, decodes.num_context_tokens, decodes.num_sampling_rows) \
            if self.is_limited else 0.0
        self.time_left_s = target_s - decode_s if self.is_limited else math.inf
        self.long_time_left_s = long_slowdown * decode_s if self.is_limited and long_slowdown else math.inf
        self.long_alone_left = long_chunk_tokens if long_chunk_tokens is not None and not self.is_limited \
            else math.inf
        self.floor_left = min_tokens

    def peek(self, start_position: int, num_wanted: int, is_long: bool = False) -> int:
        """What `take` would grant now, granting nothing."""
        if num_wanted <= 0:
            return 0
        if not self.is_limited:
            return min(num_wanted, self.long_alone_left) if is_long else num_wanted
        fit = self.cost.max_chunk(start_position, self.time_left_s)
        num = num_wanted if fit is None else min(num_wanted, max(fit, self.floor_left))
        if is_long and self.long_time_left_s < math.inf:
            long_fit = self.cost.max_chunk(start_position, self.long_time_left_s)
            if long_fit is not None:
                num = min(num, max(long_fit, 1))
        return num

    def take(self, start_position: int, num_wanted: int, is_long: bool = False) -> int:
        """Tokens granted to a chunk starting at `start_position` that wants `num_wanted`."""
        num = self.peek(start_position, num_wanted, is_long)
        if not self.is_limited or num <= 0:
            if is_long:
                self.long_alone_left -= num
            return num
        if is_long and self.long_time_left_s < math.inf:
            self.long_time_left_s -= self.cost.chunk_s(start_position, num)
        self.time_left_s -= self.cost.chunk_s(start_position, num)
        self.floor_left = max(self.floor_left - num, 0)
        return num


def _dot(u: tuple[float, ...] | list[float], v: tuple[float, ...] | list[float]) -> float:
    return sum(a * b for a, b in zip(u, v))


def _predict(theta: tuple[float, ...], sample: tuple[float, ...]) -> float:
    """theta's prediction for a sample (its features, then its measured time, which is left out)."""
    return theta[0] + sum(c * x for c, x in zip(theta[1:], sample[:-1]))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
