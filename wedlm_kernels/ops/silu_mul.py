"""silu_mul: the gated activation of a SwiGLU MLP, read from the fused gate/up projection.

Qwen-family MLPs compute ``down(silu(gate(x)) * up(x))``. Decoders run ``gate`` and ``up`` as
one GEMM whose output row holds the ``I`` gate values followed by the ``I`` up values; this op
reads both halves of that row in place and writes ``silu(gate) * up``, with the roundings of
PyTorch's ``F.silu(gate) * up`` in the input dtype. (Liger-Kernel's SwiGLU takes the two
halves as separate tensors of one stride, which this layout would have to copy first.)

Two implementations: ``silu_mul_torch`` (PyTorch, the CPU path) and ``silu_mul_triton``
(one launch, a 2-D grid of rows x column tiles).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _dispatch
from ._triton import POINTER_TYPES, KernelVariant
from ._validate import FLOAT_DTYPES, Dims, check_tensor


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    r"""``silu(gate) * up`` of a fused gate/up projection.

    Parameters
    ----------
    gate_up : torch.Tensor
        ``[N, 2 * I]`` float32, float16 or bfloat16, stride 1 in the last dimension (any row
        stride): row ``n`` holds ``gate[n, :I]`` followed by ``up[n, :I]``.

    Returns
    -------
    out : torch.Tensor
        ``[N, I]`` in gate_up's dtype, contiguous: ``silu(gate)`` rounded to the dtype, times
        ``up``, rounded again (exactly the two roundings of ``F.silu(gate) * up``;
        ``silu(g) = g * sigmoid(g)`` is computed in float32).

    Examples
    --------
    >>> import torch, wedlm_kernels as wk
    >>> gate_up = torch.tensor([[0.0, 2.0, 3.0, 5.0]])      # gate [0, 2], up [3, 5]
    >>> [round(value, 4) for value in wk.silu_mul(gate_up)[0].tolist()]
    [0.0, 8.808]
    """
    dims = Dims()
    check_tensor("gate_up", gate_up, FLOAT_DTYPES, ("N", "width"), dims, unit_last_stride=True)
    if dims["width"] % 2 != 0:
        raise ValueError(
            f"`gate_up` must have an even last dimension (gate then up), got {dims['width']}"
        )
    return _dispatch.call("silu_mul", gate_up)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).contiguous()


def silu_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


# ---------------------------------------------------------------------------- Triton kernel
#
# Program (row n, tile t) handles columns t * BLOCK .. t * BLOCK + BLOCK - 1 of the I outputs:
#     out[n, i] = round(round(silu(g)) * u),   g = gate_up[n, i], u = gate_up[n, I + i],
# silu(g) = g * sigmoid(g) in float32. The product of two values of a 16-bit float type is
# exact in float32 (at most 2 x 11 significant bits), so multiplying the rounded silu by u in
# float32 and rounding once gives the correctly rounded product, as PyTorch's multiply does;
# it also keeps bf16 arithmetic out of the kernel (wrong in Triton's interpreter). Row
# offsets are int64 (N * 2I can exceed 2^31).


# One compiled specialisation per dtype: Triton would otherwise make sizes equal to 1 constants.
@triton.jit(do_not_specialize=["gate_up_row_stride", "intermediate"])
def _silu_mul_kernel(
    gate_up_ptr,  # [N, 2I], unit last stride
    out_ptr,  # [N, I] contiguous
    gate_up_row_stride,
    intermediate,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < intermediate
    source = gate_up_ptr + row * gate_up_row_stride + columns
    gate = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(source + intermediate, mask=mask, other=0.0).to(tl.float32)
    activated = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * intermediate + columns,
             (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


# 1024 outputs per program with 4 warps: 8 elements (16 bytes of bf16) per thread and
# load; an 8B model's decode step (N = 16..64 rows, I = 12288) gets 192..768 programs.
_BLOCK = 1024
_NUM_WARPS = 4


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`silu_mul` (arguments validated by the caller)."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype,
                      device=gate_up.device)
    silu_mul_into(out, gate_up)
    return out


def silu_mul_into(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """The launch, writing into a given contiguous ``out [N, I]`` (tests hand it one between
    guard bands)."""
    rows, intermediate = out.shape
    if out.numel() == 0:
        return
    _silu_mul_kernel[(rows, triton.cdiv(intermediate, _BLOCK))](
        gate_up, out, gate_up.stride(0), intermediate, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )


def kernel_variants() -> list[KernelVariant]:
    """Every specialisation :func:`silu_mul_triton` launches: one per dtype."""
    return [
        KernelVariant(
            name=short,
            kernel=_silu_mul_kernel,
            signature={"gate_up_ptr": POINTER_TYPES[dtype], "out_ptr": POINTER_TYPES[dtype],
                       "gate_up_row_stride": "i32", "intermediate": "i32",
                       "BLOCK": "constexpr"},
            constexprs={"BLOCK": _BLOCK},
            num_warps=_NUM_WARPS,
        )
        for dtype, short in ((torch.float32, "fp32"), (torch.float16, "fp16"),
                             (torch.bfloat16, "bf16"))
    ]
