"""Every decoder layer of a step in one C call (decoder.c), the model's head (final norm and output layer)
in the same call where it can run there: the per-layer constants are set once, the per-step inputs once
per forward, so a step costs one Python round trip instead of one per operation."""

from __future__ import annotations

import ctypes

import torch

from conveyor.kernels import threads
from conveyor.kernels.build import KernelLibrary

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerParams(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2", "gate_up",
                                        "gate_up_bias", "down", "down_bias")] + \
               [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "window")] + \
               [("eps", _F32), ("scale", _F32), ("format", _I64 * 4)] + \
               [(name, _P) for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")] + \
               [("act", _I64), ("local_rope", _I64), ("rope_dim", _I64)]

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}   # half.h's element formats


class StepParams(ctypes.Structure):
    _fields_ = [("T", _I64), ("cos", _P), ("sin", _P)] + \
               [(name, _P) for name in ("slots", "tables", "rows", "ctx_lens", "tokens", "tile_start")] + \
               [(name, _I64) for name in ("max_blocks", "tiles", "block_size", "num_threads")] + \
               [("is_bf16", ctypes.c_int), ("cos_local", _P), ("sin_local", _P), ("kv_fmt", _I64)] + \
               [("positions", _P), ("rope_rows", _I64)]


class HeadParams(ctypes.Structure):
    """The final norm and the output layer (weight and format as `_weight` gives them)."""
    _fields_ = [(name, _P) for name in ("norm", "weight", "bias")] + \
               [(name, _I64) for name in ("format", "hidden", "vocab")] + [("eps", _F32)]


def declare(lib: ctypes.CDLL) -> None:
    lib.decoder_layers.restype = ctypes.c_int
    lib.decoder_layers.argtypes = [_P, _P, _I64, ctypes.POINTER(StepParams), _P, _P, _P]
    lib.decoder_step.restype = ctypes.c_int
    lib.decoder_step.argtypes = [_P, _P, _I64, ctypes.POINTER(StepParams), _P, _P, _P, ctypes.POINTER(HeadParams),
                                 _P, _I64, _P]
    lib.decoder_struct_bytes.restype = _I64
    lib.decoder_struct_bytes.argtypes = [ctypes.c_int]
    for which, params in enumerate((LayerParams, StepParams, HeadParams)):
        if lib.decoder_struct_bytes(which) != ctypes.sizeof(params):
            raise RuntimeError(f"decoder.{params.__name__} does not match decoder.c's struct")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(linear) -> tuple[int, int]:
    """(pointer, format): a packed float linear (.packed) is format -1, a quantized one (.spec, a
    quant.LinearSpec holding its segments and biases) format 0."""
    if hasattr(linear, "packed"):
        return linear.packed.data_ptr(), -1
    return ctypes.addressof(linear.spec), 0


def layer_params(ln1: torch.Tensor, qkv, o, ln2: torch.Tensor, gate_up, down, *, eps: float, heads: int,
                 kv_heads: int, head_dim: int, window: int | None, scale: float, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, post_attn_norm: torch.Tensor | None = None,
                 post_mlp_norm: torch.Tensor | None = None, activation: str = "silu",
                 local_rope: bool = False, rope_dim: int | None = None) -> LayerParams:
    """From a layer's norm weights and its linears (PackedLinear or QuantLinear: .bias, shapes). The
    keyword norms are Gemma 3's; local_rope: the layer turns with the step's second RoPE table;
    rope_dim: the leading values of each head that turn (None: all, head_dim)."""
    (w_qkv, f_qkv), (w_o, f_o), (w_gu, f_gu), (w_down, f_down) = map(_weight, (qkv, o, gate_up, down))
    return LayerParams(
        _ptr(ln1), w_qkv, _ptr(qkv.bias), w_o, _ptr(o.bias), _ptr(ln2), w_gu, _ptr(gate_up.bias), w_down,
        _ptr(down.bias), o.out_features, heads, kv_heads, head_dim, down.in_features, window or 0, eps, scale,
        (_I64 * 4)(f_qkv, f_o, f_gu, f_down), _ptr(q_norm), _ptr(k_norm), _ptr(post_attn_norm),
        _ptr(post_mlp_norm), ACTIVATIONS[activation], int(local_rope), rope_dim or head_dim)


def scratch_elements(params: LayerParams, num_tokens: int) -> int:
    qkv = (params.heads + 2 * params.kv_heads) * params.head_dim
    return num_tokens * (params.hidden + qkv + params.heads * params.head_dim + 3 * params.intermediate)


def step_params(num_tokens: int, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, plan,
                block_size: int, is_bf16: bool, local: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_dtype: torch.dtype = torch.float32, positions: torch.Tensor | None = None) -> StepParams:
    """plan: the attention metadata's KernelPlan; local: the second RoPE table (cos, sin), if the model
    has one; kv_dtype: the cache's. cos, sin (and local's): the step's rows, one per token, or with
    `positions` (T,) int64 whole tables whose row positions[t] turns token t. The tensors must outlive the
    calls."""
    return StepParams(num_tokens, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), plan.block_tables.data_ptr(),
                      plan.rows.data_ptr(), plan.context_lens.data_ptr(), plan.tokens.data_ptr(),
                      plan.tile_start.data_ptr(), plan.block_tables.shape[1], plan.tile_start.shape[0] - 1,
                      block_size, threads.num_threads(), is_bf16, *(_ptr(t) for t in (local or (None, None))),
                      KV_FORMATS[kv_dtype], _ptr(positions), cos.shape[0])


def layer_array(layers: list[LayerParams]) -> ctypes.Array:
    """The layers' parameters as run_layers takes them (the LayerParams must outlive it)."""
    return (ctypes.POINTER(LayerParams) * len(layers))(*(ctypes.pointer(layer) for layer in layers))


def cache_pointers(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[ctypes.Array, ctypes.Array]:
    """The layers' K and V caches as run_layers takes them (the tensors must outlive the arrays)."""
    return ((_P * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches)),
            (_P * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches)))


def head_params(norm_weight: torch.Tensor, eps: float, head) -> HeadParams:
    """From the final norm's weight and the output linear (PackedLinear or QuantLinear; the objects must
    outlive the params)."""
    weight, fmt = _weight(head)
    return HeadParams(norm_weight.data_ptr(), weight, _ptr(getattr(head, "bias", None)) if fmt < 0 else None,
                      fmt, head.in_features, head.out_features, eps)


def run_step(lib: KernelLibrary, x: torch.Tensor, layers: ctypes.Array, step: StepParams,
             caches: tuple[ctypes.Array, ctypes.Array], scratch: torch.Tensor, head: HeadParams,
             rows: torch.Tensor, logits: torch.Tensor) -> None:
    """run_layers, then the head over rows `rows` (S,) int64 of x into logits (S, vocab) contiguous (float32
    for a quantized head, else x's dtype); scratch as run_layers takes it."""
    if lib.lib.decoder_step(x.data_ptr(), layers, len(layers), ctypes.byref(step), caches[0], caches[1],
                            scratch.data_ptr(), ctypes.byref(head), rows.data_ptr(), rows.shape[0],
                            logits.data_ptr()) != 0:
        raise ValueError("decoder_step: a kernel refused its shapes")


def run_layers(lib: KernelLibrary, x: torch.Tensor, layers: ctypes.Array, step: StepParams,
               caches: tuple[ctypes.Array, ctypes.Array], scratch: torch.Tensor) -> None:
    """Every layer of `layer_array` in one C call; x (T, hidden) contiguous, updated in place; caches:
    `cache_pointers` of the layers' KV caches."""
    if lib.lib.decoder_layers(x.data_ptr(), layers, len(layers), ctypes.byref(step), caches[0], caches[1],
                              scratch.data_ptr()) != 0:
        raise ValueError("decoder_layers: a kernel refused its shapes")
