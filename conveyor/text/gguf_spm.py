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

import hashlib
import logging
import struct
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from conveyor.private_cache import CACHE_ROOT, private_dir, read_private_file, write_atomically

logger = logging.getLogger(__name__)

_SPACE = "\u2581"   # SentencePiece's visible space
# Derived merges kept per vocabulary: Gemma 3's 262,144 tokens take ~1 s to derive, ~0.1 s to read back.
DEFAULT_MERGES_CACHE = CACHE_ROOT / "conveyor" / "tokenizers"
_CACHE_FORMAT = b"spm-merges-v2\0"   # hashed into every key: change it whenever spm_merges changes
# A cache file: magic, number of rows, sha256 of the rows; then (left, right, merged) token ids, int32.
_MAGIC = b"conveyor-merges\0"
_HEADER = struct.Struct("<16sQ32s")
_ROW_BYTES = 12


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
    another file with the same vocabulary reads them too and a changed one derives its own. The cache
    is input like any file: read only from a folder this user alone can write, only as a plain file no
    larger than the vocabulary allows, and used only when its digest matches and every merge is one
    the derivation would give, in its order (see `_read_merges`); anything else is derived again. A
    folder that cannot be written is only logged."""
    digest = hashlib.sha256(_CACHE_FORMAT)
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.ascontiguousarray(scores, dtype=np.float64).tobytes())
    folder = private_dir(cache_dir)
    if folder is None:
        logger.warning("%s is not a folder only this user can write: SentencePiece merges are derived, not cached",
                       cache_dir)
        return spm_merges(tokens, vocab, scores)
    path = folder / f"{digest.hexdigest()[:40]}.merges"
    merges = _read_merges(path, tokens, vocab, scores)
    if merges is not None:
        return merges
    merges = spm_merges(tokens, vocab, scores)
    table = np.array([(vocab[left], vocab[right], vocab[left + right]) for left, right in merges],
                     dtype="<i4").reshape(-1, 3)
    payload = table.tobytes()
    try:
        write_atomically(path, _HEADER.pack(_MAGIC, len(table), hashlib.sha256(payload).digest()) + payload)
    except OSError as exc:
        logger.debug("SentencePiece merges not cached in %s: %s", folder, exc)
    return merges


def _read_merges(path: Path, tokens: list[str], vocab: dict[str, int], scores: np.ndarray
                 ) -> list[tuple[str, str]] | None:
    """The merges a cache file holds, or None unless it is whole and right for this vocabulary: a row
    count no larger than the splits the tokens allow (checked before reading a byte more), the digest of
    its rows, ids in range, each merged token the text of its two parts, and the derivation's order
    (best score first, then token id, then the left part's length)."""
    token_len = np.fromiter(map(len, tokens), np.int64, len(tokens))
    max_rows = max(int(token_len.sum()) - len(tokens), 0)   # a token of n characters splits n - 1 ways
    data = read_private_file(path, _HEADER.size + _ROW_BYTES * max_rows)
    if data is None or len(data) < _HEADER.size:
        return None
    magic, rows, recorded = _HEADER.unpack_from(data)
    if magic != _MAGIC or rows > max_rows or len(data) != _HEADER.size + _ROW_BYTES * rows:
        return None
    payload = memoryview(data)[_HEADER.size:]
    if hashlib.sha256(payload).digest() != recorded:
        return None
    if rows == 0:
        return []
    table = np.frombuffer(payload, dtype="<i4").reshape(rows, 3).astype(np.int64)
    if table.min() < 0 or table.max() >= len(tokens):
        return None
    left, right, merged = table[:, 0], table[:, 1], table[:, 2]
    left_len = token_len[left]
    # The order spm_merges gives: keys (-score, token id, left length) strictly increasing.
    neg_score = -np.asarray(scores, dtype=np.float64)[merged]
    before = (neg_score[:-1] < neg_score[1:]) | ((neg_score[:-1] == neg_score[1:]) & (
        (merged[:-1] < merged[1:]) | ((merged[:-1] == merged[1:]) & (left_len[:-1] < left_len[1:]))))
    if not before.all():
        return None
    names = np.array(tokens, dtype=object)
    lefts, rights = names[left], names[right]
    if not (lefts + rights == names[merged]).all():   # elementwise str + and ==, one C loop each
        return None
    return list(zip(lefts.tolist(), rights.tolist()))
