"""ops/_triton.CachedLaunch: which launches reuse a kept compiled handle and how it is
called, with a stand-in kernel and tensors that say they are on CUDA (the GPU check
``test_kept_launch_handles_are_the_kernels_triton_picks`` runs the real thing)."""

import pytest
import torch

from wedlm_kernels.ops._triton import CachedLaunch


class CudaLike:
    """An argument that says it is on CUDA (CachedLaunch keys it by identity)."""

    is_cuda = True


class Handle:
    """A compiled kernel: records the grids it is launched on."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args: None


class Kernel:
    """A @triton.jit kernel as CachedLaunch sees it: ``kernel[grid](...)`` compiles (here:
    makes a Handle) and returns the compiled kernel."""

    def __init__(self) -> None:
        self.compiled: list[Handle] = []

        def fn(x, n, BLOCK):  # noqa: N803 - a constexpr's name
            pass

        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.compiled.append(Handle(options))
            return self.compiled[-1]
        return launch


@pytest.fixture
def device(monkeypatch):
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return current


def test_a_repeated_launch_runs_the_kept_handle_on_a_three_dimensional_grid(device):
    kernel, x = Kernel(), CudaLike()
    launch = CachedLaunch(kernel)
    launch((4, 2), x, 7, BLOCK=32, num_warps=4)
    launch((4, 2), x, 7, BLOCK=32, num_warps=4)
    launch((5,), x, 7, BLOCK=32, num_warps=4)
    assert len(kernel.compiled) == 1
    assert kernel.compiled[0].grids == [(4, 2, 1), (5, 1, 1)]


@pytest.mark.parametrize("change", ["constexpr value", "launch option", "current device",
                                    "int specialisation", "warps"])
def test_a_launch_triton_would_compile_differently_gets_its_own_handle(device, change):
    kernel, x = Kernel(), CudaLike()
    launch = CachedLaunch(kernel)
    launch((1, 1, 1), x, 32, BLOCK=32, num_warps=4, num_stages=3)
    arguments = dict(n=32, BLOCK=32, num_warps=4, num_stages=3)
    if change == "constexpr value":
        arguments["BLOCK"] = 64  # (both multiples of 16: not a difference of specialisation)
    elif change == "launch option":
        arguments["num_stages"] = 2
    elif change == "current device":
        device[0] = 1
    elif change == "int specialisation":
        arguments["n"] = 33
    else:
        arguments["num_warps"] = 8
    launch((1, 1, 1), x, arguments.pop("n"), **arguments)
    assert len(kernel.compiled) == 2 and kernel.compiled[0].grids == []
    device[0] = 0
    launch((1, 1, 1), x, 32, BLOCK=32, num_warps=4, num_stages=3)  # the first one's again
    assert len(kernel.compiled) == 2 and kernel.compiled[0].grids == [(1, 1, 1)]


def test_cpu_tensors_always_go_through_triton():
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    for _ in range(2):
        launch((1,), torch.zeros(1), 7, BLOCK=32, num_warps=4)
    assert len(kernel.compiled) == 2
