"""llama-server's native endpoints on the one engine front: /completion (and /completions), /props, /slots.

/completion runs through OpenAIServing's start and collect (admission, grammars, the prompt group),
so it refuses and batches exactly as /v1/completions does; only the request's names and the
response's shape are llama.cpp's: `content`, `tokens_predicted`, `tokens_evaluated`, `stop_type`
(and the older `stopped_eos` / `stopped_word` / `stopped_limit`), `timings`,
`completion_probabilities` with n_probs. A stream is `data: {json}` lines, the last with `stop: true`.
/health is the app's own ({"status": "ok"}, as llama-server's).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor import __version__
from conveyor.engine.messages import RequestMetrics, RequestOutput
from conveyor.errors import ConveyorError, InvalidRequest
from conveyor.logprobs import TokenLogprobs
from conveyor.server.openai_api.completion_serving import CLIENT_CLOSED_REQUEST, Serving
from conveyor.server.llamacpp.schemas import LlamaCompletionRequest, LlamaPrompt
from conveyor.server.http.request_limits import check_choice_count, check_logprobs_budget
from conveyor.server.openai_api.prompt_group import PromptGroup
from conveyor.server.openai_api.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    error_payload,
    sse,
    until_disconnected,
)


# SamplingParams' and admission's names for what llama.cpp calls otherwise.
_PARAMS = {"max_tokens": "n_predict", "logprobs": "n_probs", "repetition_penalty": "repeat_penalty"}


class LlamaCppServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    def prompts(self, prompt: LlamaPrompt) -> tuple[list[list[int]], bool]:
        """Token ids per prompt, and whether the request was a batch (its answer is then a list)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str, dict)) for p in prompt):
            if not all(isinstance(p, str) for p in prompt) or len(prompt) > 1:
                return [self._one(p) for p in prompt], True
        return [self._one(prompt)], False

    def _one(self, prompt: Any) -> list[int]:
        """A text, {prompt_string: text}, or token ids with texts mixed in (the first text gets the BOS)."""
        if isinstance(prompt, dict):
            if set(prompt) != {"prompt_string"} or not isinstance(prompt["prompt_string"], str):
                raise InvalidRequest("a prompt object has only prompt_string (no multimodal data here)",
                                     param="prompt")
            prompt = prompt["prompt_string"]
        if isinstance(prompt, str):
            self.serving.check_prompt_chars(len(prompt), "prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("prompt must be a text, token ids, or a list of those", param="prompt")
        ids: list[int] = []
        for part in prompt:
            if isinstance(part, bool) or not isinstance(part, (int, str)):
                raise InvalidRequest("a token id prompt holds integers and texts only", param="prompt")
            ids += [part] if isinstance(part, int) else self.tokenizer.encode(part, add_special_tokens=not ids)
        return ids

    async def completion(self, body: LlamaCompletionRequest, request: Request) -> Response:
        try:
            params = body.sampling_params(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        except InvalidRequest as exc:
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
        # Tokenized on a worker thread, as a long text would hold the event loop (and every stream) meanwhile.
        prompts, is_batch = await asyncio.to_thread(self.prompts, body.prompt)
        check_choice_count(len(prompts), 1)
        check_logprobs_budget(params, prompts, self.serving.engine.info.max_model_len, "n_probs")
        if not await self.serving.compile_grammar(params, "grammar" if body.grammar is not None else "json_schema",
                                                  request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            group = self.serving._start("llama", prompts, params, 0, "", request)
        except InvalidRequest as exc:
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
        if body.stream:
            return EventStreamResponse(self._events(group, prompts, body), group)   # no [DONE], as llama-server
        results = [_Result() for _ in prompts]

        async def collect() -> None:
            async for index, output in group.outputs():
                results[index].add(output)

        try:
            await until_disconnected(request, collect())
        except ClientDisconnected:
            return self.serving._disconnected(group)
        finally:
            group.close()
        answers = [self._final(i, r, prompts[i], body) for i, r in enumerate(results)]
        return JSONResponse(answers if is_batch else answers[0])

    async def _events(self, group: PromptGroup, prompts: list[list[int]],
                      body: LlamaCompletionRequest) -> AsyncIterator[str]:
        results = [_Result() for _ in prompts]
        try:
            async for index, output in group.outputs():
                result = results[index]
                result.add(output)
                if output.new_token_ids and body.n_predict != 0:   # one event per step's tokens, as llama-server
                    chunk: dict[str, Any] = {
                        "index": index, "content": output.new_text,
                        "tokens": output.new_token_ids, "stop": False, "id_slot": -1,
                        "tokens_predicted": result.num_tokens, "tokens_evaluated": len(prompts[index])}
                    if body.n_probs > 0:
                        chunk["completion_probabilities"] = self._probs(output.new_logprobs)
                    yield sse(json.dumps(chunk))
                if output.finished:
                    final = self._final(index, result, prompts[index], body)
                    yield sse(json.dumps({**final, "content": "", "tokens": []}))
        except ConveyorError as exc:
            yield sse(error_payload(exc))

    def _final(self, index: int, result: _Result, prompt: list[int], body: LlamaCompletionRequest) -> dict[str, Any]:
        drop = body.n_predict == 0   # one token ran (the step that reads the prompt samples one): not shown
        reason, stop = result.finish_reason, result.stop_reason
        stop_type = "limit" if reason == "length" else "word" if isinstance(stop, str) else "eos"
        content = "" if drop else "".join(result.text)
        answer: dict[str, Any] = {
            "index": index, "content": content, "tokens": result.token_ids if body.return_tokens and not drop else [],
            "id_slot": -1, "stop": True, "model": self.serving.model_name,
            "tokens_predicted": 0 if drop else result.num_tokens, "tokens_evaluated": len(prompt),
            "generation_settings": generation_settings(body), "prompt": self.tokenizer.decode(prompt, False),
            "has_new_line": "\n" in content, "truncated": False, "stop_type": stop_type,
            "stopping_word": stop if isinstance(stop, str) else "", "stopped_eos": stop_type == "eos",
            "stopped_word": stop_type == "word", "stopped_limit": stop_type == "limit",
            "tokens_cached": 0 if result.metrics is None else result.metrics.num_cached_tokens,
            "timings": timings(result.metrics, len(prompt), 0 if drop else result.num_tokens),
        }
        if body.n_probs > 0 and not drop:
            answer["completion_probabilities"] = self._probs(result.logprobs)
        return _only(answer, body.response_fields) if body.response_fields else answer

    def _probs(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        text, raw = self.serving.logprobs.token_text, self.serving.logprobs.token_bytes

        def token(token_id: int, logprob: float) -> dict[str, Any]:
            return {"id": token_id, "token": text(token_id), "bytes": list(raw(token_id)), "logprob": logprob}

        return [{**token(e.token_id, e.logprob), "top_logprobs": [token(i, lp) for i, lp in e.top]} for e in entries]


class _Result:
    """One prompt's output so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics: RequestMetrics | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, output: RequestOutput) -> None:
        self.text.append(output.new_text)
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs
        if output.finished:
            self.finish_reason, self.stop_reason, self.metrics = output.finish_reason, output.stop_reason, output.metrics


def generation_settings(body: LlamaCompletionRequest | None = None) -> dict[str, Any]:
    body = body or LlamaCompletionRequest(prompt="")
    return {"n_predict": body.n_predict, "seed": body.seed, "temperature": body.temperature, "top_k": body.top_k,
            "top_p": body.top_p, "min_p": body.min_p, "repeat_penalty": body.repeat_penalty,
            "repeat_last_n": body.repeat_last_n, "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty, "stop": body.stop, "n_probs": body.n_probs,
            "ignore_eos": body.ignore_eos, "stream": body.stream, "cache_prompt": body.cache_prompt,
            "grammar": body.grammar or ""}


def template_caps(takes_tools: bool) -> dict[str, bool]:
    """llama-server's chat_template_caps, as far as conveyor's templates go: text, system role, tools."""
    return {"supports_object_arguments": takes_tools, "supports_parallel_tool_calls": takes_tools,
            "supports_preserve_reasoning": False, "supports_reasoning_effort": False, "supports_string_content": True,
            "supports_system_role": True, "supports_tool_calls": takes_tools, "supports_tools": takes_tools,
            "supports_typed_content": True}


def timings(metrics: RequestMetrics | None, num_prompt: int, num_predicted: int) -> dict[str, float]:
    """llama-server's timings: prompt from first scheduled to first token, generation after it."""
    cached = 0 if metrics is None else metrics.num_cached_tokens
    prompt_s = predicted_s = 0.0
    if metrics is not None and metrics.first_token_s is not None:
        prompt_s = metrics.first_token_s - (metrics.first_scheduled_s or metrics.arrival_s)
        predicted_s = (metrics.finished_s or metrics.first_token_s) - metrics.first_token_s
    prompt_n = num_prompt - cached
    return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_s * 1e3,
            "prompt_per_token_ms": prompt_s * 1e3 / max(prompt_n, 1),
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": num_predicted, "predicted_ms": predicted_s * 1e3,
            "predicted_per_token_ms": predicted_s * 1e3 / max(num_predicted, 1),
            "predicted_per_second": num_predicted / predicted_s if predicted_s > 0 else 0.0}


def _only(answer: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: each named field, 'a/b' reaching into a nested object, under its own name."""
    picked: dict[str, Any] = {}
    for name in fields:
        value: Any = answer
        for part in name.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            picked[name] = value
    return picked


def add_llamacpp_routes(app: FastAPI, serving: Serving, max_num_seqs: int) -> None:
    native = LlamaCppServing(serving)
    engine = serving.engine

    @app.post("/completion", tags=["llama.cpp"])
    @app.post("/completions", tags=["llama.cpp"], include_in_schema=False)
    async def completion(body: LlamaCompletionRequest, request: Request) -> Response:
        """llama-server's native completion."""
        return await native.completion(body, request)

    @app.get("/props", tags=["llama.cpp"])
    async def props() -> dict[str, Any]:
        """llama-server's server properties."""
        info = engine.info
        tokenizer = serving.tokenizer
        return {"default_generation_settings": {"params": generation_settings(), "n_ctx": info.max_model_len},
                "total_slots": max_num_seqs, "model_alias": serving.model_name, "model_path": info.model_path,
                "modalities": {"vision": False, "audio": False, "video": False},
                "chat_template": tokenizer.chat_template or "", "bos_token": tokenizer.bos_token or "",
                "eos_token": tokenizer.eos_token or "", "build_info": f"conveyor {__version__}",
                "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True, "is_sleeping": False,
                "model_ftype": info.weights or info.dtype, "media_marker": "", "ui": False, "ui_settings": {},
                "cors_proxy_enabled": False, "chat_template_caps": template_caps(tokenizer.template_takes_tools)}

    @app.get("/slots", tags=["llama.cpp"])
    async def slots() -> list[dict[str, Any]]:
        """One entry per batch slot (max_num_seqs); as many are processing as requests run."""
        num_running = engine.load.num_running
        return [{"id": i, "n_ctx": engine.info.max_model_len, "speculative": False, "is_processing": i < num_running}
                for i in range(max_num_seqs)]
