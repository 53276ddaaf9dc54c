"""Every Triton kernel variant a launcher can produce compiles for an sm_90 GPU target.

Runs on a CPU-only machine (Triton ships ptxas): it catches constructs that the interpreter
accepts but the GPU compiler rejects (``break``, bf16 arithmetic, shape errors, ...).
"""

import pytest

from wedlm_kernels import _library

from tests.kernel_harness import compile_sm90

VARIANTS = [
    pytest.param(variant, id=f"{name}:{variant.name}")
    for name, (module, _) in sorted(_library.OPS.items())
    for variant in (module.kernel_variants() if hasattr(module, "kernel_variants") else [])
]


@pytest.mark.skipif(not VARIANTS, reason="no Triton kernel yet")
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_variant_compiles_for_sm90(variant):
    compiled = compile_sm90(variant)
    assert "cubin" in compiled.asm and len(compiled.asm["cubin"]) > 0
