"""The GGUF tokenizer's fast build (metadata read from the mapped bytes, merges cut in C) gives the
same ids as the plain construction: gguf's `GGUFReader` and a `models.BPE` from Python loops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from conveyor.text.gguf_vocab import _GGUF_PRE, _make_pre_tokenizer, _merges, tokenizer_from_gguf
from conveyor.text.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<tool>"
CORPUS = [
    "the quick brown fox jumps over the lazy dog 0123456789",
    "def main():\n    return [x ** 2 for x in range(10)]\n\n\n",
    "naïve café 日本語のテキスト 😀 emoji 👩‍👩‍👧 ∑ α β γ",
    "a    b\t\tc\r\n\r\n  -- // ## ==",
] * 10
TEXTS = [
    "",
    "hello world 1234567",
    "def f(x):\n    return x  # 42\n\n\n",
    "naïve 日本 😀👩‍👩‍👧 ∑",
    "     spaces   and\ttabs\n\n \n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a <tool> b<tool>c <|endoftext|>",
]


@pytest.fixture(scope="module")
def trained() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=CONTROL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend


def _write_gguf(path: Path, backend: BackendTokenizer, pre: str, extra_tokens: list[str]) -> Path:
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + [USER_DEFINED, *extra_tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(backend.to_str())["model"]["merges"]]
    types = [3 if t in CONTROL else 4 if t == USER_DEFINED else 1 for t in tokens]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(path: Path) -> BackendTokenizer:
    """The construction the fast build replaced, element by element through gguf's reader."""
    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    pre = reader.fields["tokenizer.ggml.pre"].contents()
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        token = token or f"[EMPTY_{i}]"
        vocab.setdefault(token, i)
    merges = []
    for merge in reader.fields["tokenizer.ggml.merges"].contents():
        cut = merge.find(" ", 1)
        merges.append((merge[:cut], merge[cut + 1 :]))
    kind, ignore_merges, _ = _GGUF_PRE[pre]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = _make_pre_tokenizer(kind)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == 3 and tokens[i]])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == 4 and tokens[i]])
    return backend


@pytest.mark.parametrize(
    "pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken", "deepseek-v3", "default"]
)
def test_fast_build_matches_reference(tmp_path: Path, trained: BackendTokenizer, pre: str) -> None:
    path = _write_gguf(tmp_path / "t.gguf", trained, pre, extra_tokens=[])
    fast, reference = tokenizer_from_gguf(path), _reference(path)
    assert fast.backend.get_vocab(with_added_tokens=True) == reference.get_vocab(with_added_tokens=True)
    for text in TEXTS:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert fast.decode(ids, skip_special_tokens=False) == text
    assert fast.eos_token_ids == frozenset({2}) and fast.bos_token_id == 1


def test_empty_and_repeated_tokens_keep_their_first_id(
    tmp_path: Path, trained: BackendTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write_gguf(tmp_path / "t.gguf", trained, "gpt-2", extra_tokens=["", "the", ""])
    fast, reference = tokenizer_from_gguf(path), _reference(path)
    assert "repeats" in caplog.text
    assert fast.backend.get_vocab(with_added_tokens=True) == reference.get_vocab(with_added_tokens=True)
    assert fast.vocab_size == trained.get_vocab_size() + 4


@pytest.fixture(scope="module")
def qwen2_pair(
    tmp_path_factory: pytest.TempPathFactory, trained: BackendTokenizer
) -> tuple[Tokenizer, BackendTokenizer]:
    path = _write_gguf(tmp_path_factory.mktemp("gguf") / "t.gguf", trained, "qwen2", extra_tokens=[])
    return tokenizer_from_gguf(path), _reference(path)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_fast_build_matches_reference_on_any_text(
    qwen2_pair: tuple[Tokenizer, BackendTokenizer], text: str
) -> None:
    fast, reference = qwen2_pair
    assert fast.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids


def test_merges_cut_at_the_first_space_after_the_first_character() -> None:
    assert _merges(["a b", "Ġt he"]) == [("a", "b"), ("Ġt", "he")]
    # A left half that is itself a space, or a half holding one, takes the per-merge cut.
    assert _merges(["  x", "a b c", "a b"]) == [(" ", "x"), ("a", "b c"), ("a", "b")]
