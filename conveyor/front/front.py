"""Front: the work both faces do on their side of the core, written once.

The offline `LLMEngine` (a core in this process, stepped by its caller) and the server's
`AsyncEngine` (a core behind a `CoreClient`) each hold one Front; only how they reach the core
differs. The Front turns a prompt and its SamplingParams into a `CoreRequest` (tokenize, admit:
the same refusals with the same messages from both faces) and the core's token deltas into text
deltas (detokenize, stop strings). Each prompt's n choices are `SamplingParams.for_choice`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from conveyor.front.admission import bad_words_token_ids, check_request, check_token_ids, truncate_prompt
from conveyor.engine.messages import CoreInfo, CoreRequest, RequestOutput, TokenDelta
from conveyor.front.output_processor import OutputProcessor
from conveyor.engine.structured_output import GrammarCompiler, grammar_compiler
from conveyor.text.tokenizer import Tokenizer
from conveyor.sampling_params import SamplingParams


class Front:
    def __init__(self, tokenizer: Tokenizer, info: CoreInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
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
        prompt_token_ids = truncate_prompt(prompt_token_ids, params, self.info.max_model_len)
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=bad_words_token_ids(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        max_tokens = check_request(prompt_token_ids, params, self.info)
        return CoreRequest(request_id, prompt_token_ids, params, max_tokens, self.tokenizer.eos_token_ids,
                           arrival_s, priority, tenant, is_background)

    def track(self, request: CoreRequest) -> None:
        """Turn this request's deltas into text from now on."""
        self.processor.add(request.request_id, request.prompt_token_ids, request.params)

    def drop(self, request_id: str) -> None:
        self.processor.drop(request_id)

    def process(self, deltas: Iterable[TokenDelta]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """The text deltas of the tracked requests, and (request id, stop string) of those whose stop
        string was found: the caller tells the core to finish them."""
        outputs = [output for delta in deltas if (output := self.processor.process(delta)) is not None]
        return outputs, self.processor.take_stop_hits()


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
