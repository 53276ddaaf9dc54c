"""Window logits of the Generator's cache path against Hugging Face `transformers`.

During a real batched generation the Generator records every step (the window as fed and
the logits of its mask rows). For each record, HF's `Qwen3ForCausalLM` /
`Qwen2ForCausalLM` runs without a cache over ``committed ++ reordered window`` with explicit
``position_ids`` ``[0..L) ++ (L + order)``; its logits of the mask rows must equal the
Generator's (fp32, tight tolerance). The reordering is recomputed here from the window, so
the check covers reorder_window, RoPE at logical positions, the paged cache and the
mask-row gather for lm_head.
"""

import pytest
import torch

from bench.tiny_models import MASK_TOKEN_ID, build_tiny_model, hf_logits, save_checkpoint
from model_min import Generator, SamplingParams, load_model

# name -> tiny model options (+ shard size, and an entropy threshold at which this random
# model fills some masks right of an unfilled one, so windows really get reordered)
CHECKPOINTS = {
    "qwen3": dict(kind="qwen3", threshold=2.8),
    "qwen2": dict(kind="qwen2", threshold=2.8),
    "qwen3-sharded-tied-bias": dict(kind="qwen3", tie_word_embeddings=True,
                                    attention_bias=True, shard="20KB", threshold=0.2),
    "qwen2-sharded": dict(kind="qwen2", shard="20KB", seed=3, threshold=2.5),
    # YaRN over 8 trained positions: the windows sit at positions up to 25, past them
    "qwen3-yarn": dict(kind="qwen3", yarn={"factor": 4.0, "original_max_position_embeddings": 8},
                       threshold=2.8),
}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], list(range(20, 33))]


def stable_order(win_mask: list[bool]) -> list[int]:
    """Filled slots first, then masks, each in slot order (docs/algorithm.md section 3)."""
    return [s for s, m in enumerate(win_mask) if not m] + [s for s, m in enumerate(win_mask) if m]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_window_logits_equal_hf_over_committed_plus_reordered_window(name, tmp_path):
    options = dict(CHECKPOINTS[name])
    shard = options.pop("shard", None)
    seed = options.pop("seed", 0)
    threshold = options.pop("threshold")
    hf = build_tiny_model(seed=seed, **options)
    model = load_model(save_checkpoint(hf, tmp_path, max_shard_size=shard))
    window = 4
    generator = Generator(model, window=window, page_size=4, max_batch=3)
    generator.trace = []
    params = SamplingParams(max_new_tokens=12, threshold=threshold, penalty=0.0, seed=1)
    results = generator.generate(PROMPTS, params)

    checked_rows = 0
    reordered_windows = 0
    for record in generator.trace:
        for b, request in enumerate(record["request"]):
            win_len = int(record["win_len"][b])
            if win_len == 0:
                continue
            ctx_len = int(record["ctx_len"][b])
            prompt = PROMPTS[request]
            committed = prompt + results[request].token_ids[: ctx_len - len(prompt)]
            tokens = record["win_tokens"][b, :win_len].tolist()
            win_mask = record["win_mask"][b, :win_len].tolist()
            order = stable_order(win_mask)
            n_filled = win_len - sum(win_mask)
            if order != list(range(win_len)):
                reordered_windows += 1
            input_ids = committed + [tokens[s] for s in order]
            position_ids = list(range(ctx_len)) + [ctx_len + s for s in order]
            expected = hf_logits(hf, input_ids, position_ids)[ctx_len + n_filled:]
            rows = record["logits"][b * window : b * window + win_len - n_filled]
            row_pos = record["row_pos"][b * window : b * window + win_len - n_filled]
            assert row_pos.tolist() == [ctx_len + s for s in order[n_filled:]]
            # (the trace's logits are after the ban of the ids never output: on these
            # checkpoints without a tokenizer, the mask id alone)
            assert torch.isneginf(rows[:, MASK_TOKEN_ID]).all()
            expected[:, MASK_TOKEN_ID] = float("-inf")
            torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)
            checked_rows += len(rows)
    assert checked_rows >= 30
    assert reordered_windows >= 1  # some window had a filled slot right of a mask
