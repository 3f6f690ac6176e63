"""Front: the work both faces do on their side of the core, written once.

The offline `LLMEngine` (a core in this thread, behind an `InlineCoreClient`) and the server's
`AsyncEngine` (a core on a thread or in a process, behind a `CoreClient`) each hold one Front, which
sends the core its commands; only the client differs. The Front turns a prompt and its SamplingParams
into a `CoreRequest` (tokenize, admit: the same refusals with the same messages from both faces), starts
and aborts requests (tracking: which requests' deltas become text), and turns each `StepOutputs` into
text deltas (detokenize, stop strings; a stop string found here ends the request in the core). Each
prompt's n choices are `SamplingParams.for_choice`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from conveyor.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreCommand,
    CoreInfo,
    CoreRequest,
    FinishRequests,
    RequestOutput,
    StepOutputs,
)
from conveyor.engine.structured_output import GrammarCompiler, grammar_compiler
from conveyor.errors import ConveyorError, InvalidRequest
from conveyor.front.admission import bad_words_token_ids, check_request, check_token_ids, truncate_prompt
from conveyor.front.output_processor import OutputProcessor
from conveyor.sampling_params import SamplingParams
from conveyor.text.tokenizer import Tokenizer

# A core client's `send`: the core's answer when it answers at once (a core in this thread), else None.
Send = Callable[[CoreCommand], StepOutputs | None]
Rejected = list[tuple[str, ConveyorError]]   # (request id, why the core refused it)


class Front:
    def __init__(self, tokenizer: Tokenizer, info: CoreInfo, send: Send) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.send = send
        # Grammars are compiled here first, so that one that does not compile is refused before it
        # starts; a core in this process shares the cache (the process's compiler for the model).
        self.grammars = (grammar_compiler(Path(info.model_path), info.vocab_size, lambda: tokenizer)
                         if info.model_path else GrammarCompiler(lambda: tokenizer, info.vocab_size))
        self.processor = OutputProcessor(tokenizer)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return check_token_ids(prompt, self.info.vocab_size)

    def compile_grammar(self, params: SamplingParams, param: str = "structured_outputs") -> None:
        """Refuse (400 naming `param`) a grammar that does not compile; cached, so the core's compile is a hit."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs, param)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival_s: float, priority: int = 0, tenant: str = "", is_background: bool = False
                     ) -> CoreRequest:
        """Admit one sequence (InvalidRequest / ContextLengthExceeded if it could never run) as a core request."""
        if request_id in self.processor:   # before anything is tracked: the running one keeps its stream
            raise InvalidRequest(f"duplicate request id {request_id!r}")
        prompt_token_ids = truncate_prompt(prompt_token_ids, params, self.info.max_model_len)
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=bad_words_token_ids(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        max_tokens = check_request(prompt_token_ids, params, self.info)
        return CoreRequest(request_id, prompt_token_ids, params, max_tokens, self.tokenizer.eos_token_ids,
                           arrival_s, priority, tenant, is_background)

    def start(self, requests: list[CoreRequest]) -> Rejected:
        """Track admitted requests (their deltas become text from now on) and send them to the core.
        Returns those the core refused when it answers at once; a later refusal comes with `process`."""
        for request in requests:
            self.processor.add(request.request_id, request.prompt_token_ids, request.params)
        answer = self.send(AddRequests(requests))
        return [] if answer is None else self._drop_rejected(answer)

    def abort(self, request_ids: list[str]) -> None:
        """Stop tracking the requests and have the core drop them in any state."""
        for request_id in request_ids:
            self.processor.drop(request_id)
        self.send(AbortRequests(request_ids))

    def drop(self, request_id: str) -> None:
        """Stop tracking a request the core no longer runs for this front (refused, or the core is gone)."""
        self.processor.drop(request_id)

    def process(self, outputs: StepOutputs) -> tuple[list[RequestOutput], Rejected]:
        """A core message -> the text deltas of the tracked requests, and the adds the core refused.

        A request whose stop string is found here is finished for its caller now and ended in the core
        (FinishRequests). A core that answers at once gives its final figures (`metrics`) to the output,
        as it does for a request it ended itself; one elsewhere sends them to its step observers only.
        """
        rejected = self._drop_rejected(outputs)
        texts, stops = [], []
        for delta in outputs.deltas:
            text = self.processor.process(delta)
            if text is None:
                continue
            texts.append(text)
            if text.finished and not delta.finished:   # a stop string: the core still runs the request
                stops.append((text.request_id, str(text.stop_reason)))
        if stops:
            answer = self.send(FinishRequests(stops))
            if answer is not None:
                finals = {delta.request_id: delta.metrics for delta in answer.deltas}
                for text in texts:
                    if text.request_id in finals:
                        text.metrics = finals[text.request_id]
        return texts, rejected

    def _drop_rejected(self, outputs: StepOutputs) -> Rejected:
        for request_id, _ in outputs.rejected:
            self.processor.drop(request_id)
        return outputs.rejected


class Choices:
    """One prompt's n choices; choice j runs as one sequence with `params.for_choice(j)`.

    The first starts at once. With `stagger`, the other n - 1 start when the first has its first
    output: the prompt's KV blocks are then in the prefix cache, so it is computed once, not n times.
    """

    def __init__(self, params: SamplingParams, stagger: bool) -> None:
        self.params = params
        self._later = list(range(1, params.n)) if stagger else []

    def start_now(self) -> list[tuple[int, SamplingParams]]:
        """(choice index, its params) of the choices to start with the request."""
        later = set(self._later)
        return [(j, self.params.for_choice(j)) for j in range(self.params.n) if j not in later]

    def start_after_first_output(self) -> list[tuple[int, SamplingParams]]:
        """The choices that waited for the first one's first output; empty after the first call."""
        later, self._later = self._later, []
        return [(j, self.params.for_choice(j)) for j in later]
