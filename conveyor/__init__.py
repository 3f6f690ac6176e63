"""conveyor: an LLM serving engine built around continuous batching."""

from conveyor.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.llm import LLM, CompletionOutput
from conveyor.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig"]
