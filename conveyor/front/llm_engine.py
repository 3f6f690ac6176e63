"""LLMEngine: an EngineCore in this thread, behind an `InlineCoreClient`, with the front's text work around it.

Synchronous and single-threaded: the offline API and `conveyor generate` call `step()` in a loop.
Text (tokenization, admission, detokenization, stop strings) and request tracking are the `Front`'s,
tokens the core's; the server holds the same Front over a thread or process client (`async_engine.py`,
`core_process.py`) and sends the same commands. Offline, the core stays in this thread: with no event
loop to share the GIL with, a core process would only add its start-up (about 5 s to spawn and import
torch) and a pickle per step.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.config import EngineConfig
from conveyor.engine.core import EngineCore
from conveyor.engine.core_client import InlineCoreClient
from conveyor.front.front import Front, Rejected
from conveyor.engine.messages import RequestMetrics, RequestOutput
from conveyor.errors import InvalidRequest
from conveyor.text.tokenizer import Tokenizer
from conveyor.text.tokenizer_loader import load_tokenizer
from conveyor.model.checkpoint import default_model_name
from conveyor.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.core.block_manager import BlockManager
    from conveyor.core.scheduler import Scheduler
    from conveyor.engine.stats import EngineStats, StepStats
    from conveyor.model.llama import LlamaModel
    from conveyor.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestMetrics", "RequestOutput"]


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.core = EngineCore(config, clock)
        self.client = InlineCoreClient(self.core)
        self.tokenizer: Tokenizer = load_tokenizer(self.core.model_path, config.model.chat_template)
        self.model_name = config.model.served_model_name or default_model_name(self.core.model_path)
        self.front = Front(self.tokenizer, self.core.info, self.client.send)

    # The core's parts, for callers that look inside (tests, the benchmark).
    @property
    def model_path(self) -> Path:
        return self.core.model_path

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def blocks(self) -> BlockManager:
        return self.core.blocks

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def model(self) -> LlamaModel:
        return self.core.model

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def last_step(self) -> StepStats | None:
        return self.core.last_step

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    arrival_s: float | None = None, tenant: str = "") -> str:
        """Tokenize and queue a request. Raises InvalidRequest / ContextLengthExceeded / QueueFull."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequest("add_request runs one sequence: n choices are LLM.generate's and the server's",
                                 param="n")
        request_id = request_id or uuid.uuid4().hex
        self.front.compile_grammar(params)   # in the server's order: the grammar, then the prompt
        request = self.front.make_request(request_id, self.encode_prompt(prompt), params,
                                          self.clock() if arrival_s is None else arrival_s, priority, tenant)
        _raise_first(self.front.start([request]))
        return request_id

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.front.encode_prompt(prompt)

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state; its KV blocks are free before the next step. False if unknown or finished."""
        is_running = request_id in self.front.processor
        self.front.abort([request_id])
        return is_running

    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests()

    # ------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        outputs, rejected = self.front.process(self.client.step())
        _raise_first(rejected)   # never: an inline core refuses an add when it is sent
        return outputs


def _raise_first(rejected: Rejected) -> None:
    """An add the core refused, raised to the caller as the core raised it."""
    for _, exc in rejected:
        raise exc
