"""The environment the engine tests run vLLM in (tests/vllm_plugin/conftest.py sets each
variable unless the caller did). A module of its own, importing nothing, so that the
mutation check (tests/mutations.py) can give its pytest servers the same environment before
they import vLLM: Triton decides at import time whether a kernel runs in its interpreter."""

ENGINE_ENVIRONMENT = {
    "TRITON_INTERPRET": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # Model Runner V2's bookkeeping kernels as host ports, not interpreted (a vLLM plugin
    # of triton_cpu_backend: wedlm_test_triton_cpu/ported_kernels.py)
    "WEDLM_TEST_PORTED_KERNELS": "1",
}
