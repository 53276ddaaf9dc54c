"""The backend's driver: active only under TRITON_INTERPRET=1, on the CPU."""

import os

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return os.environ.get("TRITON_INTERPRET") == "1"

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the test-only Triton 'cpu' backend has no launcher")

    def get_current_target(self):
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device) -> None:
        return None

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_benchmarker(self):
        from triton.testing import do_bench

        return do_bench
