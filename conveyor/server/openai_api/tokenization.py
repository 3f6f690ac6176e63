"""/tokenize and /detokenize, in vLLM's request and response shapes (llama-server's field names too).

    POST /tokenize    {"prompt": "text"} or {"messages": [...]} (llama-server: {"content": "text"})
                      -> {"count": N, "max_model_len": M, "tokens": [...]}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "text", "content": "text"}

The text goes through the same limits and the same tokenizer as a completion's prompt, so the
tokens are the ones a completion with that prompt would run.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conveyor.errors import InvalidRequest
from conveyor.server.openai_api.chat_schemas import ChatMessage
from conveyor.server.openai_api.openai_serving import OpenAIServing
from conveyor.server.http.request_limits import bounded_messages

_THREAD_DECODE_TOKENS = 16384


# Strict like the completion requests: true is not a token id, "1" is not a string's worth of text.
_STRICT = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    content: str | None = None                 # llama-server's name for `prompt`
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None     # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, messages: Any) -> Any:
        return bounded_messages(messages)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, content or messages (got {', '.join(given) or 'none'})")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str                               # the same text, under llama-server's name


async def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(body.model)
    if body.messages is not None:
        text = await serving.render_messages(body.messages, body.add_generation_prompt)
        tokens = await serving.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        text = body.prompt if body.prompt is not None else body.content
        serving.check_prompt_chars(len(text), "prompt" if body.prompt is not None else "content")
        tokens = await serving.encode(text, add_special_tokens=body.add_special_tokens is not False)
    return TokenizeResponse(count=len(tokens), max_model_len=serving.engine.info.max_model_len, tokens=tokens)


async def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(body.model)
    vocab_size = serving.engine.info.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="tokens")
    decode = functools.partial(serving.tokenizer.decode, body.tokens, skip_special_tokens=False)
    # A long list is decoded on a worker thread, so streams and /health go on meanwhile.
    text = await asyncio.to_thread(decode) if len(body.tokens) > _THREAD_DECODE_TOKENS else decode()
    return DetokenizeResponse(prompt=text, content=text)
