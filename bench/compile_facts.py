"""sm_90 compile facts of select_tokens' Triton kernels, evidence until a GPU run measures them.

    python -m bench.compile_facts [--out-dir bench/results/sm90_compile]

Writes ``select_tokens.json`` and ``select_tokens.md``. Nothing here runs on a GPU: every
figure is a compile result, arithmetic on it, or host time on CPU tensors.

- ``variants``: every specialisation ``ops/select.kernel_variants()`` lists (the three-launch
  kernels ``scan_*``, ``filter_*``, ``sequences_splits*``, the ``one_launch_*`` kernels of
  ``ops/select_one_launch.py``, the test kernels), each compiled for sm_90 by
  ``bench/sm90_compile.compile_sm90`` (Triton's own ptxas, in a child process without
  ``TRITON_INTERPRET``). Per variant: ``registers`` per thread and spill bytes (``ptxas
  -v``), ``shared_bytes`` (static shared memory, ``metadata.shared``), ``num_warps``.
- ``programs_per_sm`` (:func:`programs_per_sm`): how many programs of the variant one sm_90
  multiprocessor holds at once, the least of four limits: registers (65536 per SM,
  allocated per warp in units of 256, i.e. per-thread registers rounded up to a multiple
  of 8), threads (2048), programs (32) and shared memory (228 KB per SM, at most 227 KB per
  program, plus 1 KB the driver reserves per program). ``limit`` names the binding one.
- ``bytes_in_flight_per_sm`` (:func:`bytes_in_flight_per_sm`), for the kernels that stream
  the logits: programs per SM x tiles in flight per program x logits per tile x bytes per
  logit (:func:`tiles_in_flight`). The scan (``scan_*``) reads tiles of ``TILE_GRANULES x
  64`` logits, one in flight per program. A one-launch kernel reads tiles of ``BLOCK``
  logits through a ``STAGES``-deep asynchronous copy pipeline: ``STAGES - 1`` tiles in
  flight, as many as the compile's shared memory holds (a variant Triton does not pipeline,
  e.g. 2-byte logits without the 16-aligned specialisation, keeps none there and has 1);
  Tile sizes and stages are the variants' constexprs. The 1cd776f row is quoted
  from the issue, not computed.
- ``shapes``: the benchmark shapes of ``bench/select_tokens.py`` (vocabulary 151936, bf16
  logits, R rows in 16 rows per sequence, R = 1 one sequence) in the modes ``greedy`` and
  ``temperature``, for ``three_launch`` and ``one_launch``. The launcher runs on CPU tensors
  with its Triton launches replaced by recording stubs, at the split count it picks on an
  H200 (``split_plan`` with 132 multiprocessors), so each launch's grid and compiled
  variant are the launcher's own; ``waves`` = programs / (programs per SM x 132).
  ``launches_per_call`` = Triton launches + the other device kernels of the call: the
  PyTorch ops it runs that launch a kernel on CUDA (fills: the tickets' ``zero_``, the
  three-launch path's ``zeros_like``/``ones_like`` of the parameters a mode overrides),
  counted with a ``TorchDispatchMode``; allocations and views are not launches.
- ``host_us``: CPU host Python of the launcher, kernels stubbed; not the GPU launch cost.
  Median of :data:`HOST_CALLS` calls (after :data:`HOST_WARMUP`) of
  ``select_tokens_triton`` on CPU tensors with no-op stubs for the Triton launches (a real
  launch adds Triton's own launch path), and separately the public ``select_tokens``
  argument checks (its dispatch stubbed out).
"""

import argparse
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.common import (
    RESULTS_ROOT,
    command_line,
    fmt,
    markdown_table,
    utc_now,
    versions,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = RESULTS_ROOT / "sm90_compile"

# sm_90 (H100 / H200) limits per multiprocessor
MULTIPROCESSORS = 132  # H200 (and H100 SXM)
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 8  # per-thread registers are allocated in multiples of 8 (256 per warp)
THREADS_PER_SM = 2048
PROGRAMS_PER_SM_MAX = 32
SHARED_PER_SM = 228 * 1024
SHARED_PER_PROGRAM_MAX = 227 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024

VOCAB = 151936
ROWS = (1, 16, 64, 256, 1024)
ROWS_PER_SEQUENCE = 16
MODES = ("greedy", "temperature")
KERNELS = ("three_launch", "one_launch")
HOST_ROWS = (16, 256)
HOST_CALLS, HOST_WARMUP = 200, 20
# quoted in the issue for the kernel of commit 1cd776f (not computed here)
QUOTED_1CD776F = {"registers": 48, "programs_per_sm": 5, "bytes_per_step": 8192,
                  "bytes_in_flight_per_sm": 40960}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# PyTorch ops that allocate or make views: no device kernel
NO_LAUNCH_OPS = {"empty", "empty_strided", "view", "_unsafe_view", "split_with_sizes", "split",
                 "slice", "detach", "alias", "as_strided", "expand", "unsqueeze", "squeeze",
                 "select", "t", "permute"}


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> tuple[int, str]:
    """Programs of ``num_warps`` warps, ``registers`` per thread and ``shared_bytes`` of
    shared memory that one sm_90 multiprocessor holds, and the limit that binds."""
    per_thread = -(-max(registers, 1) // REGISTER_UNIT) * REGISTER_UNIT
    limits = {
        "registers": REGISTERS_PER_SM // (per_thread * 32 * num_warps),
        "threads": THREADS_PER_SM // (32 * num_warps),
        "programs": PROGRAMS_PER_SM_MAX,
        "shared memory": (0 if shared_bytes > SHARED_PER_PROGRAM_MAX else
                          SHARED_PER_SM // (shared_bytes + SHARED_RESERVED_PER_PROGRAM)),
    }
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def bytes_in_flight_per_sm(programs: int, tiles_in_flight: int, tile_logits: int,
                           dtype_bytes: int) -> int:
    return programs * tiles_in_flight * tile_logits * dtype_bytes


def tiles_in_flight(variant, shared_bytes: int, dtype_bytes: int) -> tuple[int, int] | None:
    """``(tile_logits, tiles in flight per program)`` of a kernel that streams the logits
    (the scan, a one-launch kernel), else None."""
    constexprs = variant.constexprs
    if variant.name.startswith("scan_"):
        from wedlm_kernels.ops.select import GRANULE

        return constexprs["TILE_GRANULES"] * GRANULE, 1
    if not variant.name.startswith("one_launch_"):
        return None
    tile = constexprs["BLOCK"]
    buffered = shared_bytes // (tile * dtype_bytes)  # the pipeline's tiles in shared memory
    return tile, max(1, min(constexprs["STAGES"] - 1, buffered))


# ------------------------------------------------------------------------------ compiles


def launched_variant(name: str):
    """The KernelVariant called ``name`` (one of ``select.kernel_variants()``)."""
    from wedlm_kernels.ops import select

    return {variant.name: variant for variant in select.kernel_variants()}[name]


def compile_variants(extra: list[str]) -> dict:
    """Compile facts of every select variant and of ``extra`` (run without TRITON_INTERPRET)."""
    from bench.sm90_compile import compile_sm90, ptxas_resources
    from wedlm_kernels.ops import select

    listed = select.kernel_variants()
    listed_names = {variant.name for variant in listed}
    facts = {}
    for variant in [*listed, *(launched_variant(name) for name in extra)]:
        entry = {"listed": variant.name in listed_names, "num_warps": variant.num_warps,
                 "constexprs": dict(variant.constexprs)}
        try:
            compiled = compile_sm90(variant)
            entry.update(ptxas_resources(compiled), shared_bytes=compiled.metadata.shared)
            assert compiled.metadata.num_warps == variant.num_warps
        except Exception as error:  # noqa: BLE001 - recorded
            entry["error"] = f"{type(error).__name__}: {error}"[-2000:]
        dtype = variant.signature.get("logits_ptr", "").lstrip("*")
        if "registers" in entry:
            programs, limit = programs_per_sm(entry["registers"], variant.num_warps,
                                              entry["shared_bytes"])
            entry.update(programs_per_sm=programs, limit=limit)
            stream = dtype in DTYPE_BYTES and tiles_in_flight(
                variant, entry["shared_bytes"], DTYPE_BYTES[dtype])
            if stream:
                tile, tiles = stream
                entry.update(tile_logits=tile, tiles_in_flight=tiles,
                             bytes_in_flight_per_sm=bytes_in_flight_per_sm(
                                 programs, tiles, tile, DTYPE_BYTES[dtype]))
        facts[variant.name] = entry
    return facts


def compile_in_child(extra: list[str], module: str = "bench.compile_facts") -> dict:
    """``module.compile_variants(extra)`` in a child process without TRITON_INTERPRET."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (f"import json, sys; from {module} import compile_variants; "
            "print(json.dumps(compile_variants(sys.argv[1:])))")
    done = subprocess.run([sys.executable, "-c", code, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"compiling failed:\n{done.stderr[-5000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ptxas_version() -> str:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    report = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout
    return report.strip().splitlines()[-1] if report.strip() else "unknown"


# ------------------------------------------------------------------------- launcher runs


class _Stub:
    """Stands for a @triton.jit kernel: ``stub[grid](...)`` records the launch (or not)."""

    def __init__(self, kernel: str, launches: list | None) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        if self.launches is None:
            return _no_launch
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, kwargs))


def _no_launch(*args, **kwargs) -> None:
    return None


@contextmanager
def stubbed_kernels(launches: list | None = None):
    """The select launchers' Triton kernels replaced by stubs, and an H200's multiprocessor
    count for the split plans."""
    from wedlm_kernels.ops import select, select_one_launch

    patches = [(select, "_select_scan_kernel", _Stub("scan", launches)),
               (select, "_select_filter_kernel", _Stub("filter", launches)),
               (select, "_select_sequences_kernel", _Stub("sequences", launches)),
               (select_one_launch._LAUNCH, "kernel", _Stub("one_launch", launches)),
               (select, "_multiprocessor_count", lambda index: MULTIPROCESSORS)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def inputs(rows: int, mode: str) -> tuple:
    """select_tokens arguments of a benchmark shape on CPU tensors (logits uninitialised:
    no kernel reads them)."""
    sequences = max(1, rows // ROWS_PER_SEQUENCE)
    f32 = dict(dtype=torch.float32)
    return (torch.empty(rows, VOCAB, dtype=torch.bfloat16),
            torch.tensor([min(b * ROWS_PER_SEQUENCE, rows) for b in range(sequences + 1)],
                         dtype=torch.int32),
            torch.arange(rows) + 100,
            torch.full((sequences,), 0.0 if mode == "greedy" else 0.7, **f32),
            torch.zeros(sequences, dtype=torch.int32), torch.ones(sequences, **f32),
            torch.full((sequences,), 0.4, **f32), torch.full((sequences,), 0.02, **f32),
            torch.arange(sequences, dtype=torch.int64))


def h200_splits(kernel: str, rows: int) -> int:
    from wedlm_kernels.ops import select, select_one_launch

    module = select_one_launch if kernel == "one_launch" else select
    with stubbed_kernels():
        return module.split_plan(rows, VOCAB, torch.device("cuda", 0))[0]


def _variant_name(kernel: str, kwargs: dict) -> str:
    aligned = "_aligned16" if VOCAB % 16 == 0 else ""  # contiguous rows: stride = VOCAB
    if kernel in ("scan", "filter"):
        return f"{kernel}_bf16{aligned}"
    if kernel == "sequences":
        return f"sequences_splits{kwargs['SPLIT_BLOCK']}"
    mode = "temperature" if kwargs["SAMPLING"] else "greedy"
    return f"one_launch_{mode}_bf16{aligned}"


def launch_plan(kernel: str, mode: str, rows: int) -> dict:
    """The launches of one call at an H200's split count (launcher on CPU tensors, stubs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from wedlm_kernels.ops.select import select_tokens_triton

    class DeviceOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__.rstrip("_") not in NO_LAUNCH_OPS:
                device_ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    splits = h200_splits(kernel, rows)
    arguments = inputs(rows, mode)
    launches, device_ops = [], []
    with stubbed_kernels(launches), DeviceOps():
        select_tokens_triton(*arguments, mode, kernel=kernel, num_splits=splits)
    return {"splits": splits, "launches": [
        {"kernel": name, "variant": _variant_name(name, kwargs), "grid": list(grid)}
        for name, grid, kwargs in launches], "other_device_ops": device_ops}


def _median_us(fn) -> float:
    for _ in range(HOST_WARMUP):
        fn()
    samples = []
    for _ in range(HOST_CALLS):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(samples), 2)


def host_times() -> list[dict]:
    import wedlm_kernels as wk
    from wedlm_kernels.ops import _dispatch
    from wedlm_kernels.ops.select import select_tokens_triton

    results = []
    for rows in HOST_ROWS:
        for mode in MODES:
            arguments = inputs(rows, mode)
            for kernel in KERNELS:
                splits = h200_splits(kernel, rows)
                with stubbed_kernels():
                    launcher = _median_us(functools.partial(
                        select_tokens_triton, *arguments, mode, kernel=kernel,
                        num_splits=splits))
                results.append({"rows": rows, "mode": mode, "kernel": kernel,
                                "launcher_us": launcher})
            call = _dispatch.call
            _dispatch.call = _no_launch
            try:
                checks = _median_us(functools.partial(wk.select_tokens, *arguments,
                                                      sampling=mode))
            finally:
                _dispatch.call = call
            results.append({"rows": rows, "mode": mode, "kernel": "public checks",
                            "checks_us": checks})
    return results


# ------------------------------------------------------------------------------- report


def build_report(argv: list[str]) -> dict:
    plans = {(kernel, mode, rows): launch_plan(kernel, mode, rows)
             for kernel in KERNELS for mode in MODES for rows in ROWS}
    from wedlm_kernels.ops import select

    listed = {variant.name for variant in select.kernel_variants()}
    launched = {launch["variant"] for plan in plans.values() for launch in plan["launches"]}
    variants = compile_in_child(sorted(launched - listed))
    shapes = []
    for (kernel, mode, rows), plan in plans.items():
        launches = []
        for launch in plan["launches"]:
            facts = variants[launch["variant"]]
            programs = launch["grid"][0] * (launch["grid"][1] if len(launch["grid"]) > 1 else 1)
            per_sm = facts.get("programs_per_sm")
            launches.append(dict(launch, programs=programs, programs_per_sm=per_sm,
                                 waves=round(programs / (per_sm * MULTIPROCESSORS), 4) if per_sm
                                 else None))
        main = launches[0]  # the kernel that streams the logits (scan or one_launch)
        shapes.append({
            "rows": rows, "sequences": max(1, rows // ROWS_PER_SEQUENCE), "mode": mode,
            "kernel": kernel, "splits": plan["splits"], "variant": main["variant"],
            "programs": main["programs"], "waves": main["waves"],
            "bytes_in_flight_per_sm": variants[main["variant"]].get("bytes_in_flight_per_sm"),
            "triton_launches": len(launches), "other_device_ops": plan["other_device_ops"],
            "launches_per_call": len(launches) + len(plan["other_device_ops"]),
            "launches": launches,
        })
    host = host_times()
    return {
        "benchmark": "compile_facts", "op": "select_tokens",
        "target": f"sm_90 (H200: {MULTIPROCESSORS} multiprocessors), compiled on a CPU machine",
        "summary": summarise(variants, shapes, host),
        "quoted_1cd776f": dict(QUOTED_1CD776F, note="quoted in the issue, not computed"),
        "variants": variants, "shapes": shapes,
        "host_us": {"label": "CPU host Python of the launcher, kernels stubbed; not the GPU "
                             "launch cost", "calls": HOST_CALLS, "rows": host},
        "kernel_sources": {path: hashlib.sha256((ROOT / path).read_bytes()).hexdigest()[:16]
                           for path in ("wedlm_kernels/ops/select.py",
                                        "wedlm_kernels/ops/select_one_launch.py")},
        "versions": dict(versions(), ptxas=ptxas_version()),
        "command": command_line("bench.compile_facts", argv), "date": utc_now(),
    }


def summarise(variants: dict, shapes: list[dict], host: list[dict]) -> dict:
    """Headline figures: the variants an R = 16 call launches (bf16, vocabulary 151936)."""
    summary = {}
    for shape in shapes:
        if shape["rows"] != 16:
            continue
        key = f"{shape['mode']}_{{}}_{shape['kernel']}_bf16"
        facts = variants[shape["variant"]]
        summary[key.format("variant")] = shape["variant"]
        summary[key.format("registers")] = facts.get("registers")
        summary[key.format("programs_per_sm")] = facts.get("programs_per_sm")
        summary[key.format("bytes_in_flight_per_sm")] = facts.get("bytes_in_flight_per_sm")
        summary[key.format("launches_per_call")] = shape["launches_per_call"]
    summary["quoted_1cd776f_bytes_in_flight_per_sm"] = QUOTED_1CD776F["bytes_in_flight_per_sm"]
    for entry in host:
        if entry["rows"] == 16 and entry["mode"] == "greedy":
            name = entry["kernel"].replace(" ", "_")
            value = entry.get("launcher_us", entry.get("checks_us"))
            summary[f"greedy_host_us_r16_{name}"] = value
    summary["spilling_variants"] = sorted(name for name, facts in variants.items()
                                          if facts.get("spill_store_bytes"))
    summary["failed_variants"] = sorted(name for name, facts in variants.items()
                                        if "error" in facts)
    return summary


def write_markdown(report: dict, path: Path) -> None:
    def cell(value, digits=0):
        return "—" if value is None else (fmt(value, digits) if isinstance(value, float)
                                          else str(value))

    variant_rows = [
        [f"`{name}`" + ("" if facts["listed"] else " (launched, not listed)"),
         cell(facts.get("registers")), cell(facts.get("spill_store_bytes")),
         cell(facts.get("shared_bytes")), cell(facts["num_warps"]),
         cell(facts.get("programs_per_sm")), facts.get("limit", facts.get("error", "")),
         cell(facts.get("tile_logits")), cell(facts.get("tiles_in_flight")),
         cell(facts.get("bytes_in_flight_per_sm"))]
        for name, facts in report["variants"].items()]
    quoted = report["quoted_1cd776f"]
    variant_rows.append(["1cd776f kernel (quoted in the issue, not computed)",
                         str(quoted["registers"]), "—", "—", "—",
                         str(quoted["programs_per_sm"]), "—", "—",
                         f"{quoted['bytes_per_step']} B/step",
                         str(quoted["bytes_in_flight_per_sm"])])
    shape_rows = [
        [str(s["rows"]), str(s["sequences"]), s["mode"], s["kernel"], str(s["splits"]),
         str(s["programs"]), cell(s["waves"], 3), cell(s["bytes_in_flight_per_sm"]),
         f"{s['launches_per_call']} ({s['triton_launches']} Triton"
         + "".join(f" + {op}" for op in s["other_device_ops"]) + ")",
         ", ".join(f"`{launch['variant']}` {launch['grid']}" for launch in s["launches"])]
        for s in report["shapes"]]
    host_rows = [[str(h["rows"]), h["mode"], h["kernel"],
                  cell(h.get("launcher_us", h.get("checks_us")), 1)]
                 for h in report["host_us"]["rows"]]
    lines = [
        "# select_tokens: sm_90 compile facts",
        "",
        f"{report['date']}, `{report['command']}`; {report['target']}.",
        f"versions: {report['versions']}",
        "",
        "How each figure is computed: the docstring of `bench/compile_facts.py`. Programs per "
        "SM: the least of the register, thread, program and shared-memory limits of an sm_90 "
        "multiprocessor. Bytes in flight per SM: programs per SM x tiles in flight per program "
        "x logits per tile x bytes per logit.",
        "",
        "## Summary (R = 16, bf16, vocabulary 151936)",
        "",
        *(f"- `{key}`: {cell(value, 1)}" for key, value in report["summary"].items()),
        "",
        "## Variants",
        "",
        *markdown_table(["variant", "registers", "spill B", "shared B", "warps",
                         "programs/SM", "limit", "tile logits", "tiles in flight",
                         "bytes in flight/SM"], variant_rows),
        "",
        "## Benchmark shapes on an H200 (132 SMs)",
        "",
        "Waves and bytes in flight of the first launch (the kernel that reads the logits). "
        "Launches per call: Triton launches plus the call's other device kernels.",
        "",
        *markdown_table(["R", "B", "mode", "kernel", "splits", "programs", "waves",
                         "bytes in flight/SM", "launches per call", "launches (grid)"],
                        shape_rows),
        "",
        f"## Host µs per call: {report['host_us']['label']}",
        "",
        f"Median of {report['host_us']['calls']} calls on CPU tensors (bf16 logits "
        f"[R, {VOCAB}]). `public checks`: `wedlm_kernels.select_tokens`'s argument checks "
        "with its dispatch stubbed out (paid before either launcher).",
        "",
        *markdown_table(["R", "mode", "kernel", "µs"], host_rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    report = build_report(argv)
    write_json(args.out_dir / "select_tokens.json", report)
    write_markdown(report, args.out_dir / "select_tokens.md")
    print(f"compile_facts: wrote {args.out_dir}/select_tokens.{{json,md}}")
    return 1 if report["summary"]["failed_variants"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
