"""Public op calls skip the ``torch.library`` dispatcher only in plain eager mode: wherever
something observes the call (tracing, dispatch or function modes, tensor subclasses) they go
through ``torch.ops.wedlm``, whose registrations ``test_custom_ops.py`` checks."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import wedlm_kernels as wk
from wedlm_kernels.ops import _dispatch, _library


def _attention_args():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, generator=g)
    cache = torch.randn(2, 4, 1, 8, generator=g)
    return (q, cache, cache.clone(), torch.tensor([[1, 0]], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.35)


class _Recorder:
    """Stands in for the implementation and for ``torch.ops.wedlm`` and records which one
    a call reached."""

    def __init__(self, monkeypatch):
        self.reached = []
        implementation = _dispatch.IMPLEMENTATIONS["paged_attention"]["cpu"]
        through_dispatcher = _dispatch.through_dispatcher

        def direct(*args):
            self.reached.append("direct")
            return implementation(*args)

        def dispatched(name, args):
            self.reached.append("dispatcher")
            return through_dispatcher(name, args)

        monkeypatch.setitem(_dispatch.IMPLEMENTATIONS["paged_attention"], "cpu", direct)
        monkeypatch.setattr(_dispatch, "through_dispatcher", dispatched)


def test_every_op_has_the_implementations_the_dispatcher_would_run():
    assert set(_dispatch.IMPLEMENTATIONS) == set(_library.OPS)
    for name, table in _dispatch.IMPLEMENTATIONS.items():
        for device_type in ("cpu", "cuda"):
            assert table[device_type] is _library.kernel_for(name, device_type)


def test_plain_eager_calls_run_the_implementation_directly(monkeypatch):
    args = _attention_args()
    expected = torch.ops.wedlm.paged_attention(*args)
    recorder = _Recorder(monkeypatch)
    out = wk.paged_attention(*args)
    assert recorder.reached == ["direct"]
    assert torch.equal(out, expected)


class _PassThroughDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassThroughFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [_PassThroughDispatch, _PassThroughFunction])
def test_calls_under_a_mode_go_through_the_dispatcher(monkeypatch, mode):
    args = _attention_args()
    recorder = _Recorder(monkeypatch)
    with mode():
        wk.paged_attention(*args)
    assert recorder.reached == ["dispatcher"]


def test_tensor_subclasses_go_through_the_dispatcher(monkeypatch):
    class Marked(torch.Tensor):
        pass

    args = list(_attention_args())
    args[3] = args[3].as_subclass(Marked)  # not the first argument
    recorder = _Recorder(monkeypatch)
    wk.paged_attention(*args)
    assert recorder.reached == ["dispatcher"]


def test_traced_calls_go_through_the_dispatcher(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    recorder = _Recorder(monkeypatch)
    wk.paged_attention(*_attention_args())
    assert recorder.reached == ["dispatcher"]
