"""The model class that runs each family (the names each checkpoint format gives them: checkpoint.py)."""

from __future__ import annotations

from conveyor.model.gemma3 import Gemma3Model
from conveyor.model.llama import LlamaModel, ModelArch


def model_class(arch: ModelArch) -> type[LlamaModel]:
    return Gemma3Model if arch.family == "gemma3" else LlamaModel
