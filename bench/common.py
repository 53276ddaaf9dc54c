"""Shared pieces of the op microbenchmarks: timing, copy bandwidth, device facts, reports.

Timing modes (every figure keeps its median and its sample count):

- ``eager`` on CUDA: ``triton.testing.do_bench`` with every per-call time returned; the L2
  cache is flushed (a 256 MB write) before each call and device events bracket the one call,
  so a figure is the device time of one call on a cold L2. The flush also gives the host a
  head start, so launch overhead shows only when issuing the call takes longer than running
  it (the PyTorch implementations, which launch many small kernels).
- ``graph`` on CUDA: ``calls_per_graph`` calls captured back to back in one CUDA graph; each
  replay is bracketed by device events and a sample is the replay time divided by the calls.
  No launch overhead and a warm L2 (each call finds the previous call's data): the time a
  call costs inside a captured decode step.
- ``cpu`` (smoke runs only): ``time.perf_counter`` around single calls after one warm-up.

:class:`Timer` runs a callable in every mode of the run and records failures; a mutating op
is timed through :class:`PackedState` ("restore + op" minus "restore", see
:func:`subtract_restore`); :func:`add_derived` turns a case's bytes model and medians into
GB/s, fractions of the copy bandwidth (:func:`copy_bandwidth`) and speed-ups of the
``triton`` implementation over every other one.

Plots: every benchmark draws its PNG through :func:`save_plot` (a figure-building callback
and a path; the path back, or the reason no plot was written, e.g. :data:`NO_MATPLOTLIB`
on a machine without matplotlib, the ``bench`` extra).
"""

import argparse
import math
import os
import re
import shlex
import statistics
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_min.run_info import device_info, utc_now, versions, write_json  # noqa: F401

if TYPE_CHECKING:  # matplotlib is optional: imported by save_plot when it draws
    from matplotlib.figure import Figure

NO_GPU_MESSAGE = "no CUDA GPU present: GPU benchmarks skipped"
CPU_LABEL = "CPU only (no GPU); every figure is a CPU measurement"  # results label
RESULTS_ROOT = Path(__file__).resolve().parent / "results"


@dataclass
class Timing:
    """Median time of one call in microseconds, with the number of samples it is taken over."""

    median_us: float
    samples: int
    mode: str  # "eager", "graph" or "cpu"
    calls_per_sample: int = 1

    def to_json(self) -> dict:
        return asdict(self)


def time_eager_cuda(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> Timing:
    """``do_bench`` per-call device times (L2 flushed before each call); median of all."""
    import triton.testing

    times_ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return Timing(statistics.median(times_ms) * 1e3, len(times_ms), "eager")


def time_graph_cuda(
    fn: Callable[[], object], replays: int, target_ms: float = 2.0, max_calls: int = 200,
    estimate_us: float | None = None,
) -> Timing:
    """Per-call time of ``fn`` captured ``calls`` times in one CUDA graph (median of replays).

    ``calls`` is chosen so that one replay takes about ``target_ms`` (from ``estimate_us``,
    an eager estimate of one call), within ``[10, max_calls]``.
    """
    if estimate_us is None or estimate_us <= 0:
        calls = max_calls
    else:
        calls = int(min(max(target_ms * 1e3 / estimate_us, 10), max_calls))
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):  # warm-up off the default stream, as capture needs
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    per_call_us = [start.elapsed_time(end) * 1e3 / calls for start, end in zip(starts, ends)]
    del graph
    return Timing(statistics.median(per_call_us), replays, "graph", calls)


def time_cpu(fn: Callable[[], object], rep_ms: float, min_samples: int = 3,
             max_samples: int = 50) -> Timing:
    """``time.perf_counter`` around single calls (CPU tensors: every op is synchronous)."""
    fn()  # warm-up
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms * 1e-3
    while len(samples) < min_samples or (
        len(samples) < max_samples and time.perf_counter() < deadline
    ):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return Timing(statistics.median(samples), len(samples), "cpu")


def copy_bandwidth(device: torch.device, nbytes: int, time_fn: Callable[..., Timing]) -> dict:
    """Device-to-device copy of ``nbytes`` random bytes: (bytes read + bytes written) / time.

    ``time_fn(fn)`` returns a :class:`Timing` of one call of ``fn``.
    """
    timing = _time_copy(device, nbytes, time_fn)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the two buffers are gone: give their memory back
    moved = 2 * nbytes
    return {
        "bytes_copied": nbytes,
        "bytes_read_plus_written": moved,
        "timing": timing.to_json(),
        "gb_per_s": gb_per_s(moved, timing.median_us),
    }


def _time_copy(device: torch.device, nbytes: int, time_fn: Callable[..., Timing]) -> Timing:
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return time_fn(lambda: target.copy_(source))


def gb_per_s(nbytes: int | float, microseconds: float) -> float | None:
    """Achieved bandwidth in GB/s (1e9 bytes per second)."""
    if microseconds is None or microseconds <= 0:
        return None
    return nbytes / (microseconds * 1e-6) / 1e9


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def figure(case: dict | None, *keys: str) -> float | None:
    """``case[keys[0]][keys[1]]...``, or None where the case or a key is missing (a case that
    failed, a mode that did not run)."""
    value = case
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def extreme(values: list, pick: Callable) -> float | None:
    """``pick(values)`` (min or max) for a summary, None if any value is missing or none is
    given: a headline figure over a set of cases stands only if all of them ran."""
    if not values or any(v is None for v in values):
        return None
    return pick(values)


def slugify(name: str) -> str:
    """A folder name for a device: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def device_slug() -> str:
    """The results folder name of this machine's first GPU (``"cpu"`` without one)."""
    if torch.cuda.is_available():
        return slugify(torch.cuda.get_device_name(0))
    return "cpu"


def command_line(module: str, argv: Sequence[str]) -> str:
    return " ".join(["python", "-m", module, *map(shlex.quote, argv)]).strip()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a Markdown table; the first column left-aligned, the others right-aligned."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" + "---:|" * (len(headers) - 1),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A table cell: the number with ``digits`` decimals, or an em dash for no value."""
    if value is None:
        return "—"
    return f"{value:.{digits}f}{suffix}"


# ---------------------------------------------------------------------------- plots
#
# Every benchmark's plot (ops_window, paged_attention, select_tokens, bench.report's sweep
# plot, bench/vllm_serve.py) is drawn through save_plot: one backend, one way of saving, one
# answer when matplotlib is missing.

NO_MATPLOTLIB = "matplotlib is not installed: no plot"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def save_plot(
    draw: Callable[["Figure"], object],
    path: Path,
    *,
    size: tuple[float, float] = (8.0, 5.0),
    dpi: int = 110,
    metadata: dict[str, str] | None = None,
) -> Path | str:
    """Draws one figure with ``draw`` and saves it as a PNG at ``path``.

    ``draw(figure)`` is given an empty ``matplotlib.figure.Figure`` of ``size`` inches with
    a tight layout; it adds its axes (``figure.subplots(...)``) and draws, and its return
    value is ignored. The figure is rendered by Agg, matplotlib's file-only backend, bound
    to this one figure: no ``pyplot``, no global backend switch, no display needed, nothing
    left open. It is saved at ``dpi`` dots per inch, with ``metadata`` (latin-1 keys of at
    most 79 characters) as PNG text chunks beside matplotlib's ``Software`` (read back with
    :func:`png_text`).

    Returns ``path`` once the file is written, or, as a ``str``, why no plot was written:

    - :data:`NO_MATPLOTLIB` when matplotlib cannot be imported (it is the ``bench`` extra;
      the GPU machine of bench/gpu_check.sh has no network and runs without it), and
      ``draw`` is not called;
    - ``"plot failed: <error>"`` when ``draw`` or the saving raised; no file is left at
      ``path`` (a plot of an earlier run there is removed).

    Neither raises, so a plot never costs a benchmark the results it measured. A report
    keeps the outcome in its ``"plot"`` entry with :func:`plot_entry`, e.g.::

        def draw(figure):
            axis = figure.subplots()
            axis.plot(concurrency, tokens_per_second, marker="o", label="wedlm")
            axis.set(xlabel="concurrent requests", ylabel="tok/s")
            axis.legend()

        report["plot"] = plot_entry(save_plot(draw, out_dir / "vllm_serve.png", size=(6, 4)))
    """
    try:
        import matplotlib  # noqa: F401 - first, so that a missing matplotlib says so here
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return NO_MATPLOTLIB
    path = Path(path)
    try:
        figure = Figure(figsize=size, layout="tight")
        FigureCanvasAgg(figure)
        draw(figure)
        figure.savefig(path, format="png", dpi=dpi, metadata=metadata)
    except Exception as error:  # noqa: BLE001 - recorded in the report instead
        path.unlink(missing_ok=True)
        return f"plot failed: {type(error).__name__}: {error}"
    return path


def plot_entry(outcome: Path | str) -> str:
    """A report's ``"plot"`` entry from :func:`save_plot`'s outcome: the file's name, or the
    reason no plot was written."""
    return outcome.name if isinstance(outcome, Path) else outcome


def png_text(path: Path) -> dict[str, str]:
    """The ``tEXt`` chunks of a PNG file (``save_plot``'s ``metadata``); ValueError when the
    file is not a well-formed PNG: its signature, an ``IHDR`` chunk first, every chunk
    whole with a matching CRC, ``IEND`` last."""
    data = Path(path).read_bytes()
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError(f"{path}: not a PNG file (signature)")
    text, offset, kinds = {}, len(PNG_SIGNATURE), []
    while offset < len(data):
        if offset + 12 > len(data):
            raise ValueError(f"{path}: truncated chunk at byte {offset}")
        length, kind = struct.unpack(">I4s", data[offset: offset + 8])
        if offset + 12 + length > len(data):
            raise ValueError(f"{path}: truncated chunk {kind!r} at byte {offset}")
        body = data[offset + 8: offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length: offset + 12 + length])
        if zlib.crc32(kind + body) != crc:
            raise ValueError(f"{path}: chunk {kind!r} at byte {offset} is damaged (CRC)")
        kinds.append(kind)
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
        offset += 12 + length
        if kind == b"IEND":
            break
    if not kinds or kinds[0] != b"IHDR" or kinds[-1] != b"IEND" or offset != len(data):
        raise ValueError(f"{path}: not a complete PNG file (IHDR first, IEND last)")
    return text


class CudaContextLost(RuntimeError):
    """A CUDA error left the context unusable: nothing more can run in this process."""


class Timer:
    """Times a callable in every mode of this run (``eager`` and ``graph`` on CUDA, ``cpu``
    on the CPU) and records errors instead of raising them."""

    MODES = {"cuda": ("eager", "graph"), "cpu": ("cpu",)}

    def __init__(self, device: torch.device, quick: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.modes = self.MODES[device.type]
        self.warmup_ms, self.rep_ms = (10, 25) if quick else (25, 100)
        self.replays = 10 if quick else 30
        self.cpu_rep_ms = 5.0

    def once(self, fn: Callable[[], object]) -> Timing:
        """One timing of ``fn`` in the run's first mode (the copy bandwidth uses this)."""
        if self.cuda:
            return time_eager_cuda(fn, self.warmup_ms, self.rep_ms)
        return time_cpu(fn, self.cpu_rep_ms)

    def time(self, fn: Callable[[], object], mode: str, estimate_us: float | None) -> Timing:
        if mode == "eager":
            return time_eager_cuda(fn, self.warmup_ms, self.rep_ms)
        if mode == "graph":
            return time_graph_cuda(fn, self.replays, estimate_us=estimate_us)
        return time_cpu(fn, self.cpu_rep_ms)

    def all_modes(self, fn: Callable[[], object]) -> dict:
        """``{mode: Timing json or {"error": ...}}``; raises CudaContextLost if a failure
        broke the CUDA context."""
        result, estimate = {}, None
        for mode in self.modes:
            try:
                timing = self.time(fn, mode, estimate)
            except Exception as error:  # noqa: BLE001 - recorded in the report
                result[mode] = {"error": f"{type(error).__name__}: {error}"}
                self.check_context()
                continue
            estimate = estimate or timing.median_us
            result[mode] = timing.to_json()
        return result

    def check_context(self) -> None:
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001
            raise CudaContextLost(f"{type(error).__name__}: {error}") from error


class PackedState:
    """The tensors an op mutates, as contiguous views of one byte buffer, with a pristine
    copy of that buffer: :meth:`restore` puts the state back with a single copy kernel, so
    a mutating op can be timed as "restore + op" minus "restore"."""

    ALIGN = 256

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        offsets, total = {}, 0
        for name, tensor in tensors.items():
            offsets[name] = total
            nbytes = tensor.numel() * tensor.element_size()
            total += (nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        self.buffer = torch.zeros(max(total, 1), dtype=torch.uint8, device=device)
        self.views = {}
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            raw = self.buffer[offsets[name]: offsets[name] + nbytes]
            view = raw.view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            self.views[name] = view
        self.pristine = self.buffer.clone()

    def restore(self) -> None:
        self.buffer.copy_(self.pristine)


def subtract_restore(with_restore: dict, restore: dict) -> dict:
    """Per mode: the op's median = median(restore + op) - median(restore)."""
    result = {}
    for mode, timing in with_restore.items():
        if "error" in timing or "error" in restore.get(mode, {"error": ""}):
            result[mode] = timing
            continue
        result[mode] = {
            **timing,
            "median_us": timing["median_us"] - restore[mode]["median_us"],
            "with_restore_us": timing["median_us"],
            "restore_us": restore[mode]["median_us"],
        }
    return result


def with_total(breakdown: dict[str, int]) -> dict:
    return {"total": sum(breakdown.values()), "breakdown": breakdown}


def median_us(case: dict, impl: str, mode: str) -> float | None:
    timing = case["timings"].get(impl, {}).get(mode, {})
    return timing.get("median_us")


def add_derived(case: dict, copy_gb_per_s: float | None) -> None:
    """Adds to a case (``bytes.total`` and ``timings[impl][mode]``) the GB/s and the
    fraction of the copy bandwidth of every timing, and the speed-up of the ``triton``
    implementation over each other one (``speedup["triton_over_<impl>"][mode]``). The
    ``restore`` timing of a mutating op is not an implementation."""
    total = case["bytes"]["total"]
    case["gb_per_s"], case["fraction_of_copy_bandwidth"] = {}, {}
    for impl in case["timings"]:
        if impl == "restore":
            continue
        case["gb_per_s"][impl], case["fraction_of_copy_bandwidth"][impl] = {}, {}
        for mode in case["timings"][impl]:
            microseconds = median_us(case, impl, mode)
            rate = gb_per_s(total, microseconds) if microseconds else None
            case["gb_per_s"][impl][mode] = rate
            case["fraction_of_copy_bandwidth"][impl][mode] = ratio(rate, copy_gb_per_s)
    case["speedup"] = {}
    if "triton" not in case["timings"]:
        return
    for baseline in case["timings"]:
        if baseline not in ("triton", "restore"):
            case["speedup"][f"triton_over_{baseline}"] = {
                mode: ratio(median_us(case, baseline, mode), median_us(case, "triton", mode))
                for mode in case["timings"]["triton"]
            }


def fmt_rate(value: float | None) -> str:
    """GB/s with three significant digits (at least no decimals)."""
    if value is None:
        return "—"
    return fmt(value, max(0, 2 - int(math.floor(math.log10(value)))) if value > 0 else 0)


def run_cases(
    group: dict,
    cases: Iterable[tuple[str, Callable[[], dict]]],
    timer: Timer,
    derive: Callable[[dict], None],
    device: torch.device,
    prefix: str = "",
    after_each: Callable[[], None] | None = None,
) -> str | None:
    """Run ``(label, run_case)`` cases into ``group["cases"]``.

    A case that raises is recorded in ``group["case_errors"]`` and the others go on; a lost
    CUDA context stops the group: ``group["error"]`` says where, and the error text is
    returned so the caller can skip what remains. ``derive`` adds rates to each finished
    case; ``after_each`` runs after every case (e.g. to write partial results).
    """
    for label, run_case in cases:
        print(f"{prefix}{label}", flush=True)
        try:
            case = run_case()
        except CudaContextLost as error:
            group["error"] = f"{label}: CUDA context lost: {error}"
            return str(error)
        except Exception as error:  # noqa: BLE001 - recorded, the other cases go on
            group.setdefault("case_errors", []).append(
                f"{label}: {type(error).__name__}: {error}")
            timer.check_context()
            continue
        derive(case)
        group["cases"].append(case)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if after_each is not None:
            after_each()
    return None


def bench_main(
    argv: Sequence[str] | None,
    parse_args: Callable[[list[str]], object],
    run: Callable[[object, list[str]], dict],
    failures: Callable[[dict], list[str]],
    markdown_name: str,
) -> int:
    """The command line of a CUDA microbenchmark: says so and exits 0 without a GPU (unless
    ``--cpu-smoke``), prints the Markdown report, and exits 1 if any case failed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0
    report = run(args, argv)
    print((Path(report["out_dir"]) / markdown_name).read_text())
    print(f"results in {report['out_dir']}")
    problems = failures(report)
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


# ------------------------------------------------------------- the op-benchmark skeleton
#
# bench/ops_window.py, bench/paged_attention.py and bench/select_tokens.py share one shape:
#
#     parse_args(argv)  = op_parser(...) + the script's own options, checked by parse_op_args
#     run(args, argv)   : run = start_op_run(...); report = run.report(shapes=..., ...);
#                         groups of cases through run.run_group (partial results written
#                         after each); run.write(report, final=True, ...) adds the plot
#                         (write_plot: save_plot with the script's drawing) and the summary
#     failures(report)  : group_failures(...) per group of cases
#     main(argv)        = bench_main(argv, parse_args, run, failures, "<name>.md")


def op_parser(module: str, description: str, smoke_help: str) -> argparse.ArgumentParser:
    """The options every op microbenchmark takes: ``--out-dir``, ``--quick``,
    ``--cpu-smoke`` (described by ``smoke_help``), ``--interpret`` and ``--seed``."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="results folder (default bench/results/<device-name-slug>/; "
                             "a temporary folder for --cpu-smoke)")
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter timing")
    parser.add_argument("--cpu-smoke", action="store_true", help=smoke_help)
    parser.add_argument("--interpret", action="store_true",
                        help="with --cpu-smoke: also run the Triton launchers through "
                             "Triton's interpreter")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_op_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, refusing ``--interpret`` without ``--cpu-smoke``."""
    args = parser.parse_args(argv)
    if args.interpret and not args.cpu_smoke:
        parser.error("--interpret needs --cpu-smoke")
    return args


SMOKE_DEVICE_LABEL = "CPU smoke run: every figure is a CPU measurement"


@dataclass
class OpRun:
    """One run of an op microbenchmark: where it runs, where it writes, how it times."""

    name: str  # "ops_window": the module under bench/ and the results' file names
    args: argparse.Namespace
    argv: list[str]
    device: torch.device
    out_dir: Path
    timer: Timer
    copy: dict  # copy_bandwidth() of this device

    @property
    def mode(self) -> str:
        return "cpu-smoke" if self.args.cpu_smoke else "cuda"

    @property
    def with_triton(self) -> bool:
        """Whether the Triton launchers run: on the GPU, or on the CPU with --interpret."""
        return not self.args.cpu_smoke or self.args.interpret

    def triton_state(self, launcher: str, smoke_stand_in: str) -> str:
        """The report's word on the kernel: its launcher's name (with the interpreter
        named), or why it did not run."""
        if not self.with_triton:
            return f"not run (CPU smoke run: {smoke_stand_in})"
        return launcher + (" (Triton interpreter)" if self.args.interpret else "")

    def report(self, **fields) -> dict:
        """The report's common head, then ``fields`` (shapes, the case groups, ...)."""
        device = device_info(self.device)
        if self.args.cpu_smoke:
            device["label"] = SMOKE_DEVICE_LABEL
        return {
            "benchmark": self.name, "date": utc_now(),
            "command": command_line(f"bench.{self.name}", self.argv),
            "mode": self.mode, "quick": self.args.quick, "device": device,
            "versions": versions(), "modes": list(self.timer.modes),
            "copy_bandwidth": self.copy, **fields,
            "complete": False, "plot": "written at the end of the run",
        }

    def run_group(self, group: dict, cases: Iterable[tuple[str, Callable[[], dict]]],
                  derive: Callable[[dict], None], write: Callable[[bool], None],
                  prefix: str = "") -> str | None:
        """:func:`run_cases` into ``group`` with ``write(False)`` after every case: the
        results so far survive a crash or a run cut short (bench/gpu_check.sh packs them as
        it goes). Returns a lost context's error."""
        lost = run_cases(group, cases, self.timer, derive, self.device, prefix,
                         lambda: write(False))
        write(False)
        return lost

    def write(self, report: dict, final: bool, write_markdown: Callable[[dict, Path], None],
              write_plot: Callable[[dict, Path], Path | str],
              summarise: Callable[[dict], dict]) -> None:
        """``<name>.json`` and ``<name>.md``; the final write adds the plot (``write_plot``
        returns :func:`save_plot`'s outcome; the report keeps the PNG's name or the reason
        there is none) and the summary."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if final:
            report["plot"] = plot_entry(write_plot(report, self.out_dir / f"{self.name}.png"))
            report["summary"] = summarise(report)
        write_json(self.out_dir / f"{self.name}.json", report)
        write_markdown(report, self.out_dir / f"{self.name}.md")


def start_op_run(name: str, args: argparse.Namespace, argv: Sequence[str],
                 copy_bytes: int) -> OpRun:
    """The device (CPU tensors for ``--cpu-smoke``, with ``TRITON_INTERPRET=1`` set before
    any kernel module imports Triton when ``--interpret``), the results folder, the timer,
    and the copy bandwidth over ``copy_bytes`` (printed)."""
    if args.cpu_smoke:
        device = torch.device("cpu")
        if args.interpret:
            os.environ["TRITON_INTERPRET"] = "1"
    else:
        device = torch.device("cuda")
    out_dir = args.out_dir
    if out_dir is None:
        out_dir = (Path(tempfile.mkdtemp(prefix=f"{name}_smoke_")) if args.cpu_smoke
                   else RESULTS_ROOT / device_slug())
    timer = Timer(device, args.quick)
    copy = copy_bandwidth(device, copy_bytes, timer.once)
    return OpRun(name, args, list(argv), device, out_dir, timer, copy)


def group_failures(group: dict, name: str, describe: Callable[[dict], str]) -> list[str]:
    """Errors and mismatches of one group of cases: the cases that raised, a lost context,
    every timing that failed and every failed check (``describe(case)`` names a case)."""
    prefix = f"{name}: " if name else ""
    found = [prefix + message for message in group.get("case_errors", [])]
    if group.get("error"):
        found.append(prefix + group["error"])
    for case in group.get("cases", []):
        label = f"{name} {describe(case)}".strip()
        for impl, modes in case["timings"].items():
            found += [f"{label} {impl} {mode}: {timing['error']}"
                      for mode, timing in modes.items() if "error" in timing]
        found += [f"{label}: {check_name} mismatch {check}"
                  for check_name, check in case["check"].items() if not check["ok"]]
    return found
