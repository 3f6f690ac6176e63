"""Offline API in the shape vLLM users know: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import gc
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import EngineConfig, default_batch_preset
from conveyor.front.llm_engine import LLMEngine
from conveyor.front.front import Choices
from conveyor.engine.messages import RequestMetrics, RequestOutput
from conveyor.logprobs import PromptLogprob, TokenLogprobs
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Message = dict[str, Any]


@dataclass(slots=True)
class CompletionOutput:
    prompt: Prompt
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    index: int = 0                     # which of its prompt's n choices
    prompt_logprobs: list[PromptLogprob | None] | None = None   # with params.prompt_logprobs (choice 0 only)
    siblings: list[CompletionOutput] = field(default_factory=list)   # choices 1..n-1 of its prompt

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape, `outs[i].outputs[j].text`: the prompt's n choices, this one first."""
        return [self, *self.siblings]


@dataclass(slots=True)
class _Pending:
    prompt: Prompt
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class _Later:
    prompt: Prompt
    choices: Choices
    request_ids: list[str]


class LLM:
    """Runs many prompts through one continuous batch; outputs come back in input order."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        # Offline, nobody waits on each token: steps are sized for throughput unless asked otherwise
        # (the balanced preset's latency target cost 20-25 % of offline throughput, see BENCHMARKS.md).
        if not engine_options.get("batch_preset"):
            device = str(engine_options.get("device", "cpu"))
            engine_options["batch_preset"] = default_batch_preset(device, offline=True)
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        pending: dict[str, _Pending] = {}
        order: list[list[str]] = []      # per prompt, its choices' request ids
        # Only with prefix caching is there a gain in the other choices waiting for the first's output.
        stagger = self.engine.core.info.enable_prefix_caching
        later: dict[str, _Later] = {}    # first choice's request id -> the choices that wait for it
        try:
            for prompt, params in zip(prompts, params_list):
                ids = [uuid.uuid4().hex for _ in range(params.n)]
                pending.update((request_id, _Pending(prompt)) for request_id in ids)
                order.append(ids)
                choices = Choices(params, stagger)
                for j, choice in choices.start_now():
                    self.engine.add_request(prompt, choice, request_id=ids[j])
                later[ids[0]] = _Later(prompt, choices, ids)
            gc.freeze()   # the engine and the caller's objects outlive this run: full collections skip them
            try:
                results = self._run(pending, later, use_tqdm)
            finally:
                gc.unfreeze()   # nothing stays pinned after it (a dropped engine's cycles are collectable)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        outputs = []
        for ids in order:
            first = results[ids[0]]
            first.siblings = [results[request_id] for request_id in ids[1:]]
            for index, sibling in enumerate(first.siblings, start=1):
                sibling.index = index
            outputs.append(first)
        return outputs

    def chat(self, conversations: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True) -> list[CompletionOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts: list[Prompt] = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True),
                                  add_special_tokens=False)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, pending: dict[str, _Pending], later: dict[str, _Later],
             use_tqdm: bool | Callable[..., Any]) -> dict[str, CompletionOutput]:
        """Step until every pending request finished; `later` choices start when their first choice's first output comes."""
        results: dict[str, CompletionOutput] = {}
        progress = _progress_bar(len(pending), use_tqdm)
        try:
            while len(results) < len(pending):
                for output in self.engine.step():
                    waiting = later.pop(output.request_id, None)
                    if waiting is not None:
                        for j, params in waiting.choices.start_after_first_output():
                            self.engine.add_request(waiting.prompt, params, request_id=waiting.request_ids[j])
                    self._collect(pending, results, output)
                    if output.finished and progress is not None:
                        progress.update(1)
                if not self.engine.has_unfinished_requests() and len(results) < len(pending):
                    raise RuntimeError("engine went idle with requests unfinished")
        finally:
            if progress is not None:
                progress.close()
        return results

    def _collect(self, pending: dict[str, _Pending], results: dict[str, CompletionOutput],
                 output: RequestOutput) -> None:
        state = pending.get(output.request_id)
        if state is None:
            return
        state.token_ids.extend(output.new_token_ids)
        state.text.append(output.new_text)
        state.logprobs.extend(output.new_logprobs)
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            metrics = output.metrics
            results[output.request_id] = CompletionOutput(
                prompt=state.prompt,
                prompt_token_ids=output.prompt_token_ids or [],
                text="".join(state.text),
                token_ids=state.token_ids,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
                logprobs=state.logprobs or None,
                metrics=metrics,
                error=output.error,
                prompt_logprobs=state.prompt_logprobs,
            )


def _progress_bar(total: int, use_tqdm: bool | Callable[..., Any]) -> Any:
    """A progress bar only on a terminal; off when use_tqdm is False."""
    import sys

    if use_tqdm is False or total < 2 or not sys.stderr.isatty():
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="generating", unit="req")
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
