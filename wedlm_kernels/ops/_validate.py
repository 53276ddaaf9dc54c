"""Argument checks for the public boundary.

Every check reads only tensor metadata (type, dtype, shape, device, strides), never values,
so it costs no host synchronisation and traces cleanly under ``torch.compile``. Shapes are
given symbolically, e.g. ``("B", "S")``; the first tensor that mentions a symbol binds it and
every later one must agree, so mismatched batch sizes are reported with both argument names.
Value checks that do need a synchronisation live in :func:`debug_check` and only run when
``WEDLM_KERNELS_DEBUG=1``.
"""

import math
import re
from collections.abc import Callable, Sequence

import torch

from .. import _backend

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_SYMBOL = re.compile(r"^([A-Za-z_][A-Za-z_0-9]*)([+-]\d+)?$")


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


class Dims:
    """Symbolic dimension sizes bound by the first tensor that names them."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.bound_by: dict[str, str] = {}

    def __getitem__(self, symbol: str) -> int:
        return self.sizes[symbol]

    def bind(self, symbol: str, size: int, owner: str) -> None:
        self.sizes[symbol] = size
        self.bound_by[symbol] = owner


_COMPILED_SHAPES: dict[tuple, tuple[tuple[str | None, int], ...]] = {}


def _compile_shape(shape: tuple) -> tuple[tuple[str | None, int], ...]:
    """Per axis ``(symbol, offset)``: ``(None, size)`` for an exact size, ``(None, -1)`` for
    any size, ``("B", 1)`` for ``"B+1"``. Parsed once per distinct shape spec (a plain dict,
    not ``functools.cache``: Dynamo traces through a cache wrapper with a warning, and a
    dict lookup on constants it folds silently)."""
    compiled = _COMPILED_SHAPES.get(shape)
    if compiled is None:
        compiled = _COMPILED_SHAPES[shape] = _parse_shape(shape)
    return compiled


def _parse_shape(shape: tuple) -> tuple[tuple[str | None, int], ...]:
    compiled = []
    for spec in shape:
        if spec is None:
            compiled.append((None, -1))
        elif isinstance(spec, int):
            compiled.append((None, spec))
        else:
            match = _SYMBOL.match(spec)
            if match is None:
                raise AssertionError(f"bad shape spec {spec!r}")
            compiled.append((match.group(1), int(match.group(2) or 0)))
    return tuple(compiled)


def check_tensor(
    name: str,
    t: object,
    dtype: torch.dtype | Sequence[torch.dtype] | None,
    shape: Sequence[str | int | None] | None,
    dims: Dims | None = None,
    *,
    contiguous: bool = False,
    unit_last_stride: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; raise ``TypeError``/``ValueError`` naming ``name``.

    ``shape`` entries: an int (exact size), ``None`` (any size), a symbol ``"B"`` bound in
    ``dims`` or a symbol with an offset ``"B+1"`` (the symbol must be bound already or
    is bound from this size minus the offset). A call costs about a microsecond: it runs on
    every public op call.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        if t.dtype is not dtype and (isinstance(dtype, torch.dtype) or t.dtype not in dtype):
            allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
            raise TypeError(
                f"`{name}` must have dtype {_dtype_names(allowed)}, got "
                f"{str(t.dtype).replace('torch.', '')}"
            )
    if shape is not None:
        sizes = t.shape
        specs = _compile_shape(tuple(shape))
        if len(sizes) != len(specs):
            raise ValueError(
                f"`{name}` must be {len(shape)}-D [{', '.join(str(s) for s in shape)}], "
                f"got shape {list(sizes)}"
            )
        for axis, ((symbol, value), size) in enumerate(zip(specs, sizes)):
            if symbol is None:
                if value >= 0 and size != value:
                    raise ValueError(
                        f"`{name}` must have size {value} in dimension {axis}, got {size} "
                        f"(shape {list(sizes)})"
                    )
                continue
            if dims is None:
                raise AssertionError(f"shape spec {shape[axis]!r} needs a Dims")
            bound = dims.sizes.get(symbol)
            if bound is None:
                dims.bind(symbol, size - value, name)
            elif bound + value != size:
                raise ValueError(
                    f"`{name}` has size {size} in dimension {axis} but {shape[axis]} = "
                    f"{bound + value} (from `{dims.bound_by[symbol]}`)"
                )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"`{name}` must be contiguous (it is updated in place or indexed flat)")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"`{name}` must have stride 1 in its last dimension, got {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (``None`` skipped) must live on one device."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"`{name}` is on {t.device} but `{first}` is on {device}")
    assert device is not None
    return device


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")
    return value


def check_float(name: str, value: object, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"`{name}` must be > 0, got {value}")
    return float(value)


def debug_check(condition: torch.Tensor | bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` holds; only in debug mode.

    ``condition`` is a boolean tensor (all elements must be true) or a bool. Reading it
    synchronises with the device, which is why this only runs with ``WEDLM_KERNELS_DEBUG=1``.
    """
    if not _backend.DEBUG:
        return
    ok = bool(condition.all()) if isinstance(condition, torch.Tensor) else bool(condition)
    if not ok:
        raise ValueError(message)


class CheckedSignatures:
    """The argument signatures that passed an op's checks, so that a decode loop's repeated
    calls pay the checks once per signature: each tensor's dtype, shape, strides and device,
    and the other arguments' values (plain ``str``, ``int``, ``float`` or ``bool``). A call
    under tracing (``torch.compile``), with a tensor subclass or with another kind of
    argument is checked every time. At most ``limit`` signatures are kept."""

    def __init__(self, limit: int = 4096) -> None:
        self.seen: set[tuple] = set()
        self.limit = limit

    def check(self, check: Callable[..., None], tensors: tuple, *others) -> None:
        """``check(*tensors, *others)``, unless this signature has passed it before."""
        signature = self.signature(tensors, others)
        if signature is not None and signature in self.seen:
            return
        check(*tensors, *others)
        if signature is not None:
            if len(self.seen) >= self.limit:
                self.seen.clear()
            self.seen.add(signature)

    @staticmethod
    def signature(tensors: tuple, others: tuple) -> tuple | None:
        if (torch.compiler.is_compiling()
                or not all(type(t) is torch.Tensor for t in tensors)
                or not all(type(o) in (str, int, float, bool) for o in others)):
            return None
        return (*((type(o), o) for o in others),
                *((t.dtype, t.shape, t.stride(), t.device) for t in tensors))
