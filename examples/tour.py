"""A tour of the public ops: a toy one-layer model decoded with WeDLM streaming steps.

Every decode step is the pipeline of docs/algorithm.md section 6:
reorder_window (the live rows of all sequences, packed) -> (rope_kv_append, paged_attention)
per layer -> lm_head on mask rows -> select_tokens -> commit_window. The weights are random,
so the tokens are noise; what the tour shows is the data flow, the shapes and the state after
each step.

Run: python examples/tour.py   (or `make tour`)
"""

import torch

import wedlm_kernels as wk

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"

# toy model: vocab 64 (id 63 is the mask), one attention layer, GQA 4 query / 2 KV heads
vocab, mask_id, hidden, q_heads, kv_heads, head_dim = 64, 63, 32, 4, 2, 8
embed = torch.randn(vocab, hidden, device=device)
w_qkv = torch.randn(hidden, (q_heads + 2 * kv_heads) * head_dim, device=device) / hidden**0.5
w_out = torch.randn(q_heads * head_dim, hidden, device=device) / hidden**0.5
lm_head = torch.randn(hidden, vocab, device=device)

# decoder state (docs/algorithm.md section 6): 2 sequences, window 4, slot capacity 8
batch, window, slots, page_size, pages_per_seq = 2, 4, 8, 4, 8
prompts = [[1, 2, 3, 4, 5], [7, 8]]
max_new = torch.tensor([10, 6], dtype=torch.int32, device=device)
block_table = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device).view(batch, -1)
k_cache = torch.zeros(batch * pages_per_seq, page_size, kv_heads, head_dim, device=device)
v_cache = torch.zeros_like(k_cache)
cos_sin = wk.rope_cache(pages_per_seq * page_size, head_dim, theta=10000.0, device=device)

win_tokens = torch.full((batch, slots), mask_id, device=device)
win_mask = torch.ones(batch, slots, dtype=torch.bool, device=device)
win_len = torch.minimum(max_new, torch.tensor(window, device=device)).to(torch.int32)
ctx_len = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
out_tokens = torch.zeros(batch, 16, dtype=torch.int64, device=device)
out_len = torch.zeros(batch, dtype=torch.int32, device=device)
finished = torch.zeros(batch, dtype=torch.bool, device=device)
stop_ids = torch.full((batch, 1), -1, device=device)
params = dict(
    temperature=torch.tensor([0.0, 0.8], device=device),  # greedy, sampled
    top_k=torch.tensor([0, 20], dtype=torch.int32, device=device),
    top_p=torch.tensor([1.0, 0.9], device=device),
    threshold=torch.tensor([2.0, 2.0], device=device),  # loose: several tokens per step
    penalty=torch.tensor([0.02, 0.02], device=device),
    seed=torch.tensor([1234, 5678], device=device),
)


def layer(input_ids, positions, slot_mapping, query_start, ctx):
    """One attention layer over N packed rows; returns hidden states [N, hidden]."""
    qkv = embed[input_ids] @ w_qkv  # [N, (Hq + 2 Hkv) D]
    q = qkv[:, : q_heads * head_dim].view(-1, q_heads, head_dim)  # strided views: no copy
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    q = wk.rope_kv_append(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    attn = wk.paged_attention(q, k_cache, v_cache, block_table, query_start, ctx,
                              scale=head_dim**-0.5)
    return attn.reshape(attn.shape[0], -1) @ w_out


# prefill: the prompts, causal, ctx_len 0; no logits (masks have no shift,
# docs/algorithm.md section 2)
prompt_len = max(len(p) for p in prompts)
prompt_ids = torch.zeros(batch, prompt_len, dtype=torch.int64, device=device)
prefill_mask = torch.ones(batch, prompt_len, dtype=torch.bool, device=device)
for b, p in enumerate(prompts):
    prompt_ids[b, : len(p)] = torch.tensor(p)
    prefill_mask[b, : len(p)] = False
zeros = torch.zeros(batch, dtype=torch.int32, device=device)
# reorder_window on an all-filled "window" packs the prompts with their positions and slots
ids, positions, slot_mapping, _, query_start, _ = wk.reorder_window(
    prompt_ids, prefill_mask, ctx_len, zeros, block_table, page_size,
    num_rows=sum(len(p) for p in prompts))
layer(ids, positions, slot_mapping, query_start, zeros)

step = 0
while not bool(finished.all()) and step < 20:  # the host polls `finished`
    # the one number a step reads back: its live rows (an engine rounds it up to the row
    # count of a captured CUDA graph; the extra rows are padding)
    num_rows = int(win_len.sum())
    ids, positions, slot_mapping, order, query_start, n_filled = wk.reorder_window(
        win_tokens, win_mask, win_len, ctx_len, block_table, page_size, num_rows)
    hidden_states = layer(ids, positions, slot_mapping, query_start, ctx_len)  # [N, hidden]
    # lm_head on mask rows only: packed rows query_start[b] + n_filled[b] .. query_start[b+1]
    # - 1, gathered into `window` rows per sequence (unused rows get row_pos -1); each
    # predicts its logical position ctx_len + order
    mask_row, cu_rows, row_pos = wk.mask_rows(query_start, n_filled, positions, window)
    logits = hidden_states[mask_row] @ lm_head  # [B * window, vocab]
    token, selected, entropy = wk.select_tokens(logits, cu_rows, row_pos, **params)
    wk.commit_window(win_tokens, win_mask, win_len, ctx_len, cu_rows, row_pos,
                     token, selected, out_tokens, out_len, finished, stop_ids, max_new,
                     window, mask_id)
    step += 1
    for b in range(batch):
        live = int(win_len[b])
        shown = ["M" if bool(m) else str(int(t))
                 for t, m in zip(win_tokens[b, :live], win_mask[b, :live])]
        print(f"step {step} seq {b}: fed {int(query_start[b + 1] - query_start[b])} rows, "
              f"committed {out_tokens[b, : int(out_len[b])].tolist()} "
              f"window {shown}{' (finished)' if bool(finished[b]) else ''}")

print(f"done after {step} steps on {device}: "
      f"{[out_tokens[b, : int(out_len[b])].tolist() for b in range(batch)]}")
