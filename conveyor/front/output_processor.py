"""OutputProcessor: the core's token deltas -> text deltas, in the front.

Owns each request's incremental detokenizer, its text so far and the stop-string search. A stop
string found here ends the request for its client at once (an output finished with "stop" for a delta
the core did not finish: the Front tells the core to finish it), and the core's later deltas for it are
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.messages import RequestOutput, TokenDelta
from conveyor.text.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.sampling_params import SamplingParams


@dataclass(slots=True)
class _Stream:
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                             skip_special_tokens=params.skip_special_tokens,
                                             spaces_between_special_tokens=params.spaces_between_special_tokens)
        self._streams[request_id] = _Stream(prompt_token_ids, params, detokenizer)

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def process(self, delta: TokenDelta) -> RequestOutput | None:
        """One delta -> its text delta; None for a request this processor no longer tracks."""
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return None
        params = stream.params
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        token_ids, logprobs = delta.new_token_ids, delta.new_logprobs
        searched_from = len(stream.text)
        search = bool(params.stop) and finish_reason != "error"
        # Token by token: a delta of several tokens (verified guesses) may hold a stop string in its
        # middle, and the tokens after the one that completes it are not part of the output.
        for i, token_id in enumerate(token_ids):
            stream.text += stream.detokenizer.push(token_id)
            hit = _find_stop(stream.text, params.stop, searched_from) if search else None
            if hit is not None:
                index, stop = hit
                stream.text = stream.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                token_ids, logprobs = token_ids[:i + 1], logprobs[:i + 1]
                finish_reason, stop_reason = "stop", stop
                break
        finished = finish_reason is not None
        # While running, hold back a tail that could be the start of a stop string.
        hold = 0 if finished or not params.stop else max(len(s) for s in params.stop) - 1
        end = max(len(stream.text) - hold, stream.num_emitted_chars)
        new_text = stream.text[stream.num_emitted_chars:end]
        stream.num_emitted_chars = end
        output = RequestOutput(delta.request_id, token_ids, new_text, logprobs, prompt_logprobs=delta.prompt_logprobs)
        if finished:
            del self._streams[delta.request_id]
            output.finished = True
            output.finish_reason = finish_reason
            output.stop_reason = stop_reason
            output.error = delta.error
            output.metrics = delta.metrics
            output.prompt_token_ids = stream.prompt_token_ids
        return output


def _find_stop(text: str, stops: list[str], searched_from: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, searched_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
