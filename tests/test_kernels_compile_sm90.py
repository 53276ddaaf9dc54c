"""Every Triton kernel variant a launcher can produce compiles for an sm_90 GPU target.

Runs on a CPU-only machine (Triton ships ptxas): it catches constructs that the interpreter
accepts but the GPU compiler rejects (``break``, bf16 arithmetic, shape errors, ...), and
ptxas's report of each compiled kernel shows register spills, a performance defect that no
CPU test can time.

The compiles run in one child process without ``TRITON_INTERPRET``: in a process where the
interpreter is on, ``triton.language``'s own @jit functions (``tl.sum``, ``tl.cumsum``,
``tl.zeros``, ...) are interpreter objects and every interpreted kernel run leaves
``triton.language`` patched, so in-process compiles fail depending on test order.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wedlm_kernels.ops import _library

ROOT = Path(__file__).resolve().parents[1]
VARIANT_IDS = [
    f"{name}:{variant.name}"
    for name, (module, _) in sorted(_library.OPS.items())
    for variant in (module.kernel_variants() if hasattr(module, "kernel_variants") else [])
]
CHILD = r"""
import json
from tests.kernel_harness import compile_sm90, ptxas_resources
from wedlm_kernels.ops import _library
results = {}
for name, (module, _) in sorted(_library.OPS.items()):
    for variant in (module.kernel_variants() if hasattr(module, "kernel_variants") else []):
        try:
            compiled = compile_sm90(variant)
            status = "ok" if compiled.asm.get("cubin") else "no cubin"
            results[f"{name}:{variant.name}"] = dict(
                status=status, fused_multiply_adds=compiled.asm["ptx"].count("fma.rn.f32"),
                enable_fp_fusion=variant.enable_fp_fusion, num_warps=variant.num_warps,
                shared=compiled.metadata.shared, **ptxas_resources(compiled))
        except Exception as error:
            results[f"{name}:{variant.name}"] = dict(
                status=f"{type(error).__name__}: {error}"[-3000:])
print(json.dumps(results))
"""
# Variants known to spill a few bytes of registers to local memory, by Triton release
# (measured with its ptxas): any other spill is a failure.
# - the window kernel's scalar state, once per call (every release);
# - Triton 3.7 (ptxas 12.8) only: the select_tokens scan specialised on a vocabulary size and
#   row stride that are multiples of 16 keeps 80 registers and spills 12 bytes (flags and
#   the thread index) around the slow-path calls of its IEEE divisions (x / temperature
#   and the Gumbel transform's log1p), once per tile; select_tokens' one-launch greedy kernel
#   on fp32 and fp16 logits whose vocabulary size or row stride is not a multiple of 16
#   (narrower loads; such vocabularies are rare, and not measured) spills 16 and 8. Triton
#   3.6 compiles them without a spill (make test-oldest runs this test on it).
_WINDOW_SPILLS = {f"commit_window:block_slots={slots},commit_limit={limited}": size
                  for slots, size in ((32, 4), (256, 8)) for limited in (False, True)}
# - process_logits' rules kernel with the bias and the min_tokens stop-id loops (and neither
#   the penalties nor a mask): ptxas keeps 40 registers and spills 8 bytes (3.6) or 12 (3.7)
#   of the scalar loop state; the variants with more rules allocate more and spill nothing.
_LOGIT_RULE_SPILLS = {f"process_logits:rules_bias_min_tokens_{dtype}": 8
                      for dtype in ("fp32", "fp16", "bf16")}
# - paged_attention: on Triton 3.6 (the GPU image's) no fp16 or bf16 tile the launcher picks
#   spills at pages of 8, 16 or 64 positions but a 4-byte one at head size 16; pages of one
#   position spill 8 bytes in the bf16 64 x 64 tile at head size 128, and fp32 tiles (exact
#   products, the slow path) 4 to 32 bytes of scalar state. Triton 3.7's ptxas spills 4
#   bytes in the 64 x 64 tile at head size 128 (8 to 88 merging split partials in the
#   launch, ``_merged``, off by default), and 4 to 20 bytes in some small tiles.
_ATTENTION_SPILLS = {
    "3.6": {
        "fp32_d16_m32_n32_w4_p8_g4_merged": 8, "fp32_d64_m16_n16_w4_p8_g4": 12,
        "fp32_d64_m16_n16_w4_p8_g4_merged": 16, "fp32_d64_m16_n16_w4_p64_g4": 4,
        "fp32_d128_m16_n16_w4_p8_g4": 16, "fp32_d128_m16_n16_w4_p64_g4": 12,
        "fp32_d256_m16_n16_w4_p8_g4": 4, "fp32_d256_m16_n16_w4_p8_g4_merged": 4,
        "fp32_d256_m16_n16_w4_p64_g4": 20, "fp32_d256_m16_n16_w4_p64_g4_merged": 32,
        "fp16_d16_m16_n32_w4_p8_g4": 4, "bf16_d128_m64_n64_w4_p1_g4": 8},
    "3.7": {
        "fp32_d16_m32_n32_w4_p8_g4_merged": 4, "fp32_d64_m16_n16_w4_p8_g4": 12,
        "fp32_d128_m16_n16_w4_p8_g4": 16, "fp32_d128_m16_n16_w4_p64_g4": 8,
        "fp32_d256_m16_n16_w4_p8_g4": 12, "fp32_d256_m16_n16_w4_p8_g4_merged": 20,
        "fp16_d128_m16_n32_w4_p64_g4": 20, "fp16_d128_m64_n64_w4_p8_g4": 4,
        "fp16_d128_m64_n64_w4_p8_g4_merged": 88, "fp16_d128_m64_n64_w4_p16_g4": 4,
        "fp16_d128_m64_n64_w4_p16_g4_merged": 8, "bf16_d16_m16_n32_w4_p64_g4_merged": 12,
        "bf16_d32_m16_n32_w4_p64_g4_merged": 4, "bf16_d128_m16_n32_w4_p64_g4": 20,
        "bf16_d128_m16_n32_w4_p16_g4_merged": 12, "bf16_d128_m64_n64_w4_p8_g4": 4,
        "bf16_d128_m64_n64_w4_p8_g4_merged": 88, "bf16_d128_m64_n64_w4_p16_g4": 4,
        "bf16_d128_m64_n64_w4_p16_g4_merged": 8, "bf16_d128_m64_n64_w4_p16_g7": 4,
        "bf16_d128_m64_n64_w4_p16_g8": 4},
}


def _attention_spills(release: str) -> dict[str, int]:
    return {f"paged_attention:attention_{variant}": size
            for variant, size in _ATTENTION_SPILLS[release].items()}


KNOWN_SPILL_BYTES = {
    "3.6": {**_WINDOW_SPILLS, **_LOGIT_RULE_SPILLS, **_attention_spills("3.6")},
    "3.7": {**_WINDOW_SPILLS, **{name: 12 for name in _LOGIT_RULE_SPILLS},
            **_attention_spills("3.7"),
            "select_tokens:scan_fp32_aligned16": 12, "select_tokens:scan_fp16_aligned16": 12,
            "select_tokens:scan_bf16_aligned16": 12, "select_tokens:one_launch_greedy_fp16": 8,
            "select_tokens:one_launch_greedy_fp32": 16},
}


def known_spill_bytes() -> dict[str, int]:
    """The known spills of the installed Triton's release (3.6's for an unlisted one)."""
    import triton

    release = ".".join(triton.__version__.split(".")[:2])
    return KNOWN_SPILL_BYTES.get(release, KNOWN_SPILL_BYTES["3.6"])


@pytest.fixture(scope="module")
def compile_results() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not VARIANT_IDS, reason="no Triton kernel yet")
@pytest.mark.parametrize("variant_id", VARIANT_IDS)
def test_kernel_variant_compiles_for_sm90(compile_results, variant_id):
    assert compile_results[variant_id]["status"] == "ok", compile_results[variant_id]


@pytest.mark.skipif(not VARIANT_IDS, reason="no Triton kernel yet")
def test_no_kernel_variant_spills_registers_to_local_memory(compile_results):
    """Register spills turn into local-memory traffic in the hot loops: ptxas's spill
    stores of every compiled variant, as a launch with typical arguments compiles it, are
    at most the known ones (each kept for a measured reason, above)."""
    spills = {variant: result.get("spill_store_bytes", 0)
              for variant, result in compile_results.items()}
    known = known_spill_bytes()
    unexpected = {variant: size for variant, size in spills.items()
                  if size > known.get(variant, 0)}
    assert not unexpected, unexpected


@pytest.mark.skipif(not VARIANT_IDS, reason="no Triton kernel yet")
def test_kernels_launched_without_fp_fusion_contain_no_fused_multiply_add(compile_results):
    """select_tokens' per-sequence kernel rounds ``entropy + penalty * distance`` twice, as
    the PyTorch path does: compiled with fusion (the default) that line is one FMA."""
    unfused = {variant: result for variant, result in compile_results.items()
               if not result["enable_fp_fusion"]}
    assert any(variant.startswith("select_tokens:sequences") for variant in unfused)
    assert {variant: result["fused_multiply_adds"] for variant, result in unfused.items()
            if result["fused_multiply_adds"]} == {}


@pytest.mark.skipif(not VARIANT_IDS, reason="no Triton kernel yet")
def test_select_kernels_compile_with_the_alignment_real_launches_get(compile_results):
    """A launch on a model whose vocabulary size and row stride are multiples of 16 (most
    are) specialises on it, as on the split size (always a multiple of 16): those variants
    are compiled too (and checked for spills above)."""
    for kernel in ("scan", "filter", "one_launch_greedy", "one_launch_temperature"):
        for dtype in ("fp32", "fp16", "bf16"):
            assert f"select_tokens:{kernel}_{dtype}_aligned16" in compile_results


def test_the_attention_split_rule_knows_how_many_programs_each_tile_keeps_resident(
        compile_results):
    """The FA2 split rule counts multiprocessors x residency slots (ops/attention.py,
    RESIDENCY_SM90): each tile's residency is what its sm_90 compile allows (registers per
    thread, shared memory), for bf16 and fp16 at head size 128 with split partials merged by
    the combine launch (the default) or not split: on Triton 3.6, the GPU image's release, at
    every compiled page size and group; on others (whose ptxas allocates differently) at the
    benchmark's pages of 16 and group of 4."""
    import triton

    from bench.compile_facts import programs_per_sm
    from wedlm_kernels.ops import attention

    every_variant = triton.__version__.startswith("3.6.")
    for (block_m, block_n, warps), resident in attention.RESIDENCY_SM90.items():
        for dtype in ("bf16", "fp16"):
            prefix = f"paged_attention:attention_{dtype}_d128_m{block_m}_n{block_n}_w{warps}_p"
            names = [name for name in compile_results
                     if name.startswith(prefix) and not name.endswith("_merged")]
            # pages of 8, 16 and 64 (group 4), and in bf16 the extra four
            assert len(names) == {"bf16": 7, "fp16": 3}[dtype], names
            if not every_variant:
                names = [f"{prefix}16_g4"]
            for name in names:
                facts = compile_results[name]
                assert facts["num_warps"] == warps
                programs, _ = programs_per_sm(facts["registers"], warps, facts["shared"])
                assert programs == resident, (name, facts)
