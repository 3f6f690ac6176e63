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

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

_SPACE = "\u2581"   # SentencePiece's visible space


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
    left + right first; ties in token id order, then by the length of left (about 1 s for 262k tokens).

    `vocab` maps each token to its id (the first, for a token listed twice: only that id splits, so a
    repeated token does not list its merges twice)."""
    found = [
        (token[:k], token[k:], token_id)
        for token_id in sorted(vocab.values())
        for token in (tokens[token_id],)
        for k in range(1, len(token))
        if token[:k] in vocab and token[k:] in vocab
    ]
    if not found:
        return []
    score_of = np.asarray(scores, dtype=np.float64)
    best_first = np.argsort(-score_of[np.array([t for _, _, t in found], dtype=np.int64)], kind="stable")
    return [found[i][:2] for i in best_first.tolist()]
