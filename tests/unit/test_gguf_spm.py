"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model == "llama"`): a tiny BPE model trained here
with the `sentencepiece` package, written into a GGUF with gguf's writer, must tokenize as
`sentencepiece` itself does (and so as llama.cpp, which follows it) and decode back to the text."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conveyor.text.gguf_spm import cached_spm_merges, spm_merges
from conveyor.text.gguf_vocab import tokenizer_from_gguf
from conveyor.text.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")

USER_DEFINED = "<tool>"
CORPUS = [
    "the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs!",
    "def main():\n    return [x ** 2 for x in range(10)]\n\n\tif x:\n\t\tpass\n",
    "numbers 0123456789 and 3.14159 and 1,000,000 and 2024-11-26",
    "naïve café résumé über straße 日本語のテキスト 中文 한국어 Ελληνικά русский",
    "مرحبا بالعالم العربية",
    "emoji 😀 👍 🎉 and more text here, hello world, hello there.",
    "   indented    spaces\t\ttabs  and   runs      of spaces\r\nwindows line\r\n",
] * 30
HARD = [
    "",
    "Hello world",
    " leading",
    "trailing ",
    "  both  ",
    "".join("a" + " " * n for n in range(1, 9)) + "b",   # runs of 1 to 8 spaces
    "0 12 345 6789 3.14159 1234567890123 -42 1e10 ٣٤٥",
    "naïve café ñ Ünïcödé 日本語 中文 한국어 عربية مرحبا Ελληνικά",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "emoji 😀 👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️",
    "def f(x):\n\tif x:\n\t\treturn x  # comment\n    else:\n        pass\n",
    "line one\nline two\r\nline three\r\n\r\n\n\n",
    "never seen in training: ŧŵ ʘ ∮ ⅞ ꙮ 𝔘𝔫𝔦 \x00 \x7f \u2028 ~`@#%^&*=+{}[]|\\<>",   # byte fallback
    " ".join(CORPUS[:7]),
]
WITH_SPECIALS = ["a<tool>b <tool> c<tool>", "<s>x</s> y<unk>z", "<tool>", "</s>"]


def _train(add_dummy_prefix: bool, split_by_whitespace: bool) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    # Identity normalization and kept whitespace, as Llama 2's and Gemma's models: llama.cpp applies no
    # normalization at all, so only such a model can match it.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=700,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, split_digits=True,
        split_by_whitespace=split_by_whitespace, allow_whitespace_only_pieces=True,
        user_defined_symbols=[USER_DEFINED], minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """The GGUF token type (llama.cpp's numbering, which is SentencePiece's own)."""
    if sp.is_control(i):
        return 3
    if sp.is_unknown(i):
        return 2
    if sp.is_unused(i):
        return 5
    if sp.is_byte(i):
        return 6
    return 4 if sp.id_to_piece(i) == USER_DEFINED else 1


def _write_gguf(path: Path, sp: spm.SentencePieceProcessor, add_space_prefix: bool | None) -> Path:
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    w.add_token_types([_token_type(sp, i) for i in range(len(pieces))])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """sentencepiece's ids, with control, unknown and user-defined tokens taken whole first and each
    stretch of text between them encoded on its own, as llama.cpp does (with a dummy prefix, each
    stretch after such a token gets its own U+2581; sentencepiece alone would add none after `<tool>`)."""
    specials = ["<s>", "</s>", "<unk>", USER_DEFINED]
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


# (add_dummy_prefix, split_by_whitespace): Llama 2 / Mistral prefix a space; Gemma does not, and its
# pieces cross word boundaries.
CONFIGS = [(True, True), (False, True), (False, False), (True, False)]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"prefix={c[0]},split={c[1]}")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Tokenizer, spm.SentencePieceProcessor, bool]:
    add_dummy_prefix, split_by_whitespace = request.param
    sp = _train(add_dummy_prefix, split_by_whitespace)
    path = _write_gguf(tmp_path_factory.mktemp("spm") / "t.gguf", sp, add_dummy_prefix)
    return tokenizer_from_gguf(path), sp, add_dummy_prefix


@pytest.mark.parametrize("text", HARD)
def test_ids_equal_sentencepiece_and_decode_round_trips(
    pair: tuple[Tokenizer, spm.SentencePieceProcessor, bool], text: str
) -> None:
    tok, sp, _ = pair
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text), [tok.backend.id_to_token(i) for i in ids]
    assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode(text) == [sp.bos_id(), *ids]   # BOS by default, as llama.cpp for SentencePiece


@pytest.mark.parametrize("text", WITH_SPECIALS)
def test_special_and_user_defined_tokens_are_taken_whole(
    pair: tuple[Tokenizer, spm.SentencePieceProcessor, bool], text: str
) -> None:
    tok, sp, add_dummy_prefix = pair
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == _reference(sp, text)
    decoded = tok.decode(ids, skip_special_tokens=False)
    if add_dummy_prefix:   # each stretch after a special token carries its own prefix space
        assert decoded.replace(" ", "") == text.replace(" ", "")
    else:
        assert decoded == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_equals_sentencepiece(pair: tuple[Tokenizer, spm.SentencePieceProcessor, bool], text: str) -> None:
    tok, sp, _ = pair
    assume(not any(s in text for s in ("<s>", "</s>", "<unk>", USER_DEFINED, "\u2581")))
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == text


def test_merges_are_unique_and_include_the_trained_ones(pair: tuple[Tokenizer, spm.SentencePieceProcessor, bool]) -> None:
    _, sp, _ = pair
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = np.array([sp.get_score(i) for i in range(len(tokens))], dtype=np.float32)
    merges = spm_merges(tokens, vocab, scores)
    assert ("▁t", "he") in merges and len(set(merges)) == len(merges)


def test_merges_rank_by_the_merged_tokens_score() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "ab"]   # "ab" twice: only its first id splits
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "ca": 6}
    scores = np.array([0, 0, 0, -3, -1, -2, -5, 0], dtype=np.float32)
    assert spm_merges(tokens, vocab, scores) == [("b", "c"), ("a", "bc"), ("ab", "c"), ("a", "b"), ("c", "a")]


def test_merges_cache_is_per_vocabulary_and_survives_a_bad_file(pair: tuple[Tokenizer, spm.SentencePieceProcessor, bool],
                                                                  tmp_path: Path) -> None:
    _, sp, _ = pair
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = np.array([sp.get_score(i) for i in range(len(tokens))], dtype=np.float32)
    want = spm_merges(tokens, vocab, scores)
    assert cached_spm_merges(tokens, vocab, scores, tmp_path) == want   # derived and written
    (written,) = tmp_path.iterdir()
    assert written.stat().st_size > 8 * len(want)
    assert cached_spm_merges(tokens, vocab, scores, tmp_path) == want   # read back
    changed = scores.copy()
    changed[vocab["▁t"]], changed[vocab["he"]] = changed[vocab["he"]], changed[vocab["▁t"]]
    assert cached_spm_merges(tokens, vocab, changed, tmp_path) == spm_merges(tokens, vocab, changed)
    assert len(list(tmp_path.iterdir())) == 2   # another vocabulary, another entry
    written.write_bytes(b"not a numpy file")
    assert cached_spm_merges(tokens, vocab, scores, tmp_path) == want   # derived again, and rewritten
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder would go")
    assert cached_spm_merges(tokens, vocab, scores, blocked) == want   # cannot write: derived, logged


def test_gemma_style_file(tmp_path: Path) -> None:
    """No space prefix, whitespace runs as user-defined tokens spelled with real spaces (taken whole,
    the longest first, as llama.cpp does), <end_of_turn> ending generation without an eot id."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "  ", "   ",
              *[f"<0x{b:02X}>" for b in range(256)],
              "▁", "h", "i", "u", "s", "e", "r", "hi", "▁hi", "us", "er", "user"]
    types = [3, 3, 3, 3, 3, 3, 4, 4, 4, *[6] * 256, *[1] * 12]
    scores = [0.0] * 265 + [-float(i) for i in range(12)]
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch="gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = tokenizer_from_gguf(tmp_path / "g.gguf")
    assert tok.eos_token_ids == frozenset({1, 5}) and tok.bos_token_id == 2 and tok.add_bos
    vocab = {p: i for i, p in enumerate(pieces)}
    text = "<start_of_turn>user\nhi     hi<end_of_turn>\n"
    ids = tok.encode(text)
    assert [pieces[i] for i in ids] == ["<bos>", "<start_of_turn>", "user", "\n", "hi", "   ", "  ", "hi",
                                        "<end_of_turn>", "\n"]
    assert tok.decode(ids) == "user\nhi     hi\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tok.encode(" hi", add_special_tokens=False) == [vocab["▁hi"]]
    # "é" is no token: its two UTF-8 bytes, each its own byte token, whose bytes token_bytes gives back.
    ids = tok.encode("hé", add_special_tokens=False)
    assert ids == [vocab["h"], vocab["<0xC3>"], vocab["<0xA9>"]]
    assert b"".join(tok.token_bytes(i) for i in ids) == "hé".encode()


def test_space_prefix_is_on_when_the_file_does_not_say(tmp_path: Path) -> None:
    sp = _train(True, True)
    tok = tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf", sp, None))
    assert tok.encode("hello world", add_special_tokens=False) == sp.encode("hello world")


def test_file_without_scores_is_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="no tokenizer.ggml.scores"):
        tokenizer_from_gguf(tmp_path / "t.gguf")
