"""The byte-level GGUF pre-tokenizers split text as their regexes say: checked against Python's `regex`
module applying the same patterns one after the other (as llama.cpp's unicode_regex_split does), and
by hand on a few strings for the splits Qwen3, Phi-4-mini, DeepSeek-V3 and Mistral Nemo name."""

from __future__ import annotations

import pytest

from conveyor.text.gguf_vocab import _GGUF_PRE, _SPLITS, _make_pre_tokenizer

regex = pytest.importorskip("regex")

TEXTS = [
    "HelloWorld's 12345",
    "Hello 日本語 12345!!",
    "I'M don't CAN'T  x\n\n  y\r\n\tz",
    "camelCaseXMLHttp 3.14 ☺☺ a/b//c\n/",
    "naïve e\u0301te ÉCOLE Ωμέγα ǅungla",
    "   lead",
    "trail   ",
    "def f(x):\n    return x**2  # ok\n",
    "価格は1234円です。カタカナ ひらがな",
    "😀👩‍👩‍👧 🇫🇷!",
    "a,b;c.d!?e--f",
    "x$+<=>^~|y 1,234,567 ١٢٣٤",
]


def _pieces(kind: str, text: str) -> list[str]:
    return [text[start:end] for _, (start, end) in _make_pre_tokenizer(kind).pre_tokenize_str(text)]


def _regex_split(patterns: tuple[str, ...], text: str) -> list[str]:
    """Each pattern splits every piece so far into its matches and the text between them."""
    spans = [(0, len(text))] if text else []
    for pattern in patterns:
        compiled, out = regex.compile(pattern), []
        for start, end in spans:
            at = start
            for match in compiled.finditer(text, start, end):
                if match.start() > at:
                    out.append((at, match.start()))
                out.append(match.span())
                at = match.end()
            if at < end:
                out.append((at, end))
        spans = out
    return [text[start:end] for start, end in spans]


@pytest.mark.parametrize("kind", sorted(_SPLITS))
def test_splits_equal_the_regex_module(kind: str) -> None:
    for text in TEXTS:
        assert _pieces(kind, text) == _regex_split(_SPLITS[kind], text), text


@pytest.mark.parametrize(("pre", "text", "expected"), [
    # Qwen3: single digits, contractions stay with the word before.
    ("qwen2", "I'm 2024 ok", ["I", "'m", " ", "2", "0", "2", "4", " ok"]),
    # Phi-4-mini (o200k): upper-then-lower runs, contractions kept, digits in threes, "/" after punctuation.
    ("gpt-4o", "HelloWorld's 12345 ../x", ["Hello", "World's", " ", "123", "45", " ../", "x"]),
    # Mistral Nemo (Tekken): the same runs without contractions, single digits.
    ("tekken", "HelloWorld's 123", ["Hello", "World", "'s", " ", "1", "2", "3"]),
    # DeepSeek-V3: digits in threes and CJK runs split out first.
    ("deepseek-v3", "Hello 日本語 12345!!", ["Hello", " ", "日本語", " ", "123", "45", "!!"]),
])
def test_split_by_hand(pre: str, text: str, expected: list[str]) -> None:
    assert _pieces(_GGUF_PRE[pre][0], text) == expected


def test_table_names_only_kinds_that_exist() -> None:
    assert {kind for kind, _, _ in _GGUF_PRE.values()} <= {*_SPLITS, "gpt2", "digits"}
    assert _GGUF_PRE["tekken"] == ("tekken", True, True)   # llama.cpp: ignore_merges and BOS, as llama3
