"""The backend's compiler: it compiles nothing (kernels run in Triton's interpreter)."""

from triton.backends.compiler import BaseBackend


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target) -> bool:
        return getattr(target, "backend", None) == "cpu"

    def hash(self) -> str:
        return "wedlm-test-triton-cpu"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError("the test-only Triton 'cpu' backend compiles nothing: set "
                           "TRITON_INTERPRET=1")

    def add_stages(self, stages: dict, options: object, *args) -> None:
        raise RuntimeError("the test-only Triton 'cpu' backend compiles nothing")

    def load_dialects(self, context) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
