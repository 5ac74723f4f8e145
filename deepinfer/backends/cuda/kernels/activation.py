"""SiLU-and-multiply of a fused gate/up projection: out = silu(x[:, :F]) * x[:, F:].

The grid is (tokens, column blocks): F is large (14336 for Llama-3-8B), so a decode step with a
handful of tokens still fills the GPU. silu is rounded to the activation dtype before the
multiply, as the reference (torch.nn.functional.silu(gate) * up) does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.backends.cuda.kernels.pdl import launch_kwargs

_BLOCK = 1024  # 4 warps x 32 threads x 8 bf16 elements (one 16-byte vector each)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, f, sx_t, sy_t, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # let the next kernel launch now; wait for the one ahead (see pdl.py)
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    gate = tl.load(x_ptr + t * sx_t + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * sx_t + f + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t * sy_t + cols, (silu * up).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2F] (contiguous last dim, any token stride) -> silu(x[:, :F]) * x[:, F:] [T, F]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2F] with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    tokens, f = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((tokens, f), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, f) or out.stride(1) != 1:
        raise ValueError(f"out must be [{tokens}, {f}] with a contiguous last dim, got "
                         f"{tuple(out.shape)}")
    if tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(f))
    grid = (tokens, triton.cdiv(f, block))
    _silu_and_mul_kernel[grid](x, out, f, x.stride(0), out.stride(0), BLOCK=block,
                               num_warps=max(1, block // 256), **launch_kwargs(x.device))
    return out
