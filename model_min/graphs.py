"""CUDA-graph capture of the decode step (CUDA only, optional).

A decode step never synchronises with the host inside, so it can be recorded once per set of
shapes and replayed. The batch is padded to a size bucket (powers of two up to
``max_batch``) so that few shapes cover every batch size. A window step feeds only the live
rows of its windows, packed: their number is read back before each step and rounded up to a
row bucket (``generator.row_bucket``), and each (batch shape, row bucket) has its own graph.
All graphs of one batch shape share one static copy of the batch state: the host copies the
live state in before the first replay, and reads (and compacts) the static state after the
last. Padding rows are finished sequences with an empty window and no pages: a window step
feeds none of their rows; an AR step feeds one row each, which writes no K/V (its attention
output is NaN, having no page) and whose token is discarded.
"""

from collections.abc import Callable, Hashable

import torch

from .state import BatchState


def bucket_size(size: int, max_batch: int) -> int:
    """The smallest power of two >= ``size``, capped at ``max_batch``."""
    bucket = 1
    while bucket < size:
        bucket *= 2
    return min(bucket, max_batch)


class StepGraphs:
    """Captured ``step(state, mode, num_rows)`` calls per (mode, batch signature, variant,
    rows); ``variant``: what else the step's Python branches depend on (the generator's
    sampling mode and logit rules), which no state shape shows."""

    def __init__(self, step: Callable[..., None]) -> None:
        self.step = step
        # (mode, batch signature, variant) -> (static state, {rows: graph})
        self.batches: dict[tuple, tuple[BatchState, dict]] = {}
        self.pool = None

    def clear(self) -> None:
        """Forget every graph (call when a buffer the step reads was reallocated)."""
        self.batches.clear()

    def run(self, state: BatchState, steps: int, mode: str,
            rows_for_step: Callable[[BatchState], int | None],
            variant: Hashable = None) -> BatchState:
        """Run ``steps`` steps on ``state``'s values, each by replaying the graph of the rows
        ``rows_for_step`` gives for it; returns the static state that holds the result.
        ``variant``: a graph captured under another variant is never replayed."""
        key = (mode, state.signature(), variant)
        if key not in self.batches:
            self.batches[key] = (self.static_buffers(state), {})
        static, graphs = self.batches[key]
        if state is not static:
            static.copy_(state)
        for _ in range(steps):
            rows = rows_for_step(static)
            if rows == 0:  # every window is empty: the step would do nothing
                continue
            if rows not in graphs:
                graphs[rows] = self._capture(static, mode, rows)
            graphs[rows].replay()
        return static

    @staticmethod
    def static_buffers(like: BatchState) -> BatchState:
        """Buffers shaped like ``like`` holding only finished, empty rows: a step on them
        changes nothing (so warm-up and capture leave the cache and the state alone)."""
        static = BatchState(**{n: t.clone() for n, t in like.tensors().items()})
        StepGraphs._empty(static)
        return static

    @staticmethod
    def _empty(state: BatchState) -> None:
        state.finished.fill_(True)
        state.win_len.zero_()
        state.win_mask.fill_(True)
        state.block_table.fill_(-1)

    def _capture(self, static: BatchState, mode: str, rows: int | None) -> torch.cuda.CUDAGraph:
        """Capture the step for ``rows`` packed rows on ``static``: its live values are
        set aside, warm-up and capture run on finished, empty rows, then the values return."""
        saved = BatchState(**{n: t.clone() for n, t in static.tensors().items()})
        self._empty(static)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernel compilation, allocator pools
                self.step(static, mode, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(static, mode, rows)
        static.copy_(saved)
        return graph
