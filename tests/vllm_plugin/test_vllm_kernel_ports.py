"""The host ports of Model Runner V2's bookkeeping kernels
(``triton_cpu_backend/wedlm_test_triton_cpu/ported_kernels.py``) against the kernels they
stand for, run in Triton's interpreter: vLLM's own launchers (``prepare_pos_seq_lens``,
``BlockTables``, ``StagedWriteTensor``, ...) run once on each, from the same random state,
and must leave every tensor they touch equal, including prefill and draft rows, padding
rows, skipped (negative) rows, empty queries and both KV cache group layouts."""

import contextlib
import importlib
import random

import pytest
import torch
import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker: host buffers for UVA ones)
from vllm.v1.worker.gpu import block_table, input_batch
from wedlm_test_triton_cpu import ported_kernels

SEEDS = range(8)


def original(module_name: str, name: str):
    kernel = getattr(importlib.import_module(module_name), name)
    return kernel.original if isinstance(kernel, ported_kernels.PortedKernel) else kernel


@contextlib.contextmanager
def kernels(ported: bool):
    """Every ported kernel as its port (``ported``) or interpreted, restored after."""
    saved = {}
    for (module_name, name), function in ported_kernels.PORTS.items():
        module = importlib.import_module(module_name)
        saved[(module, name)] = getattr(module, name)
        kernel = original(module_name, name)
        setattr(module, name,
                ported_kernels.PortedKernel(kernel, function) if ported else kernel)
    try:
        yield
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)


def same_on_both(scenario, seed):
    """``scenario(rng)`` returns the tensors it left behind; they must be equal whether the
    kernels ran interpreted or ported."""
    results = {}
    for ported in (False, True):
        with kernels(ported):
            results[ported] = scenario(random.Random(seed))
    interpreted, ported = results[False], results[True]
    assert interpreted.keys() == ported.keys()
    for name in interpreted:
        assert torch.equal(interpreted[name], ported[name]), (
            f"{name}: interpreted {interpreted[name].tolist()} != "
            f"ported {ported[name].tolist()}")


def test_every_port_replaces_the_kernel_it_was_written_from():
    """The hashes match this vLLM's kernels (another vLLM would keep them interpreted), and
    installing puts a port in each kernel's place."""
    left = [f"{module}.{name}" for (module, name) in ported_kernels.PORTS
            if ported_kernels.source_sha256(original(module, name))
            != ported_kernels.SOURCE_SHA256[(module, name)]]
    assert not left, f"kernels whose source changed (their ports were not installed): {left}"
    with kernels(ported=False), pytest.MonkeyPatch.context() as patch:
        patch.setenv(ported_kernels.ENABLE, "1")
        assert ported_kernels.install() == []
        for module_name, name in ported_kernels.PORTS:
            kernel = getattr(importlib.import_module(module_name), name)
            assert isinstance(kernel, ported_kernels.PortedKernel), name


def batch(rng, max_num_reqs=8, max_query=7):
    """A step's batch: requests of random slots (idx_mapping), query lengths (zero
    included), computed and prefill lengths (some still in prefill), int32 as vLLM's."""
    num_reqs = rng.randint(1, 5)
    slots = rng.sample(range(max_num_reqs), num_reqs)
    query_lens = [rng.randint(0, max_query) for _ in range(num_reqs)]
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    num_computed = [rng.randint(0, 20) for _ in range(max_num_reqs)]
    prefill_len = [computed + rng.choice([-3, 0, 2, 9]) for computed in num_computed]
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return dict(num_reqs=num_reqs, idx_mapping=as_int32(slots),
                query_start_loc=as_int32(starts), query_lens=query_lens,
                num_computed_tokens=as_int32(num_computed),
                prefill_len=as_int32([max(length, 0) for length in prefill_len]))


@pytest.mark.parametrize("seed", SEEDS)
def test_prepare_prefill_inputs_and_positions(seed):
    def scenario(rng):
        step = batch(rng)
        torch.manual_seed(seed)
        all_token_ids = torch.randint(0, 1000, (8, 64), dtype=torch.int32)
        input_ids = torch.full((48,), -7, dtype=torch.int32)
        next_prefill_tokens = torch.full((3, 8), -7, dtype=torch.int32)
        input_batch.prepare_prefill_inputs(
            input_ids, next_prefill_tokens, step["idx_mapping"], step["query_start_loc"],
            all_token_ids, step["prefill_len"], step["num_computed_tokens"])
        pos = torch.full((48,), -7, dtype=torch.int64)
        seq_lens = torch.full((8,), -7, dtype=torch.int32)
        input_batch.prepare_pos_seq_lens(step["idx_mapping"], step["query_start_loc"],
                                         step["num_computed_tokens"], pos, seq_lens)
        return dict(input_ids=input_ids, next_prefill_tokens=next_prefill_tokens, pos=pos,
                    seq_lens=seq_lens)

    same_on_both(scenario, seed)


@pytest.mark.parametrize("num_new_sampled_tokens", [0, 1])
@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_and_draft_tokens_and_what_they_leave_behind(seed, num_new_sampled_tokens):
    """combine_sampled_and_draft_tokens, expand_idx_mapping, get_num_sampled_and_rejected,
    post_update (with and without bin counts and query starts, a skipped row) and
    post_update_num_computed_tokens, on one random step."""
    def scenario(rng):
        step = batch(rng)
        torch.manual_seed(seed)
        num_reqs, num_speculative_steps = step["num_reqs"], 4
        # each request's logits: its last rows (at most its query and 1 + the drafts)
        num_logits = [min(length, rng.randint(num_new_sampled_tokens,
                                              num_speculative_steps + num_new_sampled_tokens))
                      for length in step["query_lens"]]
        cu_num_logits = torch.tensor([0] + [sum(num_logits[:i + 1]) for i in range(num_reqs)],
                                     dtype=torch.int32)
        seq_lens = torch.tensor([int(step["num_computed_tokens"][slot]) + length
                                 for slot, length in zip(step["idx_mapping"].tolist(),
                                                         step["query_lens"])],
                                dtype=torch.int32)
        input_ids = torch.randint(0, 1000, (48,), dtype=torch.int32)
        last_sampled = torch.randint(0, 1000, (8, 1), dtype=torch.int64)
        draft_tokens = torch.randint(0, 1000, (8, num_speculative_steps), dtype=torch.int64)
        logits_indices = input_batch.combine_sampled_and_draft_tokens(
            input_ids, step["idx_mapping"], last_sampled, step["query_start_loc"], seq_lens,
            step["prefill_len"], draft_tokens, cu_num_logits, sum(num_logits),
            num_new_sampled_tokens)
        expanded_idx, expanded_pos = input_batch.expand_idx_mapping(
            step["idx_mapping"], sum(num_logits), cu_num_logits, max(num_logits + [1]))
        num_sampled = torch.tensor([rng.randint(0, n) for n in num_logits], dtype=torch.int32)
        num_sampled, num_rejected = input_batch.get_num_sampled_and_rejected(
            num_sampled, seq_lens, cu_num_logits, step["idx_mapping"], step["prefill_len"])
        sampled_tokens = torch.randint(0, 50, (num_reqs, num_speculative_steps + 1),
                                       dtype=torch.int64)
        idx_mapping = step["idx_mapping"].clone()
        idx_mapping[rng.randrange(num_reqs)] = -1  # a row post_update skips
        num_computed = step["num_computed_tokens"].clone()
        total_len = torch.randint(0, 20, (8,), dtype=torch.int32)
        all_token_ids = torch.zeros(8, 64, dtype=torch.int32)
        bin_counts = torch.zeros(8, 50, dtype=torch.int32)
        input_batch.post_update(idx_mapping, num_computed, last_sampled, bin_counts,
                                sampled_tokens, num_sampled, num_rejected,
                                step["query_start_loc"], all_token_ids, total_len)
        input_batch.post_update(idx_mapping, num_computed, last_sampled, None,
                                sampled_tokens, num_sampled, num_rejected, None,
                                all_token_ids, total_len)
        input_batch.post_update_num_computed_tokens(step["idx_mapping"], num_computed,
                                                    step["query_start_loc"])
        return dict(input_ids=input_ids, logits_indices=logits_indices,
                    expanded_idx=expanded_idx, expanded_pos=expanded_pos,
                    num_sampled=num_sampled, num_rejected=num_rejected,
                    num_computed=num_computed, total_len=total_len,
                    last_sampled=last_sampled, all_token_ids=all_token_ids,
                    bin_counts=bin_counts)

    same_on_both(scenario, seed)


@pytest.mark.parametrize("block_sizes, cp_size", [([16], 1), ([16, 32], 1), ([16], 2)],
                         ids=["one group", "two groups", "context parallel (interpreted)"])
@pytest.mark.parametrize("seed", SEEDS)
def test_block_tables_writes_gathers_and_slot_mappings(seed, block_sizes, cp_size):
    """BlockTables as the runner drives it: staged block ids written (one group: a plain
    write; two: the fused one), then gathered for a batch with padding rows, and slot
    mappings computed for its positions, a dummy request (-1) and a disabled group
    included. (Under context parallelism the slot mappings' port hands the launch back to
    the interpreted kernel.)"""
    def scenario(rng):
        tables = block_table.BlockTables(
            block_sizes=block_sizes, max_num_reqs=6, max_num_batched_tokens=40,
            max_num_blocks_per_group=[8, 5][:len(block_sizes)], device=torch.device("cpu"),
            cp_size=cp_size, cp_rank=cp_size - 1,
            slot_mapping_enabled=[True, rng.random() < 0.5][:len(block_sizes)])
        for _ in range(2):  # two rounds of staged writes, appended and overwritten
            for req_index in rng.sample(range(6), rng.randint(1, 6)):
                new = tuple([rng.randrange(100) for _ in range(rng.randint(0, 2))]
                            for _ in block_sizes)
                tables.append_block_ids(req_index, new, overwrite=rng.random() < 0.3)
            tables.apply_staged_writes()
        step = batch(rng, max_num_reqs=6)
        idx_mapping = step["idx_mapping"]
        for stale in tables.input_block_tables:  # last step's rows, padding rows included
            stale.fill_(-5)
        gathered = tables.gather_block_tables(idx_mapping, min(step["num_reqs"] + 2, 6))
        # positions inside every group's rows (8 blocks of 16, 5 of 32)
        positions = torch.tensor([rng.randrange(128) for _ in range(40)], dtype=torch.int64)
        dummy = idx_mapping.clone()
        dummy[rng.randrange(step["num_reqs"])] = -1
        slots = tables.compute_slot_mappings(dummy, step["query_start_loc"], positions, 40)
        result = {f"table {i}": table.gpu.clone() for i, table in enumerate(tables.block_tables)}
        result.update({f"gathered {i}": table.clone() for i, table in enumerate(gathered)})
        result["slot_mappings"] = slots.clone()
        return result

    same_on_both(scenario, seed)
