"""Long texts are tokenized with the GIL released (so the server's event loop runs meanwhile) and
give the same ids as the short-text path."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import tiny_bpe_tokenizer

from conveyor.text.tokenizer import RELEASE_GIL_CHARS, Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog, héllo wörld 日本 <|endoftext|> "


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_bpe_tokenizer(TEXT, vocab_size=400)


def test_long_texts_give_the_same_ids(tokenizer: Tokenizer) -> None:
    text = TEXT * (RELEASE_GIL_CHARS // len(TEXT) + 3)
    assert len(text) > RELEASE_GIL_CHARS
    assert tokenizer.encode(text) == tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(TEXT) == tokenizer.backend.encode(TEXT, add_special_tokens=False).ids


def test_other_threads_run_while_a_long_text_is_tokenized(tokenizer: Tokenizer) -> None:
    text = TEXT * (1_000_000 // len(TEXT))
    done = threading.Event()
    ticks = 0

    def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            time.sleep(0.002)
            ticks += 1

    thread = threading.Thread(target=ticker)
    thread.start()
    started = time.monotonic()
    tokenizer.encode(text)
    elapsed = time.monotonic() - started
    done.set()
    thread.join()
    # Holding the GIL throughout, the ticker would get in about once; released, it ticks all along.
    assert ticks > 10, f"only {ticks} ticks in {elapsed:.2f} s of tokenizing"
