"""model_min.Generator end to end on tiny random Qwen3 / Qwen2 checkpoints (fp32, CPU).

The oracles are things this project did not write, or the no-cache reference decoder run on
them: Hugging Face `transformers` forwards, its `generate` and its KV cache;
`reference.decoder.decode` driven by the HF forward (no KV cache, every forward recomputes
the whole sequence), compared token for token together with its forward and row counts.
"""

import dataclasses
import functools

import pytest
import torch

from bench.tiny_models import (
    MASK_TOKEN_ID,
    build_tiny_model,
    hf_key_values,
    hf_logits,
    save_checkpoint,
)
from model_min import CacheFullError, Generator, SamplingParams, load_model
from reference.decoder import Params, decode
from wedlm_kernels.ops import attention as attention_ops
from wedlm_kernels.ops import select as select_ops

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], list(range(20, 36)), [11]]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def tiny(request, tmp_path_factory):
    """``(hf_model, model_min model)`` of the same random weights."""
    hf = build_tiny_model(request.param)
    directory = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(directory)


def reference_decode(hf, prompt, params: SamplingParams, mode, window):
    forward = functools.partial(hf_logits, hf)
    reference_params = Params(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature,
        top_k=params.top_k, top_p=params.top_p, threshold=params.threshold,
        penalty=params.penalty, seed=params.seed, stop_token_ids=params.stop_token_ids,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_p=params.min_p,
        min_tokens=params.min_tokens, logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
    )
    # (the random checkpoints have no tokenizer: the mask id is the one id never output)
    return decode(forward, prompt, reference_params, mode=mode, window=window,
                  mask_id=MASK_TOKEN_ID, never_output=(MASK_TOKEN_ID,))


def assert_matches_reference(hf, prompts, params_list, results, mode, window):
    for prompt, params, result in zip(prompts, params_list, results):
        expected = reference_decode(hf, prompt, params, mode, window)
        assert result.token_ids == expected.token_ids
        assert result.finish_reason == expected.finish_reason
        assert result.forwards == expected.forwards
        assert result.rows == expected.rows
        assert result.p_cache == pytest.approx(expected.p_cache, rel=1e-12)
        assert result.tokens_per_forward == pytest.approx(expected.tokens_per_forward, rel=1e-12)


# Per-request parameter sets: greedy and seeded sampling, thresholds (None = one token per
# step), penalties, max_new limits, in one batch.
CASES = {
    "greedy": [
        SamplingParams(max_new_tokens=14, threshold=2.8, penalty=0.02, seed=1),
        SamplingParams(max_new_tokens=9, threshold=3.1, penalty=0.0, seed=2),
        SamplingParams(max_new_tokens=11, threshold=None, seed=3),
        SamplingParams(max_new_tokens=3, threshold=2.5, penalty=0.1, seed=4),
    ],
    "sampling": [
        SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9,
                       threshold=3.0, penalty=0.02, seed=11),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_k=0, top_p=0.7,
                       threshold=2.8, penalty=0.05, seed=2**40 + 7),
        SamplingParams(max_new_tokens=13, temperature=0.6, top_k=5, top_p=1.0,
                       threshold=None, seed=-5),
        SamplingParams(max_new_tokens=1, temperature=1.0, top_k=3, seed=99),
    ],
    # the logit rules (wk.process_logits), greedy and sampled, beside a request without any
    "rules": [
        SamplingParams(max_new_tokens=12, threshold=2.8, presence_penalty=1.5,
                       frequency_penalty=0.5, repetition_penalty=1.4, seed=1),
        SamplingParams(max_new_tokens=10, temperature=0.9, threshold=3.0, min_p=0.2,
                       logit_bias={5: 3.0, 17: -2.0, 260: 1.5}, seed=21),
        SamplingParams(max_new_tokens=11, threshold=2.9, min_tokens=6,
                       stop_token_ids=(3, 7, 12, 20), allowed_token_ids=list(range(0, 40, 2)),
                       seed=3),
        SamplingParams(max_new_tokens=9, threshold=2.8, seed=4),
    ],
}


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_metrics_equal_the_reference_decoder(tiny, mode, case):
    hf, model = tiny
    window = 4 if case == "greedy" else 5
    params = CASES[case]
    # max_batch=3 < 4 requests: the last one is admitted when the first finishes
    generator = Generator(model, window=window, page_size=4, max_batch=3)
    results = generator.generate(PROMPTS, params, mode=mode)
    assert_matches_reference(hf, PROMPTS, params, results, mode, window)
    if mode != "ar" and case == "greedy":
        assert max(r.tokens_per_forward for r in results) > 1  # parallel steps happened
    if case == "rules":  # not vacuous: each rule request decodes otherwise without its rules
        plain = [dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0,
                                     repetition_penalty=1.0, min_p=0.0, min_tokens=0,
                                     logit_bias=None, allowed_token_ids=None) for p in params]
        without = generator.generate(PROMPTS, plain, mode=mode)
        assert [r.token_ids != w.token_ids for r, w in zip(results, without)] == [
            True, True, True, False]
    assert len(generator.cache.free_pages) == generator.cache.num_pages  # all pages back


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_min_tokens_holds_back_the_stop_ids_like_the_reference(tiny, mode):
    hf, model = tiny
    generator = Generator(model, window=4, page_size=8, max_batch=4)
    free_run = generator.generate(PROMPTS, SamplingParams(max_new_tokens=12, threshold=2.8),
                                  mode=mode)
    # stop ids each request generates early (its 2nd and 3rd tokens), held back for 7
    params = [SamplingParams(max_new_tokens=12, threshold=2.8, min_tokens=7,
                             stop_token_ids=tuple(r.token_ids[1:3])) for r in free_run]
    results = generator.generate(PROMPTS, params, mode=mode)
    assert_matches_reference(hf, PROMPTS, params, results, mode, window=4)
    for result, p in zip(results, params):
        assert not set(result.token_ids[:7]) & set(p.stop_token_ids)
    assert all(len(r.token_ids) >= 7 for r in results)


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_stop_tokens_end_requests_like_the_reference(tiny, mode):
    hf, model = tiny
    generator = Generator(model, window=4, page_size=8, max_batch=4)
    free_run = generator.generate(PROMPTS, SamplingParams(max_new_tokens=12, threshold=2.8),
                                  mode=mode)
    # stop at a token each request really generates (its 4th), plus one never generated
    params = [
        SamplingParams(max_new_tokens=12, threshold=2.8, stop_token_ids=(r.token_ids[3], 298))
        for r in free_run
    ]
    results = generator.generate(PROMPTS, params, mode=mode)
    assert_matches_reference(hf, PROMPTS, params, results, mode, window=4)
    assert all(r.finish_reason == "stop" for r in results)
    assert all(len(r.token_ids) <= 4 for r in results)


def test_an_empty_prompt_decodes_beside_a_real_one(tiny):
    hf, model = tiny
    generator = Generator(model, window=4, page_size=4)
    params = [SamplingParams(max_new_tokens=6, threshold=3.0),
              SamplingParams(max_new_tokens=7, threshold=3.0)]
    prompts = [[], [8, 9, 10]]  # the empty prompt is prefilled next to a real one
    results = generator.generate(prompts, params)
    assert_matches_reference(hf, prompts, params, results, "streaming", 4)


def test_max_new_tokens_none_decodes_up_to_the_models_positions(tiny):
    _, model = tiny
    positions = model.config.max_position_embeddings
    generator = Generator(model, window=16, page_size=16, max_batch=1)
    prompt = [5] * (positions - 9)
    [result] = generator.generate([prompt], SamplingParams(max_new_tokens=None, threshold=9.0))
    assert len(result.token_ids) == 9 and result.finish_reason == "length"
    with pytest.raises(ValueError, match="leave no room for new tokens"):
        generator.generate([[5] * positions], SamplingParams(max_new_tokens=None))


def test_pages_are_given_back_when_decoding_fails(tiny, monkeypatch):
    _, model = tiny
    generator = Generator(model, window=4, page_size=4)

    def broken_step(state, *args, **kwargs):
        raise RuntimeError("step failed")

    monkeypatch.setattr(generator, "_step", broken_step)
    with pytest.raises(RuntimeError, match="step failed"):
        generator.generate(PROMPTS, SamplingParams(max_new_tokens=5))
    assert len(generator.cache.free_pages) == generator.cache.num_pages


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_a_step_that_makes_no_progress_raises_instead_of_looping(tiny, mode, monkeypatch):
    """A decode step that never commits (here: the forward counter advances, nothing else
    does) is reported after 2 * max_new + 2 forwards, and the pages are given back."""
    _, model = tiny
    generator = Generator(model, window=4, page_size=4)

    def stuck_step(state, mode=None, num_rows=None):
        state.forwards += ~state.finished

    monkeypatch.setattr(generator, "_step", stuck_step)
    with pytest.raises(RuntimeError, match="after 1[3-6] decode forwards.*no progress"):
        generator.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5), mode=mode)
    assert len(generator.cache.free_pages) == generator.cache.num_pages


def test_ar_mode_equals_hf_greedy_generate(tiny):
    hf, model = tiny
    generator = Generator(model, window=4, page_size=4)
    results = generator.generate(PROMPTS, SamplingParams(max_new_tokens=10), mode="ar")
    for prompt, result in zip(PROMPTS, results):
        input_ids = torch.tensor([prompt])
        expected = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                               max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert result.token_ids == expected[0, len(prompt):].tolist()
        assert (result.forwards, result.tokens_per_forward, result.p_cache) == (10, 1.0, 1.0)


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "raw_logits"])
def test_ar_named_token_logprobs_are_the_causal_models_values(tiny, logprobs_mode):
    """AR: each token's entry lists the token and exactly the named ids (logprob_token_ids),
    valued by the causal model's logits at its position (log-softmax or the logits
    themselves) over the ids a request may output (the mask id, the one never output on
    this checkpoint without a tokenizer, at -inf), the token with its rank, id j with rank
    j; a top-K request beside it keeps its top-K."""
    hf, model = tiny
    named = [5, 9, 5, 200, MASK_TOKEN_ID]
    generator = Generator(model, window=4, page_size=4, logprobs_mode=logprobs_mode)
    params = [SamplingParams(max_new_tokens=6, logprob_token_ids=named),
              SamplingParams(max_new_tokens=6, logprobs=2)]
    results = generator.generate(PROMPTS[:2], params, mode="ar")
    for prompt, result in zip(PROMPTS[:2], results):
        assert len(result.logprobs) == len(result.token_ids) == 6
        for j, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
            ids = prompt + result.token_ids[:j]
            with torch.no_grad():
                logits = hf_logits(hf, ids, range(len(ids)))[-1].double()
            logits[MASK_TOKEN_ID] = float("-inf")
            values = (torch.log_softmax(logits, -1) if logprobs_mode == "raw_logprobs"
                      else logits)
            rank = int((logits >= logits[token]).sum())
            if result is results[1]:
                assert entry[token].rank == rank and len(entry) in (2, 3)
                continue
            expected = {token: (float(values[token]), rank)}
            expected.update((t, (float(values[t]), c)) for c, t in enumerate(named, start=1))
            assert list(entry) == list(expected)
            for t, (value, token_rank) in expected.items():
                assert entry[t].rank == token_rank
                assert entry[t].logprob == pytest.approx(value, abs=1e-4)
            assert entry[MASK_TOKEN_ID].logprob == float("-inf")


def test_cached_kv_of_committed_positions_equals_hf_causal_forward(tiny):
    hf, model = tiny
    generator = Generator(model, window=4, page_size=4, max_batch=4)
    generator.trace = []
    prompts = PROMPTS[:3]
    results = generator.generate(prompts, SamplingParams(max_new_tokens=14, threshold=2.8))
    cache = generator.cache
    for index, (prompt, result) in enumerate(zip(prompts, results)):
        last = [r for r in generator.trace if index in r["request"]
                and r["win_len"][r["request"].index(index)] > 0][-1]
        b = last["request"].index(index)  # the request's row in that step's batch
        # K/V is final for positions committed before the sequence's last forward plus the
        # leading filled run that forward committed (later tokens were never fed filled).
        win_mask = last["win_mask"][b, : int(last["win_len"][b])].tolist()
        run = (win_mask + [True]).index(True)
        final = min(int(last["ctx_len"][b]) + run, len(prompt) + len(result.token_ids))
        assert final >= len(prompt) + len(result.token_ids) - 4  # at most W tokens later
        tokens = (prompt + result.token_ids)[:final]
        positions = torch.arange(final)
        pages = last["block_table"][b].long()[positions // cache.page_size]
        for layer, (k_expected, v_expected) in enumerate(hf_key_values(hf, tokens)):
            k = cache.k[layer][pages, positions % cache.page_size]
            v = cache.v[layer][pages, positions % cache.page_size]
            torch.testing.assert_close(k, k_expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v_expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["streaming", "ar"])
def test_a_seeded_request_does_not_depend_on_its_batch(tiny, mode):
    _, model = tiny
    target = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95,
                            threshold=3.0, seed=1234)
    alone = Generator(model, window=4, page_size=4).generate([PROMPTS[0]], target, mode=mode)
    others = [
        SamplingParams(max_new_tokens=5, temperature=0.5, seed=1, threshold=None),
        SamplingParams(max_new_tokens=16, threshold=2.5, seed=2),
        SamplingParams(max_new_tokens=2, temperature=2.0, seed=3),
    ]
    batch = Generator(model, window=4, page_size=4, max_batch=4).generate(
        [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3]],
        [others[0], others[1], target, others[2]], mode=mode,
    )
    assert batch[2].token_ids == alone[0].token_ids
    assert batch[2].forwards == alone[0].forwards


def test_unseeded_requests_are_reproducible_through_the_generator_seed(tiny):
    _, model = tiny
    params = SamplingParams(max_new_tokens=10, temperature=1.0, threshold=3.0)
    first = Generator(model, window=4, seed=7).generate(PROMPTS[:2], params)
    second = Generator(model, window=4, seed=7).generate(PROMPTS[:2], params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert first[0].seed != first[1].seed


def test_requests_wait_for_free_pages_and_decode_the_same(tiny):
    _, model = tiny
    params = SamplingParams(max_new_tokens=8, threshold=2.8)
    roomy = Generator(model, window=4, page_size=4).generate(PROMPTS, params)
    # room for one request at a time: the others wait until its pages are freed
    tight = Generator(model, window=4, page_size=4, max_cache_tokens=36)
    results = tight.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
    assert len(tight.cache.free_pages) == tight.cache.num_pages


def test_a_request_that_can_never_fit_is_rejected_before_decoding(tiny):
    _, model = tiny
    generator = Generator(model, window=4, page_size=4, max_cache_tokens=16)
    with pytest.raises(CacheFullError, match="prompt 1 needs 26 cache positions"):
        generator.generate([[1, 2], [1, 2]], [SamplingParams(max_new_tokens=4),
                                              SamplingParams(max_new_tokens=20)])


def test_a_prompt_longer_than_the_trained_positions_is_rejected(tiny):
    """max_position_embeddings is 256: positions past it were never trained, so a request
    that would reach them fails naming the prompt instead of decoding garbage."""
    _, model = tiny
    assert model.config.max_position_embeddings == 256
    generator = Generator(model, window=4, page_size=4)
    [fits] = generator.generate([[1] * 250], SamplingParams(max_new_tokens=6))
    assert len(fits.token_ids) == 6
    with pytest.raises(ValueError, match=r"prompt 1: 250 prompt tokens \+ max_new_tokens 7 "
                                         r"exceed the model's max_position_embeddings \(256\)"):
        generator.generate([[1, 2], [1] * 250], [SamplingParams(max_new_tokens=4),
                                                 SamplingParams(max_new_tokens=7)])


def test_missing_mask_token_id_asks_for_one(tiny):
    hf, model = tiny
    config = model.config
    object.__setattr__(config, "mask_token_id", None)  # as if config.json had none
    try:
        with pytest.raises(ValueError, match="mask_token_id"):
            Generator(model, window=4).generate([[1, 2]], SamplingParams(max_new_tokens=3))
        generator = Generator(model, window=4, mask_token_id=MASK_TOKEN_ID)
        [result] = generator.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        assert len(result.token_ids) == 3
        [ar] = Generator(model, window=4).generate([[1, 2]], SamplingParams(max_new_tokens=3),
                                                   mode="ar")
        assert len(ar.token_ids) == 3
    finally:
        object.__setattr__(config, "mask_token_id", MASK_TOKEN_ID)


def test_on_tokens_streams_every_committed_token_in_order(tiny):
    _, model = tiny
    streamed: dict[int, list[int]] = {}
    results = Generator(model, window=4, poll_every=2).generate(
        PROMPTS[:2], SamplingParams(max_new_tokens=9, threshold=2.8),
        on_tokens=lambda i, new: streamed.setdefault(i, []).extend(new),
    )
    assert streamed == {0: results[0].token_ids, 1: results[1].token_ids}


FORBIDDEN = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
             "__index__")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buckets"])
@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
def test_window_steps_feed_the_model_only_live_rows(tiny, mode, graphs, monkeypatch):
    """Ten requests in one batch (B >= 8): each window step reads back one number, its live
    rows, and packs only those for the model, not B * 2W: exactly them in eager mode; on the
    CUDA-graph path (run here with eager replays) row_bucket's rounding, at most 1.15x while
    8 or more sequences are unfinished. Tokens stay those of the reference decoder."""
    from model_min.generator import row_bucket
    from model_min.graphs import StepGraphs

    hf, model = tiny
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 4)] for i in range(10)]
    params = [SamplingParams(max_new_tokens=6 + i % 5, threshold=2.8, seed=i) for i in range(10)]
    window = 4
    # (the step that reads its live rows back; under CUDA graphs "auto" reads nothing back
    # while B * 2W is memory-bound, as here: test_steps_without_the_row_readback_... )
    generator = Generator(model, window=window, page_size=4, max_batch=10,
                          row_readback="every_step")
    if graphs:
        class EagerGraphs(StepGraphs):
            def _capture(self, static, mode, rows):
                return _EagerReplay(self.step, static, mode, rows)

        generator.graphs = EagerGraphs(generator._step)
    steps, fed = [], []  # per readback: (live rows, unfinished, batch rows); per forward: rows
    forward, rows_for_step = model.forward, generator._rows_for_step

    def counting_forward(input_ids, *args):
        fed.append(input_ids.shape[0])
        return forward(input_ids, *args)

    def counting_rows(state):
        live_rows = int(state.win_len.clamp(0, 2 * window).sum())
        steps.append((live_rows, int((~state.finished).sum()), state.size))
        return rows_for_step(state)

    monkeypatch.setattr(model, "forward", counting_forward)
    monkeypatch.setattr(generator, "_rows_for_step", counting_rows)
    results = generator.generate(prompts, params, mode=mode)
    steps = [step for step in steps if step[0] > 0]  # an empty batch runs no forward
    window_forwards = fed[1:]  # fed[0]: the prefill of all prompts
    assert len(window_forwards) == len(steps) > 5
    assert max(unfinished for _, unfinished, _ in steps) >= 8
    for rows, (live_rows, unfinished, batch) in zip(window_forwards, steps):
        assert rows == (row_bucket(live_rows, batch * 2 * window) if graphs else live_rows)
        assert live_rows <= rows <= batch * 2 * window
        if unfinished >= 8:
            assert rows <= 1.15 * live_rows
    assert sum(window_forwards) < 0.7 * sum(batch * 2 * window for _, _, batch in steps)
    assert_matches_reference(hf, prompts, params, results, mode, window)


def test_row_buckets_hold_the_live_rows_with_less_than_an_eighth_of_padding():
    from model_min.generator import row_bucket

    buckets = set()
    for live_rows in range(1, 4097):
        bucket = row_bucket(live_rows, 4096)
        buckets.add(bucket)
        assert live_rows <= bucket < 1.125 * live_rows or bucket == live_rows, live_rows
        assert bucket == live_rows or live_rows > 8
    assert len(buckets) <= 80
    assert row_bucket(300, 64) == 64 and row_bucket(0, 64) == 0
    assert [row_bucket(n, 4096) for n in (9, 17, 18, 19, 129, 1000)] == [9, 18, 18, 20, 144, 1024]


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_decode_step_never_reads_tensor_values_on_the_host(tiny, mode, logprobs,
                                                          monkeypatch):
    """No tensor value reaches the host inside a decode step (with logprobs: a top-K
    request, one naming tokens and a plain one in a batch). On CPU tensors the attention
    loops over sequences and select_tokens samples only the sampling rows, on the host by
    design (paged_attention_torch_per_sequence, _tokens_on_the_host: free on a CPU); here
    both take the static-shape paths CUDA tensors take with the PyTorch backend."""
    _, model = tiny
    monkeypatch.setattr(attention_ops, "paged_attention_torch_per_sequence",
                        attention_ops.paged_attention_torch_gathered)
    monkeypatch.setattr(select_ops, "_tokens_on_the_host", select_ops._tokens_on_the_device)
    generator = Generator(model, window=4, page_size=4, max_batch=4)
    step = generator._step
    inside = []

    def guarded_step(state, *args, **kwargs):
        inside.append(True)
        try:
            step(state, *args, **kwargs)
        finally:
            inside.pop()

    def forbid(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if inside:
                raise AssertionError(f"Tensor.{name} called inside a decode step")
            return original(self, *args, **kwargs)

        return method

    for name in FORBIDDEN:
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    monkeypatch.setattr(generator, "_step", guarded_step)
    params = SamplingParams(max_new_tokens=8, threshold=2.8)
    if logprobs:
        params = [dataclasses.replace(params, logprobs=3),
                  dataclasses.replace(params, logprob_token_ids=[4, 7, 4, 1, 2]), params,
                  dataclasses.replace(params, logprobs=1, logprob_token_ids=[9])]
    results = generator.generate(PROMPTS, params, mode=mode)
    assert all(len(r.token_ids) == 8 for r in results)
    assert [r.logprobs is not None for r in results] == (
        [True, True, False, True] if logprobs else [False] * 4)


@pytest.fixture
def one_split_everywhere(monkeypatch):
    """select_tokens and paged_attention with one split per row whatever the row count.
    Graphs feed row buckets (padding rows included), eager steps the exact rows, and the
    split counts follow the row count: their sums then run in other orders, and a near-tie
    (a token, a selection, a top-p cutoff) can flip, which the contract allows. With one
    split on both sides, the kernels compute every row alike."""
    monkeypatch.setattr(select_ops, "default_num_splits", lambda *shape: 1)
    monkeypatch.setattr(attention_ops, "split_count", lambda *shape: 1)
    attention_ops.schedule.cache_clear()
    yield
    attention_ops.schedule.cache_clear()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_cuda_graph_decoding_equals_eager(mode, tmp_path, one_split_everywhere):
    hf = build_tiny_model("qwen3")
    model = load_model(save_checkpoint(hf, tmp_path), device="cuda", dtype=torch.float32)
    params = [SamplingParams(max_new_tokens=n, threshold=2.8, temperature=t, seed=s)
              for n, t, s in ((14, 0.0, 1), (9, 1.0, 2), (20, 0.7, 3), (5, 0.0, 4))]
    eager = Generator(model, window=4, page_size=4, max_batch=3).generate(PROMPTS, params,
                                                                           mode=mode)
    graphed = Generator(model, window=4, page_size=4, max_batch=3, cuda_graph=True)
    results = graphed.generate(PROMPTS, params, mode=mode)
    assert [r.token_ids for r in results] == [r.token_ids for r in eager]
    assert [r.forwards for r in results] == [r.forwards for r in eager]
    assert [r.rows for r in results] == [r.rows for r in eager]
    assert any(graphs for _, graphs in graphed.graphs.batches.values())  # something captured
    again = graphed.generate(PROMPTS, params, mode=mode)  # replays the captured graphs
    assert [r.token_ids for r in again] == [r.token_ids for r in eager]


@pytest.mark.cuda
def test_cuda_decode_step_does_not_synchronise(tmp_path):
    hf = build_tiny_model("qwen2")
    model = load_model(save_checkpoint(hf, tmp_path), device="cuda", dtype=torch.float32)
    generator = Generator(model, window=4, page_size=4, max_batch=4)
    step = generator._step

    def checked_step(state, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(state, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    generator._step = checked_step
    results = generator.generate(PROMPTS, SamplingParams(max_new_tokens=8, threshold=2.8))
    assert all(len(r.token_ids) == 8 for r in results)


@pytest.mark.cuda
def test_cuda_bf16_decoding_runs_and_first_step_logits_track_fp32(tmp_path):
    hf = build_tiny_model("qwen3")
    directory = save_checkpoint(hf, tmp_path)
    params = SamplingParams(max_new_tokens=16, threshold=2.8)
    first_logits = []
    for dtype in (torch.float32, torch.bfloat16):
        generator = Generator(load_model(directory, "cuda", dtype), window=4)
        generator.trace = []
        results = generator.generate(PROMPTS, params)
        assert all(len(r.token_ids) == 16 for r in results)
        first_logits.append(generator.trace[0]["logits"].float())  # all-mask windows
    torch.testing.assert_close(first_logits[1], first_logits[0], rtol=0.05, atol=0.25)


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replay() runs the step again."""

    def __init__(self, step, static, mode, rows):
        self.step, self.static, self.mode, self.rows = step, static, mode, rows

    def replay(self):
        self.step(self.static, self.mode, self.rows)


def test_graph_bucket_path_pads_copies_and_compacts_like_eager(tiny):
    """The CUDA-graph path's host logic (batch padded to a bucket, state copied into static
    buffers, one graph per row bucket, replays, compaction of the static state) on the CPU,
    with eager replays."""
    from model_min.graphs import StepGraphs

    _, model = tiny

    class EagerGraphs(StepGraphs):
        def _capture(self, static, mode, rows):
            return _EagerReplay(self.step, static, mode, rows)

    params = [SamplingParams(max_new_tokens=n, threshold=2.8, temperature=t, seed=s)
              for n, t, s in ((14, 0.0, 1), (5, 1.0, 2), (20, 0.7, 3), (9, 0.0, 4))]
    for mode in ("streaming", "ar"):
        eager = Generator(model, window=4, page_size=4, max_batch=3).generate(
            PROMPTS, params, mode=mode)
        generator = Generator(model, window=4, page_size=4, max_batch=3,
                              row_readback="every_step")
        generator.graphs = EagerGraphs(generator._step)
        results = generator.generate(PROMPTS, params, mode=mode)
        assert [r.token_ids for r in results] == [r.token_ids for r in eager]
        assert [(r.forwards, r.rows) for r in results] == [(r.forwards, r.rows) for r in eager]
        sizes = {dict((name, shape) for name, shape, _ in signature)["win_len"][0]
                 for _, signature, _ in generator.graphs.batches}
        assert len(sizes) >= 2  # several batch buckets were used
        # the default under graphs at these memory-bound rows: no readback, B * 2W rows
        unread = Generator(model, window=4, page_size=4, max_batch=3)
        unread.graphs = EagerGraphs(unread._step)
        results = unread.generate(PROMPTS, params, mode=mode)
        assert [r.token_ids for r in results] == [r.token_ids for r in eager]
        assert [(r.forwards, r.rows) for r in results] == [(r.forwards, r.rows) for r in eager]
        if mode == "streaming":  # and several row buckets
            assert max(len(graphs) for _, graphs in generator.graphs.batches.values()) >= 2
        assert len(generator.cache.free_pages) == generator.cache.num_pages


def test_graph_bucket_path_keeps_the_logprobs_of_eager_decoding(tiny):
    """Padded batch rows (a graph bucket's) name no tokens: every request's logprobs,
    named tokens and top-K alike, equal eager decoding's."""
    from model_min.graphs import StepGraphs

    _, model = tiny

    class EagerGraphs(StepGraphs):
        def _capture(self, static, mode, rows):
            return _EagerReplay(self.step, static, mode, rows)

    asks = (dict(logprob_token_ids=[3, 8, 3]), dict(logprobs=4), {},
            dict(logprob_token_ids=list(range(10, 16))))
    params = [SamplingParams(max_new_tokens=n, threshold=2.8, temperature=0.8, seed=s, **ask)
              for n, s, ask in zip((14, 5, 20, 9), range(4), asks)]
    for mode in ("streaming", "ar"):
        eager = Generator(model, window=4, page_size=4, max_batch=3).generate(
            PROMPTS, params, mode=mode)
        generator = Generator(model, window=4, page_size=4, max_batch=3)
        generator.graphs = EagerGraphs(generator._step)
        results = generator.generate(PROMPTS, params, mode=mode)
        assert [r.token_ids for r in results] == [r.token_ids for r in eager]
        for result, alone in zip(results, eager):
            if alone.logprobs is None:
                assert result.logprobs is None
                continue
            assert [{t: e.rank for t, e in p.items()} for p in result.logprobs] == [
                {t: e.rank for t, e in p.items()} for p in alone.logprobs]
            assert [e.logprob for p in result.logprobs for e in p.values()] == pytest.approx(
                [e.logprob for p in alone.logprobs for e in p.values()], abs=1e-4)
        assert all(set(p) == {t, 3, 8} for t, p in zip(results[0].token_ids,
                                                        results[0].logprobs))


def test_auto_window_keeps_batch_times_window_plus_one_rows_under_the_memory_bound():
    from model_min import auto_window
    from model_min.generator import AUTO_WINDOWS, MEMORY_BOUND_ROWS

    chosen = {batch: auto_window(batch) for batch in range(1, 300)}
    assert chosen[1] == chosen[9] == 16 and chosen[10] == chosen[17] == 8
    assert chosen[18] == chosen[64] == chosen[299] == 4
    for batch, window in chosen.items():
        larger = [w for w in AUTO_WINDOWS if w > window]
        assert batch * (window + 1) <= MEMORY_BOUND_ROWS or window == AUTO_WINDOWS[-1]
        assert all(batch * (w + 1) > MEMORY_BOUND_ROWS for w in larger)  # the largest fitting
    assert auto_window(40, memory_bound_rows=400) == 8
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="batch"):
            auto_window(bad)


def test_window_auto_decodes_each_call_with_the_window_of_its_batch(tiny):
    """Generator(window="auto") picks W per generate call from min(requests, max_batch) and
    then decodes exactly as a Generator with that W (tokens equal the reference decoder)."""
    hf, model = tiny
    prompts = [[(5 * i + j) % 250 + 1 for j in range(2 + i % 3)] for i in range(12)]
    params = SamplingParams(max_new_tokens=5, threshold=2.8, seed=3)
    generator = Generator(model, window="auto", page_size=4, max_batch=12)
    assert generator.window == 16  # before any call
    for count, window in ((1, 16), (12, 8)):
        results = generator.generate(prompts[:count], params)
        assert generator.window == window
        explicit = Generator(model, window=window, page_size=4, max_batch=12)
        assert ([r.token_ids for r in results]
                == [r.token_ids for r in explicit.generate(prompts[:count], params)])
    assert_matches_reference(hf, prompts[:2], [params] * 2,
                             generator.generate(prompts[:2], params), "streaming", 16)
    single = Generator(model, window="auto", page_size=4, max_batch=12)
    single.generate(prompts[0], params)  # one prompt passed alone
    assert single.window == 16


@pytest.mark.parametrize("window", ["big", 0, -2, 1.5, True, None, 4097])
def test_window_must_be_a_positive_int_or_auto(tiny, window):
    _, model = tiny
    with pytest.raises(ValueError, match='window must be an integer from 1 to 4096, got .* '
                                         r'\(or "auto"\)'):
        Generator(model, window=window)


# ---------------------------------------------------------------- select_tokens' sampling mode


def test_sampling_mode_is_the_narrowest_that_agrees_with_every_request():
    from model_min.generator import sampling_mode

    def mode(*params, vocab=64):
        return sampling_mode([SamplingParams(**p) for p in params], vocab)

    greedy, warm = dict(temperature=0.0), dict(temperature=0.7)
    assert mode(greedy) == mode(greedy, greedy) == "greedy"
    # (a greedy request's top_k and top_p are set off; they are never read for it anyway)
    assert mode(dict(temperature=0.0, top_k=5, top_p=0.5)) == "greedy"
    assert mode(warm) == mode(greedy, warm) == "temperature"
    # top-k off: -1, 0, or at least the vocabulary; top-p off: 1
    assert mode(dict(temperature=0.7, top_k=-1, top_p=1.0)) == "temperature"
    assert mode(dict(temperature=0.7, top_k=64)) == mode(dict(temperature=0.7, top_k=10**6)) \
        == "temperature"
    assert mode(dict(temperature=0.7, top_k=63)) == mode(dict(temperature=0.7, top_k=1)) \
        == "any"
    assert mode(dict(temperature=0.7, top_p=0.999)) == "any"
    assert mode(greedy, warm, dict(temperature=1.0, top_p=0.9)) == "any"
    assert mode() == "greedy"  # (no request: nothing samples)


@pytest.fixture
def recorded_modes(monkeypatch):
    """The ``sampling`` argument of every select_tokens call (the generator calls
    ``wk.select_tokens``); ``forced[0]``, when set, replaces it."""
    import wedlm_kernels

    original = wedlm_kernels.select_tokens
    calls: list[str] = []
    forced: list[str | None] = [None]

    def select_tokens(*args, sampling="any"):
        calls.append(sampling)
        return original(*args, sampling=forced[0] or sampling)

    monkeypatch.setattr(wedlm_kernels, "select_tokens", select_tokens)
    return calls, forced


MODE_CASES = {
    "greedy": CASES["greedy"],
    # temperature only: top_k -1 / 0 / the whole vocabulary, top_p 1, one greedy request
    "temperature": [
        SamplingParams(max_new_tokens=12, temperature=0.8, top_k=-1, threshold=3.0, seed=11),
        SamplingParams(max_new_tokens=10, temperature=1.3, threshold=2.8, seed=2**40 + 7),
        SamplingParams(max_new_tokens=13, temperature=0.6, top_k=10**6, threshold=None,
                       seed=-5),
        SamplingParams(max_new_tokens=7, threshold=2.8, seed=4),
    ],
    "any": CASES["sampling"],
}


@pytest.mark.parametrize("mode", ["streaming", "ar"])
def test_every_select_call_gets_the_calls_sampling_mode_and_the_same_tokens(
        tiny, mode, recorded_modes):
    """Each generate call passes select_tokens the mode its requests' parameters allow
    (greedy, temperature only, top-k / top-p), in every step (and AR's prefill commit);
    the tokens, forwards and rows are those of the full rule ("any")."""
    _, model = tiny
    calls, forced = recorded_modes
    generator = Generator(model, window=4, page_size=4, max_batch=3)
    tokens = {}
    for expected, params in MODE_CASES.items():
        calls.clear()
        results = generator.generate(PROMPTS, params, mode=mode)
        assert calls and set(calls) == {expected}
        forced[0] = "any"
        full_rule = generator.generate(PROMPTS, params, mode=mode)
        forced[0] = None
        assert [(r.token_ids, r.forwards, r.rows) for r in results] == [
            (r.token_ids, r.forwards, r.rows) for r in full_rule]
        tokens[expected] = [r.token_ids for r in results]
    # not vacuous: the temperature case samples (greedy decoding gives other tokens)
    greedy = generator.generate(PROMPTS, [dataclasses.replace(p, temperature=0.0)
                                          for p in MODE_CASES["temperature"]], mode=mode)
    assert [r.token_ids for r in greedy][:3] != tokens["temperature"][:3]


def test_a_graph_replays_only_under_the_sampling_mode_and_rules_it_was_captured_with(tiny):
    """The step's sampling mode, logit rules and window policy are Python branches a captured
    graph keeps: the graphs' key holds them, so a call in another mode (or with min_p, which
    changes no state shape, or the adaptive window) captures its own graphs instead of
    replaying the last call's."""
    from model_min.graphs import StepGraphs

    _, model = tiny
    generator = Generator(model, window=4, page_size=4, max_batch=2)

    class CheckedReplay(_EagerReplay):
        def __init__(self, *args):
            super().__init__(*args)
            self.captured = (generator._sampling, dict(generator._rules), generator._adaptive)

        def replay(self):
            assert (generator._sampling, generator._rules, generator._adaptive) == self.captured
            super().replay()

    class EagerGraphs(StepGraphs):
        def _capture(self, static, mode, rows):
            return CheckedReplay(self.step, static, mode, rows)

    generator.graphs = EagerGraphs(generator._step)
    base = SamplingParams(max_new_tokens=6, threshold=2.8, seed=5)
    calls = [base, dataclasses.replace(base, temperature=0.8),
             dataclasses.replace(base, temperature=0.8, min_p=0.2),
             dataclasses.replace(base, temperature=0.8, top_p=0.9), base,
             dataclasses.replace(base, window_policy="adaptive")]
    for params in calls:
        results = generator.generate(PROMPTS[:2], params)
        assert all(len(r.token_ids) == 6 for r in results)
    variants = {variant for _, _, variant in generator.graphs.batches}
    assert {variant[0] for variant in variants} == {"greedy", "temperature", "any"}
    assert {variant[2] for variant in variants} == {False, True}  # the window policy
    assert len(variants) == 5


@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
@pytest.mark.parametrize("case", ["greedy", "sampling"])
def test_steps_without_the_row_readback_decode_the_same_tokens(tiny, mode, case):
    """``row_readback="never"`` feeds all ``B * 2W`` rows every step instead of reading the
    live-row count back (what ``"auto"`` does under CUDA graphs while the batch's rows are
    memory-bound): the padding rows change no token and no forward or row count."""
    hf, model = tiny
    params = CASES[case]
    results = {}
    for readback in ("every_step", "never"):
        generator = Generator(model, window=5, page_size=4, max_batch=3,
                              row_readback=readback)
        results[readback] = generator.generate(PROMPTS, params, mode=mode)
    for read, unread in zip(results["every_step"], results["never"]):
        assert unread.token_ids == read.token_ids
        assert (unread.forwards, unread.rows) == (read.forwards, read.rows)
    assert_matches_reference(hf, PROMPTS, params, results["never"], mode, 5)


class _Rows:
    """The fields of a batch state that the row count of a step reads."""

    def __init__(self, win_len: list[int], slots: int) -> None:
        self.size = len(win_len)
        self.win_len = torch.tensor(win_len, dtype=torch.int32)
        self.win_tokens = torch.zeros(self.size, slots, dtype=torch.int64)


def test_auto_skips_the_row_readback_only_under_cuda_graphs_at_memory_bound_rows(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="row_readback"):
        Generator(model, row_readback="sometimes")
    generator = Generator(model, window=4, page_size=4)
    generator._mode = "streaming"
    few, many = _Rows([3, 0, 9], slots=10), _Rows([3] * 17, slots=10)  # 30 and 170 rows
    assert generator._rows_for_step(few) == 12  # no graphs: the live rows, read back
    generator.graphs = object()  # as with cuda_graph=True (never run here)
    assert generator._rows_for_step(few) == 30  # B * 2W <= MEMORY_BOUND_ROWS: no readback
    assert generator._rows_for_step(many) == 52  # above it: the bucket of its 51 live rows
    generator.row_readback = "every_step"
    assert generator._rows_for_step(few) == 12
    generator._mode = "ar"
    assert generator._rows_for_step(few) is None
