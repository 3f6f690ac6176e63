"""OpenAI's Responses API (/v1/responses) on the chat completions path: one front, one engine path.

A request becomes a chat completion request (responses_schemas.py) and runs through
`OpenAIServing.start_chat`, so it is validated, rendered, constrained and batched as a chat is; its
output (thinking, text, tool calls, split by the same ChatOutputSplitter) becomes output items:
`reasoning`, `message` with `output_text`, and `function_call` items. Streamed, it sends OpenAI's
events: response.created and .in_progress, then per item output_item.added, its deltas
(reasoning_text.delta, content_part.added / output_text.delta / .done / content_part.done,
function_call_arguments.delta / .done) and output_item.done, then response.completed.

Responses are kept (response_store.py, unless `store` is false) so that `previous_response_id` continues a
conversation: the stored conversation, its output as assistant turns, then the new input. GET and DELETE
/v1/responses/{id} read and drop them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.errors import ConveyorError, InvalidRequest
from conveyor.server.openai_api.chat_output import ChatRun
from conveyor.server.openai_api.openai_serving import CLIENT_CLOSED_REQUEST, OpenAIServing
from conveyor.server.openai_api.request_schemas import ChatCompletionRequest
from conveyor.server.openai_responses.store import ResponseStore
from conveyor.server.openai_responses.schemas import ResponsesRequest
from conveyor.server.openai_api.streaming import ClientDisconnected, EventStreamResponse, error_payload, sse, until_disconnected
from conveyor.server.parsing.tool_calls import ToolCall

# Chat field names in errors -> the Responses request's own.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


class _Output:
    """The output items of one response as they form, and the stream events that announce them."""

    def __init__(self, response_id: str, with_logprobs: bool = False) -> None:
        self.with_logprobs = with_logprobs   # include: message.output_text.logprobs
        self._held: list[dict[str, Any]] = []   # logprobs of tokens whose text is not out yet (a split character)
        self.items: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open: dict[str, Any] | None = None
        self._id = response_id.removeprefix("resp_")

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self._id[:20]}{len(self.items):04d}"

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self.events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                            "item": {**item, "status": "in_progress"}}))

    def _close(self) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self.events.append(("response.reasoning_text.done", {**where, "content_index": 0, "text": text}))
        else:
            part = item["content"][0]
            self.events.append(("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                              "logprobs": part.get("logprobs", [])}))
            self.events.append(("response.content_part.done", {**where, "content_index": 0, "part": part}))
        item["status"] = "completed"
        self.events.append(("response.output_item.done", {"output_index": where["output_index"], "item": item}))

    def _text_item(self, kind: str) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": self._item_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            self._add(item)
        else:
            part = {"type": "output_text", "text": "", "annotations": [],
                    **({"logprobs": []} if self.with_logprobs else {})}
            item = {"type": "message", "id": self._item_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [part]}
            self._add({**item, "content": []})
            self.events.append(("response.content_part.added", {
                "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)}))
            self.items[-1] = item
        self._open = item
        return item

    def feed(self, reasoning: str, text: str, calls: list[ToolCall], logprobs: list[dict[str, Any]]) -> None:
        """One delta: its thinking, answer text and finished calls; `logprobs` are its tokens' (with_logprobs),
        given to the answer text when the delta has some, held while a delta shows no text yet, and dropped with
        thinking or a call (those tokens wrote no answer text)."""
        self._held += logprobs
        if not text and (reasoning or calls):
            self._held = []
        logprobs, self._held = (self._held, []) if text else ([], self._held)
        for kind, delta in (("reasoning", reasoning), ("message", text)):
            if not delta:
                continue
            item = self._text_item(kind)
            part = item["content"][0]
            part["text"] += delta
            event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            if kind == "message" and self.with_logprobs:
                part["logprobs"].extend(logprobs)
            self.events.append((event, {"item_id": item["id"], "output_index": self.items.index(item),
                                        "content_index": 0, "delta": delta,
                                        **({"logprobs": logprobs if self.with_logprobs else []}
                                           if kind == "message" else {})}))
        for call in calls:
            self._close()
            item = {"type": "function_call", "id": self._item_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            self._add(item)
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            self.events.append(("response.function_call_arguments.delta", {**where, "delta": call.arguments}))
            self.events.append(("response.function_call_arguments.done", {**where, "name": call.name,
                                                                         "arguments": call.arguments}))
            item["arguments"], item["status"] = call.arguments, "completed"
            self.events.append(("response.output_item.done", {"output_index": where["output_index"], "item": item}))

    def finish(self) -> None:
        if self._held and self._open is not None and self._open["type"] == "message":
            self._open["content"][0]["logprobs"].extend(self._held)   # tokens whose text never came out
        self._close()


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        body.check_fields()
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = (await asyncio.to_thread(self.store.get, body.previous_response_id, "previous_response_id"))[1]
        conversation = history + body.input_messages()
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            chat = ChatCompletionRequest.model_validate({**body.chat_fields(), "messages": system + conversation},
                                                        strict=False)
            run = await self.serving.start_chat(chat, request, "resp")
        except InvalidRequest as exc:
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
        if run is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        response_id = "resp_" + run.group.group_id.removeprefix("resp-")
        base = self._base(response_id, body)
        output = _Output(response_id, body.wants_logprobs)
        if body.stream:
            return EventStreamResponse(self._events(run, base, output, conversation, body), run.group)
        try:
            finish, num_tokens = await self._run(run, output, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            run.group.close()
        return JSONResponse(await self._complete(base, output, finish, num_tokens, run, conversation, body))

    def _feed(self, output: _Output, run: ChatRun, delta: Any) -> None:
        logprobs = []
        if output.with_logprobs and delta.new_logprobs:
            formatted = self.serving.logprobs.chat_logprobs(delta.new_logprobs).content or []
            logprobs = [entry.model_dump() for entry in formatted]
        output.feed(*run.splitters[0].feed(delta.new_text, len(delta.new_token_ids), delta.finished, delta.steps),
                    logprobs)

    async def _run(self, run: ChatRun, output: _Output, request: Request) -> tuple[str | None, int]:
        async def collect() -> tuple[str | None, int]:
            finish, num_tokens = None, 0
            async for _, delta in run.group.outputs():
                num_tokens += len(delta.new_token_ids)
                self._feed(output, run, delta)
                output.events.clear()   # only a stream sends them
                if delta.finished:
                    finish = delta.finish_reason
            output.finish()
            return finish, num_tokens

        return await until_disconnected(request, collect())

    async def _events(self, run: ChatRun, base: dict[str, Any], output: _Output, conversation: list[dict[str, Any]],
                      body: ResponsesRequest) -> AsyncIterator[str]:
        number = 0

        def event(kind: str, data: dict[str, Any]) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\n" + sse(json.dumps({"type": kind, "sequence_number": number - 1, **data}))

        yield event("response.created", {"response": base})
        yield event("response.in_progress", {"response": base})
        finish, num_tokens = None, 0
        try:
            async for _, delta in run.group.outputs():
                num_tokens += len(delta.new_token_ids)
                self._feed(output, run, delta)
                if delta.finished:
                    finish = delta.finish_reason
                    output.finish()
                for kind, data in output.events:
                    yield event(kind, data)
                output.events.clear()
        except ConveyorError as exc:
            error = json.loads(error_payload(exc))["error"]
            yield event("error", {"code": error["code"], "message": error["message"], "param": error["param"]})
            return
        # response.completed also when max_output_tokens cut it short (its status says incomplete), as vLLM
        # sends it: the openai client's stream helper waits for that event alone.
        completed = await self._complete(base, output, finish, num_tokens, run, conversation, body)
        yield event("response.completed", {"response": completed})

    def _base(self, response_id: str, body: ResponsesRequest) -> dict[str, Any]:
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.serving.model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store, "top_logprobs": body.top_logprobs, "include": body.include or [],
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "text": body.text_echo(),
            "tool_choice": (body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
                            else body.tool_choice or ("auto" if body.tools else "none")),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": "disabled", "user": body.user, "metadata": body.metadata or {}, "usage": None,
        }

    async def _complete(self, base: dict[str, Any], output: _Output, finish: str | None, num_tokens: int,
                        run: ChatRun, conversation: list[dict[str, Any]], body: ResponsesRequest) -> dict[str, Any]:
        num_prompt = len(run.prompts[0])
        cut_short = finish == "length"
        response = {**base, "status": "incomplete" if cut_short else "completed", "output": output.items,
                    "incomplete_details": {"reason": "max_output_tokens"} if cut_short else None,
                    "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": num_tokens,
                              "output_tokens_details": {"reasoning_tokens": run.num_reasoning_tokens or 0},
                              "total_tokens": num_prompt + num_tokens}}
        if body.store:
            await asyncio.to_thread(self.store.put, response, conversation + _as_messages(output.items))
        return response


def _as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the assistant turn(s) of a later request's conversation (thinking left out)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


def add_responses_routes(app: FastAPI, serving: OpenAIServing, store: ResponseStore | None = None) -> None:
    responses = ResponsesServing(serving, store or ResponseStore())

    @app.post("/v1/responses", tags=["openai"])
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API, on the chat completions path (events when `stream` is true)."""
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}", tags=["openai"])
    async def get_response(response_id: str) -> Any:
        return (await asyncio.to_thread(responses.store.get, response_id))[0]

    @app.delete("/v1/responses/{response_id}", tags=["openai"])
    async def delete_response(response_id: str) -> Any:
        await asyncio.to_thread(responses.store.delete, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

