"""wedlm_kernels.window_policy: the adaptive window's rule (bounds, decay to one mask with
probes, growth back to W, each sequence on its own history) and resize_windows against a
per-sequence loop; model_min decoding under it (a request's tokens do not depend on its
batch, "fixed" requests decode as before, rows per token fall on unpredictable text)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wedlm_kernels as wk
from wedlm_kernels.window_policy import ROW_BUDGETS

MASK = 99


def lengths(fed, decided, state, policy):
    return wk.next_window_lengths(torch.tensor(fed), torch.tensor(decided), state, policy)


def window_trace(policy, state, fed, steps, decide):
    """The windows one sequence gets over ``steps`` steps, starting fed ``fed`` masks and
    deciding ``decide(fed)`` of them each step."""
    seen = []
    for _ in range(steps):
        fed = int(lengths([fed], [decide(fed)], state, policy)[0])
        seen.append(fed)
    return seen


def test_settings_are_checked_by_name():
    for bad, name in [(dict(max_window=0), "max_window"), (dict(min_window=0), "min_window"),
                      (dict(max_window=4, min_window=5), "min_window"),
                      (dict(smoothing=0.0), "smoothing"), (dict(smoothing=1.5), "smoothing"),
                      (dict(parallel_rate=0.5), "parallel_rate"),
                      (dict(parallel_rate=math.inf), "parallel_rate"),
                      (dict(probe_every=0), "probe_every")]:
        with pytest.raises(ValueError, match=name):
            wk.AdaptiveWindow(**bad)
    with pytest.raises(TypeError, match="max_window"):
        wk.AdaptiveWindow(max_window=4.0)


def test_the_floor_comes_from_the_engines_batch_and_row_budget():
    assert wk.AdaptiveWindow.for_batch(16, 64, ROW_BUDGETS["cuda"]).min_window == 1
    assert wk.AdaptiveWindow.for_batch(16, 8, ROW_BUDGETS["cuda"]).min_window == 10
    assert wk.AdaptiveWindow.for_batch(16, 1, ROW_BUDGETS["cuda"]).min_window == 16
    assert wk.AdaptiveWindow.for_batch(16, 4, ROW_BUDGETS["cpu"]).min_window == 4


def test_a_sequence_that_decides_one_mask_a_step_decays_to_one_mask_and_probes():
    policy = wk.AdaptiveWindow(max_window=16, probe_every=3)
    state = wk.new_policy_state(1, policy)
    seen = window_trace(policy, state, 16, 14, lambda fed: 1)
    # rate 2.5 -> 2.125, 1.84, 1.63, 1.47 (< parallel_rate 1.5): the whole window until then,
    # then one mask, with a two-mask probe after every third one-mask step
    assert seen == [16, 16, 16, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1]


def test_a_sequence_that_decides_every_mask_grows_back_to_the_whole_window():
    policy = wk.AdaptiveWindow(max_window=16, probe_every=2)
    state = wk.new_policy_state(1, policy)
    state.commit_rate.fill_(1.0)
    seen = window_trace(policy, state, 1, 7, lambda fed: fed)
    assert seen == [1, 2, 4, 16, 16, 16, 16]  # a probe, a doubling, then rate >= 1.5


def test_the_floor_holds_where_rows_cost_about_nothing():
    policy = wk.AdaptiveWindow(max_window=16, min_window=4)
    state = wk.new_policy_state(1, policy)
    assert window_trace(policy, state, 16, 6, lambda fed: 1) == [16, 16, 16, 4, 4, 4]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=12),
       st.integers(1, 16), st.integers(1, 16), st.integers(0, 11))
def test_each_sequence_follows_its_own_history_within_the_bounds(steps, low, high, other):
    low, high = min(low, high), max(low, high)
    policy = wk.AdaptiveWindow(max_window=high, min_window=low, probe_every=2)
    alone = wk.new_policy_state(1, policy)
    batch = wk.new_policy_state(3, policy)
    for fed, decided in steps:
        decided = min(decided, fed)
        one = lengths([fed], [decided], alone, policy)
        # the same sequence in the middle of a batch whose other rows do something else
        many = lengths([other, fed, 40 - other], [other // 2, decided, 1], batch, policy)
        assert int(many[1]) == int(one[0])
        assert low <= int(one[0]) <= high
    assert batch.commit_rate[1] == alone.commit_rate[0]


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=12),
       st.lists(st.integers(1, 16), min_size=3, max_size=3), st.integers(1, 16))
def test_a_sequences_own_window_runs_the_rule_with_that_window(steps, windows, floor):
    # an engine of W = 16 whose requests chose windows of their own: each sequence decodes
    # as under a policy of its own W and the floor min(engine floor, W)
    policy = wk.AdaptiveWindow(max_window=16, min_window=floor, probe_every=2)
    batch = wk.new_policy_state(3, policy)
    own = [wk.AdaptiveWindow(max_window=w, min_window=min(floor, w), probe_every=2)
           for w in windows]
    alone = [wk.new_policy_state(1, p) for p in own]
    for fed, decided in steps:
        decided = min(decided, fed)
        many = wk.next_window_lengths(torch.tensor([fed] * 3), torch.tensor([decided] * 3),
                                      batch, policy, max_window=torch.tensor(windows))
        for i, (p, state) in enumerate(zip(own, alone)):
            assert int(many[i]) == int(lengths([fed], [decided], state, p)[0])


def test_a_sequence_fed_nothing_keeps_its_state():
    policy = wk.AdaptiveWindow(max_window=8)
    state = wk.new_policy_state(2, policy)
    state.commit_rate.copy_(torch.tensor([3.0, 5.5]))
    state.one_slot_steps.copy_(torch.tensor([5, 0]))
    out = lengths([0, 0], [0, 0], state, policy)
    assert out.tolist() == [3, 6] and state.commit_rate.tolist() == [3.0, 5.5]
    # ... its one-mask steps too: a step that only prefills it (a resumed request in the
    # vLLM plugin) does not put off its probe
    assert state.one_slot_steps.tolist() == [5, 0]


def test_window_masks_counts_live_masks_and_checks_its_arguments_by_name():
    mask = torch.tensor([[True, False, True, True], [True, True, True, True]])
    assert wk.window_masks(mask, torch.tensor([3, 0], dtype=torch.int32)).tolist() == [2, 0]
    with pytest.raises(TypeError, match="win_mask"):
        wk.window_masks(mask.int(), torch.tensor([3, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="win_len"):
        wk.window_masks(mask, torch.tensor([3], dtype=torch.int32))


def test_policy_inputs_are_checked_by_name():
    policy = wk.AdaptiveWindow()
    state = wk.new_policy_state(2, policy)
    with pytest.raises(ValueError, match="decided"):
        wk.next_window_lengths(torch.tensor([1, 2]), torch.tensor([1]), state, policy)
    with pytest.raises(TypeError, match="fed"):
        wk.next_window_lengths(torch.tensor([1.0, 2.0]), torch.tensor([1, 1]), state, policy)
    with pytest.raises(ValueError, match="max_window"):
        wk.next_window_lengths(torch.tensor([1, 2]), torch.tensor([1, 1]), state, policy,
                               max_window=torch.tensor([4]))


# ------------------------------------------------------------------------ resize_windows


def resize_loop(tokens, mask, length, masks, out_len, max_new, finished, max_output, enabled):
    """One sequence at a time, in plain Python: the contract of resize_windows."""
    tokens, mask = [list(row) for row in tokens], [list(row) for row in mask]
    length = list(length)
    slots = len(tokens[0])
    for b in range(len(tokens)):
        if length[b] <= 0 or finished[b] or not enabled[b]:
            continue
        run = 0
        while run < length[b] and not mask[b][run]:
            run += 1
        room = max(min(max(max_new[b], 0), max_output) - out_len[b], 0)
        new = min(run + max(masks[b], 1), room, slots)
        for s in range(new, slots):
            tokens[b][s], mask[b][s] = MASK, True
        length[b] = new
    return tokens, mask, length


@st.composite
def windows(draw):
    batch = draw(st.integers(1, 5))
    slots = draw(st.integers(1, 12))
    rows = []
    for _ in range(batch):
        length = draw(st.integers(0, slots))
        mask = draw(st.lists(st.booleans(), min_size=slots, max_size=slots))
        tokens = [MASK if m else draw(st.integers(0, 50)) for m in mask]
        rows.append((tokens, mask, length, draw(st.integers(1, 14)),
                     draw(st.integers(0, 20)), draw(st.integers(-2, 40)), draw(st.booleans()),
                     draw(st.booleans())))
    return rows, draw(st.integers(0, 40))


@given(windows())
def test_resize_windows_keeps_the_leading_run_and_the_wanted_slots_past_it(case):
    rows, max_output = case
    tokens, mask, length, masks, out_len, max_new, finished, enabled = map(list, zip(*rows))
    expected = resize_loop(tokens, mask, length, masks, out_len, max_new, finished,
                           max_output, enabled)
    win_tokens, win_mask = torch.tensor(tokens), torch.tensor(mask)
    win_len = torch.tensor(length, dtype=torch.int32)
    wk.resize_windows(win_tokens, win_mask, win_len, torch.tensor(masks),
                      torch.tensor(out_len, dtype=torch.int32),
                      torch.tensor(max_new, dtype=torch.int32), torch.tensor(finished), MASK,
                      max_output=max_output, enabled=torch.tensor(enabled))
    assert win_len.tolist() == expected[2]
    assert win_mask.tolist() == expected[1]
    assert win_tokens.tolist() == expected[0]


def test_resize_windows_checks_its_arguments_by_name():
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    length = torch.ones(2, dtype=torch.int32)
    args = dict(out_len=length.clone(), max_new=length.clone(),
                finished=torch.zeros(2, dtype=torch.bool), mask_id=1, max_output=4)
    with pytest.raises(ValueError, match="masks"):
        wk.resize_windows(tokens, mask, length, torch.ones(3, dtype=torch.int32), **args)
    with pytest.raises(TypeError, match="win_len"):
        wk.resize_windows(tokens, mask, length.long(), torch.ones(2, dtype=torch.int32), **args)
    with pytest.raises(ValueError, match="mask_id"):
        wk.resize_windows(tokens, mask, length, torch.ones(2, dtype=torch.int32),
                          **dict(args, mask_id=-1))


# ------------------------------------------------------------------------------- model_min


@pytest.fixture(scope="module")
def tiny():
    from pathlib import Path

    from model_min import load_model, load_tokenizer

    folder = Path(__file__).resolve().parents[1] / "model_min" / "tiny_wedlm"
    return load_model(folder, device="cpu", dtype=torch.float32), load_tokenizer(folder)


PROMPTS = ["count: 3 ", "the cat sat on ", "abc abc ", "count: 17 "]


def decode(tiny, prompts, policy="adaptive", max_batch=4, **params):
    from model_min import Generator, SamplingParams

    model, tokenizer = tiny
    generator = Generator(model, window=8, tokenizer=tokenizer, max_batch=max_batch,
                          window_policy=policy)
    return generator.generate(prompts, [SamplingParams(max_new_tokens=40, **params)
                                        for _ in prompts])


@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0, seed=7)],
                         ids=["greedy", "seeded"])
def test_an_adaptive_request_decodes_the_same_tokens_alone_and_in_a_batch(tiny, params):
    together = decode(tiny, PROMPTS, **params)
    for prompt, result in zip(PROMPTS, together):
        [alone] = decode(tiny, [prompt], **params)
        assert alone.token_ids == result.token_ids
        assert (alone.forwards, alone.rows) == (result.forwards, result.rows)


def test_a_fixed_request_in_an_adaptive_engine_decodes_as_in_a_fixed_engine(tiny):
    fixed = decode(tiny, PROMPTS, policy="fixed", temperature=1.0, seed=3)
    mixed = decode(tiny, PROMPTS, policy="adaptive", temperature=1.0, seed=3,
                   window_policy="fixed")
    assert [r.token_ids for r in mixed] == [r.token_ids for r in fixed]
    assert [r.rows for r in mixed] == [r.rows for r in fixed]


def test_unpredictable_text_costs_fewer_rows_per_token_under_the_adaptive_window(tiny):
    # max_batch 16 on the CPU's 32-row budget: a floor of one mask
    fixed = decode(tiny, PROMPTS, policy="fixed", max_batch=16, temperature=1.0, seed=5)
    adaptive = decode(tiny, PROMPTS, max_batch=16, temperature=1.0, seed=5)
    rows = sum(r.rows for r in fixed), sum(r.rows for r in adaptive)
    tokens = sum(len(r.token_ids) for r in fixed), sum(len(r.token_ids) for r in adaptive)
    assert rows[1] / tokens[1] < 0.75 * rows[0] / tokens[0], (rows, tokens)
    assert all(len(r.token_ids) == 40 or r.finish_reason == "stop" for r in adaptive)


@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0, seed=11)],
                         ids=["greedy", "seeded"])
def test_a_floor_of_the_whole_window_decodes_exactly_as_the_fixed_window(tiny, params):
    # max_batch 1 on the CPU's 32-row budget: a floor of 16 masks >= W = 8, so every
    # resize gives the W slots the refill leaves: the same windows, tokens and rows
    fixed = decode(tiny, PROMPTS, policy="fixed", max_batch=1, **params)
    adaptive = decode(tiny, PROMPTS, max_batch=1, **params)
    assert [(r.token_ids, r.forwards, r.rows) for r in adaptive] == [
        (r.token_ids, r.forwards, r.rows) for r in fixed]


def test_an_explicit_floor_replaces_the_one_derived_from_the_batch(tiny):
    # min_window=W at max_batch 16 (whose derived floor is one mask): the fixed window's
    # tokens and rows; min_window=1 at max_batch 1 (derived floor: W): fewer rows
    from model_min import Generator, SamplingParams

    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5)

    def run(**settings):
        generator = Generator(model, window=8, tokenizer=tokenizer, **settings)
        return [(r.token_ids, r.rows) for r in generator.generate(PROMPTS, params)]

    fixed = run(max_batch=16)
    assert run(max_batch=16, window_policy="adaptive", min_window=8) == fixed
    floor_one = run(max_batch=1, window_policy="adaptive", min_window=1)
    assert sum(rows for _, rows in floor_one) < sum(rows for _, rows in fixed)
    for bad in (0, 9, 2.0):
        with pytest.raises((ValueError, TypeError), match="min_window"):
            Generator(model, window=8, min_window=bad)


def test_the_request_field_is_checked_by_name():
    from model_min import SamplingParams
    from wedlm_kernels.requests.params import ParameterError

    with pytest.raises(ParameterError, match="SamplingParams.window_policy"):
        SamplingParams(window_policy="wide")
    assert SamplingParams(window_policy="adaptive").window_policy == "adaptive"
