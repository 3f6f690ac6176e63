"""Streaming client for any OpenAI-compatible /v1/completions: token-id prompts, Poisson or all-at-once.

Like vLLM's `bench serve`: each request is a streaming completion with `ignore_eos`; the client
timestamps every SSE chunk that carries output. TTFT is send -> first output chunk, ITLs are the
gaps between output chunks. Output tokens are counted from what came back: the tokens listed in
each chunk's logprobs when requested, else one per output chunk; when the server also reports
`usage` (stream_options.include_usage) that count is kept and the chunk count is checked against it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from bench.workloads import OfflineRequest, arrival_times


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A streamed response's lines, broken at LF (and CRLF) only, as server-sent events are: httpx's
    aiter_lines also breaks at U+0085, U+2028 and U+2029, which a server may send raw inside JSON."""
    buffer = ""
    async for text in response.aiter_text():
        *lines, buffer = (buffer + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buffer:
        yield buffer.removesuffix("\r")


@dataclass(slots=True)
class RequestRecord:
    prompt_tokens: int
    max_tokens: int
    sent_s: float = 0.0                  # perf_counter when the request was sent
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)   # perf_counter of each output chunk
    chunk_tokens: int = 0                # tokens counted from the chunks themselves
    usage_tokens: int | None = None      # the server's own count, when it sent usage
    cached_prompt_tokens: int = 0        # prompt tokens the server says it took from a cache
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunk_tokens

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM defines it."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServingRun:
    records: list[RequestRecord]
    duration_s: float                  # first send -> last response done
    rate: float | None                 # requests/s of the Poisson process; None = all at once
    max_concurrency: int | None


def chunk_output_tokens(choice: dict) -> int:
    """Tokens carried by one streamed completion choice (0 for a chunk with no output)."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    if isinstance(logprobs, dict) and logprobs.get("content") is not None:   # llama.cpp's shape
        return len(logprobs["content"])
    return 1 if choice.get("text") else 0


async def _one_request(client: httpx.AsyncClient, url: str, model: str | None, request: OfflineRequest,
                       record: RequestRecord, logprobs: bool, extra_body: dict) -> None:
    body = {"prompt": request.prompt_token_ids, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra_body}
    if model is not None:
        body["model"] = model
    if logprobs:
        body["logprobs"] = 0
    record.sent_s = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:300]
                    return
                num_tokens = sum(chunk_output_tokens(c) for c in chunk.get("choices") or [])
                if num_tokens:
                    if record.ttft_s is None:
                        record.ttft_s = now - record.sent_s
                    record.chunk_times_s.append(now)
                    record.chunk_tokens += num_tokens
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.usage_tokens = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_prompt_tokens = int(details.get("cached_tokens") or 0)
        record.e2e_s = time.perf_counter() - record.sent_s
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def _run(base_url: str, model: str | None, requests: list[OfflineRequest], rate: float | None,
               max_concurrency: int | None, seed: int, logprobs: bool, extra_body: dict,
               on_done: Callable[[], None] | None) -> ServingRun:
    url = base_url.rstrip("/") + "/v1/completions"
    records = [RequestRecord(len(r.prompt_token_ids), r.max_tokens) for r in requests]
    send_at = arrival_times(len(requests), rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        start = time.perf_counter()

        async def send(i: int) -> None:
            delay = start + send_at[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                await _one_request(client, url, model, requests[i], records[i], logprobs, extra_body)
            else:
                async with semaphore:
                    await _one_request(client, url, model, requests[i], records[i], logprobs, extra_body)
            if on_done is not None:
                on_done()

        await asyncio.gather(*(send(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    return ServingRun(records, duration, rate, max_concurrency)


def run_serving(base_url: str, requests: list[OfflineRequest], *, model: str | None = None,
                rate: float | None = None, max_concurrency: int | None = None, seed: int = 0,
                logprobs: bool = False, extra_body: dict | None = None,
                on_done: Callable[[], None] | None = None) -> ServingRun:
    """Send `requests` to `base_url` (Poisson at `rate` req/s, or all at once) and time every chunk."""
    return asyncio.run(_run(base_url, model, requests, rate, max_concurrency, seed, logprobs,
                            extra_body or {}, on_done))


def wait_healthy(base_url: str, timeout_s: float, is_alive: Callable[[], bool] = lambda: True,
                 path: str = "/health", poll_s: float = 0.25) -> None:
    """Poll GET `path` (/health; Prometheus says /-/ready) every `poll_s` until it answers 200; raises
    TimeoutError, or RuntimeError if the server died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError(f"server at {base_url} exited while starting")
        try:
            if httpx.get(base_url.rstrip("/") + path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"server at {base_url} not healthy after {timeout_s:.0f} s")


def greedy_text(base_url: str, prompt_token_ids: list[int], max_tokens: int, ignore_eos: bool = False,
                timeout_s: float = 600.0) -> str:
    """The text of one greedy, non-streaming /v1/completions call on a token-id prompt: up to
    `max_tokens` tokens, ending at the end-of-sequence token unless `ignore_eos`."""
    body = {"prompt": prompt_token_ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    response = httpx.post(base_url.rstrip("/") + "/v1/completions", json=body, timeout=timeout_s)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]
