"""A Hugging Face model folder (config.json and safetensors) -> ModelArch and Hugging Face-named tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.checkpoint import HF_ARCHITECTURES, SUPPORTED
from conveyor.model.llama import ModelArch

GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma 3's defaults where a config leaves them out (transformers' Gemma3TextConfig).
_GEMMA3_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "global_theta": 1_000_000.0, "local_theta": 10_000.0, "pattern": 6}


def read_hf_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder / 'config.json'} does not hold a JSON object")
    return config


def _architecture(cfg: dict) -> str:
    architectures = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    name = architectures if isinstance(architectures, str) else architectures[0]
    if name not in HF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {name!r}. Supported: {SUPPORTED}.")
    return name


def arch_from_hf_config(cfg: dict) -> ModelArch:
    name = _architecture(cfg)
    if name in GEMMA3:
        return _gemma3_arch(name, cfg.get("text_config") or cfg if name == GEMMA3[1] else cfg)
    rope = cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    num_heads = cfg["num_attention_heads"]
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if name in ("MistralForCausalLM", "Phi3ForCausalLM"):
        sliding = tuple([window is not None] * num_layers)
    elif name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("layer_types"):
        sliding = tuple(t == "sliding_attention" for t in cfg["layer_types"])
    elif name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        sliding = tuple(i >= first for i in range(num_layers))
    else:
        sliding = tuple([False] * num_layers)
    if not any(sliding):
        window = None
    attention_bias = bool(cfg.get("attention_bias", False))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rotary = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return ModelArch(
        architecture=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=name == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias and name != "Qwen2ForCausalLM",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
        sliding_layers=sliding,
        qk_norm=name == "Qwen3ForCausalLM",
        rotary_dim=int(head_dim * rotary) if rotary < 1.0 else None,
    )


def _gemma3_arch(name: str, cfg: dict) -> ModelArch:
    """Gemma 3's text model. Its RoPE comes per layer type (transformers 5's rope_parameters keyed by
    full_attention / sliding_attention) or, in older configs, as rope_theta, rope_local_base_freq and a
    rope_scaling for the global layers."""
    d = _GEMMA3_DEFAULTS
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelLoadError(f"Gemma 3 config sets {key}, which conveyor does not implement")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention (an embedding model) is not a text generator")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"unsupported Gemma 3 activation {cfg['hidden_activation']!r}")
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", d["pattern"]) else "full_attention"
        for i in range(num_layers)]
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", d["global_theta"])}
        local = {"rope_theta": cfg.get("rope_local_base_freq", d["local_theta"])}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError("Gemma 3 config scales the sliding layers' RoPE, which conveyor does not implement")
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    num_heads = cfg["num_attention_heads"]
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    return ModelArch(
        architecture=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or d["head_dim"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", d["global_theta"])),
        rope_scaling=scaling if scaling.get("rope_type", scaling.get("type", "default")) != "default" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=cfg.get("sliding_window", d["sliding_window"]) if any(sliding) else None,
        sliding_layers=sliding,
        qk_norm=True,
        family="gemma3",
        attn_scale=float(cfg.get("query_pre_attn_scalar", d["query_pre_attn_scalar"])) ** -0.5,
        rope_local_theta=float(local.get("rope_theta", d["local_theta"])),
        hidden_act="gelu_tanh",
    )


def open_hf_folder(folder: Path) -> tuple[ModelArch, Iterator[tuple[str, torch.Tensor]], None]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    arch = arch_from_hf_config(read_hf_config(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (other weight formats are not "
                             f"supported). Expected {SUPPORTED}.")

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc

    return arch, (_gemma3_weights(weights()) if arch.family == "gemma3" else weights()), None


def _gemma3_weights(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors under the causal LM's names, norms as multipliers (Hugging Face stores
    multiplier - 1). A multimodal folder's vision tower and projector are left out."""
    for name, tensor in weights:
        for prefix, ours in (("model.language_model.", "model."), ("language_model.model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
            if name.startswith(prefix):
                name = ours + name.removeprefix(prefix)
                break
        if name.startswith(("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                            "model.multi_modal_projector.")):
            continue
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor
