"""Registration of every op as a ``torch.library.custom_op`` in namespace ``wedlm``.

This is the one place where ops are registered. Each op family module in ``ops/`` provides

- ``<op>_torch``: the vectorised PyTorch implementation; its type hints define the schema,
  and it is the default kernel for every device;
- ``<op>_fake``: the fake (meta) kernel used by ``torch.compile`` and ``opcheck``;
- optionally ``<op>_triton``: the Triton launcher, registered for CUDA tensors (backends
  ``auto`` and ``interpret``) and for CPU tensors under the ``interpret`` backend.

The public functions (``wedlm_kernels.<op>``) validate their arguments and then call
``_dispatch.call``: the implementation directly in plain eager mode, ``torch.ops.wedlm.<op>``
wherever the dispatcher must see the call (``torch.compile``, fake tensors, ...).
"""

from types import ModuleType

import torch

from .._backend import BACKEND
from . import _dispatch, attention, commit, logits, reorder, rope, select, silu_mul

# op name -> (module, mutated arguments)
OPS: dict[str, tuple[ModuleType, tuple[str, ...]]] = {
    "reorder_window": (reorder, ()),
    "rope_kv_append": (rope, ("k_cache", "v_cache")),
    "paged_attention": (attention, ()),
    "process_logits": (logits, ("logits",)),
    "select_tokens": (select, ()),
    "commit_window": (
        commit,
        ("win_tokens", "win_mask", "win_len", "ctx_len", "out_tokens", "out_len", "finished"),
    ),
    "silu_mul": (silu_mul, ()),
}


def triton_launcher(name: str):
    """The Triton launcher of op ``name``, or ``None`` while the op has no kernel."""
    module, _ = OPS[name]
    return getattr(module, f"{name}_triton", None)


def kernel_for(name: str, device_type: str):
    """The implementation that op ``name`` runs for tensors on ``device_type``."""
    module, _ = OPS[name]
    launcher = triton_launcher(name)
    if launcher is not None:
        if device_type == "cuda" and BACKEND in ("auto", "interpret"):
            return launcher
        if device_type == "cpu" and BACKEND == "interpret":
            return launcher
    return getattr(module, f"{name}_torch")


def _register(name: str) -> torch.library.CustomOpDef:
    module, mutates = OPS[name]
    op = torch.library.custom_op(f"wedlm::{name}", mutates_args=mutates)(
        getattr(module, f"{name}_torch")
    )
    op.register_fake(getattr(module, f"{name}_fake"))
    for device_type in ("cpu", "cuda"):
        impl = kernel_for(name, device_type)
        if impl is not getattr(module, f"{name}_torch"):
            op.register_kernel(device_type, impl)
    _dispatch.IMPLEMENTATIONS[name] = {
        device_type: kernel_for(name, device_type) for device_type in ("cpu", "cuda")
    }
    return op


CUSTOM_OPS: dict[str, torch.library.CustomOpDef] = {name: _register(name) for name in OPS}
