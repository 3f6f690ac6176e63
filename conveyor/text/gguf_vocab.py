"""GGUF vocabulary -> `Tokenizer`: llama.cpp's tokenizer metadata rebuilt as a `tokenizers` backend.

`tokenizer.ggml.model` names the kind, as in llama.cpp:
- `gpt2`: byte-level BPE with the file's merges, split first as `tokenizer.ggml.pre` says (the
  table below is llama.cpp's, for the splits written here).
- `llama`: SentencePiece BPE with scores and byte fallback (Llama 2, Mistral 7B, Phi-3, Gemma); see
  gguf_spm.py. llama.cpp reads no pre-tokenizer for these.
Any other model, and a `tokenizer.ggml.pre` not in the table, is refused by name: a guessed split
gives plausible ids that differ from the ones the model was trained on, and nothing later notices.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from conveyor.text.gguf_spm import DEFAULT_MERGES_CACHE, spm_backend
from conveyor.text.tokenizer import Tokenizer
from conveyor.model.gguf.metadata import GGUFValue, read_gguf_metadata

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# Every id that ends generation: llama.cpp's end-of-generation set, from metadata.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# llama.cpp also ends generation on these tokens by their text, whatever the metadata says. SentencePiece
# files often lack eot_token_id while their chat template closes each turn with one of these (Gemma's
# <end_of_turn>, Phi-3's <|end|>): without them a chat reply would run on into a made-up next turn.
# llama.cpp's list also has "</s>", left out here: Gemma's vocabulary holds it as ordinary text.
_EOG_TEXTS = (
    "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
)
# Every key read here: the metadata reader stops once it has them all.
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
    "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template", *_GGUF_EOS_KEYS,
)
_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}

# Split patterns in `tokenizers` (Oniguruma) syntax: the tokenizer.json originals, which llama.cpp
# keeps as comments next to its hand-expanded versions in llama-vocab.cpp.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Upper-then-lower letter runs, so "camelCase" splits in two (o200k, Tekken).
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",   # CJK ideographs, hiragana, katakana
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# llama.cpp's fallback for "default" (and for files without tokenizer.ggml.pre): punctuation runs,
# then the GPT-2 split, then numbers, then three-digit groups.
_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# Pre-tokenizer kind -> the regexes applied one after the other (each keeps what it matched and what it
# did not), as llama.cpp's unicode_regex_split. "gpt2" and "digits" are built in (_make_pre_tokenizer).
_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "qwen35": (_QWEN35_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),
    "gpt-4o": (_GPT4O_SPLIT,),
    "deepseek-v3": _DEEPSEEK3_SPLITS,
}

# tokenizer.ggml.pre -> (pre-tokenizer kind, ignore_merges, add_bos default), llama.cpp's table for the
# kinds above.
_GGUF_PRE: dict[str, tuple[str, bool, bool]] = {
    "default": ("default", False, False),
    **{name: ("gpt2", False, False) for name in (
        "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
        "jina-v1-en", "jina-v2-code", "roberta-bpe", "modern-bert", "gigachat", "exaone4", "trillion",
        "granite-docling", "a.x-4.0", "mellum",
    )},
    **{name: ("digits", False, False) for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2",
    )},
    **{name: ("llama3", True, True) for name in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
    )},
    **{name: ("llama3", False, False) for name in ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4")},
    **{name: ("qwen2", False, False) for name in (
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
    )},
    "qwen35": ("qwen35", False, False),
    "tekken": ("tekken", True, True),
    **{name: ("gpt-4o", False, False) for name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    "deepseek-v3": ("deepseek-v3", False, False),
}


def _make_pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == "digits":
        # Same as the GPT-2 split except every digit stands alone (llama.cpp's "\p{N}" pass first).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _SPLITS[kind]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(path: str | Path, merges_cache: Path | None = DEFAULT_MERGES_CACHE) -> Tokenizer:
    """Build the tokenizer a GGUF file's metadata describes (`tokenizer.ggml.model` "gpt2" or "llama");
    merges_cache: where a SentencePiece vocabulary's derived merges are kept (None: derived each time)."""
    started = time.perf_counter()
    source = str(path)
    meta = read_gguf_metadata(path, _TOKENIZER_KEYS)
    read_s = time.perf_counter() - started

    model = meta.get("tokenizer.ggml.model")
    if model not in _MODELS:
        supported = ", ".join(f"{name!r} ({kind})" for name, kind in _MODELS.items())
        raise ValueError(f"{source}: GGUF tokenizer model {model!r} is not supported; supported: {supported}")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []  # type: ignore[assignment]
    if not tokens:
        raise ValueError(f"{source}: GGUF has no tokenizer.ggml.tokens")
    token_types = meta.get("tokenizer.ggml.token_type")
    types = np.asarray(token_types if token_types is not None else [], dtype=np.int64)
    vocab = _vocab(tokens, source)

    def token_id_at(key: str, default: int | None = None) -> int | None:
        token_id = meta.get(key, default)
        return int(token_id) if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None

    def token_at(key: str, default: int | None = None) -> str | None:
        token_id = token_id_at(key, default)
        return None if token_id is None else tokens[token_id]

    special_types = [_TOKEN_TYPE_CONTROL]
    eos_ids = [token_id for key in _GGUF_EOS_KEYS if (token_id := token_id_at(key)) is not None]
    if model == "gpt2":
        backend, detail, add_bos_default = _byte_level_backend(meta, vocab, source)
        bos_default = eos_default = None
    else:
        # llama.cpp's defaults for a SentencePiece file that names no ids: <unk> 0, <s> 1, </s> 2.
        bos_default, eos_default = 1, 2
        add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) < len(tokens):  # type: ignore[arg-type]
            raise ValueError(f"{source}: GGUF SentencePiece vocabulary has no tokenizer.ggml.scores for each token")
        names = tokens if all(tokens) else [token or f"[EMPTY_{i}]" for i, token in enumerate(tokens)]
        backend, num_merges = spm_backend(
            names, vocab, np.asarray(scores), add_space_prefix=bool(add_space_prefix),
            unk_token=token_at("tokenizer.ggml.unknown_token_id", 0), merges_cache=merges_cache,
        )
        detail = f"{num_merges} merges from scores, add_space_prefix={bool(add_space_prefix)}"
        add_bos_default = True
        # llama.cpp also matches the unknown token whole in text.
        special_types.append(_TOKEN_TYPE_UNKNOWN)
        eos_ids += [vocab[text] for text in _EOG_TEXTS if text in vocab]

    # Control tokens (and a SentencePiece file's unknown token) are special: dropped by
    # skip_special_tokens; user-defined ones are matched whole but kept in decoded text, as in llama.cpp
    # and transformers.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(np.isin(types, special_types)).tolist()
        if tokens[i]
    ]
    added = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.flatnonzero(types == _TOKEN_TYPE_USER_DEFINED).tolist()
        if tokens[i]
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(added)

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    template = meta.get("tokenizer.chat_template")
    tokenizer = Tokenizer(
        backend,
        bos_token=token_at("tokenizer.ggml.bos_token_id", bos_default),
        eos_token=token_at("tokenizer.ggml.eos_token_id", eos_default),
        eos_token_ids=eos_ids,
        add_bos=add_bos_default if add_bos is None else bool(add_bos),
        chat_template=template if isinstance(template, str) else None,
        vocab_size=len(tokens),
    )
    logger.debug("GGUF tokenizer (%s, %s): %d tokens, %s, %d special and %d added tokens, end ids %s; "
                 "built in %.3f s (metadata read in %.3f s)", model, _MODELS[model], len(tokens), detail,
                 len(special), len(added), sorted(tokenizer.eos_token_ids), time.perf_counter() - started, read_s)
    return tokenizer


def _byte_level_backend(meta: dict[str, GGUFValue], vocab: dict[str, int], source: str
                        ) -> tuple[BackendTokenizer, str, bool]:
    """(backend, what the log says of it, add_bos default) for a "gpt2" file."""
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []  # type: ignore[assignment]
    if not merges_raw:
        raise ValueError(f"{source}: GGUF has no tokenizer.ggml.merges")
    merges = _merges(merges_raw)
    if "tokenizer.ggml.pre" not in meta:
        logger.warning("%s: no tokenizer.ggml.pre; using llama.cpp's 'default' split", source)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE:
        raise ValueError(
            f"{source}: GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_GGUF_PRE))}"
        )
    kind, ignore_merges, add_bos_default = _GGUF_PRE[pre]  # type: ignore[index]
    try:
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    except Exception as exc:  # tokenizers raises a bare Exception for a merge it cannot place
        raise ValueError(f"{source}: GGUF tokenizer.ggml.merges do not fit its tokens ({exc})") from None
    backend.pre_tokenizer = _make_pre_tokenizer(kind)
    backend.decoder = decoders.ByteLevel()
    return backend, f"{len(merges)} merges, pre-tokenizer {pre!r} ({kind})", add_bos_default


def _vocab(tokens: list[str], source: str) -> dict[str, int]:
    """token -> id. Empty entries get llama.cpp's `[EMPTY_<id>]` name so ids stay dense; a repeated
    token keeps its first id."""
    vocab = dict(zip(tokens, range(len(tokens))))  # the common case, in C: no repeats, no empties
    if len(vocab) == len(tokens) and "" not in vocab:
        return vocab
    vocab = {}
    for i, token in enumerate(tokens):
        if not token:
            token = f"[EMPTY_{i}]"
        if token in vocab:
            logger.warning(
                "%s: token %r repeats at ids %d and %d; keeping the first", source, token, vocab[token], i
            )
            continue
        vocab[token] = i
    return vocab


def _merges(merges_raw: list[str]) -> list[tuple[str, str]]:
    """"left right" -> (left, right), cut at the first space after the first character (a merge's
    left half may itself start with a space)."""
    halves = " ".join(merges_raw).split(" ")
    if len(halves) == 2 * len(merges_raw) and "" not in halves:
        # Every merge holds exactly one space with text on both sides (byte-level vocabularies spell
        # a space as "Ġ"): the one cut, done in C.
        return list(zip(halves[0::2], halves[1::2]))
    return [(m[:cut], m[cut + 1 :]) for m in merges_raw for cut in (m.find(" ", 1),)]
