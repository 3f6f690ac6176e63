"""Structured outputs: grammars compiled with xgrammar, and the matchers that mask a step's logits.

The front compiles a request's grammar before admitting it (a grammar that does not compile is a
400 naming why). The core compiles it again on a worker thread, never on the step path: both go
through one `GrammarCompiler` per model and process, whose cache makes a repeated schema free, so
in one process the second compile is a cache hit. A constrained request waits for its grammar
outside the scheduler while the batch runs on. Each step, the core fills one packed bitmask row per
logits position of a constrained row (a row with draft tokens gets one per position, the matcher
walked through the drafts and rolled back), and the sampler applies them all in one operation.

xgrammar is an optional dependency (`make install` installs it without triton, which its CPU path never
imports; see pyproject's structured-cpu extra), imported on first use.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.engine.json_strings import StringBounds, string_bound
from conveyor.engine.schema_bounds import bounded_schema_text
from conveyor.errors import InvalidRequest
from conveyor.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from conveyor.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ANY_OBJECT = '{"type": "object"}'
# xgrammar's messages start with a time stamp and its C++ source location: "[16:06:50] /project/cpp/x.cc:49: ".
_SOURCE_LOCATION = re.compile(r"^(\[[\d:]+\]\s*)?\S+\.(cc|cpp|h|hpp):\d+:\s*")
_CACHE_BYTES = 256 * 2**20   # compiled grammars kept per process; a server sent endless new schemas stays bounded


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest("structured outputs need xgrammar, which is not installed on this server "
                             "(make install, or pip install 'conveyor[structured-cpu]' and then pip install "
                             "--no-deps xgrammar==0.2.8)", param="structured_outputs") from None
    return xgrammar


class GrammarCompiler:
    """xgrammar's compiler for one vocabulary, built on first use; thread-safe, with xgrammar's cache."""

    def __init__(self, make_tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        self._make_tokenizer = make_tokenizer
        self.vocab_size = vocab_size                # the model's logits width, may exceed the tokenizer's
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._info: Any = None

    def use_tokenizer(self, make_tokenizer: Callable[[], Tokenizer]) -> None:
        """Build from `make_tokenizer` instead, unless already built: a tokenizer already loaded beats
        loading it again. Takes no lock: a build under way has its tokenizer already, and waiting gains nothing."""
        if self._compiler is None:
            self._make_tokenizer = make_tokenizer

    @property
    def is_built(self) -> bool:
        return self._compiler is not None

    def build(self) -> None:
        """Build xgrammar's compiler now (seconds: it indexes the whole vocabulary) rather than in a first compile."""
        self._get()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                from transformers import PreTrainedTokenizerFast

                tokenizer = self._make_tokenizer()
                info = xgr.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend), vocab_size=self.vocab_size,
                    stop_token_ids=sorted(tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_CACHE_BYTES)
                self._info = info
            return self._compiler

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes, as the grammar engine reads them."""
        self._get()
        return list(self._info.decoded_vocab)

    def compile(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> Any:
        """The CompiledGrammar of `spec`; InvalidRequest (naming `param`) when it does not compile."""
        compiler = self._get()
        try:
            if spec.after_thinking is not None:
                return compiler.compile_grammar(_after_thinking(spec))
            if spec.json_object or spec.json is not None:
                schema = _ANY_OBJECT if spec.json_object else bounded_schema_text(spec.json)
                # Compact JSON: a small model left free whitespace pretty-prints until its budget runs out.
                return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=spec.strict)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return compiler.compile_grammar(f"root ::= {literals}")
            if spec.grammar is not None:
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_structural_tag(spec.structural_tag)
        except Exception as exc:   # xgrammar raises RuntimeError / ValueError / its own types, with the reason
            kind = spec.key.split(":", 1)[0]
            raise InvalidRequest(f"the {kind} constraint could not be compiled: {refusal_reason(exc)}",
                                 param=param) from None


def _after_thinking(spec: StructuredOutputsParams) -> Any:
    """The grammar of `spec` behind a reasoning model's thinking: any text up to </think> (and the
    whitespace after it), either from the start ("open") or in an optional leading <think> block."""
    xgr = _xgrammar()
    if spec.json_object or spec.json is not None:
        schema = _ANY_OBJECT if spec.json_object else bounded_schema_text(spec.json)
        base = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=spec.strict)
    elif spec.regex is not None:
        base = xgr.Grammar.from_regex(spec.regex)
    elif spec.choice is not None:
        base = xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    elif spec.grammar is not None:
        base = xgr.Grammar.from_ebnf(spec.grammar)
    else:
        base = xgr.Grammar.from_structural_tag(spec.structural_tag)
    thinking = xgr.Grammar.concat(
        xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}})),
        xgr.Grammar.from_ebnf('root ::= [ \\t\\r\\n]{0,4}'))   # bounded: a model may write spaces forever
    if spec.after_thinking == "open":
        return xgr.Grammar.concat(thinking, base)
    return xgr.Grammar.union(xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<think>"'), thinking, base), base)


def can_start(compiled: Any, vocab_size: int) -> bool:
    """Whether any token may open the grammar's text: a grammar that needs bytes the vocabulary has
    no token for (some control characters, for one) compiles but leaves the sampler nothing to pick."""
    xgr = _xgrammar()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def refusal_reason(exc: Exception) -> str:
    """xgrammar's reason in one line, without its time stamp and C++ source location."""
    text = str(exc).strip()
    return _SOURCE_LOCATION.sub("", text.splitlines()[0]) if text else type(exc).__name__


def json_schema_refusal(schema: dict[str, Any]) -> str | None:
    """Why the grammar compiler would refuse this JSON schema, or None (also when xgrammar is not installed).

    Converts the schema to a grammar without the vocabulary, so it costs milliseconds, not a compile.
    """
    if importlib.util.find_spec("xgrammar") is None:
        return None
    try:
        _xgrammar().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as exc:   # as in GrammarCompiler.compile
        return refusal_reason(exc)
    return None


_compilers: dict[tuple[str, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def grammar_compiler(model_path: Path, vocab_size: int,
                     make_tokenizer: Callable[[], Tokenizer] | None = None) -> GrammarCompiler:
    """The process's compiler for this model: the front and an in-process core share one cache."""
    key = (str(model_path), vocab_size)
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            if make_tokenizer is None:
                from conveyor.text.tokenizer_loader import load_tokenizer

                def make_tokenizer() -> Tokenizer:
                    return load_tokenizer(model_path)
            compiler = _compilers[key] = GrammarCompiler(make_tokenizer, vocab_size)
        elif make_tokenizer is not None:
            compiler.use_tokenizer(make_tokenizer)
    return compiler


class StructuredOutputs:
    """The core's side: compiles on a worker thread, then owns one matcher per constrained request."""

    def __init__(self, compiler: GrammarCompiler, num_threads: int = 1) -> None:
        self.compiler = compiler
        self.num_threads = num_threads           # for filling a step's masks: the model is idle meanwhile
        self._batch: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._compiling: dict[str, Future[Any]] = {}
        self._matchers: dict[str, Any] = {}
        self.strings = StringBounds(compiler.vocab_size, compiler.token_bytes)

    def submit(self, request_id: str, spec: StructuredOutputsParams) -> None:
        bound = string_bound(spec)
        if bound is not None:
            self.strings.add(request_id, bound)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-grammar")
        self._compiling[request_id] = self._executor.submit(self.compiler.compile, spec)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def take_compiled(self) -> list[tuple[str, str | None]]:
        """Requests whose grammar is done: (request id, None) with a matcher ready, or (id, the error)."""
        done = [(request_id, future) for request_id, future in self._compiling.items() if future.done()]
        result: list[tuple[str, str | None]] = []
        for request_id, future in done:
            del self._compiling[request_id]
            try:
                self._matchers[request_id] = _xgrammar().GrammarMatcher(future.result())
            except Exception as exc:
                result.append((request_id, str(exc)))
            else:
                result.append((request_id, None))
        return result

    def wait(self, timeout_s: float) -> None:
        """Sleep until a compile finishes (or timeout_s): an idle core has nothing else to do."""
        if self._compiling:
            wait_futures(list(self._compiling.values()), timeout=timeout_s, return_when="FIRST_COMPLETED")

    def drop(self, request_id: str) -> None:
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()
        self._matchers.pop(request_id, None)
        self.strings.drop(request_id)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def step_masks(self, rows: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """The masks of one step's constrained rows, (request id, drafts) each: rows without drafts in
        one call over num_threads threads (a bounded string's mask can take a millisecond), rows with
        drafts by walking them (`masks`)."""
        plain = [request_id for request_id, drafts in rows if not drafts]
        out: dict[str, torch.Tensor] = {}
        if plain:
            xgr = _xgrammar()
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=self.num_threads)
            bitmask = xgr.allocate_token_bitmask(len(plain), self.compiler.vocab_size)
            self._batch.batch_fill_next_token_bitmask([self._matchers[r] for r in plain], bitmask)
            out = {request_id: bitmask[i:i + 1] for i, request_id in enumerate(plain)}
        for request_id, drafts in rows:
            if drafts:
                out[request_id] = self.masks(request_id, drafts)
            self.strings.narrow(request_id, out[request_id])   # a draft row: its first position only
        return out

    def masks(self, request_id: str, draft_token_ids: list[int]) -> torch.Tensor:
        """(len(drafts) + 1, words) int32: the allowed tokens at each logits position of the row.

        Position i is masked as if drafts 1..i had been emitted. Past the first draft the grammar
        refuses (or a drafted eos), positions keep the last mask: nothing after it can be emitted.
        """
        xgr = _xgrammar()
        matcher = self._matchers[request_id]
        bitmask = xgr.allocate_token_bitmask(len(draft_token_ids) + 1, self.compiler.vocab_size)
        walked = 0
        for i in range(len(draft_token_ids) + 1):
            if i and (walked < i or matcher.is_terminated()):   # past a refused draft, or a drafted eos
                bitmask[i] = bitmask[i - 1]
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
            if i < len(draft_token_ids) and matcher.accept_token(draft_token_ids[i]):
                walked += 1
        if walked:
            matcher.rollback(walked)
        return bitmask

    def accept(self, request_id: str, token_ids: list[int]) -> int:
        """Advance the request's matcher by its emitted tokens; how many it took (fewer: it refused one)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return len(token_ids)
        for i, token_id in enumerate(token_ids):
            if not (matcher.is_terminated() or matcher.accept_token(token_id)):
                self.strings.accept(request_id, token_ids[:i])
                return i
        self.strings.accept(request_id, token_ids)
        return len(token_ids)

    def is_dead_end(self, request_id: str) -> bool:
        """True when the grammar is unfinished yet allows no token: it needs bytes no token of this
        vocabulary writes, so the sampler had nothing to pick (its pick is then no token at all)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return False
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.compiler.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())
