"""CUDA-graph capture of the decode step (CUDA only, optional).

A decode step has fixed shapes and never synchronises with the host, so it can be recorded
once per batch shape and replayed. The batch is padded to a size bucket (powers of two up to
``max_batch``) so that few graphs cover every batch size. Each graph owns static copies of
the batch state: the host copies the live state in before replaying, and reads (and
compacts) the static state after. Padding rows are finished sequences with an empty window,
which no op touches.
"""

from collections.abc import Callable

import torch

from .state import BatchState


def bucket_size(size: int, max_batch: int) -> int:
    """The smallest power of two >= ``size``, capped at ``max_batch``."""
    bucket = 1
    while bucket < size:
        bucket *= 2
    return min(bucket, max_batch)


class StepGraphs:
    """One captured ``step(state, mode)`` per (mode, batch signature)."""

    def __init__(self, step: Callable[[BatchState, str], None]) -> None:
        self.step = step
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, BatchState]] = {}
        self.pool = None

    def clear(self) -> None:
        """Forget every graph (call when a buffer the step reads was reallocated)."""
        self.graphs.clear()

    def run(self, state: BatchState, steps: int, mode: str) -> BatchState:
        """Replay the step ``steps`` times on ``state``'s values; returns the static state
        that now holds the result."""
        key = (mode, state.signature())
        if key not in self.graphs:
            self.graphs[key] = self._capture(state, mode)
        graph, static = self.graphs[key]
        if state is not static:
            static.copy_(state)
        for _ in range(steps):
            graph.replay()
        return static

    @staticmethod
    def static_buffers(like: BatchState) -> BatchState:
        """Buffers shaped like ``like`` holding only finished, empty rows: a step on them
        changes nothing (so warm-up and capture leave the cache and the state alone)."""
        static = BatchState(**{n: t.clone() for n, t in like.tensors().items()})
        static.finished.fill_(True)
        static.win_len.zero_()
        static.win_mask.fill_(True)
        static.block_table.fill_(-1)
        return static

    def _capture(self, like: BatchState, mode: str) -> tuple[torch.cuda.CUDAGraph, BatchState]:
        static = self.static_buffers(like)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernel compilation, allocator pools
                self.step(static, mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step(static, mode)
        return graph, static
