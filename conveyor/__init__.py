"""conveyor: an LLM serving engine built around continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.llm import LLM, CompletionOutput

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `conveyor.core` can be used without loading torch.
    if name in ("LLM", "CompletionOutput"):
        from conveyor import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
