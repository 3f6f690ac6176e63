"""OpenAI requests -> engine requests, and engine deltas -> OpenAI responses and stream chunks.

Everything that can be refused is refused before any engine request starts (model name, fields,
context length, queue capacity), so those errors get their own status even when streaming. After
that, an error reaches a streaming client as an error event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from conveyor.config import GrammarLimits
from conveyor.front.admission import truncate_prompt
from conveyor.front.async_engine import AsyncEngine
from conveyor.errors import ConveyorError, InvalidRequest, ModelNotFound, PromptTooLong
from conveyor.sampling_params import SamplingParams
from conveyor.server.prompt_cache import cache_keys
from conveyor.server.batch.api import is_batch_request
from conveyor.server.prompt_cache.cache_keys import CacheKey
from conveyor.server.openai_api.chat_schemas import ChatMessage, ToolDefinition
from conveyor.server.openai_api.completion_serving import CLIENT_CLOSED_REQUEST, Choice, serve_completions
from conveyor.server.grammar_gate import GrammarGate
from conveyor.server.openai_api.logprob_format import LogprobFormatter
from conveyor.server.http.off_loop import (
    THREAD_TOKENIZE_CHARS,
    encode_large,
    render_off_loop,
    respond_off_loop,
)
from conveyor.server.http.request_limits import check_logprobs_budget, tenant_of
from conveyor.server.openai_api.request_schemas import ChatCompletionRequest, CompletionRequest
from conveyor.server.openai_api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionTokensDetails,
    UsageInfo,
)
from conveyor.server.parsing.chat_tools import template_input
from conveyor.server.parsing.tool_calls import ToolCall, parse_tool_calls
from conveyor.server.parsing.tool_syntaxes import resolve_tool_call_parser, syntaxes
from conveyor.server.openai_api.chat_output import (ChatOutputSplitter, ChatRun, Thinking, effort_settings,
                                                    finish_reason, tool_call_deltas, tool_calls_out)
from conveyor.server.openai_api.prompt_group import PromptGroup
from conveyor.server.openai_api.streaming import (
    DONE_EVENT,
    ClientDisconnected,
    EventStreamResponse,
    TextChunks,
    error_event,
    sse,
    until_disconnected,
)

logger = logging.getLogger(__name__)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, max_prompt_chars: int | None = None,
                 grammar_limits: GrammarLimits = GrammarLimits(), reasoning_parser: str | None = None,
                 tool_call_parser: str = "auto") -> None:
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        parser = resolve_tool_call_parser(tool_call_parser, engine.tokenizer.chat_template)
        logger.info("tool calls under tool_choice auto are read as %s (--tool-call-parser %s)", parser,
                    tool_call_parser)
        self.tool_forms = syntaxes(parser)
        self.grammar_gate = GrammarGate(engine.grammars, grammar_limits)
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_prompt_chars = max_prompt_chars or engine.info.max_model_len * self.tokenizer.max_token_chars
        self.logprobs = LogprobFormatter(self.tokenizer)

    # ------------------------------------------------------------ shared

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                param="model")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse a prompt text over the limit before any time goes into tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise PromptTooLong(f"the prompt has {num_chars} characters; this server tokenizes at most "
                                f"{self.max_prompt_chars} (--max-prompt-chars)", param=param)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Large texts are tokenized on a worker thread, so streams and /health go on meanwhile.
        if len(text) > THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(encode_large, self.tokenizer, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def render_messages(self, chat_messages: list[ChatMessage], add_generation_prompt: bool,
                              tools: list[ToolDefinition] | None = None, tool_choice: str = "none",
                              template_kwargs: dict[str, Any] | None = None) -> str:
        """The messages (and tools) through the model's chat template, size-checked before and after."""
        messages, template_tools = template_input(chat_messages, tools, tool_choice,
                                                  self.tokenizer.template_takes_tools)
        num_chars = sum(len(m["content"] or "") for m in messages)
        self.check_prompt_chars(num_chars, "messages")
        render = functools.partial(self.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=add_generation_prompt, tools=template_tools,
                                   template_kwargs=template_kwargs)
        text = await render_off_loop(render)
        self.check_prompt_chars(len(text), "messages")
        return text

    async def compile_grammar(self, params: SamplingParams, param: str, request: Request) -> bool:
        """Compile the request's grammar off the event loop, bounded (grammar_gate.py); 400 naming why it
        does not compile. False when the client left meanwhile."""
        if params.structured_outputs is None:
            return True
        try:
            await until_disconnected(request, self.grammar_gate.admit(params.structured_outputs, param))
        except ClientDisconnected:
            logger.info("the client left while its grammar compiled")
            return False
        return True

    def _start(self, prefix: str, prompts: list[list[int]], params: SamplingParams, priority: int,
               tenant: str, request: Request, cache: CacheKey | None = None) -> PromptGroup:
        """Refuse now whatever can be refused, then start every prompt in the running batch."""
        bound = self.grammar_gate.limits.json_string_max_tokens   # None: the engine's default
        if params.structured_outputs is not None and bound is not None:
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, max_string_tokens=bound))
        group = PromptGroup(self.engine, f"{prefix}-{uuid.uuid4().hex}", prompts, params, priority, tenant,
                            is_batch_request(request.scope))
        if cache is not None and cache.save:
            cache_keys.save_when_done(cache, group, prompts[0])
        return group

    async def _collect(self, request: Request, group: PromptGroup,
                       splitters: list[ChatOutputSplitter] | None = None) -> list[Choice]:
        async def collect() -> list[Choice]:
            choices = [Choice() for _ in range(group.num_prompts)]
            async for index, output in group.outputs():
                choice = choices[index]
                text = output.new_text
                if splitters is not None:
                    thinking, text = splitters[index].split_thinking(text, len(output.new_token_ids), output.finished,
                                                                     output.steps)
                    choice.thinking.append(thinking)
                choice.text.append(text)
                choice.num_tokens += len(output.new_token_ids)
                choice.logprobs.extend(output.new_logprobs)
                if output.prompt_logprobs is not None:
                    choice.prompt_logprobs = output.prompt_logprobs
                if output.finished:
                    choice.finish_reason = output.finish_reason
            return choices

        try:
            return await until_disconnected(request, collect())
        finally:
            group.close()

    @staticmethod
    def _usage(prompts: list[list[int]], num_completion_tokens: int,
               num_reasoning_tokens: int | None = None) -> UsageInfo:
        num_prompt_tokens = sum(len(p) for p in prompts)
        details = (None if num_reasoning_tokens is None
                   else CompletionTokensDetails(reasoning_tokens=num_reasoning_tokens))
        return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                         total_tokens=num_prompt_tokens + num_completion_tokens, completion_tokens_details=details)

    @staticmethod
    def _disconnected(group: PromptGroup) -> Response:
        logger.info("the client of %s disconnected", group.group_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    # ------------------------------------------------------------ /v1/completions

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await serve_completions(self, body, request)

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        run = await self.start_chat(body, request, "chatcmpl")
        if run is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        group, prompts, splitters = run.group, run.prompts, run.splitters
        created = int(time.time())
        if body.stream:
            return EventStreamResponse(self._chat_events(group, prompts, created, body, run), group)
        try:
            choices = await self._collect(request, group, splitters)
        except ClientDisconnected:
            return self._disconnected(group)
        return await respond_off_loop(lambda: ChatCompletionResponse(
            id=group.group_id, created=created, model=self.model_name,
            choices=[self._chat_choice(i, c, body, s) for i, (c, s) in enumerate(zip(choices, splitters))],
            usage=self._usage(prompts, sum(c.num_tokens for c in choices), run.num_reasoning_tokens),
            prompt_logprobs=None if body.prompt_logprobs is None or choices[0].prompt_logprobs is None else
            self.logprobs.prompt_logprobs(prompts[0], choices[0].prompt_logprobs, body.return_tokens_as_token_ids,
                                          body.prompt_logprobs),
        ))

    async def start_chat(self, body: ChatCompletionRequest, request: Request, prefix: str) -> ChatRun | None:
        """A chat request's engine requests, started (or refused); None when the client left while its
        grammar compiled. The Responses API runs through here too."""
        self.check_model(body.model)
        tenant = tenant_of(request, body.user)
        params = body.sampling_params()
        if body.tools:
            await self.grammar_gate.check_tools(body.tools)
        template_kwargs, budget = effort_settings(body.reasoning_effort, self.reasoning_parser,
                                                  body.chat_template_kwargs, body.thinking_token_budget)
        text = await self.render_messages(body.messages, body.add_generation_prompt, body.tools,
                                          body.effective_tool_choice, template_kwargs)
        thinking = Thinking.of(self.reasoning_parser, text, self.tokenizer, budget)
        params = thinking.constrain(params)
        if not await self.compile_grammar(params, body.constraint_field, request):
            return None
        # The template has the BOS; vLLM's add_special_tokens asks for the tokenizer's too.
        prompts = [truncate_prompt(await self.encode(text, add_special_tokens=bool(body.add_special_tokens)),
                                   params, self.engine.info.max_model_len)]
        check_logprobs_budget(params, prompts, self.engine.info.max_model_len, "top_logprobs")
        cache = await cache_keys.prepare(body, self.engine, prompts)
        try:
            group = self._start(prefix, prompts, params, body.priority, tenant, request, cache)
        except InvalidRequest as exc:
            if exc.param == "prompt":   # a chat client sent messages; the prompt is their rendering
                exc.param = "messages"
            elif exc.param == "max_tokens" and body.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise
        return ChatRun(group, prompts, thinking,
                       [thinking.splitter(body, self.tool_forms) for _ in range(group.num_prompts)])

    def _chat_choice(self, index: int, choice: Choice, body: ChatCompletionRequest,
                     splitter: ChatOutputSplitter) -> ChatChoice:
        content: str | None = "".join(choice.text)
        reasoning = "".join(choice.thinking) if splitter.reasoning is not None and splitter.reasoning.thought else None
        calls: list[ToolCall] = []
        if body.effective_tool_choice != "none":
            parsed, calls = parse_tool_calls(content or "", self.tool_forms, body.tool_names)
            if calls:   # a reply without calls keeps its text as generated
                content = parsed
            if body.forces_tool_calls:   # any text besides the calls is a call cut short by max_tokens
                content = None
        if reasoning is not None and not content:
            content = None
        message = AssistantMessage(content=content, reasoning_content=reasoning,
                                   tool_calls=tool_calls_out(calls) or None)
        return ChatChoice(index=index, message=message,
                          finish_reason=finish_reason(choice.finish_reason, bool(calls)),
                          logprobs=self.logprobs.chat_logprobs(choice.logprobs, body.return_tokens_as_token_ids)
                          if body.logprobs else None)

    async def _chat_events(self, group: PromptGroup, prompts: list[list[int]], created: int,
                           body: ChatCompletionRequest, run: ChatRun) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=group.group_id, created=created, model=self.model_name,
                                           choices=choices, usage=usage).model_dump_json())

        # OpenAI's first chunk names the role, before any content exists.
        yield chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                     for i in range(group.num_prompts)])
        plain = TextChunks(ChatCompletionChunk(id=group.group_id, created=created, model=self.model_name, choices=[
            ChatStreamChoice(index=0, delta=ChatDelta(content=""))]).model_dump_json(),
            '"index":0,"delta":{"content":""}', '"index":{},"delta":{{"content":{}}}')
        num_tokens = 0
        try:
            async for index, output in group.outputs():
                num_tokens += len(output.new_token_ids)
                splitter = run.splitters[index]
                reasoning, text, calls = splitter.feed(output.new_text, len(output.new_token_ids), output.finished,
                                                       output.steps)
                if not (reasoning or text or calls or output.finished or (body.logprobs and output.new_logprobs)):
                    continue
                if text and not (reasoning or calls or output.finished or body.logprobs) and (
                        event := plain.render(index, text)) is not None:
                    yield event
                    continue
                first = splitter.num_calls - len(calls)
                finish = finish_reason(output.finish_reason, splitter.num_calls > 0) if output.finished else None
                yield chunk([ChatStreamChoice(
                    index=index, delta=ChatDelta(content=text if text or not (calls or reasoning) else None,
                                                 reasoning_content=reasoning or None,
                                                 tool_calls=tool_call_deltas(calls, first) or None),
                    logprobs=self.logprobs.chat_logprobs(output.new_logprobs, body.return_tokens_as_token_ids)
                    if body.logprobs else None,
                    finish_reason=finish)])
        except ConveyorError as exc:
            yield error_event(exc)
            yield DONE_EVENT
            return
        if body.include_usage:
            yield chunk([], self._usage(prompts, num_tokens, run.num_reasoning_tokens))
        yield DONE_EVENT

