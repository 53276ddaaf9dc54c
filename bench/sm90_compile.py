"""Compiling a ``KernelVariant`` for an NVIDIA sm_90 target with Triton's own ptxas, on a
machine without a GPU (the sm_90 compile test and ``bench.compile_facts``).
"""

import sys
from contextlib import contextmanager

from wedlm_kernels.ops._triton import KernelVariant


@contextmanager
def _compilable_jit_functions(module_name: str):
    """Under TRITON_INTERPRET=1 every @triton.jit function, triton.language's own (tl.sum,
    tl.cumsum, tl.cdiv, ...) and a kernel module's helpers, is an InterpretedFunction, which
    the GPU compiler cannot call. Swap them for JITFunctions while compiling."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = [
        module for name, module in list(sys.modules.items())
        if name == "triton.language" or name.startswith("triton.language.")
    ]
    modules.append(sys.modules[module_name])
    swapped, replacements = [], {}
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, InterpretedFunction):
                if id(value) not in replacements:
                    replacements[id(value)] = JITFunction(value.fn)
                swapped.append((module, attr, value))
                setattr(module, attr, replacements[id(value)])
    try:
        yield
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


def compile_sm90(variant: KernelVariant):
    """Compile ``variant`` for an NVIDIA sm_90 target as a launch with typical arguments
    would: pointers 16-byte aligned and ``variant.divisible_by_16`` multiples of 16 (the
    specialisations Triton makes at run time). Returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = variant.kernel
    if not isinstance(kernel, JITFunction):  # an InterpretedFunction under TRITON_INTERPRET
        kernel = JITFunction(kernel.fn)
    attrs = {
        (index,): [["tt.divisibility", 16]]
        for index, (name, kind) in enumerate(variant.signature.items())
        if kind.startswith("*") or name in variant.divisible_by_16
    }
    source = ASTSource(fn=kernel, signature=variant.signature, constexprs=variant.constexprs,
                       attrs=attrs)
    with _compilable_jit_functions(kernel.fn.__module__):
        return triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                     "enable_fp_fusion": variant.enable_fp_fusion},
        )


def ptxas_resources(compiled) -> dict[str, int]:
    """Registers per thread and spill bytes of a compiled sm_90 kernel, from ``ptxas -v``
    (Triton's own ptxas) on its PTX."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.ptx")
        with open(path, "w") as file:
            file.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
    }
