"""GGUF vocabulary -> `Tokenizer`: llama.cpp's tokenizer metadata rebuilt as a `tokenizers` BPE.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported; the pre-tokenizer split is
chosen from `tokenizer.ggml.pre` after llama.cpp's own table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from conveyor.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# Every id that ends generation: llama.cpp's end-of-generation set, from metadata only.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# Split patterns in `tokenizers` (Oniguruma) syntax; llama.cpp keeps these originals as comments
# next to its hand-expanded versions in llama-vocab.cpp.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (pre-tokenizer kind, ignore_merges, add_bos default), after llama.cpp's table.
_GGUF_PRE: dict[str, tuple[str, bool, bool]] = {
    **{name: ("gpt2", False, False) for name in (
        "default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es",
        "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "exaone4", "trillion",
        "granite-docling", "a.x-4.0", "mellum",
    )},
    **{name: ("digits", False, False) for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
    )},
    **{name: ("llama3", True, True) for name in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    )},
    **{name: ("llama3", False, False) for name in ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4")},
    **{name: ("qwen2", False, False) for name in (
        "qwen2", "qwen2.5", "qwen-2.5", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2",
    )},
}


def _make_pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == "digits":
        # Same as the GPT-2 split except every digit stands alone (llama.cpp's "\p{N}" pass first).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[kind]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf(path: str | Path | GGUFReader) -> Tokenizer:
    """Build a byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from a GGUF file's metadata.

    Accepts an open `GGUFReader` too: parsing the metadata takes seconds, so a loader can share one.
    """
    from gguf import GGUFReader  # gguf is only needed for GGUF checkpoints

    from conveyor.model.gguf_file import GGUFFile

    if isinstance(path, (GGUFReader, GGUFFile)):
        reader, source = path, str(getattr(path.data, "filename", "GGUF"))
    else:
        from conveyor.model.loader import gguf_reader

        reader, source = gguf_reader(Path(path)), str(path)

    def field(name: str, default: Any = None) -> Any:
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{source}: unsupported GGUF tokenizer model {model!r}; only 'gpt2' (byte-level BPE) is supported"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges_raw: list[str] | None = field("tokenizer.ggml.merges")
    if not tokens or not merges_raw:
        raise ValueError(f"{source}: GGUF has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not token:
            token = f"[EMPTY_{i}]"  # llama.cpp's name for empty entries, so ids stay dense
        if token in vocab:
            logger.warning(
                "%s: token %r repeats at ids %d and %d; keeping the first", source, token, vocab[token], i
            )
            continue
        vocab[token] = i
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        cut = merge.find(" ", 1)  # a merge's left half may itself start with a space
        merges.append((merge[:cut], merge[cut + 1 :]))

    pre = field("tokenizer.ggml.pre", "default")
    if pre in _GGUF_PRE:
        kind, ignore_merges, add_bos_default = _GGUF_PRE[pre]
    else:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using the GPT-2 byte-level split", source, pre)
        kind, ignore_merges, add_bos_default = "gpt2", False, False

    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = _make_pre_tokenizer(kind)
    backend.decoder = decoders.ByteLevel()
    # Control tokens are special (dropped by skip_special_tokens); user-defined ones are matched whole
    # but kept in decoded text, as in llama.cpp and transformers.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t == _TOKEN_TYPE_CONTROL and tokens[i]
    ]
    added = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types)
        if t == _TOKEN_TYPE_USER_DEFINED and tokens[i]
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(added)

    def token_at(key: str) -> str | None:
        token_id = field(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    eos_ids = [
        int(token_id)
        for key in _GGUF_EOS_KEYS
        if (token_id := field(key)) is not None and 0 <= token_id < len(tokens)
    ]
    add_bos = field("tokenizer.ggml.add_bos_token")
    return Tokenizer(
        backend,
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        eos_token_ids=eos_ids,
        add_bos=add_bos_default if add_bos is None else bool(add_bos),
        chat_template=field("tokenizer.chat_template"),
        vocab_size=len(tokens),
    )
