"""Work of one request that is too big for the event loop: tokenizing a long text, rendering a chat
template, building a large response. Each runs on a worker thread, so other streams and /health go
on meanwhile (a Python thread holds the GIL for at most its switch interval at a time).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

from pydantic import BaseModel
from starlette.responses import Response

from conveyor.text.chat_template import RENDER_TIMEOUT_S, ChatTemplateLimit
from conveyor.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

THREAD_TOKENIZE_CHARS = 64 * 1024   # longer texts are tokenized off the event loop
_TRIM_AFTER_CHARS = 1024 * 1024     # after tokenizing this much, hand freed heap back to the OS
_RENDER_GRACE_S = 5.0               # past the template's own budget, before its client is answered anyway


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim   # glibc; elsewhere freed memory is left to the allocator
    except (OSError, AttributeError):
        return None


_trim_heap = _malloc_trim()


def encode_large(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenize on a worker thread. A big text leaves hundreds of MB of freed tokenizer buffers in
    glibc's arenas (8 MB of text: about 600 MB of RSS), which stay in the process unless trimmed."""
    token_ids = tokenizer.encode(text, add_special_tokens)
    if len(text) > _TRIM_AFTER_CHARS and _trim_heap is not None:
        _trim_heap(0)
    return token_ids


def encode_all(tokenizer: Tokenizer, prompts: list[str] | list[list[int]],
               add_special_tokens: bool = True) -> list[list[int]]:
    """A completion's prompts as token ids (texts tokenized, by default with special tokens; id lists copied)."""
    return [encode_large(tokenizer, p, add_special_tokens) if isinstance(p, str) else list(p) for p in prompts]


async def render_off_loop(render: Callable[[], str]) -> str:
    """A chat template render, always on a worker thread: the template came with the model. Its
    budget stops the render itself (chat_template.py); the timeout answers the client even if not."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(render), RENDER_TIMEOUT_S + _RENDER_GRACE_S)
    except TimeoutError:
        logger.error("a chat template render ran past its budget and is left running on its thread")
        raise ChatTemplateLimit(f"the chat template did not finish rendering these messages within "
                                f"{RENDER_TIMEOUT_S:g} s") from None


async def respond_off_loop(build: Callable[[], BaseModel]) -> Response:
    """Build and serialize a whole response on a worker thread: with logprobs of many choices it
    is megabytes of JSON."""
    def render() -> Response:
        return Response(build().model_dump_json(), media_type="application/json")

    return await asyncio.to_thread(render)
