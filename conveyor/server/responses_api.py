"""OpenAI's Responses API (/v1/responses) on the chat completions path: one front, one engine path.

A request becomes a chat completion request (responses_schemas.py) and runs through
`OpenAIServing.start_chat`, so it is validated, rendered, constrained and batched as a chat is; its
output (thinking, text, tool calls, split by the same ChatOutputSplitter) becomes output items:
`reasoning`, `message` with `output_text`, and `function_call` items. Streamed, it sends OpenAI's
events: response.created and .in_progress, then per item output_item.added, its deltas
(reasoning_text.delta, content_part.added / output_text.delta / .done / content_part.done,
function_call_arguments.delta / .done) and output_item.done, then response.completed.

Responses are kept in memory (the last 1024, at most 64 MiB, unless `store` is false) so that
`previous_response_id` continues a conversation: the stored conversation, its output as assistant
turns, then the new input. GET and DELETE /v1/responses/{id} read and drop them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.errors import ConveyorError, InvalidRequest, NotFound
from conveyor.server.chat_output import ChatRun
from conveyor.server.openai_serving import CLIENT_CLOSED_REQUEST, OpenAIServing
from conveyor.server.request_schemas import ChatCompletionRequest
from conveyor.server.responses_schemas import ResponsesRequest
from conveyor.server.streaming import ClientDisconnected, EventStreamResponse, error_payload, sse, until_disconnected
from conveyor.server.parsing.tool_calls import ToolCall

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20   # conversations can be long: the store is bounded in size as well as count
# Chat field names in errors -> the Responses request's own.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


class ResponseStore:
    """The last `max_stored` responses and the conversations that led to them, at most `max_bytes` of them
    (as JSON), least recent dropped first."""

    def __init__(self, max_stored: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_stored, self.max_bytes = max_stored, max_bytes
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._num_bytes = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self._items[response["id"]] = (response, conversation)
        self._sizes[response["id"]] = size
        self._num_bytes += size
        while len(self._items) > self.max_stored or (self._num_bytes > self.max_bytes and len(self._items) > 1):
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        del self._items[response_id]
        self._num_bytes -= self._sizes.pop(response_id)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        found = self._items.get(response_id)
        if found is None:
            raise NotFound(f"no stored response {response_id!r} (this server keeps the last {self.max_stored} "
                                f"in memory)", param=param)
        self._items.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)


class _Output:
    """The output items of one response as they form, and the stream events that announce them."""

    def __init__(self, response_id: str) -> None:
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
                                                              "logprobs": []}))
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
            item = {"type": "message", "id": self._item_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self._add({**item, "content": []})
            self.events.append(("response.content_part.added", {
                "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}))
            self.items[-1] = item
        self._open = item
        return item

    def feed(self, reasoning: str, text: str, calls: list[ToolCall]) -> None:
        for kind, delta in (("reasoning", reasoning), ("message", text)):
            if not delta:
                continue
            item = self._text_item(kind)
            item["content"][0]["text"] += delta
            event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            self.events.append((event, {"item_id": item["id"], "output_index": self.items.index(item),
                                        "content_index": 0, "delta": delta,
                                        **({"logprobs": []} if kind == "message" else {})}))
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
        self._close()


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        body.check_fields()
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id, "previous_response_id")[1]
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
        output = _Output(response_id)
        if body.stream:
            return EventStreamResponse(self._events(run, base, output, conversation, body), run.group)
        try:
            finish, num_tokens = await self._run(run, output, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            run.group.close()
        return JSONResponse(self._complete(base, output, finish, num_tokens, run, conversation, body))

    async def _run(self, run: ChatRun, output: _Output, request: Request) -> tuple[str | None, int]:
        async def collect() -> tuple[str | None, int]:
            finish, num_tokens = None, 0
            async for _, delta in run.group.outputs():
                num_tokens += len(delta.new_token_ids)
                output.feed(*run.splitters[0].feed(delta.new_text, len(delta.new_token_ids), delta.finished))
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
                output.feed(*run.splitters[0].feed(delta.new_text, len(delta.new_token_ids), delta.finished))
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
        yield event("response.completed", {"response": self._complete(base, output, finish, num_tokens, run,
                                                                      conversation, body)})

    def _base(self, response_id: str, body: ResponsesRequest) -> dict[str, Any]:
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.serving.model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "text": body.text_echo(),
            "tool_choice": (body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
                            else body.tool_choice or ("auto" if body.tools else "none")),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": "disabled", "user": body.user, "metadata": body.metadata or {}, "usage": None,
        }

    def _complete(self, base: dict[str, Any], output: _Output, finish: str | None, num_tokens: int, run: ChatRun,
                  conversation: list[dict[str, Any]], body: ResponsesRequest) -> dict[str, Any]:
        num_prompt = len(run.prompts[0])
        cut_short = finish == "length"
        response = {**base, "status": "incomplete" if cut_short else "completed", "output": output.items,
                    "incomplete_details": {"reason": "max_output_tokens"} if cut_short else None,
                    "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": num_tokens,
                              "output_tokens_details": {"reasoning_tokens": run.num_reasoning_tokens or 0},
                              "total_tokens": num_prompt + num_tokens}}
        if body.store:
            self.store.put(response, conversation + _as_messages(output.items))
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
        return responses.store.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}", tags=["openai"])
    async def delete_response(response_id: str) -> Any:
        responses.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

