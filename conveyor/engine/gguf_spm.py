"""SentencePiece BPE vocabularies of GGUF files (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE.

llama.cpp tokenizes these (llm_tokenizer_spm) without merges: spaces become U+2581 (one more in front
when `tokenizer.ggml.add_space_prefix` says so), then adjacent pieces are merged while their
concatenation is a token, the highest-scored merged token first (the leftmost on a tie), and a
character no token holds falls back to its `<0xNN>` byte tokens. A `tokenizers` BPE does the same
when its merges are every split of every token into two tokens, ranked by the whole token's score:
its ranks order merges as the scores do, and it too takes the leftmost of equal-ranked pairs.

Ties are where the two could differ: llama.cpp takes the leftmost of equally scored pairs, the ranks
here the lower token id first (then the shorter left part). A trained SentencePiece vocabulary gives
each piece its own score, which leaves equal scores to tokens text is never merged into (control, added
and byte tokens) and to one token reached by two different splits at overlapping places.
"""

from __future__ import annotations

import logging
from operator import itemgetter

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

logger = logging.getLogger(__name__)

_SPACE = "\u2581"   # SentencePiece's visible space

# Polynomial hashing of every token and of every prefix and suffix of every token, mod 2**64: odd
# base (so it has an inverse), characters mixed first so that nearby code points spread out.
_BASE = 0x100000001B3
_MIX_XOR, _MIX_MUL = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


def spm_backend(tokens: list[str], vocab: dict[str, int], scores: np.ndarray, *, add_space_prefix: bool,
                unk_token: str | None) -> tuple[BackendTokenizer, int]:
    """(the backend, its number of merges) for a SentencePiece vocabulary; special and added tokens
    are the caller's."""
    merges = spm_merges(tokens, vocab, scores)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, byte_fallback=True, fuse_unk=False)
    backend = BackendTokenizer(model)
    escape = normalizers.Replace(" ", _SPACE)
    # A normalizer, not the Metaspace pre-tokenizer: it runs once per stretch of text between added
    # tokens and prepends even to text that starts with a space (" hi" -> "▁▁hi"), as llama.cpp does.
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), escape]) if add_space_prefix else escape
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))   # the space the encoder put in front
    backend.decoder = decoders.Sequence(steps)
    return backend, len(merges)


def spm_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) such that left, right and left + right are tokens, the best-scored
    left + right first; ties in token id order, then by the length of left.

    `vocab` maps each token to its id (the first, for a token listed twice). Vectorised: hashes of
    all prefixes and suffixes are looked up among the tokens' hashes; the hits are checked as strings,
    and any hash collision falls back to the plain loop (`spm_merges_exact`).
    """
    n = len(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    if n == 0 or lengths.max() < 2:
        return []
    width = int(lengths.max())
    powers = np.array([pow(_BASE, k, 1 << 64) for k in range(width + 1)], dtype=np.uint64)
    inverse = pow(_BASE, -1, 1 << 64)
    inverse_powers = np.array([pow(inverse, k, 1 << 64) for k in range(width + 1)], dtype=np.uint64)

    # All tokens' characters in one array; cumulative sums of char * base**(position in its token).
    codes = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    starts = np.cumsum(lengths) - lengths
    position = np.arange(len(codes), dtype=np.int64) - np.repeat(starts, lengths)
    with np.errstate(over="ignore"):
        terms = ((codes ^ _MIX_XOR) * _MIX_MUL) * powers[position]
        running = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(terms, dtype=np.uint64)])
        full = running[starts + lengths] - running[starts]

        table = full[ids]
        order = np.argsort(table)
        table_sorted, table_ids = table[order], ids[order]
        if len(table_sorted) > 1 and bool((table_sorted[1:] == table_sorted[:-1]).any()):
            logger.debug("SentencePiece merges: two tokens share a hash; deriving them one by one")
            return spm_merges_exact(tokens, vocab, scores)

        def lookup(hashes: np.ndarray, expected_length: np.ndarray) -> np.ndarray:
            """The id of the token with each hash and length, or -1."""
            # Sorted queries walk the table in order: faster than the binary searches' scattered reads.
            query_order = np.argsort(hashes)
            at = np.empty(len(hashes), dtype=np.int64)
            at[query_order] = np.searchsorted(table_sorted, hashes[query_order])
            np.minimum(at, len(table_sorted) - 1, out=at)
            found = table_ids[at]
            hit = (table_sorted[at] == hashes) & (lengths[found] == expected_length)
            return np.where(hit, found, -1)

        # Split k of token t: t[:k] + t[k:], 0 < k < len(t); only a token's own id splits (a token
        # listed twice would otherwise list its merges twice).
        cuts = np.zeros(n, dtype=np.int64)
        cuts[ids] = np.maximum(lengths[ids] - 1, 0)
        merged = np.repeat(np.arange(n, dtype=np.int64), cuts)
        k = np.arange(len(merged), dtype=np.int64) - np.repeat(np.cumsum(cuts) - cuts, cuts) + 1
        left_hash = running[starts[merged] + k] - running[starts[merged]]
        left = lookup(left_hash, k)
        keep = left >= 0
        merged, k, left, left_hash = merged[keep], k[keep], left[keep], left_hash[keep]
        right = lookup((full[merged] - left_hash) * inverse_powers[k], lengths[merged] - k)
        keep = right >= 0
        merged, left, right = merged[keep], left[keep], right[keep]

    best_first = np.argsort(-np.asarray(scores, dtype=np.float64)[merged], kind="stable")
    merged, left, right = merged[best_first], left[best_first], right[best_first]
    lefts, rights = _pick(tokens, left), _pick(tokens, right)
    if not all(map(str.__eq__, map(str.__add__, lefts, rights), _pick(tokens, merged))):
        logger.debug("SentencePiece merges: a hash collision; deriving them one by one")
        return spm_merges_exact(tokens, vocab, scores)
    return list(zip(lefts, rights))


def spm_merges_exact(tokens: list[str], vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """`spm_merges` one split at a time (about 1 s for 262k tokens)."""
    found = [
        (token[:k], token[k:], token_id)
        for token_id in sorted(vocab.values())
        for token in (tokens[token_id],)
        for k in range(1, len(token))
        if token[:k] in vocab and token[k:] in vocab
    ]
    score_of = np.asarray(scores, dtype=np.float64)
    best_first = np.argsort(-score_of[np.array([t for _, _, t in found], dtype=np.int64)], kind="stable")
    return [found[i][:2] for i in best_first.tolist()]


def _pick(tokens: list[str], ids: np.ndarray) -> list[str]:
    """[tokens[i] for i in ids], in C."""
    if len(ids) == 0:
        return []
    if len(ids) == 1:
        return [tokens[int(ids[0])]]
    return list(itemgetter(*ids.tolist())(tokens))

