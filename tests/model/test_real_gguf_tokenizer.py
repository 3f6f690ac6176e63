"""The real-file tier for the tokenizer: on a GGUF file you have (`pytest -m real_model --real-gguf FILE`),
our ids equal transformers' for the same file (transformers converts the GGUF vocabulary itself).

Where the two part, llama.cpp (the reference for GGUF files) decides. On Gemma 3 they part on runs of
spaces longer than the longest whitespace token: the file lists those tokens as user-defined, spelled
with real spaces, and llama.cpp takes them whole, the longest first (31 + 9 for 40 spaces), as we do;
transformers respells them as U+2581 runs and merges those (16 + 24).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conveyor.text.gguf_vocab import tokenizer_from_gguf
from conveyor.text.tokenizer import Tokenizer
from conveyor.model.gguf.metadata import read_gguf_metadata

pytestmark = pytest.mark.real_model

TEXTS = [
    "",
    "Hello world",
    " leading",
    "trailing ",
    "  both  ",
    "".join("a" + " " * n for n in range(1, 9)) + "b",
    "0 12 345 6789 3.14159 1234567890123 -42 1e10 ٣٤٥",
    "naïve café ñ Ünïcödé 日本語 中文 한국어 عربية مرحبا Ελληνικά",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "emoji 😀 👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️",
    "def f(x):\n\tif x:\n\t\treturn x  # comment\n    else:\n        pass\n",
    "line one\nline two\r\nline three\r\n\r\n\n\n",
    "rare: ŧŵ ʘ ∮ ⅞ ꙮ 𝔘𝔫𝔦 \x00 \x7f \u2028 ~`@#%^&*=+{}[]|\\<>",
    "https://example.com/path?q=1&r=2#frag and <b>bold</b> <table><tr><td>1</td></tr></table>",
    "ｆｕｌｌｗｉｄｔｈ " + "A" * 100 + " " + "1" * 50,
    "a\t\t\t\tb a \n b  \n  \n" + "\n" * 40,
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] hi [/INST]</s> <unk>",
]


@pytest.fixture
def pair(real_gguf: Path) -> tuple[Tokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    return tokenizer_from_gguf(real_gguf), theirs


def test_ids_equal_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, theirs = pair
    assert theirs.is_fast
    # transformers adds BOS from the same tokenizer.ggml.add_bos_token flag (Gemma 3: yes, Qwen: no).
    assert ours.add_bos == (theirs.encode("a")[:1] == [theirs.bos_token_id])
    mismatches = {}
    for text in TEXTS:
        ids = ours.encode(text)
        if ids != theirs.encode(text):
            mismatches[text] = (ids, theirs.encode(text))
        elif ours.decode(ids) != theirs.decode(ids, skip_special_tokens=True):
            mismatches[text] = (ours.decode(ids), theirs.decode(ids, skip_special_tokens=True))
    assert not mismatches


def test_whitespace_runs_follow_llama_cpp(real_gguf: Path) -> None:
    """User-defined whitespace tokens are taken whole, the longest first, as llama.cpp's
    tokenizer_st_partition does."""
    meta = read_gguf_metadata(real_gguf, ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    runs = {len(t): i for i, t in enumerate(tokens) if types[i] == 4 and t and set(t) == {" "}}  # type: ignore[index]
    if not runs:
        pytest.skip("the file has no user-defined whitespace tokens")
    longest = max(runs)
    ours = tokenizer_from_gguf(real_gguf)
    x, y = ours.encode("x", add_special_tokens=False), ours.encode("y", add_special_tokens=False)
    text = "x" + " " * (longest + 9) + "y"
    assert ours.encode(text, add_special_tokens=False) == [*x, runs[longest], runs[9], *y]
    assert ours.decode(ours.encode(text)) == text
