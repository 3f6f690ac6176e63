"""The server's admission of structured-output grammars: bounded in size, time and threads, cached by spec.

A grammar is checked against the size limits before any compiling (a 400 naming the limit), then
compiled on this gate's own few threads, so compiles can never take the worker threads other
requests need (tokenizing a long prompt). A compile still running after the time limit is a 400
and its spec is remembered as refused; a compile xgrammar cannot stop runs on to its end on its
thread, but no request waits for it, and the same spec waiting or arriving meanwhile shares it
rather than starting another. A client that leaves stops waiting; a compile nobody waits for any
more is cancelled if it has not started. Verdicts (compiles, or why not) are kept in a bounded LRU,
so a repeated spec costs a dictionary lookup; the compiled grammars themselves stay in xgrammar's
own cache, bounded in bytes, which the engine core's compile reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import GrammarLimits
from conveyor.engine.structured_output import GrammarCompiler, can_start
from conveyor.errors import InvalidRequest, ServerBusy
from conveyor.sampling_params import StructuredOutputsParams
from conveyor.server.openai_api.chat_schemas import ToolDefinition
from conveyor.server.parsing.chat_tools import check_tool_schemas

logger = logging.getLogger(__name__)


class _DaemonPool:
    """A few daemon threads running submitted calls. Unlike ThreadPoolExecutor's threads, which the
    interpreter joins at exit, a compile that runs for minutes never holds up the server's exit."""

    def __init__(self, num_threads: int) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._num_threads, self._threads = num_threads, []

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        if not self._threads:
            self._threads = [threading.Thread(target=self._work, name=f"conveyor-grammar-admit-{i}", daemon=True)
                             for i in range(self._num_threads)]
            for thread in self._threads:
                thread.start()
        future: Future[Any] = Future()
        self._calls.put((future, call))
        return future

    def _work(self) -> None:
        while True:
            future, call = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue   # cancelled while it waited
            try:
                future.set_result(call())
            except BaseException as exc:   # handed to whoever awaits the future
                future.set_exception(exc)


@dataclass(slots=True, eq=False)
class _Compile:
    """One spec's compile in flight, shared by every request waiting for that spec."""

    future: asyncio.Future[str | None] = field(init=False)
    began_s: float | None = None       # when a thread began it (monotonic); None while queued


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler, limits: GrammarLimits) -> None:
        self.compiler, self.limits = compiler, limits
        self._pool = _DaemonPool(limits.max_concurrent_compiles)
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()   # spec key's hash -> refusal, or None
        self._running: dict[str, _Compile] = {}
        self._waiters: dict[str, int] = {}

    async def admit(self, spec: StructuredOutputsParams, param: str) -> None:
        """Return once `spec` compiles (and its grammar lets the model write something); else raise."""
        check_size(spec, self.limits, param)   # before the key: a schema's key is its whole text, sorted
        kind = _kind(spec)
        key = hashlib.sha256(spec.key.encode("utf-8", errors="surrogatepass")).hexdigest()   # kept small
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return _raise_refusal(self._verdicts[key], param)
        if not self.compiler.is_built:   # once per model, and not the request's to pay against its limit
            await asyncio.wrap_future(self._pool.submit(self.compiler.build))
        work = self._running.get(key)
        if work is None:
            work = self._running[key] = _Compile()
            work.future = asyncio.wrap_future(self._pool.submit(lambda: self._compile(spec, key, work)))
            work.future.add_done_callback(lambda done: self._settle(key, work))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            refusal = await self._outcome(key, kind, work)
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]
                if not work.future.done() and work.began_s is None:
                    work.future.cancel()   # nobody waits for it and no thread has begun it
        _raise_refusal(refusal, param)

    async def _outcome(self, key: str, kind: str, work: _Compile) -> str | None:
        """The compile's verdict. The time limit runs from when a thread began it; waiting for a thread
        is bounded by the same limit (then a 503: the threads are busy, the spec may be fine)."""
        timeout_s = self.limits.timeout_s
        queued_until = time.monotonic() + timeout_s
        future = work.future
        while not future.done():
            began = work.began_s
            wait_s = (queued_until if began is None else began + timeout_s) - time.monotonic()
            if wait_s <= 0 and began is None:
                raise ServerBusy(f"every grammar compiler thread is busy; the {kind} constraint did not start "
                                 f"compiling within {timeout_s:g} s, retry later")
            if wait_s <= 0:
                if key not in self._verdicts:
                    self._remember(key, f"the {kind} constraint did not compile within {timeout_s:g} s, this "
                                        f"server's limit (--grammar-timeout); simplify it")
                return self._verdicts[key]
            try:
                await asyncio.wait_for(asyncio.shield(future), wait_s)
            except TimeoutError:
                continue
        return future.result()

    async def check_tools(self, tools: list[ToolDefinition] | None) -> None:
        """Refuse tools whose parameter schemas are over the size limits, or that take past the time
        limit to check (chat_tools.check_tool_schemas, on this gate's threads)."""
        if not tools:
            return
        for i, tool in enumerate(tools):
            if tool.function.parameters is not None:
                _check_schema(tool.function.parameters, self.limits, f"tools[{i}].function.parameters", "tool")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._pool.submit(lambda: check_tool_schemas(tools))),
                                   self.limits.timeout_s)
        except TimeoutError:
            raise InvalidRequest(f"the tools' parameter schemas could not be checked within {self.limits.timeout_s:g} "
                                 f"s, this server's limit (--grammar-timeout); simplify them", param="tools") from None

    def _compile(self, spec: StructuredOutputsParams, key: str, work: _Compile) -> str | None:
        """On a gate thread: None if the grammar compiles and can start, else why not."""
        work.began_s = time.monotonic()
        try:
            compiled = self.compiler.compile(spec)
        except InvalidRequest as exc:
            return exc.message
        if not can_start(compiled, self.compiler.vocab_size):
            return f"the {_kind(spec)} constraint admits no text this model's tokens can write"
        return None

    def _settle(self, key: str, work: _Compile) -> None:
        if self._running.get(key) is work:
            del self._running[key]
        future = work.future
        if not future.cancelled() and future.exception() is None and key not in self._verdicts:
            self._remember(key, future.result())
        elif not future.cancelled() and future.exception() is not None:
            logger.error("compiling a grammar failed", exc_info=future.exception())

    def _remember(self, key: str, refusal: str | None) -> None:
        self._verdicts[key] = refusal
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.limits.cache_size:
            self._verdicts.popitem(last=False)


def _raise_refusal(refusal: str | None, param: str) -> None:
    if refusal is not None:
        raise InvalidRequest(refusal, param=param)


def check_size(spec: StructuredOutputsParams, limits: GrammarLimits, param: str) -> None:
    """InvalidRequest naming the limit when `spec` is bigger than this server compiles."""
    kind = _kind(spec)
    if spec.regex is not None and len(spec.regex) > limits.max_regex_chars:
        raise InvalidRequest(f"the regex has {len(spec.regex)} characters; this server compiles at most "
                             f"{limits.max_regex_chars} (--max-regex-chars)", param=param)
    if spec.json is not None:
        return _check_schema(spec.json, limits, param, kind)
    _check_bytes(len(spec.key.encode("utf-8", errors="replace")), limits, param, kind)
    if spec.choice is not None:
        _check_choices(len(spec.choice), limits, param, kind)


def _kind(spec: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "regex", "choice", "grammar", "structural_tag", "json_object")
                if getattr(spec, name) not in (None, False))


def _check_schema(schema: str | dict[str, Any], limits: GrammarLimits, param: str, kind: str) -> None:
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
    except RecursionError:
        raise InvalidRequest(f"the {kind} constraint is nested too deeply", param=param) from None
    _check_bytes(len(text.encode("utf-8", errors="replace")), limits, param, kind)
    _check_choices(_num_schema_choices(schema), limits, param, kind)


def _check_bytes(num_bytes: int, limits: GrammarLimits, param: str, kind: str) -> None:
    if num_bytes > limits.max_bytes:
        raise InvalidRequest(f"the {kind} constraint is {num_bytes} bytes; this server compiles at most "
                             f"{limits.max_bytes} (--max-grammar-bytes)", param=param)


def _check_choices(num_choices: int, limits: GrammarLimits, param: str, kind: str) -> None:
    if num_choices > limits.max_choices:
        raise InvalidRequest(f"the {kind} constraint lists {num_choices} choices (enum and const values); this "
                             f"server compiles at most {limits.max_choices} (--max-grammar-choices)", param=param)


def _num_schema_choices(schema: Any) -> int:
    """enum values and consts anywhere in a JSON schema (a dict or its text), counted without recursion."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return 0   # the compiler names what is wrong with it
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                count += len(node["enum"])
            count += "const" in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count
