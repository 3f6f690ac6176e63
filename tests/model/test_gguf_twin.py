"""A GGUF file written from a tiny Hugging Face checkpoint (gguf's writer, F32 tensors, llama.cpp's
tensor names and metadata) loads as the same model: identical logits to its Hugging Face twin."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.model.loader import load_model

from test_hf_parity import PagedRunner, random_tokens

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Hugging Face names -> llama.cpp's, per layer.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",   # Phi-3 fuses them
}
# Gemma 3's norms before and after attention and MLP (its ffn_norm is the one before the MLP).
GEMMA3_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3"}


def _permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves q/k rows per head for its RoPE (llama only)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_twin(folder: Path, path: Path, arch: str) -> Path:
    config = json.loads((folder / "config.json").read_text())
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    if arch == "gemma3":   # llama.cpp's Gemma 3 scales q.k by 1/sqrt(head_dim): no key says otherwise
        assert config["query_pre_attn_scalar"] == head_dim
        writer.add_sliding_window(config["sliding_window"])
        writer.add_array("gemma3.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in config["layer_types"]])
        writer.add_float32("gemma3.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
        if rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta"))))
    for name, tensor in tensors.items():
        w = tensor.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            module, suffix = ".".join(parts[2:-1]), parts[-1]
            gguf_name = f"blk.{parts[1]}.{(GEMMA3_NAMES if arch == 'gemma3' else {}).get(module, LAYER_NAMES.get(module))}.{suffix}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                w = _permute_rope_rows(w, heads if module == "self_attn.q_proj" else kv_heads)
        else:
            gguf_name = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[".".join(parts)]
            if gguf_name == "output.weight" and config.get("tie_word_embeddings"):
                continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0   # llama.cpp's converter stores Gemma's norms as multipliers
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", list(ARCHES))
def test_gguf_twin_gives_the_hugging_face_logits(name: str, tiny_checkpoint_factory: Callable[[str], Path],
                                                 tmp_path: Path) -> None:
    folder = tiny_checkpoint_factory(name)
    twin = write_twin(folder, tmp_path / f"{name}.gguf", ARCHES[name])
    from_hf, from_gguf = load_model(folder), load_model(twin, quantization="auto")
    assert from_gguf.arch.qk_norm == (name in ("qwen3", "gemma3")) and from_gguf.arch.head_dim == from_hf.arch.head_dim
    assert from_gguf.arch.rope_dim == from_hf.arch.rope_dim
    assert from_gguf.arch.sliding_layers == from_hf.arch.sliding_layers
    assert from_gguf.arch.sliding_window == from_hf.arch.sliding_window
    prompts = random_tokens(from_hf.arch.vocab_size, (7, 19), seed=3)
    hf_runner, gguf_runner = PagedRunner(from_hf), PagedRunner(from_gguf)
    for prompt in prompts:
        ours_hf = hf_runner.step([(prompt, 0, hf_runner.allocate(len(prompt)))])[0]
        ours_gguf = gguf_runner.step([(prompt, 0, gguf_runner.allocate(len(prompt)))])[0]
        torch.testing.assert_close(ours_gguf, ours_hf, rtol=1e-5, atol=1e-5)
