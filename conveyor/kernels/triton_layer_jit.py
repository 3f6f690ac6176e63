"""The Triton kernels behind triton_layer.py, imported only where they run (Triton's import is slow)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    dtype = out_ptr.dtype.element_ty
    normed = (x * inv).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (normed * w).to(dtype, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, token_stride, head_stride, table_stride, D: tl.constexpr,
                   BLOCK: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    base = x_ptr + token * token_stride + head * head_stride
    x = tl.load(base + offs, mask=mask, other=0.0)
    rolled = tl.load(base + (offs + D // 2) % D, mask=mask, other=0.0)
    c = tl.load(cos_ptr + token * table_stride + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * table_stride + offs, mask=mask, other=0.0)
    dtype = x.dtype
    a = (x.to(tl.float32) * c.to(tl.float32)).to(dtype, fp_downcast_rounding="rtne")
    b = (rolled.to(tl.float32) * s.to(tl.float32)).to(dtype, fp_downcast_rounding="rtne")
    out = (a.to(tl.float32) + b.to(tl.float32)).to(dtype, fp_downcast_rounding="rtne")
    tl.store(base + offs, out, mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (act * up).to(dtype, fp_downcast_rounding="rtne"), mask=mask)
