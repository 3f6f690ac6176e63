"""/v1/completions: prompts -> engine requests, and their outputs -> OpenAI completions and stream chunks.

With `echo` the prompt comes back before the completion; with echo and `logprobs` its tokens are
scored too (the engine's prompt logprobs), the first one null, as OpenAI and vLLM write it. This is
how evaluation harnesses (lm-evaluation-harness's local-completions) score a text's loglikelihood:
`echo: true, logprobs: 1, max_tokens: 1`, or `max_tokens: 0` for the prompt alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from conveyor.front.admission import truncate_prompt
from conveyor.front.async_engine import AsyncEngine
from conveyor.text.tokenizer import Tokenizer
from conveyor.errors import ConveyorError
from conveyor.logprobs import PromptLogprob, TokenLogprobs
from conveyor.sampling_params import SamplingParams
from conveyor.server.prompt_cache import cache_keys
from conveyor.server.prompt_cache.cache_keys import CacheKey
from conveyor.server.openai_api.logprob_format import LogprobFormatter
from conveyor.server.http.off_loop import THREAD_TOKENIZE_CHARS, encode_all, respond_off_loop
from conveyor.server.http.request_limits import check_choice_count, check_logprobs_budget, tenant_of
from conveyor.server.openai_api.request_schemas import CompletionRequest
from conveyor.server.openai_api.responses import CompletionChoice, CompletionChunk, CompletionResponse, UsageInfo
from conveyor.server.openai_api.prompt_group import PromptGroup
from conveyor.server.openai_api.streaming import (
    DONE_EVENT,
    ClientDisconnected,
    EventStreamResponse,
    TextChunks,
    error_event,
    sse,
)


class Serving(Protocol):
    """What this module uses of OpenAIServing (openai_serving.py), which hands /v1/completions here."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    logprobs: LogprobFormatter

    def check_model(self, model: str | None) -> None: ...
    def check_prompt_chars(self, num_chars: int, param: str) -> None: ...
    async def compile_grammar(self, params: SamplingParams, param: str, request: Request) -> bool: ...
    def _start(self, prefix: str, prompts: list[list[int]], params: SamplingParams, priority: int,
               tenant: str, request: Request, cache: CacheKey | None = None) -> PromptGroup: ...
    async def _collect(self, request: Request, group: PromptGroup) -> list[Choice]: ...
    @staticmethod
    def _usage(prompts: list[list[int]], num_completion_tokens: int) -> UsageInfo: ...
    @staticmethod
    def _disconnected(group: PromptGroup) -> Response: ...

CLIENT_CLOSED_REQUEST = 499          # nginx's status for a client that left; nobody reads it


@dataclass(slots=True)
class Choice:
    """One choice's output so far."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_chars: int = 0               # text emitted so far; completions' logprob text offsets start here
    prompt_logprobs: list[PromptLogprob | None] | None = None   # the prompt's scores, when asked for
    thinking: list[str] = field(default_factory=list)   # chat with a reasoning parser: the text is the answer only


async def serve_completions(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    serving.check_model(body.model)
    tenant = tenant_of(request, body.user)
    params = body.sampling_params()
    if not await serving.compile_grammar(params, body.constraint_field, request):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    texts = body.prompts()
    check_choice_count(len(texts), params.n)
    num_chars = sum(len(p) for p in texts if isinstance(p, str))
    serving.check_prompt_chars(num_chars, "prompt")
    add_special = body.add_special_tokens is not False
    # Many short prompts add up: past the threshold in all, they are tokenized on one worker thread.
    prompts = (await asyncio.to_thread(encode_all, serving.tokenizer, texts, add_special)
               if num_chars > THREAD_TOKENIZE_CHARS else encode_all(serving.tokenizer, texts, add_special))
    max_model_len = serving.engine.info.max_model_len
    if params.truncate_prompt_tokens is not None:
        prompts = [truncate_prompt(p, params, max_model_len) for p in prompts]
        texts = prompts   # the echoed prompt is what ran
    check_logprobs_budget(params, prompts, max_model_len, "logprobs")
    cache = await cache_keys.prepare(body, serving.engine, prompts)
    group = serving._start("cmpl", prompts, params, body.priority, tenant, request, cache)
    echoed = [_echo_text(serving, t) for t in texts] if body.echo else None
    created = int(time.time())
    if body.stream:
        return EventStreamResponse(_completion_events(serving, group, prompts, echoed, created, body), group)
    try:
        choices = await serving._collect(request, group)
    except ClientDisconnected:
        return serving._disconnected(group)
    n = params.n
    return await respond_off_loop(lambda: CompletionResponse(
        id=group.group_id, created=created, model=serving.model_name,
        choices=[_choice(serving, body, i, c, prompts[i // n], None if echoed is None else echoed[i // n],
                         choices[i - i % n].prompt_logprobs) for i, c in enumerate(choices)],
        usage=serving._usage(prompts, 0 if body.drops_output else sum(c.num_tokens for c in choices)),
    ))


def _echo_text(serving: Serving, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else serving.tokenizer.decode(prompt, skip_special_tokens=False)


def _choice(serving: Serving, body: CompletionRequest, index: int, choice: Choice, prompt: list[int],
            echoed: str | None, scores: list[PromptLogprob | None] | None) -> CompletionChoice:
    """One choice; siblings of a prompt's first choice show its scores (only the first computes them)."""
    text, entries = ("", []) if body.drops_output else ("".join(choice.text), choice.logprobs)
    as_ids = body.return_tokens_as_token_ids
    logprobs = None
    if body.logprobs is not None:
        logprobs = serving.logprobs.completion_logprobs(entries, 0, as_ids, scores if echoed is not None else None,
                                                        prompt, body.logprobs)
    prompt_logprobs = None
    if body.prompt_logprobs is not None and scores is not None:
        prompt_logprobs = serving.logprobs.prompt_logprobs(prompt, scores, as_ids, body.prompt_logprobs)
    return CompletionChoice(index=index, text=(echoed or "") + text, logprobs=logprobs,
                            finish_reason=choice.finish_reason, prompt_logprobs=prompt_logprobs)


async def _completion_events(serving: Serving, group: PromptGroup, prompts: list[list[int]],
                             echoed: list[str] | None, created: int, body: CompletionRequest) -> AsyncIterator[str]:
    choices = [Choice() for _ in range(group.num_prompts)]
    want_logprobs = body.logprobs is not None
    as_ids = body.return_tokens_as_token_ids
    n = max(1, group.num_prompts // len(prompts))
    plain = TextChunks(CompletionChunk(id=group.group_id, created=created, model=serving.model_name, choices=[
        CompletionChoice(index=0, text="", logprobs=None, finish_reason=None)]).model_dump_json(),
        '"index":0,"text":""', '"index":{},"text":{}')
    drops_output = body.drops_output
    try:
        async for index, output in group.outputs():
            choice = choices[index]
            first = choice.num_tokens == 0
            choice.num_tokens += len(output.new_token_ids)
            if output.prompt_logprobs is not None:
                choice.prompt_logprobs = output.prompt_logprobs
            text, entries = ("", []) if drops_output else (output.new_text, output.new_logprobs)
            prefix, scores = "", None
            if echoed is not None and first:   # the prompt goes out with the choice's first chunk
                prefix = echoed[index // n]
                scores = choices[index - index % n].prompt_logprobs
            if not (prefix or text or output.finished or (want_logprobs and entries)):
                continue  # text held back (a possible stop string, a split character)
            if not (prefix or want_logprobs or output.finished) and (event := plain.render(index, text)) is not None:
                choice.num_chars += len(text)
                yield event
                continue
            logprobs = (serving.logprobs.completion_logprobs(entries, choice.num_chars, as_ids, scores,
                                                             prompts[index // n], body.logprobs or 0)
                        if want_logprobs else None)
            choice.num_chars += len(prefix) + len(text)
            chunk = CompletionChunk(
                id=group.group_id, created=created, model=serving.model_name,
                choices=[CompletionChoice(index=index, text=prefix + text, logprobs=logprobs,
                                          finish_reason=output.finish_reason if output.finished else None)])
            yield sse(chunk.model_dump_json())
    except ConveyorError as exc:
        yield error_event(exc)
        yield DONE_EVENT
        return
    if body.include_usage:
        num_tokens = 0 if body.drops_output else sum(c.num_tokens for c in choices)
        yield sse(CompletionChunk(id=group.group_id, created=created, model=serving.model_name, choices=[],
                                  usage=serving._usage(prompts, num_tokens)).model_dump_json())
    yield DONE_EVENT
