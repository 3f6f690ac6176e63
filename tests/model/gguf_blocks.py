"""Seeded GGUF blocks of every format our kernels take, with valid scales, as a file would hold them.

gguf can quantize Q8_0 / Q4_0 / Q4_1 / Q5_0 but not the K-quants, so those are built from random
codes with scales chosen so the weights are centred near zero at about `scale` in size, as a real
quantizer's would be (a positive mean would make a model's activations grow layer by layer).
"""

from __future__ import annotations

import gguf
import numpy as np

TYPES = {name: getattr(gguf.GGMLQuantizationType, name.upper())
         for name in ("q5_0", "q5_1", "iq4_nl", "q4_k", "q5_k", "q6_k", "iq4_xs", "q3_k", "q8_0", "q4_0", "q4_1")}


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(fmt: str, n: int, k: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """GGUF blocks (n, bytes per row) of an (n, k) tensor in `fmt`."""
    rng = np.random.default_rng(seed)
    if fmt in ("q5_0", "q5_1", "q8_0", "q4_0", "q4_1"):
        w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
        w[:, :32] *= 10                                                   # an outlier block
        return gguf.quants.quantize(w, TYPES[fmt])
    if fmt == "iq4_nl":                                                   # d, then 16 bytes of table indices
        raw = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
        raw[:, :, 0:2] = _f16(rng.uniform(0.5, 1.5, size=(n, k // 32)) * scale / 127)
        return raw.reshape(n, -1)
    nb = k // 256
    d = rng.uniform(0.5, 1.5, size=(n, nb)) * scale
    if fmt == "iq4_xs":                                                   # d, 6-bit scales (high, low), indices
        raw = rng.integers(0, 256, size=(n, nb, 136), dtype=np.uint8)
        raw[:, :, 0:2] = _f16(d / (127 * 32))
        return raw.reshape(n, -1)
    if fmt == "q3_k":                                                     # hmask, 2-bit codes, 6-bit scales, d
        raw = rng.integers(0, 256, size=(n, nb, 110), dtype=np.uint8)
        raw[:, :, 108:110] = _f16(d / (4 * 32))
        return raw.reshape(n, -1)
    if fmt == "q6_k":
        raw = np.empty((n, nb, 210), np.uint8)
        raw[:, :, :192] = rng.integers(0, 256, size=(n, nb, 192))         # 6-bit codes
        raw[:, :, 192:208] = rng.integers(-40, 41, size=(n, nb, 16)).astype(np.int8).view(np.uint8)
        raw[:, :, 208:210] = _f16(d / (40 * 32))
        return raw.reshape(n, -1)
    top = 15 if fmt == "q4_k" else 31
    raw = np.empty((n, nb, 144 if fmt == "q4_k" else 176), np.uint8)
    sc = rng.integers(8, 16, size=(n, nb, 8))              # 4-bit scales and mins: no high bits to pack
    f = (top + 1) // 2                                     # dmin = f d and m ~ sc: the min is half the range
    m = np.clip(np.rint(sc * top / 2 / f), 0, 15).astype(np.int64)
    raw[:, :, 0:2] = _f16(d / (15 * top))                                  # d
    raw[:, :, 2:4] = _f16(f * d / (15 * top))                              # dmin
    raw[:, :, 4:8] = sc[:, :, :4]
    raw[:, :, 8:12] = m[:, :, :4]
    raw[:, :, 12:16] = sc[:, :, 4:] | (m[:, :, 4:] << 4)
    raw[:, :, 16:] = rng.integers(0, 256, size=(n, nb, raw.shape[2] - 16))
    return raw.reshape(n, -1)


def llama_layer_shapes(hidden: int, ffn: int, heads: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    """A Llama layer's weight shapes (rows, columns) by GGUF tensor kind, for writing tiny test files."""
    head_dim = hidden // heads
    return {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
            "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
