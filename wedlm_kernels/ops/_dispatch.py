"""How a public op call reaches its implementation.

Through ``torch.ops.wedlm.<op>`` (the ``torch.library`` dispatcher) a call costs tens of
microseconds of Python before the implementation runs. That path is needed only where
someone looks at the call: ``torch.compile``/``torch.export`` tracing, a dispatch or
function mode (fake tensors, ``opcheck``, ``__torch_dispatch__`` tools), functorch
transforms, or tensor subclasses. In plain eager mode on CPU or CUDA tensors, :func:`call`
runs the implementation the dispatcher would pick (``_library.kernel_for``) directly.
"""

from collections.abc import Callable

import torch

# op name -> {device type: implementation}; filled by _library when it registers the ops
IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {}


def _plain_eager(args: tuple) -> bool:
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._are_functorch_transforms_active()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))


def through_dispatcher(name: str, args: tuple):
    return getattr(torch.ops.wedlm, name)(*args)


def call(name: str, *args):
    """Run op ``name`` on ``args`` (already validated): directly in plain eager mode, else
    through ``torch.ops.wedlm.<name>``."""
    if _plain_eager(args):
        implementation = IMPLEMENTATIONS[name].get(args[0].device.type)
        if implementation is not None:
            return implementation(*args)
    return through_dispatcher(name, args)
