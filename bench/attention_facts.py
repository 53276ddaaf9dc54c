"""paged_attention's schedules, memory traffic and sm_90 compile facts at the benchmark
shapes: evidence until a GPU run measures them.

    python -m bench.attention_facts [--out-dir bench/results/sm90_compile]

Writes ``paged_attention.json`` and ``paged_attention.md``. Nothing here runs on a GPU:
every figure is the launcher's own schedule, arithmetic on it, or a compile result.

- ``cases``: the shapes of ``bench/paged_attention.py`` (Qwen3-8B attention: 32 q heads, 8
  KV heads, head_dim 128, bf16, pages of 16 positions): decode windows of B in {1, 16, 64}
  sequences x 16 and 32 rows after 512 .. 16384 committed positions, and prefills of 1024
  .. 8192 tokens. Each under the four configurations the launcher can run: the split rule
  (``measured``, the default, or ``fa2``) x the merge of split partials (``combine``, a
  second launch and the default, or ``last_program``, in the attention launch).
- ``schedule``: ``ops/attention.schedule`` on an H200 (132 multiprocessors): the tile, the
  split count, the programs launched and those holding rows (``working``), and ``waves`` =
  working programs / (132 x the programs per multiprocessor the compiled tile allows);
  ``diagonal_tiles_max``, the most key tiles a query tile masks per row (the diagonal loop:
  from the last whole tile every row of it sees to its last row's key).
- ``traffic`` (bytes): ``kv``: the keys and values every query tile reads (a tile of a
  sequence reads each key up to its last row's, K and V, once per KV head); ``partials``:
  the fp32 partial outputs and log-sum-exps of every split that holds keys of a tile,
  written once and read once by the merge; ``partial_over_kv``, their ratio (the issue's
  bound: at most 0.25).
- ``launches``: Triton launches per call, and the fills of PyTorch ops (the last-program
  merge zeroes its tickets).
- ``variants``: the sm_90 compile facts of every kernel variant a case launches (through
  ``bench/sm90_compile``, Triton's own ptxas, in a child process without
  ``TRITON_INTERPRET``): registers per thread, spill bytes, static shared memory, programs
  per multiprocessor (``bench.compile_facts.programs_per_sm``), the integer divisions and
  remainders left in the PTX (``integer_divisions``) and the software pipeline
  read from the TTGIR: ``ring_depths``, the leading size of each multi-buffered shared
  memory allocation (K and V tiles; 1: one buffer), ``async_wait_nums``, the asynchronous
  copies each wait leaves in flight (0: the loop waits for every copy it issued), and
  ``mma_wait_pendings``, the tensor-core products each wait leaves running (0: softmax
  never overlaps a product).
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import triton

from bench.common import (
    RESULTS_ROOT,
    command_line,
    fmt,
    markdown_table,
    utc_now,
    versions,
    write_json,
)
from bench.compile_facts import (
    MULTIPROCESSORS,
    compile_in_child,
    programs_per_sm,
    ptxas_version,
)
from bench.paged_attention import QWEN3_8B

OUT_DIR = RESULTS_ROOT / "sm90_compile"
RULES = ("measured", "fa2")
MERGES = ("combine", "last_program")
PARTIAL_BOUND = 0.25  # partial traffic over key and value traffic, at most (issue bound)


def shapes() -> list[dict]:
    """The cases of ``bench/paged_attention.py``'s full run."""
    sizes = QWEN3_8B
    decode = [{"kind": "decode", "batch": batch, "q_len": rows, "context": context}
              for batch in sizes.batches for rows in sizes.window_rows
              for context in sizes.contexts]
    prefill = [{"kind": "prefill", "batch": 1, "q_len": tokens, "context": 0}
               for tokens in sizes.prefill_tokens]
    return decode + prefill


def plan(case: dict, rule: str, merge: str) -> dict:
    """The launch of ``case`` under ``rule`` and ``merge``: its schedule, traffic and the
    variants it compiles, computed from the launcher's own schedule."""
    from wedlm_kernels.ops import attention

    sizes = QWEN3_8B
    batch, rows, context = case["batch"], case["q_len"], case["context"]
    group = sizes.q_heads // sizes.kv_heads
    head_dim, page_size = sizes.head_dim, sizes.page_size
    capacity = triton.cdiv(context + rows, page_size) * page_size
    num_rows = batch * rows
    config, splits = attention.schedule(sizes.dtype, num_rows, batch, sizes.kv_heads, group,
                                        head_dim, capacity, MULTIPROCESSORS, rule)
    block_m, block_n = config.block_m, config.block_n
    merged = merge == "last_program" and splits > 1
    element = torch.finfo(sizes.dtype).bits // 8
    # per sequence and KV head: each query tile reads keys 0 .. ctx + its last row
    sequence_keys = context + rows
    keys_per_split = max(triton.cdiv(triton.cdiv(sequence_keys, splits), block_n), 1) * block_n
    kv_bytes = partial_bytes = diagonal_tiles = 0
    pairs = rows * group
    for tile in range(triton.cdiv(pairs, block_m)):
        live = min(block_m, pairs - tile * block_m)
        first_row, last_row = tile * block_m // group, (tile * block_m + live - 1) // group
        key_end = context + last_row + 1
        kv_bytes += key_end * 2 * head_dim * element
        # the masked key tiles: from the last whole tile every row sees to the last row's key
        full_stop = (context + first_row + 1) // block_n * block_n
        diagonal_tiles = max(diagonal_tiles, triton.cdiv(key_end - full_stop, block_n))
        if splits > 1:
            used = min(splits, triton.cdiv(key_end, keys_per_split))
            partial_bytes += 2 * used * live * (head_dim + 1) * 4  # written, then read
    scale = batch * sizes.kv_heads
    kv_bytes, partial_bytes = kv_bytes * scale, partial_bytes * scale
    programs = attention.query_tiles(num_rows, batch, group, block_m) * sizes.kv_heads * splits
    working = attention.working_tiles(num_rows, batch, group, block_m) * sizes.kv_heads * splits
    # the launcher's own variant names (ops/attention.kernel_variants)
    block_d = attention.head_dim_block(head_dim)
    variants = [attention._attention_variant(sizes.dtype, block_d, config, page_size, group,
                                             merged).name]
    if splits > 1 and not merged:
        variants.append(attention._combine_variant(sizes.dtype, block_d, block_n).name)
    return {
        "rule": rule, "merge": merge,
        "schedule": {"block_m": block_m, "block_n": block_n, "num_warps": config.num_warps,
                     "num_splits": splits, "programs": programs, "working": working,
                     "diagonal_tiles_max": diagonal_tiles},
        "traffic": {"kv": kv_bytes, "partials": partial_bytes,
                    "partial_over_kv": partial_bytes / kv_bytes},
        "launches": {"triton": 1 + (splits > 1 and not merged), "fills": int(merged)},
        "variants": variants,
    }


# ------------------------------------------------------------------------------ compiles


def pipeline_facts(ttgir: str) -> dict:
    """The software pipeline of a compiled kernel, read from its TTGIR."""
    rings = sorted({int(depth) for depth in re.findall(
        r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)})
    waits = sorted({int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", ttgir)})
    pendings = sorted({int(n) for n in re.findall(
        r"ttng\.warp_group_dot_wait[^\n]*\{pendings = (\d+)", ttgir)})
    return {"ring_depths": rings, "async_wait_nums": waits, "mma_wait_pendings": pendings}


def integer_divisions(ptx: str) -> int:
    """Integer division and remainder instructions of a compiled kernel (PTX ``div``/``rem``
    on 32- or 64-bit integers; a division by a compile-time constant compiles to shifts or a
    multiplication instead)."""
    return len(re.findall(r"\b(?:div|rem)\.[su](?:32|64)\b", ptx))


def compile_variants(names: list[str]) -> dict:
    """Compile facts of the named ``ops/attention.kernel_variants()`` (run without
    TRITON_INTERPRET)."""
    from bench.sm90_compile import compile_sm90, ptxas_resources
    from wedlm_kernels.ops import attention

    listed = {variant.name: variant for variant in attention.kernel_variants()}
    facts = {}
    for name in names:
        variant = listed[name]
        entry = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
        try:
            compiled = compile_sm90(variant)
            entry.update(ptxas_resources(compiled), shared_bytes=compiled.metadata.shared,
                         integer_divisions=integer_divisions(compiled.asm["ptx"]),
                         **pipeline_facts(compiled.asm["ttgir"]))
            programs, limit = programs_per_sm(entry["registers"], variant.num_warps,
                                              entry["shared_bytes"])
            entry.update(programs_per_sm=programs, limit=limit)
        except Exception as error:  # noqa: BLE001 - recorded
            entry["error"] = f"{type(error).__name__}: {error}"[-2000:]
        facts[name] = entry
    return facts


# ------------------------------------------------------------------------------- report


def build_report(argv: list[str]) -> dict:
    cases = []
    for case in shapes():
        cases.append({**case, "launches": [plan(case, rule, merge)
                                           for rule in RULES for merge in MERGES]})
    names = sorted({name for case in cases for launch in case["launches"]
                    for name in launch["variants"]})
    variants = compile_in_child(names, "bench.attention_facts")
    for case in cases:
        for launch in case["launches"]:
            facts = variants[launch["variants"][0]]
            resident = facts.get("programs_per_sm")
            launch["schedule"]["waves"] = (launch["schedule"]["working"]
                                           / (MULTIPROCESSORS * resident) if resident else None)
    return {
        "benchmark": "compile_facts", "op": "paged_attention",
        "target": f"sm_90 (H200: {MULTIPROCESSORS} multiprocessors), compiled on a CPU machine",
        "shapes": {"q_heads": QWEN3_8B.q_heads, "kv_heads": QWEN3_8B.kv_heads,
                   "head_dim": QWEN3_8B.head_dim, "dtype": "bfloat16",
                   "page_size": QWEN3_8B.page_size},
        "summary": summarise(cases, variants),
        "cases": cases, "variants": variants,
        "versions": {**versions(), "ptxas": ptxas_version()},
        "command": command_line("bench.attention_facts", argv), "date": utc_now(),
    }


def summarise(cases: list[dict], variants: dict) -> dict:
    """Per configuration (``<rule>_<merge>``): the largest partial traffic over key and
    value traffic, the chosen tiles that spill, and the largest spill."""
    summary = {}
    for rule in RULES:
        for merge in MERGES:
            launches = [launch for case in cases for launch in case["launches"]
                        if (launch["rule"], launch["merge"]) == (rule, merge)]
            chosen = sorted({launch["variants"][0] for launch in launches})
            key = f"{rule}_{merge}"
            summary[f"partial_over_kv_max_{key}"] = round(
                max(launch["traffic"]["partial_over_kv"] for launch in launches), 4)
            summary[f"spilling_tiles_{key}"] = [
                name for name in chosen if variants[name].get("spill_store_bytes")]
            summary[f"max_spill_bytes_{key}"] = max(
                variants[name].get("spill_store_bytes", 0) for name in chosen)
            summary[f"max_integer_divisions_{key}"] = max(
                variants[name].get("integer_divisions", 0) for name in chosen)
            summary[f"diagonal_tiles_max_{key}"] = max(
                launch["schedule"]["diagonal_tiles_max"] for launch in launches)
    summary["partial_bound"] = PARTIAL_BOUND
    return summary


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"# paged_attention: schedules, traffic and sm_90 compile facts ({report['date']})",
             "", f"`{report['command']}` — {report['target']}; nothing here ran on a GPU.",
             "Shapes: " + ", ".join(f"{k} {v}" for k, v in report["shapes"].items()) + ".", ""]
    lines += ["## Summary", ""]
    lines += [f"- `{key}`: {value}" for key, value in report["summary"].items()]
    lines += ["", "## Schedules and traffic", "",
              "`partials / kv`: fp32 partial outputs and LSE (written and read back) over "
              "the keys and values the tiles read.", ""]
    rows = []
    for case in report["cases"]:
        shape = (f"{case['kind']} B={case['batch']} q={case['q_len']} ctx={case['context']}"
                 if case["kind"] == "decode" else f"prefill {case['q_len']} tokens")
        for launch in case["launches"]:
            schedule, traffic = launch["schedule"], launch["traffic"]
            rows.append([
                shape, f"{launch['rule']}, {launch['merge']}",
                f"{schedule['block_m']}x{schedule['block_n']} w{schedule['num_warps']}",
                str(schedule["num_splits"]), str(schedule["working"]),
                str(schedule["diagonal_tiles_max"]),
                fmt(schedule["waves"], 2), f"{traffic['kv'] / 1e6:.2f}",
                f"{traffic['partials'] / 1e6:.2f}", f"{traffic['partial_over_kv']:.3f}",
                f"{launch['launches']['triton']} + {launch['launches']['fills']} fill",
            ])
    lines += markdown_table(["case", "rule, merge", "tile", "splits", "working programs",
                             "diagonal tiles", "waves", "kv MB", "partials MB",
                             "partials / kv", "launches"], rows)
    lines += ["", "## Compiled variants", ""]
    rows = [[name, str(facts.get("registers")), str(facts.get("spill_store_bytes")),
             str(facts.get("shared_bytes")), str(facts.get("programs_per_sm")),
             str(facts.get("integer_divisions")),
             str(facts.get("ring_depths")), str(facts.get("async_wait_nums")),
             str(facts.get("mma_wait_pendings")), facts.get("error", "")]
            for name, facts in report["variants"].items()]
    lines += markdown_table(["variant", "registers", "spill bytes", "shared bytes",
                             "programs / SM", "integer div/rem", "ring depths", "async_wait num",
                             "wgmma wait pendings", "error"], rows)
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items())]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="bench.attention_facts", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    report = build_report(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "paged_attention.json", report)
    write_markdown(report, args.out_dir / "paged_attention.md")
    print(json.dumps(report["summary"], indent=1))
    print(f"results in {args.out_dir}")


if __name__ == "__main__":
    main()
