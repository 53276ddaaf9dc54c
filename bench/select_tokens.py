"""Microbenchmark of select_tokens: the fused Triton kernels vs the batched PyTorch
implementation vs the reference engine's per-sequence sampler.

    python -m bench.select_tokens [--out-dir bench/results/<device>/] [--quick]
    python -m bench.select_tokens --cpu-smoke [--interpret] [--out-dir DIR]

On a CUDA GPU, at vocabulary 151936 (bf16 logits) and R in {1, 16, 64, 256, 1024} mask
rows, laid out as decode steps of 16 mask rows per sequence (R = 1: one sequence of one
row; R = 256: 16 sequences x 16 rows), in two parameter sets:

- ``greedy``: temperature 0 (the project's default);
- ``temperature``, ``top_k``, ``top_p``, ``top_k_top_p``: temperature 0.7 alone, with
  top-k 50, with top-p 0.9, with both;

it times these implementations of one decode step's selection:

- ``triton``: ``select_tokens_triton`` (wedlm_kernels.ops.select) as the existing call makes
  it, ``sampling="any"``: the three-launch kernels (scan, filter, per-sequence selection),
  whatever ``WEDLM_KERNELS_SELECT_KERNEL`` says;
- ``triton_one_launch``: the one-launch kernel (wedlm_kernels.ops.select_one_launch), in
  the ``greedy`` and ``temperature`` sets only (the sets without top-k or top-p): the same
  launcher with ``sampling="greedy"`` or ``"temperature"`` and ``kernel="one_launch"``.
  Its case checks, before timing, that its tokens and selection equal the three-launch
  kernel's exactly (``triton_one_launch_vs_triton``; entropy within 1e-4 relative). As
  for every implementation, ``speedup["triton_over_triton_one_launch"]`` is its time over
  the three launches' (> 1: the three launches are faster); the Markdown's "one launch ×
  over three" column is the inverse. The three-launch figure is the kernels' own: a
  ``sampling="greedy"``/``"temperature"`` call under the ``three_launch`` setting runs the
  same kernels after building the mode's parameter tensors (two or three fills;
  ``bench.host_time`` times the public call under each setting);
- ``torch``: ``select_tokens_torch``, the batched PyTorch implementation;
- ``engine``: :func:`engine_sampler`, a re-statement of the reference engine's sampler
  (entropy by ``torch.distributions.Categorical`` in the logits' dtype, softmax argmax,
  ``torch.topk`` then a full-vocabulary sort for top-p, ``torch.multinomial``, and the
  threshold selection with ``nonzero``/``argmin``/``.item()``), one sequence at a time in a
  Python loop with its host synchronisations, on the same batch layout (greedy and
  top_k_top_p only).

Timing modes (bench/common.py): ``eager`` (do_bench, L2 flushed before each call) for all
of them, ``graph`` (CUDA graph, warm L2) for all but the engine sampler (it synchronises
with the host), with the graph replays of a slow implementation capped at
about 2 s in all. For every case: median microseconds with the sample count, the
bytes-moved model (the logits read once plus the outputs), GB/s, the fraction of the
device-to-device copy bandwidth measured in the same run, and the speed-up of the Triton
launcher over each other one. Before timing, each case checks the Triton result against the
PyTorch implementation on the same inputs (entropy within 1e-4 relative, greedy tokens and
selection equal, sampled tokens equal on at least 99% of the rows: the rest are fp32
near-ties).

The same run then prices a request's logit rules (``rules`` in the results): on the inputs
of the ``temperature`` set at every R, the plain ``select_tokens`` call against
``process_logits`` + ``select_tokens`` (wedlm_kernels.ops.logits; the Triton launchers of
both on a GPU, the PyTorch implementations on the CPU) with three rule sets (:data:`RULES`
has the values):

- ``penalties_bias``: presence, frequency and repetition penalties on each sequence's
  committed outputs (``output_counts``: up to 512 generated tokens, half of them repeats of
  32 frequent ones) and its prompt (``prompt_mask``), and a logit bias of 4 entries;
- ``bitmask``: a grammar's row bitmask (``token_bitmask``) allowing a random half of the
  vocabulary in every row;
- ``all``: both, with ``allowed_mask`` (a random 3/4 of the vocabulary per sequence),
  ``min_tokens`` with 2 stop ids and ``min_p``.

``process_logits`` changes the logits in place, so every timed call (the plain one too)
first restores them from a pristine copy with one copy kernel, as the LM head would write
them; the restore is timed alone the same way and subtracted (``common.subtract_restore``).
Per case and mode: each call's median, the cost the rules add (``added_us``: with rules
minus plain) and that cost over the plain call (``added_over_plain``). Untimed checks: the
Triton ``process_logits`` equals the PyTorch implementation bit for bit on every set, and
after all rules every selected token is allowed by its row's bitmask and its sequence's
``allowed_mask``.

Results: ``select_tokens.json``, ``select_tokens.md`` and ``select_tokens.png`` (when
matplotlib is installed) in ``--out-dir`` (default ``bench/results/<device-name-slug>/``).
The JSON's ``summary`` (:func:`summarise`, graph mode; None where a case it needs did not
run) holds, besides the logit rules' figures:

- ``greedy_min_copy_bw_fraction_256plus``: the least, over R >= 256, of the greedy set's
  fraction of the copy bandwidth by the faster of the kernels timed (``triton``,
  ``triton_one_launch``);
- ``max_sampling_over_greedy``: the largest ratio of a sampling set's time to the greedy
  set's at the same R (R in 1, 16, 256, 1024, those the run has), each set timed by the
  one-launch kernel where the run timed it (``greedy``, ``temperature``) and by ``triton``
  otherwise; ``max_sampling_over_greedy_impls`` says which implementation timed which
  set; ``max_sampling_1row_us``: the slowest sampling set at one row, by the same
  implementations;
- ``new_over_old_min``: the least ratio of the three-launch time to the one-launch time
  over the ``greedy`` and ``temperature`` cases (> 1: the one launch is faster in every
  case);
- ``speedup_over_engine_16x16``: the eager speed-up of ``triton`` over the engine sampler
  at 16 sequences x 16 rows with top-k 50 and top-p 0.9;
- ``select_host_us_eager``: always None here (``bench.host_time``'s summary has the host
  time of one eager call).

Without a CUDA GPU the default mode prints that GPU benchmarks are skipped and exits 0;
``--cpu-smoke`` runs the whole code path on CPU tensors at tiny shapes with the PyTorch
implementations and the engine sampler (``--interpret`` adds both Triton kernels through
Triton's interpreter) on one intra-op thread (recorded as the device's ``torch_threads``),
writing to a temporary folder unless ``--out-dir`` is given (``bench/results/cpu/`` keeps
one such run: CPU figures at vocabulary 1000).
"""

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench import common
from bench.common import Timer, add_derived, fmt, fmt_rate, markdown_table

ONE_LAUNCH = "triton_one_launch"
IMPLS = ("triton", ONE_LAUNCH, "torch", "engine")
GRAPH_CAPTURABLE = ("triton", ONE_LAUNCH, "torch")


@dataclass(frozen=True)
class Sizes:
    vocab: int
    rows: tuple[int, ...]
    rows_per_sequence: int
    dtype: torch.dtype
    threshold: float = 0.4
    penalty: float = 0.02


@dataclass(frozen=True)
class Params:
    name: str
    temperature: float
    top_k: int
    top_p: float
    engine: bool = False  # also time the reference-engine sampler (slow: a few sets only)


def one_launch_mode(params: Params) -> str | None:
    """The ``sampling`` hint under which the one-launch kernel runs a set's calls:
    ``"greedy"`` (temperature 0), ``"temperature"`` (no top-k, no top-p), or None for a set
    with top-k or top-p (only the three launches run it)."""
    if params.top_k > 0 or params.top_p < 1:
        return None
    return "greedy" if params.temperature <= 0 else "temperature"


FULL = Sizes(vocab=151936, rows=(1, 16, 64, 256, 1024), rows_per_sequence=16,
             dtype=torch.bfloat16)
QUICK = replace(FULL, rows=(1, 16, 256))
SMOKE = Sizes(vocab=1000, rows=(1, 8), rows_per_sequence=4, dtype=torch.float32)
PARAMS = (
    Params("greedy", 0.0, 0, 1.0, engine=True),
    Params("temperature", 0.7, 0, 1.0),
    Params("top_k", 0.7, 50, 1.0),
    Params("top_p", 0.7, 0, 0.9),
    Params("top_k_top_p", 0.7, 50, 0.9, engine=True),
)


@dataclass(frozen=True)
class Rules:
    """The logit rules of the ``rules`` cases, the same for every sequence."""

    presence_penalty: float = 0.5
    frequency_penalty: float = 0.3
    repetition_penalty: float = 1.1
    max_generated: int = 512  # committed outputs per sequence: uniform in [0, this)
    frequent_tokens: int = 32  # half of the outputs repeat one of these
    bias_entries: int = 4  # logit_bias entries, values uniform in [-5, 5)
    min_p: float = 0.05
    min_tokens: int = 32
    stop_ids: int = 2


RULES = Rules()
RULES_PARAMS = PARAMS[1]  # temperature 0.7 alone: min_p applies (not at temperature 0)
RULE_GROUPS = {  # process_logits' keyword arguments, given together
    "penalties": ("output_counts", "prompt_mask", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"),
    "bias": ("bias_ids", "bias_values"),
    "bitmask": ("token_bitmask",),
    "allowed": ("allowed_mask",),
    "min_tokens": ("min_tokens", "stop_ids"),
    "min_p": ("min_p",),
}
RULE_SETS = {
    "penalties_bias": ("penalties", "bias"),
    "bitmask": ("bitmask",),
    "all": tuple(RULE_GROUPS),
}
RULES_SUMMARY_ROWS = (1, 16, 256)  # the rows of a --quick run (bench/gpu_check.sh)
RULES_CPU_ROUNDS = 15  # rounds of interleaved calls on the CPU

METHODS = {
    "eager": (
        "triton.testing.do_bench, every per-call time kept: the L2 cache is flushed before "
        "each call and device events bracket one call (cold L2). The engine sampler's host "
        "synchronisations are inside the bracket."
    ),
    "graph": (
        "calls_per_sample calls captured back to back in one CUDA graph, sample = replay "
        "time / calls: no launch overhead, warm L2. Not for the engine sampler (it "
        "synchronises with the host, which a graph cannot capture)."
    ),
    "cpu": "time.perf_counter around single calls on CPU tensors after one warm-up.",
    "copy_bandwidth": (
        "a device-to-device torch copy of random bytes, (bytes read + bytes written) / "
        "median time, timed like the eager mode in the same run."
    ),
    "bytes_model": (
        "the logits read once plus the three outputs written once (13 bytes per row); the "
        "sampling path reads each row more than once, so its GB/s is a lower bound on the "
        "traffic."
    ),
    "logits": (
        "N(0, 2^2) per entry plus +6..+12 on 8 random tokens per row (a peaked distribution "
        "like a language model's), rounded to the benchmark dtype."
    ),
    "engine": (
        "bench.select_tokens.engine_sampler: the reference engine's sampler re-stated, one "
        "sequence at a time with its host synchronisations."
    ),
    "rules": (
        "process_logits + select_tokens against select_tokens alone on the temperature set's "
        "inputs. Every timed call restores the logits first (one copy kernel from a pristine "
        "copy, as the LM head writes them); the restore alone is timed the same way and "
        "subtracted: median_us = median(restore + call) - median(restore) (raw: "
        "with_restore_us, restore_us). added_us = with rules - plain; added_over_plain = "
        "added_us / plain; process_logits_<set>: the rules alone, timed the same way. "
        "GPU: each call timed like the others (eager, graph); CPU: the calls interleaved, "
        "one of each per round after a warm-up call each (samples = rounds), so that the "
        "load of a shared machine falls on every call alike."
    ),
}


# ---------------------------------------------------------------------------- the inputs


def make_inputs(sizes: Sizes, params: Params, num_rows: int, device: torch.device,
                seed: int) -> tuple:
    """One decode step's select_tokens arguments: sequences of ``rows_per_sequence`` mask
    rows (fewer when ``num_rows`` is smaller), each at its own context length."""
    generator = torch.Generator().manual_seed(seed)
    per_sequence = min(sizes.rows_per_sequence, num_rows)
    num_seqs = -(-num_rows // per_sequence)  # the last sequence may be shorter
    logits = torch.randn(num_rows, sizes.vocab, generator=generator) * 2
    peaks = torch.randint(0, sizes.vocab, (num_rows, 8), generator=generator)
    logits.scatter_add_(1, peaks, 6 + 6 * torch.rand(num_rows, 8, generator=generator))
    context = torch.randint(16, 4000, (num_seqs,), generator=generator)
    row = torch.arange(num_rows)
    row_pos = context[row // per_sequence] + row % per_sequence
    cu_rows = torch.tensor([*range(0, num_rows, per_sequence), num_rows], dtype=torch.int32)
    full = torch.full
    return (
        logits.to(sizes.dtype).to(device),
        cu_rows.to(device),
        row_pos.to(device),
        full((num_seqs,), params.temperature, dtype=torch.float32).to(device),
        full((num_seqs,), params.top_k, dtype=torch.int32).to(device),
        full((num_seqs,), params.top_p, dtype=torch.float32).to(device),
        full((num_seqs,), sizes.threshold, dtype=torch.float32).to(device),
        full((num_seqs,), sizes.penalty, dtype=torch.float32).to(device),
        torch.randint(0, 2**62, (num_seqs,), generator=generator).to(device),
    )


def make_rule_inputs(args: tuple, rules: Rules, seed: int) -> dict[str, torch.Tensor]:
    """Every logit rule's tensors for the decode step ``args`` (:func:`make_inputs`), on its
    device: ``output_start`` and each keyword argument of ``process_logits``.

    Sequence ``b``'s first window row is at its context length ``n``; its last ``g`` tokens
    (``g`` uniform below ``min(n, rules.max_generated)``) are its committed outputs, half of
    them one of ``rules.frequent_tokens`` frequent ids (``output_counts``), the ``n - g``
    before them its prompt (``prompt_mask``, random ids). The row bitmask allows each token
    with probability 1/2, ``allowed_mask`` with probability 3/4."""
    logits, cu_rows, row_pos, temperature = args[0], args[1], args[2], args[3]
    num_rows, vocab = logits.shape
    num_seqs = cu_rows.shape[0] - 1
    generator = torch.Generator().manual_seed(seed + 1)

    def uniform(*shape):
        return torch.rand(*shape, generator=generator)

    def tokens(count):
        return torch.randint(0, vocab, (count,), generator=generator)

    def words(count):
        return torch.randint(-2**31, 2**31, (count, -(-vocab // 32)), dtype=torch.int32,
                             generator=generator)

    context = row_pos.cpu()[cu_rows[:-1].long().cpu()]
    generated = (uniform(num_seqs) * context.clamp(max=rules.max_generated)).long()
    counts = torch.zeros(num_seqs, vocab, dtype=torch.int32)
    prompt = torch.zeros(num_seqs, vocab, dtype=torch.bool)
    for b, (n, g) in enumerate(zip(context.tolist(), generated.tolist())):
        frequent = tokens(rules.frequent_tokens)
        repeat = frequent[torch.randint(0, rules.frequent_tokens, (g,), generator=generator)]
        outputs = torch.where(uniform(g) < 0.5, repeat, tokens(g))
        counts[b] = torch.bincount(outputs, minlength=vocab).to(torch.int32)
        prompt[b, tokens(n - g)] = True

    def full(value, dtype=torch.float32):
        return torch.full((num_seqs,), value, dtype=dtype)

    inputs = {
        "output_start": (context - generated).to(torch.int32),
        "output_counts": counts, "prompt_mask": prompt,
        "presence_penalty": full(rules.presence_penalty),
        "frequency_penalty": full(rules.frequency_penalty),
        "repetition_penalty": full(rules.repetition_penalty),
        "bias_ids": torch.randint(0, vocab, (num_seqs, rules.bias_entries),
                                  generator=generator),
        "bias_values": uniform(num_seqs, rules.bias_entries) * 10 - 5,
        "token_bitmask": words(num_rows),
        "allowed_mask": words(num_seqs) | words(num_seqs),
        "min_tokens": full(rules.min_tokens, torch.int32),
        "stop_ids": torch.randint(0, vocab, (num_seqs, rules.stop_ids), generator=generator),
        "min_p": full(rules.min_p),
    }
    inputs = {name: value.to(logits.device) for name, value in inputs.items()}
    inputs["temperature"] = temperature
    return inputs


def rule_arguments(inputs: dict[str, torch.Tensor], rule_set: str) -> dict:
    """process_logits' keyword arguments for ``rule_set`` (``RULE_SETS``): its groups'
    tensors, ``None`` for every other rule."""
    given = {name for group in RULE_SETS[rule_set] for name in RULE_GROUPS[group]}
    return {name: inputs[name] if name in given else None
            for group in RULE_GROUPS.values() for name in group}


def allowed(words: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Whether bit ``token % 32`` of ``words[i, token // 32]`` is set, per row ``i``."""
    word = words.gather(1, (token // 32)[:, None]).squeeze(1)
    return ((word >> (token % 32).to(torch.int32)) & 1).bool()


def bytes_moved(args: tuple) -> dict:
    logits = args[0]
    num_rows = logits.shape[0]
    breakdown = {"logits": logits.numel() * logits.element_size(),
                 "outputs": num_rows * (8 + 1 + 4)}
    return {"total": sum(breakdown.values()), "breakdown": breakdown}


# -------------------------------------------------------------- the reference engine's sampler


def _engine_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0:
        return logits
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _engine_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Sort the whole vocabulary, drop the tokens after the cumulative probability first
    exceeds top_p (the crossing token kept), scatter the mask back."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    drop = cumulative > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def engine_sampler(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    row_pos: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    threshold: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference engine's per-sequence sampler, re-stated with select_tokens' batch
    layout and outputs. Per sequence, as the engine does it per request: its parameters come
    to the host, then Categorical entropy of the mask rows in the logits' dtype, the greedy
    argmax of the softmax, top-k (``torch.topk``), top-p (full sort), ``torch.multinomial``
    on softmax(filtered / T), the distance-penalised threshold selection (``nonzero``, or
    the ``argmin`` fallback) and the chosen tokens read back one ``.item()`` at a time.
    The engine draws from torch's global generator (``seed`` is unused); every row counts as
    valid (the benchmark has no padding rows)."""
    offsets = cu_rows.tolist()
    positions = row_pos.tolist()
    temperatures, top_ks, top_ps = temperature.tolist(), top_k.tolist(), top_p.tolist()
    thresholds, penalties = threshold.tolist(), penalty.tolist()
    token = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    selected = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    entropy = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    for b in range(len(offsets) - 1):
        start, end = offsets[b], offsets[b + 1]
        if end <= start:
            continue
        rows = logits[start:end]
        row_entropy = torch.distributions.Categorical(logits=rows).entropy()
        greedy = torch.softmax(rows, dim=-1).argmax(dim=-1)
        if temperatures[b] == 0:
            sampled = greedy
        else:
            filtered = _engine_top_p(_engine_top_k(rows, int(top_ks[b])), top_ps[b])
            probs = torch.softmax(filtered / temperatures[b], dim=-1)
            sampled = torch.multinomial(probs, num_samples=1).squeeze(-1)
        slots = torch.tensor(positions[start:end], device=logits.device, dtype=torch.float)
        adjusted = row_entropy + (slots - slots[0]) * penalties[b]
        chosen = (adjusted < thresholds[b]).nonzero(as_tuple=True)[0]
        fill = chosen.tolist() if chosen.numel() > 0 else [int(adjusted.argmin().item())]
        tokens = [int(sampled[k].item()) for k in fill]
        for k, value in zip(fill, tokens):
            token[start + k] = value
            selected[start + k] = True
        entropy[start:end] = row_entropy.float()
    return token, selected, entropy


# ------------------------------------------------------------------------------- one case


def check_against_torch(triton_out: tuple, torch_out: tuple, params: Params) -> dict:
    token, selected, entropy = (t.cpu() for t in triton_out)
    torch_token, torch_selected, torch_entropy = (t.cpu() for t in torch_out)
    entropy_error = float(((entropy.double() - torch_entropy.double()).abs()
                           / torch_entropy.double().abs().clamp_min(1e-3)).max())
    same_tokens = float((token == torch_token).double().mean())
    same_selection = bool(torch.equal(selected, torch_selected))
    if params.temperature > 0:
        ok = entropy_error < 1e-4 and same_tokens >= 0.99
    else:
        ok = entropy_error < 1e-4 and same_tokens == 1.0 and same_selection
    return {"ok": ok, "max_relative_entropy_error": entropy_error,
            "fraction_of_equal_tokens": same_tokens, "equal_selection": same_selection}


def check_one_launch(one_launch_out: tuple, three_launch_out: tuple) -> dict:
    """The one-launch kernel against the three launches on the same inputs: tokens and
    selection equal exactly, entropy within 1e-4 relative (fp32 summation order)."""
    token, selected, entropy = (t.cpu() for t in one_launch_out)
    three_token, three_selected, three_entropy = (t.cpu() for t in three_launch_out)
    entropy_error = float(((entropy.double() - three_entropy.double()).abs()
                           / three_entropy.double().abs().clamp_min(1e-3)).max())
    equal_tokens = bool(torch.equal(token, three_token))
    equal_selection = bool(torch.equal(selected, three_selected))
    return {"ok": equal_tokens and equal_selection and entropy_error < 1e-4,
            "max_relative_entropy_error": entropy_error, "equal_tokens": equal_tokens,
            "equal_selection": equal_selection}


def filter_paths(args: tuple) -> dict:
    """How the Triton filter kernel drew the top-k / top-p rows of ``args`` (an untimed
    call): rows per path of ``select.PATH_NAMES``."""
    from wedlm_kernels.ops import select

    logits = args[0]
    num_splits, _ = select.split_plan(logits.shape[0], logits.shape[1], logits.device)
    workspace = select.SelectWorkspace.empty(logits.shape[0], logits.shape[1], num_splits,
                                             logits.device)
    workspace.path.zero_()
    select.select_tokens_triton(*args, workspace=workspace)
    path = workspace.path.cpu()
    return {name: int((path == code).sum()) for code, name in select.PATH_NAMES.items()}


def run_case(sizes: Sizes, params: Params, num_rows: int, launchers: dict, timer: Timer,
             seed: int) -> dict:
    args = make_inputs(sizes, params, num_rows, timer.device, seed)
    case = {
        "params": {"rows": num_rows, "sequences": args[1].shape[0] - 1,
                   "rows_per_sequence": min(sizes.rows_per_sequence, num_rows),
                   "parameters": params.name},
        "bytes": bytes_moved(args),
        "timings": {},
        "check": {},
    }
    mode = one_launch_mode(params)
    if launchers.get("triton") is not None:
        three_launch_out = launchers["triton"](*args)
        case["check"]["triton_vs_torch"] = check_against_torch(
            three_launch_out, launchers["torch"](*args), params)
        case["filter_paths"] = filter_paths(args)
        if launchers.get(ONE_LAUNCH) is not None and mode is not None:
            case["one_launch_sampling"] = mode
            case["check"][f"{ONE_LAUNCH}_vs_triton"] = check_one_launch(
                launchers[ONE_LAUNCH](*args, sampling=mode), three_launch_out)
    for impl in IMPLS:
        launcher = launchers.get(impl)
        if launcher is None or (impl == "engine" and not params.engine):
            continue
        if impl == ONE_LAUNCH:
            if mode is None:
                continue
            launcher = functools.partial(launcher, sampling=mode)

        def call(launcher=launcher):
            return launcher(*args)

        if timer.cuda:
            case["timings"][impl] = time_on_gpu(call, timer, impl in GRAPH_CAPTURABLE)
        else:
            case["timings"][impl] = timer.all_modes(call)
    return case


def time_on_gpu(call, timer: Timer, capturable: bool) -> dict:
    """Eager timing, then (if ``capturable``) graph timing with the number of replays
    capped so that one implementation spends about 2 s in graph replays (the slow
    baselines take tens of milliseconds per call)."""
    timings = {}
    try:
        eager = timer.time(call, "eager", None)
        timings["eager"] = eager.to_json()
        if capturable:
            replays = max(3, min(timer.replays, int(2e5 / max(eager.median_us, 1.0))))
            timings["graph"] = common.time_graph_cuda(
                call, replays, estimate_us=eager.median_us).to_json()
    except Exception as error:  # noqa: BLE001 - recorded in the report
        mode = "graph" if "eager" in timings else "eager"
        timings[mode] = {"error": f"{type(error).__name__}: {error}"}
        timer.check_context()
    return timings


# ------------------------------------------------------------------------ the logit rules


def check_rules(args: tuple, inputs: dict, launchers: dict) -> dict:
    """Untimed checks of a rules case: with the Triton launchers, ``process_logits_triton``
    equals ``process_logits_torch`` bit for bit on every rule set; with every rule, each
    token ``select_tokens`` selects is allowed by its row's bitmask and its sequence's
    ``allowed_mask`` (the rules were applied)."""
    logits, cu_rows, row_pos = args[:3]
    checks = {}

    def processed(process, rule_set):
        out = logits.clone()
        process(out, cu_rows, row_pos, inputs["output_start"], inputs["temperature"],
                **rule_arguments(inputs, rule_set))
        return out

    if launchers["process"] is not launchers["process_torch"]:
        equal = {name: bool(torch.equal(processed(launchers["process"], name),
                                        processed(launchers["process_torch"], name)))
                 for name in RULE_SETS}
        checks["process_logits_vs_torch"] = {"ok": all(equal.values()), "bit_equal": equal}
    token, selected, _ = launchers["select"](processed(launchers["process"], "all"), *args[1:])
    sequence = torch.searchsorted(cu_rows.long(), torch.arange(len(token), device=token.device),
                                  right=True) - 1
    ok = (allowed(inputs["token_bitmask"], token)
          & allowed(inputs["allowed_mask"].index_select(0, sequence), token))
    checks["bans_respected"] = {"ok": bool(ok[selected].all()),
                                "selected_rows": int(selected.sum())}
    return checks


def run_rules_case(sizes: Sizes, num_rows: int, launchers: dict, timer: Timer,
                   seed: int) -> dict:
    """On the inputs of ``RULES_PARAMS`` at ``num_rows`` rows: the plain ``select_tokens``
    call (``plain``), ``process_logits`` with each rule set of ``RULE_SETS`` then
    ``select_tokens`` (``<set>``), and ``process_logits`` alone (``process_logits_<set>``);
    every call after a restore of the logits, the restore subtracted."""
    args = make_inputs(sizes, RULES_PARAMS, num_rows, timer.device, seed)
    inputs = make_rule_inputs(args, RULES, seed)
    case = {
        "params": {"rows": num_rows, "sequences": args[1].shape[0] - 1,
                   "rows_per_sequence": min(sizes.rows_per_sequence, num_rows),
                   "parameters": RULES_PARAMS.name},
        "timings": {},
        "check": check_rules(args, inputs, launchers),
    }
    packed = common.PackedState({"logits": args[0]}, timer.device)
    logits, rest = packed.views["logits"], args[1:]
    process, select = launchers["process"], launchers["select"]

    def call(rule_set: str | None, then_select: bool = True) -> Callable[[], object]:
        def step():
            packed.restore()
            if rule_set is not None:
                process(logits, rest[0], rest[1], inputs["output_start"],
                        inputs["temperature"], **rule_arguments(inputs, rule_set))
            return select(logits, *rest) if then_select else None
        return step

    calls = {"restore": packed.restore, "plain": call(None),
             **{name: call(name) for name in RULE_SETS},
             **{f"process_logits_{name}": call(name, then_select=False) for name in RULE_SETS}}
    if timer.cuda:
        timings = {name: time_on_gpu(fn, timer, capturable=True) for name, fn in calls.items()}
    else:
        timings = time_interleaved_cpu(calls, RULES_CPU_ROUNDS)
    case["timings"]["restore"] = restore = timings.pop("restore")
    for name, timing in timings.items():
        case["timings"][name] = common.subtract_restore(timing, restore)
    packed.restore()
    return case


def time_interleaved_cpu(calls: dict[str, Callable[[], object]], rounds: int) -> dict:
    """``{name: {"cpu": Timing json}}``: ``time.perf_counter`` around single calls, after
    one warm-up call each, in ``rounds`` rounds of one call of each in turn, so that a
    shared machine's drift falls on every call alike (the rules' figures are differences)."""
    samples = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: {"cpu": common.Timing(statistics.median(values), len(values), "cpu").to_json()}
            for name, values in samples.items()}


def add_rules_derived(case: dict) -> None:
    """``added_us[set][mode]`` (the set's median minus the plain call's) and
    ``added_over_plain[set][mode]`` (that over the plain call's median) of a rules case."""
    case["added_us"], case["added_over_plain"] = {}, {}
    for name in RULE_SETS:
        added, relative = {}, {}
        for mode in case["timings"].get(name, {}):
            plain = common.median_us(case, "plain", mode)
            with_rules = common.median_us(case, name, mode)
            added[mode] = None if None in (plain, with_rules) else with_rules - plain
            relative[mode] = None if added[mode] is None else common.ratio(added[mode], plain)
        case["added_us"][name], case["added_over_plain"][name] = added, relative


# ------------------------------------------------------------------------------ reporting


def case_table(cases: list[dict], mode: str) -> list[str]:
    """One row per case: every implementation's µs, each Triton kernel's GB/s and fraction
    of the copy bandwidth, the speed-ups of ``triton`` over the PyTorch baselines and of
    the one launch over the three, and the checks."""
    impls = [impl for impl in IMPLS if any(mode in c["timings"].get(impl, {}) for c in cases)]
    kernels = [impl for impl in ("triton", ONE_LAUNCH) if impl in impls]
    baselines = [impl for impl in impls if impl not in kernels] if "triton" in impls else []
    one_vs_three = kernels == ["triton", ONE_LAUNCH]
    headers = (["rows", "B × rows", "MB moved"] + [f"{impl} µs" for impl in impls]
               + [header for impl in kernels for header in (f"{impl} GB/s",
                                                            f"{impl} % copy BW")]
               + [f"× over {impl}" for impl in baselines]
               + (["one launch × over three"] if one_vs_three else []) + ["check"])
    lines = []
    for case in cases:
        p = case["params"]
        row = [str(p["rows"]), f"{p['sequences']} × {p['rows_per_sequence']}",
               fmt(case["bytes"]["total"] / 1e6, 2)]
        for impl in impls:
            timing = case["timings"].get(impl, {}).get(mode, {})
            row.append("error" if "error" in timing else fmt(timing.get("median_us"), 1))
        for impl in kernels:
            fraction = case["fraction_of_copy_bandwidth"].get(impl, {}).get(mode)
            row += [fmt_rate(case["gb_per_s"].get(impl, {}).get(mode)),
                    fmt(None if fraction is None else 100 * fraction, 1, "%")]
        for impl in baselines:
            row.append(fmt(case["speedup"].get(f"triton_over_{impl}", {}).get(mode), 1, "×"))
        if one_vs_three:  # the three launches' time over the one launch's
            row.append(fmt(common.ratio(common.median_us(case, "triton", mode),
                                        common.median_us(case, ONE_LAUNCH, mode)), 2, "×"))
        failed = [name for name, check in case["check"].items() if not check["ok"]]
        row.append("—" if not case["check"] else
                   ("MISMATCH: " + ", ".join(failed)) if failed else "ok")
        lines.append(row)
    return markdown_table(headers, lines)


def write_markdown(report: dict, path: Path) -> None:
    device, versions, copy = report["device"], report["versions"], report["copy_bandwidth"]
    shapes = report["shapes"]
    lines = [
        "# select_tokens microbenchmark",
        "",
        f"{report['date']} on **{device['name']}**; torch {versions['torch']}, triton "
        f"{versions['triton']}, CUDA {versions['cuda']}, Python {versions['python']}.",
        f"Command: `{report['command']}`.",
        "",
    ]
    if report["mode"] == "cpu-smoke":
        lines += ["CPU smoke run: tiny shapes, CPU tensors, every figure a CPU time "
                  "(no GPU figure).", ""]
    lines += [
        f"Vocabulary {shapes['vocab']}, {shapes['dtype']} logits, up to "
        f"{shapes['rows_per_sequence']} mask rows per sequence, threshold "
        f"{shapes['threshold']}, penalty {shapes['penalty']}. Triton launcher: "
        f"{report['triton']}.",
        f"Copy bandwidth (same run): **{fmt(copy['gb_per_s'], 0)} GB/s** "
        f"({copy['bytes_copied'] / 2**20:.0f} MiB copied, bytes read + written over the "
        f"median of {copy['timing']['samples']} copies).",
        "",
    ]
    for name, result in report["parameters"].items():
        p = result["params"]
        lines += [f"## {name}: temperature {p['temperature']}, top-k {p['top_k']}, "
                  f"top-p {p['top_p']}", ""]
        for message in result.get("case_errors", []):
            lines += [f"**Case failed:** {message}", ""]
        if result.get("error"):
            lines += [f"**Error:** {result['error']}", ""]
        for mode in report["modes"]:
            if result["cases"]:
                lines += [f"Mode `{mode}`: {METHODS[mode]}", ""]
                lines += case_table(result["cases"], mode) + [""]
    lines += rules_lines(report, report.get("rules"))
    lines += ["## How it is measured", ""]
    lines += [f"- **{name}**: {text}" for name, text in METHODS.items()]
    lines += [f"- **plot**: {report['plot']}", ""]
    path.write_text("\n".join(lines))


def timing_cell(case: dict, name: str, mode: str) -> str:
    timing = case["timings"].get(name, {}).get(mode, {})
    return "error" if "error" in timing else fmt(timing.get("median_us"), 1)


def added_cell(case: dict, name: str, mode: str) -> str:
    added = case.get("added_us", {}).get(name, {}).get(mode)
    relative = case.get("added_over_plain", {}).get(name, {}).get(mode)
    if added is None:
        return "—"
    return f"{added:+.1f} µs" + ("" if relative is None else f" ({100 * relative:+.1f}%)")


def rules_table(cases: list[dict], mode: str) -> list[str]:
    headers = ["rows", "B × rows", "plain µs"]
    for name in RULE_SETS:
        headers += [f"{name} µs", f"{name} added", f"{name}: process_logits alone µs"]
    headers.append("check")
    lines = []
    for case in cases:
        p = case["params"]
        row = [str(p["rows"]), f"{p['sequences']} × {p['rows_per_sequence']}",
               timing_cell(case, "plain", mode)]
        for name in RULE_SETS:
            row += [timing_cell(case, name, mode), added_cell(case, name, mode),
                    timing_cell(case, f"process_logits_{name}", mode)]
        failed = [name for name, check in case["check"].items() if not check["ok"]]
        row.append("FAIL: " + ", ".join(failed) if failed else "ok")
        lines.append(row)
    return markdown_table(headers, lines)


def rules_lines(report: dict, rules: dict | None) -> list[str]:
    """The Markdown section of the rules cases (none when the run has none)."""
    if rules is None:
        return []
    p = rules["params"]
    lines = [
        "## Logit rules: process_logits + select_tokens against select_tokens alone", "",
        f"Implementations: {rules['implementation']}; the inputs of the `{p['parameters']}` "
        f"set (temperature {p['temperature']}). Rule sets: "
        + "; ".join(f"`{name}`: {', '.join(groups)}" for name, groups in rules["sets"].items())
        + f". Penalties: presence {p['presence_penalty']}, frequency "
        f"{p['frequency_penalty']}, repetition {p['repetition_penalty']} on up to "
        f"{p['max_generated']} committed outputs and the prompt; {p['bias_entries']} bias "
        f"entries; min_p {p['min_p']}; min_tokens {p['min_tokens']} with {p['stop_ids']} stop "
        "ids; the row bitmask allows half of the vocabulary, allowed_mask 3/4. "
        "\"added\": with the rules minus plain, and over plain; \"process_logits alone\": "
        "the rules without the selection. Restore times (subtracted) are in the JSON.", "",
    ]
    for message in rules.get("case_errors", []):
        lines += [f"**Case failed:** {message}", ""]
    if rules.get("error"):
        lines += [f"**Error:** {rules['error']}", ""]
    for mode in report["modes"]:
        if rules["cases"]:
            lines += [f"Mode `{mode}`: {METHODS[mode]}", ""]
            lines += rules_table(rules["cases"], mode) + [""]
    return lines


def plot_panels(report: dict) -> int:
    """One panel per parameter set, and one for the rules cases when there are any."""
    return len(report["parameters"]) + bool(report.get("rules", {}).get("cases"))


def write_plot(report: dict, path: Path) -> Path | str:
    """µs against the mask rows, one panel per parameter set, and the µs each rule set
    adds to the plain call (``common.save_plot``)."""
    return common.save_plot(lambda figure: draw_plot(figure, report), path,
                            size=(4.5 * plot_panels(report), 4.5))


def draw_plot(figure, report: dict) -> None:
    mode = report["modes"][0]
    axes = figure.subplots(1, plot_panels(report), squeeze=False)[0]
    colors = {"triton": "C0", ONE_LAUNCH: "C6", "torch": "C1", "engine": "C2"}
    for axis, (name, result) in zip(axes, report["parameters"].items()):
        for impl, color in colors.items():
            points = [(c["params"]["rows"], c["timings"].get(impl, {}).get(mode, {})
                       .get("median_us")) for c in result["cases"]]
            points = [(x, y) for x, y in points if y]
            if points:
                axis.plot(*zip(*points), marker="o", color=color, label=impl)
        axis.set(title=f"{name} ({mode})", xlabel="mask rows R", ylabel="µs")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
    if plot_panels(report) > len(report["parameters"]):
        draw_rules(axes[-1], report["rules"]["cases"], mode)
    figure.suptitle(f"{report['device']['name']}: select_tokens, V = "
                    f"{report['shapes']['vocab']}, {report['date']}")


def draw_rules(axis, cases: list[dict], mode: str) -> None:
    """Per rule set: the µs it adds to the plain call (solid) and process_logits alone
    (dashed)."""
    rows = [c["params"]["rows"] for c in cases]
    for index, name in enumerate(RULE_SETS):
        added = [c["added_us"].get(name, {}).get(mode) for c in cases]
        alone = [common.median_us(c, f"process_logits_{name}", mode) for c in cases]
        for label, values, style in ((name, added, "-"), (f"{name}: alone", alone, "--")):
            points = [(x, y) for x, y in zip(rows, values) if y is not None]
            if points:
                axis.plot(*zip(*points), style, marker="o", color=f"C{index + 3}", label=label)
    if axis.lines:
        axis.legend(fontsize=8)
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.set(title=f"process_logits added ({mode})", xlabel="mask rows R",
             ylabel="µs over plain select_tokens")
    axis.set_xscale("log", base=2)
    axis.grid(True, which="both", alpha=0.3)


SUMMARY_ROWS = (1, 16, 256, 1024)


def summary_impls(report: dict) -> dict[str, str]:
    """Per parameter set, the implementation whose times the summary's sampling-over-greedy
    figures read: ``triton_one_launch`` where the run timed it (the ``greedy`` and
    ``temperature`` sets on a GPU), ``triton`` otherwise."""
    return {name: ONE_LAUNCH if any(ONE_LAUNCH in case["timings"]
                                    for case in result.get("cases", [])) else "triton"
            for name, result in report["parameters"].items()}


def summarise(report: dict) -> dict:
    """Headline figures of the Triton kernels, graph mode unless named (the module
    docstring lists them); with the rules cases, :func:`summarise_rules`. None where a case
    needed did not run."""
    by_rows = {name: {case["params"]["rows"]: case for case in result.get("cases", [])}
               for name, result in report["parameters"].items()}
    greedy = by_rows.get("greedy", {})
    sampling = [name for name in by_rows if name != "greedy"]
    impls = summary_impls(report)
    run_rows = report.get("shapes", {}).get("rows", SUMMARY_ROWS)
    rows_compared = [rows for rows in SUMMARY_ROWS if rows in run_rows]

    def graph_us(case, impl="triton"):
        return common.figure(case, "timings", impl, "graph", "median_us")

    def best_fraction(case):  # the faster kernel's, of those the case timed
        kernels = [impl for impl in ("triton", ONE_LAUNCH) if impl in case["timings"]]
        return common.extreme([common.figure(case, "fraction_of_copy_bandwidth", impl, "graph")
                               for impl in kernels], max)

    engine_set = [name for name in sampling
                  if (report["parameters"][name]["params"]["top_k"],
                      report["parameters"][name]["params"]["top_p"]) == (50, 0.9)]
    engine_case = by_rows[engine_set[0]].get(256) if engine_set else None
    if common.figure(engine_case, "params", "sequences") != 16:
        engine_case = None
    over_greedy = common.extreme(
        [common.ratio(graph_us(by_rows[name].get(rows), impls[name]),
                      graph_us(greedy.get(rows), impls.get("greedy", "triton")))
         for name in sampling for rows in rows_compared], max)
    by_impl: dict[str, list[str]] = {}
    for name, impl in impls.items():
        by_impl.setdefault(impl, []).append(name)
    one_launch_cases = [case for name in by_rows if impls[name] == ONE_LAUNCH
                        for case in by_rows[name].values()]
    return {
        "max_sampling_over_greedy": over_greedy,
        "max_sampling_1row_us": common.extreme(
            [graph_us(by_rows[name].get(1), impls[name]) for name in sampling], max),
        "greedy_min_copy_bw_fraction_256plus": common.extreme(
            [best_fraction(case) for rows, case in greedy.items() if rows >= 256], min),
        "speedup_over_engine_16x16": common.figure(
            engine_case, "speedup", "triton_over_engine", "eager"),
        "max_sampling_over_greedy_impls": None if over_greedy is None else "; ".join(
            f"{impl}: {', '.join(names)}" for impl, names in by_impl.items()),
        "new_over_old_min": common.extreme(
            [common.ratio(graph_us(case), graph_us(case, ONE_LAUNCH))
             for case in one_launch_cases], min),
        "select_host_us_eager": None,  # bench.host_time's summary has it
        **summarise_rules(report.get("rules")),
    }


def summarise_rules(rules: dict | None) -> dict:
    """Per rule set and rows R in ``RULES_SUMMARY_ROWS``, graph mode:
    ``process_logits_<set>_added_us_r<R>``, the µs that process_logits with the set adds to
    the plain select_tokens call at R mask rows, and ``process_logits_<set>_added_over_plain_
    r<R>``, that over the plain call (0.25: the step's selection takes 25% longer). Nothing
    for a report without rules cases (results from before them)."""
    if rules is None:
        return {}
    by_rows = {case["params"]["rows"]: case for case in rules.get("cases", [])}
    return {f"process_logits_{name}_{figure}_r{rows}":
            common.figure(by_rows.get(rows), figure, name, "graph")
            for name in RULE_SETS for figure in ("added_us", "added_over_plain")
            for rows in RULES_SUMMARY_ROWS}


def write_outputs(run: common.OpRun, report: dict, final: bool) -> None:
    run.write(report, final, write_markdown, write_plot, summarise)


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = common.op_parser("bench.select_tokens", __doc__.split("\n\n")[0],
                              "tiny shapes on CPU tensors, no Triton unless --interpret")
    return common.parse_op_args(parser, argv)


def load_launchers(with_triton: bool) -> dict:
    from wedlm_kernels.ops import select

    """Each implementation's launcher (None for the Triton kernels without ``with_triton``);
    ``triton_one_launch`` takes the ``sampling`` hint as a keyword (``one_launch_mode``)."""
    one_launch = functools.partial(select.select_tokens_triton, kernel="one_launch")
    return {"triton": select.select_tokens_triton if with_triton else None,
            ONE_LAUNCH: one_launch if with_triton else None,
            "torch": select.select_tokens_torch, "engine": engine_sampler}


def load_rule_launchers(with_triton: bool) -> dict:
    """The rules cases' ``process`` and ``select`` launchers (Triton's, or the PyTorch
    implementations), and ``process_torch`` to check ``process`` against."""
    from wedlm_kernels.ops import logits, select

    return {"process": logits.process_logits_triton if with_triton
            else logits.process_logits_torch,
            "select": select.select_tokens_triton if with_triton else select.select_tokens_torch,
            "process_torch": logits.process_logits_torch}


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    sizes = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    if args.cpu_smoke:  # tiny tensors: on a shared 2-core machine a second thread only waits
        torch.set_num_threads(1)
    bench = common.start_op_run("select_tokens", args, argv,
                                8 * 2**20 if args.cpu_smoke else 2**30)
    print(f"copy bandwidth: {fmt(bench.copy['gb_per_s'], 0)} GB/s", flush=True)
    launchers = load_launchers(bench.with_triton)
    report = bench.report(
        triton=bench.triton_state("select_tokens_triton", "PyTorch implementation and the "
                                  "engine sampler only"),
        shapes={"vocab": sizes.vocab, "rows": list(sizes.rows),
                "rows_per_sequence": sizes.rows_per_sequence,
                "dtype": str(sizes.dtype).replace("torch.", ""),
                "threshold": sizes.threshold, "penalty": sizes.penalty},
        methods=METHODS, parameters={},
    )
    context_lost = None
    for params in PARAMS:
        result = {"params": {"temperature": params.temperature, "top_k": params.top_k,
                             "top_p": params.top_p}, "cases": []}
        report["parameters"][params.name] = result
        if context_lost:
            result["error"] = f"not run: the CUDA context was lost ({context_lost})"
            continue
        cases = [(f"R={num_rows}", lambda params=params, num_rows=num_rows: run_case(
            sizes, params, num_rows, launchers, bench.timer, args.seed))
            for num_rows in sizes.rows]
        context_lost = bench.run_group(
            result, cases, lambda case: add_derived(case, bench.copy["gb_per_s"]),
            lambda final: write_outputs(bench, report, final), prefix=f"{params.name} ")
    rules = {"implementation": "triton" if bench.with_triton else "torch",
             "params": {"parameters": RULES_PARAMS.name,
                        "temperature": RULES_PARAMS.temperature, **asdict(RULES)},
             "sets": {name: list(groups) for name, groups in RULE_SETS.items()}, "cases": []}
    report["rules"] = rules
    if context_lost:
        rules["error"] = f"not run: the CUDA context was lost ({context_lost})"
    else:
        rule_launchers = load_rule_launchers(bench.with_triton)
        cases = [(f"R={num_rows}", lambda num_rows=num_rows: run_rules_case(
            sizes, num_rows, rule_launchers, bench.timer, args.seed))
            for num_rows in sizes.rows]
        context_lost = bench.run_group(rules, cases, add_rules_derived,
                                       lambda final: write_outputs(bench, report, final),
                                       prefix="rules ")
    report["complete"] = context_lost is None
    write_outputs(bench, report, final=True)
    report["out_dir"] = str(bench.out_dir)
    return report


def failures(report: dict) -> list[str]:
    """Errors and mismatches of a finished report (the exit status is 1 if any)."""
    groups = {**report["parameters"], "rules": report.get("rules", {})}
    return [failure for name, result in groups.items()
            for failure in common.group_failures(result, name,
                                                 lambda case: f"R={case['params']['rows']}")]


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(argv, parse_args, run, failures, "select_tokens.md")


if __name__ == "__main__":
    sys.exit(main())
