"""Sampler: one step's logits -> one token per row, with per-row penalties, min_tokens,
temperature, top-k / top-p / min-p, per-request seeds and logprobs.

Order of operations (vLLM's):
    penalties (repetition over prompt+output; frequency, presence over output) -> logit_bias
    -> logprobs snapshot (log_softmax of the penalised logits)
    -> min_tokens mask (eos and stop_token_ids -> -inf) -> allowed_token_ids, bad_words (token_filters.py)
    -> the grammar's allowed tokens
    -> greedy rows: argmax
    -> random rows: / temperature -> min_p -> top_k -> top_p -> draw argmax(probs / Exp(1) noise)

Filters cut at a value threshold, never at a sort position, so a row's result depends only on its
own logits, not on tie order or on what else is in the batch.

Every step is batched over rows with per-row parameter tensors; the only per-row Python loops are
over rows that need it (seeded rows for their generators, rows still under min_tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from conveyor import kernels
from conveyor.logprobs import IMPOSSIBLE_LOGPROB, TokenLogprobs
from conveyor.runtime.token_filters import apply_token_filters
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Below this a row is greedy: dividing float32 logits by a tinier temperature can overflow to inf (vLLM's cutoff).
MIN_TEMPERATURE = 1e-5
# top_p looks for its cut among this many best tokens first; rows whose cut lies further get a full sort.
TOP_P_CANDIDATES = 256


@dataclass(slots=True)
class SamplingRow:
    """The per-request state one row of logits is sampled with."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # tokens generated so far (penalties, min_tokens)
    generator: torch.Generator | None    # the request's own generator when params.seed is set, else None
    eos_token_ids: frozenset[int]        # blocked while len(output_token_ids) < params.min_tokens
    allowed_tokens: torch.Tensor | None = None   # structured outputs: packed bitmask (words,) int32, bit t = token t


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]                 # one per row
    logprobs: list[TokenLogprobs | None] # one per row; None when params.logprobs is None


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator a request keeps for its whole life (it advances every sampled step), or None."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    # torch accepts seeds in [-2**63, 2**64), as SamplingParams does; the fold maps negatives the same way.
    generator.manual_seed(params.seed % 2**64)
    return generator


def uses_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return logits (S, V) with each row's repetition, frequency and presence penalties applied.

    repetition: tokens seen in prompt or output get logit / p if logit > 0 else logit * p.
    frequency, presence: logit -= frequency * count_in_output + presence * (count_in_output > 0).
    The input tensor is not modified.
    """
    penalised = [i for i, row in enumerate(rows) if uses_penalties(row.params)]
    if not penalised:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    index = torch.tensor(penalised, dtype=torch.long, device=device)
    params = [rows[i].params for i in penalised]
    sub = logits.index_select(0, index)                                                      # (R, V)
    output_counts = _token_counts([rows[i].output_token_ids for i in penalised], vocab_size, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = output_counts > 0
        if any(rows[i].prompt_token_ids for i in penalised):
            seen |= _token_counts([rows[i].prompt_token_ids for i in penalised], vocab_size, device) > 0
        repetition = _column([p.repetition_penalty for p in params], device)               # (R, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    if any(p.frequency_penalty != 0.0 for p in params):
        sub = sub - _column([p.frequency_penalty for p in params], device) * output_counts
    if any(p.presence_penalty != 0.0 for p in params):
        sub = sub - _column([p.presence_penalty for p in params], device) * (output_counts > 0)
    return logits.index_copy(0, index, sub)


class Sampler:
    """Stateless across steps: everything a row needs (history, generator) comes in its SamplingRow.

    A seeded row's draw depends only on its own generator and its own probabilities, so the same
    seed gives the same tokens whatever else is in the batch. Greedy rows never consume randomness,
    and unseeded rows draw from torch's default generator only.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (S, V) float32, one row per SamplingRow. Rows with allowed_tokens are masked in place."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be (num_rows={len(rows)}, vocab), got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = logits.to(device=self.device, dtype=torch.float32)                       # (S, V)
        if all(_argmax_only(row) for row in rows):   # every stage below would pass these rows through
            return SamplerOutput(token_ids=_argmax_rows(logits).tolist(), logprobs=[None] * len(rows))
        logits = _apply_logit_bias(apply_penalties(logits, rows), rows)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        # Reported logprobs are the model's distribution after penalties, before min_tokens and temperature.
        raw_logprobs = (logits.index_select(0, self._index(logprob_rows)).log_softmax(dim=-1)
                        if logprob_rows else None)                                           # (L, V)
        filtered = apply_token_filters(_block_stop_tokens(logits, rows), [r.params for r in rows],
                                       [r.output_token_ids for r in rows])
        logits = _apply_allowed_tokens(filtered, logits, rows)
        token_ids = self._choose(logits, rows)                                               # (S,)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            sampled = token_ids.index_select(0, self._index(logprob_rows))                     # (L,)
            num_top = [rows[i].params.logprobs or 0 for i in logprob_rows]
            for i, entry in zip(logprob_rows, _gather_logprobs(raw_logprobs, sampled, num_top)):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        token_ids = _argmax_rows(logits)               # (S,) the greedy answer; random rows are overwritten
        random_rows = [i for i, row in enumerate(rows) if row.params.temperature >= MIN_TEMPERATURE]
        if not random_rows:
            return token_ids
        index = self._index(random_rows)
        params = [rows[i].params for i in random_rows]
        vocab_size = logits.shape[1]
        temperature = _column([p.temperature for p in params], self.device)                 # (R, 1)
        sub = logits.index_select(0, index) / temperature                                    # (R, V)
        if any(p.min_p > 0 for p in params):
            sub = _apply_min_p(sub, _column([p.min_p for p in params], self.device))
        k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab_size]
        if k_rows:
            k_index = self._index(k_rows)
            top_k = torch.tensor([params[j].top_k for j in k_rows], dtype=torch.long, device=self.device)
            sub = sub.index_copy(0, k_index, _apply_top_k(sub.index_select(0, k_index), top_k))
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            p_index = self._index(p_rows)
            top_p = _column([params[j].top_p for j in p_rows], self.device)                  # (P, 1)
            sub = sub.index_copy(0, p_index, _apply_top_p(sub.index_select(0, p_index), top_p))
        probs = sub.softmax(dim=-1)                                                          # (R, V)
        sampled = _draw(probs, [rows[i].generator for i in random_rows])                     # (R,)
        return token_ids.index_copy(0, index, sampled)

    def _index(self, positions: list[int]) -> torch.Tensor:
        return torch.tensor(positions, dtype=torch.long, device=self.device)


def _argmax_only(row: SamplingRow) -> bool:
    """A greedy row that no penalty, bias, filter, mask or min_tokens changes, and that wants no logprobs."""
    params = row.params
    return (params.temperature < MIN_TEMPERATURE and params.logprobs is None and not params.logit_bias
            and row.allowed_tokens is None and params.allowed_token_ids is None and not params.bad_words_token_ids
            and len(row.output_token_ids) >= params.min_tokens and not uses_penalties(params))


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(S, V) -> (S,) int64: the first index of each row's largest value (a NaN counts as largest), as
    torch.argmax. On the CPU the C kernels' (split across their threads), else numpy's: torch's took ~0.3 ms
    of every decode step over a 150k vocabulary."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    ids = kernels.argmax_rows(logits)
    if ids is not None:
        return ids
    return torch.from_numpy(np.argmax(logits.detach().numpy(), axis=-1).astype(np.int64, copy=False))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)           # (R, 1)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(R, V) float32 occurrence counts, built with one scatter_add over the flattened ids."""
    counts = torch.zeros(len(token_lists) * vocab_size, dtype=torch.float32, device=device)  # (R*V,)
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.long, device=device)
    if int(lengths.sum()) > 0:
        flat_ids = torch.cat([torch.as_tensor(ids, dtype=torch.long) for ids in token_lists]).to(device)
        row_of = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)  # (N,)
        counts.scatter_add_(0, row_of * vocab_size + flat_ids, torch.ones_like(flat_ids, dtype=torch.float32))
    return counts.view(len(token_lists), vocab_size)


def _block_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set eos and stop_token_ids to -inf for rows that have not yet produced min_tokens tokens."""
    vocab_size = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            # Ids past the vocabulary can never be sampled, so there is nothing to block.
            blocked = [t for t in row.eos_token_ids.union(row.params.stop_token_ids) if t < vocab_size]
            row_ids.extend([i] * len(blocked))
            token_ids.extend(blocked)
    if not row_ids:
        return logits
    index = (torch.tensor(row_ids, dtype=torch.long, device=logits.device),
             torch.tensor(token_ids, dtype=torch.long, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's logit_bias to its logits, all rows in one scatter."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if token_id < vocab_size:
                row_ids.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    if not row_ids:
        return logits
    index = (torch.tensor(row_ids, dtype=torch.long, device=logits.device),
             torch.tensor(token_ids, dtype=torch.long, device=logits.device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, words) int32, bit j of word w = token 32 * w + j -> (R, vocab_size) bool."""
    bits = (packed.unsqueeze(-1) >> _BIT_SHIFTS.to(packed.device)) & 1                       # (R, words, 32)
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()


def mask_refused_tokens_(logits: torch.Tensor, rows: list[int], packed: torch.Tensor) -> list[bool]:
    """In place: -inf for the tokens each row's packed mask (C, words) refuses. Per row, whether a
    finite logit is left. The C kernel when built, else the same in torch."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    alive = kernels.mask_logits(logits, index, packed)
    if alive is not None:
        return alive
    sub = logits.index_select(0, index).masked_fill(~unpack_bitmask(packed.to(logits.device), logits.shape[1]),
                                                     float("-inf"))
    logits.index_copy_(0, index, sub)
    return (sub > float("-inf")).any(dim=-1).tolist()


def _apply_allowed_tokens(logits: torch.Tensor, unblocked: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for tokens a row's grammar does not allow, in place, all constrained rows in one call.

    When min_tokens blocked every token the grammar allows (the grammar is at its end, where only
    eos is left) the grammar wins: the row is taken from `unblocked` (the logits before the
    min_tokens mask) and masked again.
    """
    constrained = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
    if not constrained:
        return logits
    packed = torch.stack([rows[i].allowed_tokens for i in constrained])                       # (C, words)
    alive = mask_refused_tokens_(logits, constrained, packed)
    dead = [j for j, ok in enumerate(alive) if not ok]
    if dead and unblocked is not logits:
        for j in dead:
            logits[constrained[j]] = unblocked[constrained[j]]
        mask_refused_tokens_(logits, [constrained[j] for j in dead], packed[dead])
    return logits


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits (R, V), min_p (R, 1): drop tokens whose probability is below min_p * the row's top probability."""
    probs = logits.softmax(dim=-1)                                                           # (R, V)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits (K, V), top_k (K,) in [1, V): keep logits >= the row's k-th largest (ties survive, as in vLLM)."""
    largest = logits.topk(int(top_k.max()), dim=-1).values                                  # (K, max_k) best first
    kth = largest.gather(1, (top_k - 1).unsqueeze(1))                                        # (K, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (P, V), top_p (P, 1) in (0, 1): keep the smallest best-first prefix whose mass reaches top_p.

    The cut is a probability threshold, so tokens tied with the last kept one survive too and the
    result never depends on sort order among ties. Only sorted values are needed: the best
    TOP_P_CANDIDATES settle most rows, and a full sort runs only for rows whose cut lies past them.
    """
    probs = logits.softmax(dim=-1)                                                           # (P, V)
    num_candidates = min(TOP_P_CANDIDATES, probs.shape[1])
    candidates = probs.topk(num_candidates, dim=-1).values                                   # (P, C) best first
    num_kept = _num_kept(candidates, top_p)                                                  # (P, 1)
    threshold = candidates.gather(1, num_kept - 1)                                           # (P, 1)
    if num_candidates < probs.shape[1]:
        short = (num_kept.squeeze(1) == num_candidates).nonzero().squeeze(1)                 # (F,)
        if short.numel() > 0:
            # A sort's prefix equals the top-k values and cumsum is a running sum, so both paths agree.
            ranked = probs.index_select(0, short).sort(dim=-1, descending=True).values       # (F, V)
            full_threshold = ranked.gather(1, _num_kept(ranked, top_p.index_select(0, short)) - 1)
            threshold = threshold.index_copy(0, short, full_threshold)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _num_kept(ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """ranked (P, C) probabilities best first, top_p (P, 1) -> (P, 1) length of the kept prefix (>= 1)."""
    mass_before = ranked.cumsum(dim=-1) - ranked                 # (P, C) mass of strictly better-ranked tokens
    # A top_p that rounds to 0 in float32 (1e-46) keeps nothing by the sum; the best token always stays.
    return (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min_(1)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs (R, V) -> (R,) token ids via argmax(probs / q), q ~ Exp(1): exact categorical sampling.

    Seeded rows fill their own noise row from their own generator, so their draw is independent of
    the batch; unseeded rows share torch's default generator.
    """
    uniform = torch.empty_like(probs)                                                        # (R, V) in [0, 1)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        uniform.uniform_()
    elif unseeded:
        index = torch.tensor(unseeded, dtype=torch.long, device=probs.device)
        uniform.index_copy_(0, index, torch.rand(len(unseeded), probs.shape[1], device=probs.device))
    for j, generator in enumerate(generators):
        if generator is not None:
            uniform[j].uniform_(generator=generator)
    noise = uniform.log_().neg_()                                                            # (R, V) ~ Exp(1)
    # Guards u == 1: a zero would make 0/0 = NaN, which argmax prefers over every real token.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def skip_draws(generator: torch.Generator, vocab_size: int, count: int) -> None:
    """Advance `generator` exactly as `count` seeded draws of `_draw` over `vocab_size` tokens do."""
    row = torch.empty(vocab_size, device=generator.device)
    for _ in range(count):
        row.uniform_(generator=generator)


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs (L, V), token_ids (L,) -> the sampled token's logprob and each row's top-N, as Python values."""
    logprobs = logprobs.nan_to_num(nan=IMPOSSIBLE_LOGPROB, neginf=IMPOSSIBLE_LOGPROB)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()                  # (L,)
    max_top = min(max(num_top), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(max_top, dim=-1)                                     # (L, N); N may be 0
    return [TokenLogprobs(token_id=token_id, logprob=value, top=list(zip(ids[:n], values[:n])))
            for token_id, value, ids, values, n
            in zip(token_ids.tolist(), chosen, top_ids.tolist(), top_values.tolist(), num_top)]
