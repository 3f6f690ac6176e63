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

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

logger = logging.getLogger(__name__)

_SPACE = "\u2581"   # SentencePiece's visible space
# Derived merges kept per vocabulary: Gemma 3's 262,144 tokens take ~1 s to derive, ~0.1 s to read back.
DEFAULT_MERGES_CACHE = Path.home() / ".cache" / "conveyor" / "tokenizers"
_CACHE_FORMAT = b"spm-merges-v1\0"   # hashed into every key: change it whenever spm_merges changes


def spm_backend(tokens: list[str], vocab: dict[str, int], scores: np.ndarray, *, add_space_prefix: bool,
                unk_token: str | None, merges_cache: Path | None = None) -> tuple[BackendTokenizer, int]:
    """(the backend, its number of merges) for a SentencePiece vocabulary; special and added tokens
    are the caller's. merges_cache: a folder to keep the derived merges in (None: derive them)."""
    merges = spm_merges(tokens, vocab, scores) if merges_cache is None else \
        cached_spm_merges(tokens, vocab, scores, merges_cache)
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


def cached_spm_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray,
                      cache_dir: Path) -> list[tuple[str, str]]:
    """`spm_merges`, kept in `cache_dir` as token id pairs under a hash of the tokens and scores, so
    another file with the same vocabulary reads them too and a changed one derives its own. A file
    that cannot be read or does not fit the vocabulary is derived again; one that cannot be written
    is only logged."""
    digest = hashlib.sha256(_CACHE_FORMAT)
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.ascontiguousarray(scores, dtype=np.float64).tobytes())
    path = cache_dir / f"{digest.hexdigest()[:40]}.npy"
    try:
        pairs = np.load(path, allow_pickle=False)
        if pairs.dtype == np.int32 and pairs.ndim == 2 and pairs.shape[1] == 2 and \
                (pairs.size == 0 or (pairs.min() >= 0 and pairs.max() < len(tokens))):
            names = np.array(tokens, dtype=object)
            return list(zip(names[pairs[:, 0]].tolist(), names[pairs[:, 1]].tolist()))
    except (OSError, ValueError, EOFError):
        pass
    merges = spm_merges(tokens, vocab, scores)
    pairs = np.array([(vocab[left], vocab[right]) for left, right in merges], dtype=np.int32).reshape(-1, 2)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            np.save(f, pairs)
        os.replace(partial, path)   # whole or not at all, whoever else writes it
    except OSError as exc:
        logger.debug("SentencePiece merges not cached in %s: %s", cache_dir, exc)
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return merges
