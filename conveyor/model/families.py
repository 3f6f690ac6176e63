"""The model families conveyor serves, by the names each checkpoint format gives them, and the model
class that runs each."""

from __future__ import annotations

from conveyor.model.gemma3 import Gemma3Model
from conveyor.model.llama import LlamaModel, ModelArch

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
SUPPORTED = (f"Hugging Face folders of {', '.join(HF_ARCHITECTURES)} with safetensors weights, "
             f"or GGUF files of architecture {', '.join(GGUF_ARCHITECTURES)}")


def model_class(arch: ModelArch) -> type[LlamaModel]:
    return Gemma3Model if arch.family == "gemma3" else LlamaModel
