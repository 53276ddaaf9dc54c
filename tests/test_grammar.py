"""wedlm_kernels.requests.grammar: the window walk (which slots a grammar decides, under which masks)
and what a step does with it, on a grammar of a few token sequences (tests/grammars.py);
then model_min decoding under it in every mode: every output is one the grammar accepts,
forced tokens commit several tokens a forward, and the rules never leave a decided slot
without a token."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from model_min import Generator, SamplingParams, load_model
from model_min import generator as generator_module
from tests.grammars import Choice, Repeat
from wedlm_kernels.requests.grammar import GrammarStep, only_token, plan_window, token_allowed
from wedlm_kernels.requests.output_ids import output_bitmask

END, VOCAB = 9, 70
TINY = Path(__file__).resolve().parent.parent / "model_min" / "tiny_wedlm"


def words(tokens) -> np.ndarray:
    row = np.zeros(-(-VOCAB // 32), dtype=np.int64)
    for token in tokens:
        row[token // 32] |= 1 << (token % 32)
    return np.where(row >= 1 << 31, row - (1 << 32), row).astype(np.int32)


def allowed_of(row: np.ndarray) -> set[int]:
    return {v for v in range(VOCAB) if token_allowed(row, v)}


def bitmask(rows: int) -> torch.Tensor:
    return torch.full((rows, -(-VOCAB // 32)), 7, dtype=torch.int32)  # junk to overwrite


@pytest.mark.parametrize("tokens", [[], [0], [31], [32], [63], [69], [5, 40]])
def test_only_token_and_token_allowed_read_the_bits_xgrammar_writes(tokens):
    row = words(tokens)
    assert only_token(row) == (tokens[0] if len(tokens) == 1 else None)
    assert allowed_of(row) == set(tokens)
    assert not token_allowed(row, -1) and not token_allowed(row, 10**6)


def test_an_empty_window_decides_the_forced_run_and_the_first_free_slot():
    # "1 2 3" or "1 2 4": 1 and 2 are forced, the third slot is a choice
    grammar = Choice([[1, 2, 3], [1, 2, 4]], END, VOCAB)
    rows = bitmask(6)
    assert plan_window(grammar, [-1] * 5, rows, 1) == (3, -1, False, True)
    table = rows.numpy()
    assert [allowed_of(table[1 + s]) for s in range(3)] == [{1}, {2}, {3, 4}]
    assert all((table[1 + s] == -1).all() for s in (3, 4))  # undecided: not constrained
    assert (table[0] == 7).all() and grammar.tokens == []  # other rows untouched, undone


def test_filled_slots_are_checked_in_order_and_a_rejected_one_ends_the_walk():
    grammar = Choice([[1, 2, 3, 5], [1, 6]], END, VOCAB)
    rows = bitmask(6)
    # slot 0 filled with 1 (accepted), slot 1 a mask (2 or 6), slot 2 filled: undecided
    assert plan_window(grammar, [1, -1, 3, -1], rows, 0) == (2, -1, False, True)
    assert allowed_of(rows.numpy()[1]) == {2, 6}
    # 1, 2 accepted; slot 2 holds 4, which the grammar rejects there: decided up to it;
    # filled slots have no mask row (their rows constrain nothing)
    assert plan_window(grammar, [1, 2, 4, -1, -1], rows, 0) == (3, 2, False, False)
    assert (rows.numpy()[:5] == -1).all()
    assert grammar.tokens == []


def test_after_the_end_the_window_is_decided_and_free():
    grammar = Choice([[1]], END, VOCAB)
    rows = bitmask(4)
    assert plan_window(grammar, [-1, -1, -1, -1], rows, 0) == (4, -1, False, False)  # 1, END
    table = rows.numpy()
    assert allowed_of(table[0]) == {1} and allowed_of(table[1]) == {END}
    assert (table[2:] == -1).all() and not grammar.terminated


def _two_sequence_step(top_of_grammar_slot: int, drafts: bool = True):
    """Sequence 0 fed four masks under "1 2 3 | 1 2 4" (1, 2 forced, slot 2 the grammar
    slot, slot 3 a draft), logit rows 0..3; sequence 1 held, rows 4..7 (row 6 held)."""
    grammar = Choice([[1, 2, 3], [1, 2, 4]], END, VOCAB)
    rows = bitmask(8)
    windows = [[-1, -1, -1, -1], None]
    plans = [plan_window(grammar, windows[0], rows, 0), None]
    step = GrammarStep.build(windows, plans, [0, 0], [0, 4], rows.numpy(), "cpu",
                             held_rows=[6], drafts=drafts)
    logits = torch.randn(8, VOCAB)
    logits[2, top_of_grammar_slot] = 100.0  # the model's first choice at the grammar slot
    return step, logits


def test_a_step_bans_masks_keeps_drafts_idles_held_rows_and_fills_the_decided_slots():
    step, logits = _two_sequence_step(top_of_grammar_slot=3)
    assert step.idle_rows.tolist() == [6] and step.draft_rows.tolist() == [3]
    assert step.gate_rows.tolist() == [2] and step.commit_limit.tolist() == [3, 2**31 - 1]
    before = logits.clone()
    row_pos = step.mask_logits(logits, torch.arange(8))
    assert row_pos.tolist() == [0, 1, 2, 3, 4, 5, -1, 7]  # the draft is a valid row
    for row, allowed in enumerate([{1}, {2}, {3, 4}]):
        banned = [v for v in range(VOCAB) if v not in allowed]
        assert torch.isneginf(logits[row, banned]).all()
        assert torch.equal(logits[row, sorted(allowed)], before[row, sorted(allowed)])
    assert torch.equal(logits[3:], before[3:])  # the draft samples without a mask
    selected = torch.zeros(8, dtype=torch.bool)
    selected[3] = selected[5] = True  # the selection chose the draft (and a free row)
    step.settle(selected)
    assert selected.tolist() == [True] * 4 + [False, True, False, False]


def test_drafts_are_dropped_where_the_grammar_slot_overrules_the_models_first_choice():
    step, logits = _two_sequence_step(top_of_grammar_slot=7)  # 7: not 3 or 4
    step.mask_logits(logits, torch.arange(8))
    selected = torch.zeros(8, dtype=torch.bool)
    selected[3] = True
    step.settle(selected)
    assert selected.tolist() == [True] * 3 + [False] * 5  # the grammar slot, no draft


def test_without_drafts_every_undecided_mask_is_idle():
    step, logits = _two_sequence_step(top_of_grammar_slot=3, drafts=False)
    assert step.idle_rows.tolist() == [6, 3] and step.draft_rows.numel() == 0
    assert step.mask_logits(logits, torch.arange(8)).tolist() == [0, 1, 2, -1, 4, 5, -1, 7]
    selected = torch.zeros(8, dtype=torch.bool)
    step.settle(selected)
    assert selected.tolist() == [True] * 3 + [False] * 5


def test_no_drafts_past_a_dead_end_or_a_window_the_walk_decided_to_its_end():
    rows = bitmask(4)
    forced_then_nothing = Choice([[1, 5]], END, VOCAB)
    plan = plan_window(forced_then_nothing, [-1] * 4, rows, 0,
                       output_mask=output_bitmask(VOCAB, [5]))
    step = GrammarStep.build([[-1] * 4], [plan], [0], [0], rows.numpy(), "cpu")
    assert step.idle_rows.tolist() == [1, 2, 3] and step.draft_rows.numel() == 0
    ended = Choice([[1]], END, VOCAB)  # 1, END, then two free slots: all decided
    plan = plan_window(ended, [-1] * 4, rows, 0)
    step = GrammarStep.build([[-1] * 4], [plan], [0], [0], rows.numpy(), "cpu")
    assert step.sampled_rows.tolist() == [0, 1, 2, 3] and step.draft_rows.numel() == 0


def test_a_filled_slot_the_grammar_rejects_is_masked_again_before_the_commit():
    grammar = Choice([[1, 2]], END, VOCAB)
    rows = bitmask(3)
    window = [1, 5, -1]
    plan = plan_window(grammar, window, rows, 0)
    assert plan == (2, 1, False, False) and plan.commit_limit == 1
    step = GrammarStep.build([window], [plan], [0], [0], rows.numpy(), "cpu")
    tokens = torch.tensor([[1, 5, 0]])
    masks = torch.tensor([[False, False, True]])
    step.remask(tokens, masks, 99)
    assert tokens.tolist() == [[1, 99, 0]] and masks.tolist() == [[False, True, True]]
    assert step.sampled_rows.numel() == 0  # the rejected slot has no mask row this step
    assert step.idle_rows.tolist() == [0]  # and the mask right of it is not drafted
    assert step.commit_limit.tolist() == [1]


def test_a_rejected_draft_masks_again_every_filled_slot_right_of_it_and_cuts_the_window():
    # 1 then 2 are the grammar's; the drafts 7 (rejected), 8 and 9 depended on it
    grammar = Choice([[1, 2, 3]], END, VOCAB)
    rows = bitmask(6)
    window = [1, 7, 8, -1, 9, -1]  # fed: its leading run 1 7 8, then W slots
    plan = plan_window(grammar, window, rows, 0)
    assert plan == (2, 1, False, False)
    step = GrammarStep.build([window], [plan], [0], [0], rows.numpy(), "cpu")
    tokens = torch.tensor([window + [0, 0]])
    masks = tokens < 0
    tokens[masks] = 99
    step.remask(tokens, masks, 99)
    assert tokens.tolist() == [[1, 99, 99, 99, 99, 99, 0, 0]]
    assert masks[0, :6].tolist() == [False] + [True] * 5
    assert step.idle_rows.tolist() == [0, 1] and step.commit_limit.tolist() == [1]
    # W = 3: the fed run of 3 keeps 1 (its commit), and 5 slots are left after the rejected
    # slot: the window drops the 2 past W; a window of W or fewer there keeps its slots
    assert step.cut_windows(torch.tensor([6], dtype=torch.int32), 3).tolist() == [4]
    assert step.cut_windows(torch.tensor([6], dtype=torch.int32), 16).tolist() == [6]


def test_a_row_the_rules_leave_empty_takes_back_the_grammars_tokens():
    grammar = Choice([[END]], END, VOCAB)
    rows = bitmask(1)
    step = GrammarStep.build([[-1]], [plan_window(grammar, [-1], rows, 0)], [0], [0],
                             rows.numpy(), "cpu")
    assert step.sampled_bounds.tolist() == [0, 1]
    logits = torch.randn(1, VOCAB)
    raw = logits[0, END].item()
    step.mask_logits(logits, torch.zeros(1, dtype=torch.int64))
    logits[0, END] = -math.inf  # a rule bans the only token the grammar allows
    step.restore_dead_rows(logits)
    assert logits[0, END].item() == raw and torch.isneginf(logits[0, :END]).all()


class Inconsistent(Choice):
    """A broken grammar: its masks allow ``refused``, its accept_tokens refuses it."""

    def __init__(self, *args, refused: int) -> None:
        super().__init__(*args)
        self.refused = refused

    def accept_tokens(self, request_id, tokens):
        return self.refused not in tokens and super().accept_tokens(request_id, tokens)


def test_a_grammar_whose_mask_and_acceptance_disagree_never_gets_a_refused_token():
    rows = bitmask(4)
    # a filled slot the mask allows and accept_tokens refuses is masked again
    grammar = Inconsistent([[1, 2, 3]], END, VOCAB, refused=2)
    assert plan_window(grammar, [1, 2, -1, -1], rows, 0) == (2, 1, False, False)
    # a forced token it refuses is not decided, so never sampled: a dead end
    assert plan_window(grammar, [1, -1, -1, -1], rows, 0) == (1, -1, True, False)
    assert plan_window(grammar, [1, -1, -1, -1], rows, 0).stuck is False
    assert grammar.tokens == []


def test_a_mask_no_token_can_fill_is_a_dead_end_and_at_the_first_slot_the_request_is_stuck():
    nothing = Choice([], END, VOCAB)  # accepts no sequence: it allows no first token
    rows = bitmask(3)
    plan = plan_window(nothing, [-1, -1, -1], rows, 0)
    assert plan == (0, -1, True, False) and plan.stuck
    assert (rows.numpy() == -1).all()  # nothing decided: no row constrains a slot
    # after the forced 1, the one token the grammar allows (5) is never output: a dead end
    # at slot 1, with slot 0 still decided
    grammar = Choice([[1, 5]], END, VOCAB)
    plan = plan_window(grammar, [-1, -1, -1], rows, 0, output_mask=output_bitmask(VOCAB, [5]))
    assert plan == (1, -1, True, False) and not plan.stuck
    assert allowed_of(rows.numpy()[0]) == {1} and (rows.numpy()[1:] == -1).all()
    assert grammar.tokens == []


def test_the_output_mask_narrows_each_row_and_a_filled_slot_outside_it_is_rejected():
    grammar = Choice([[1, 2], [1, 3]], END, VOCAB)
    rows = bitmask(4)
    mask = output_bitmask(VOCAB, [3, 40])
    # 1, then 2 (3 is never output), then the end: all forced; the last slot free
    assert plan_window(grammar, [-1] * 4, rows, 0, output_mask=mask) == (4, -1, False, False)
    assert [allowed_of(rows.numpy()[s]) for s in range(3)] == [{1}, {2}, {END}]
    assert plan_window(grammar, [1, 3, -1], rows, 0, output_mask=mask) == (2, 1, False, False)


CHOICES = [list(b"positive"), list(b"negative"), list(b"neutral")]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(TINY)


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
@pytest.mark.parametrize("window", [8, 16])
def test_model_min_outputs_parse_in_every_mode_and_window(tiny, mode, window):
    made = []

    def grammar():
        made.append(Choice(CHOICES, 256, tiny.config.vocab_size))
        return made[-1]

    prompts = [list(b"Review: great. Sentiment:"), list(b"count: 1 2 3"), [1, 2, 3]]
    generator = Generator(tiny, window=window, max_batch=3)
    for params in (SamplingParams(max_new_tokens=20, stop_token_ids=(256,), grammar=grammar),
                   SamplingParams(max_new_tokens=20, stop_token_ids=(256,), grammar=grammar,
                                  temperature=0.9, seed=4)):
        for result in generator.generate(prompts, params, mode=mode):
            assert result.token_ids[:-1] in CHOICES and result.token_ids[-1] == 256
            assert result.finish_reason == "stop"
            if mode != "ar":  # the forced tokens commit beside the sampled one
                assert result.forwards < len(result.token_ids) / 2
    # each request walked a grammar of its own (which raised on no committed token)
    assert len(made) == 6 and all(
        any((c + [256])[:len(g.tokens)] == g.tokens for c in CHOICES) for g in made)


def test_model_min_lets_the_grammar_end_before_min_tokens(tiny):
    """min_tokens bans the end the grammar forces: the grammar decides (the row takes back
    its tokens), so the output still parses."""
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(256,), min_tokens=20,
                            grammar=lambda: Choice(CHOICES, 256, tiny.config.vocab_size))
    for mode in ("streaming", "ar"):
        [result] = Generator(tiny, window=8).generate([list(b"x = ")], params, mode=mode)
        assert result.token_ids[:-1] in CHOICES and result.token_ids[-1] == 256


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
def test_a_grammar_that_allows_nothing_ends_its_request_alone_before_any_forward(tiny, mode):
    def params(choices):
        return SamplingParams(max_new_tokens=20, stop_token_ids=(256,),
                              grammar=lambda: Choice(choices, 256, tiny.config.vocab_size))

    prompts = [list(b"Review: great. Sentiment:"), list(b"x = "), [1, 2, 3]]
    generator = Generator(tiny, window=8, max_batch=3)
    together = generator.generate(prompts, [params(CHOICES), params([]), params(CHOICES)],
                                  mode=mode)
    alone = generator.generate(prompts[::2], params(CHOICES), mode=mode)
    stuck = together[1]
    assert (stuck.token_ids, stuck.forwards, stuck.rows, stuck.finish_reason) == (
        [], 0, 0, "error")
    assert "SamplingParams.grammar" in stuck.error and "after its 0 output tokens" in stuck.error
    assert [(r.token_ids, r.forwards, r.finish_reason) for r in together[::2]] == [
        (r.token_ids, r.forwards, r.finish_reason) for r in alone]
    assert all(r.error is None for r in alone)


def test_a_grammar_that_is_not_a_function_is_refused_by_name():
    with pytest.raises(TypeError, match="SamplingParams.grammar"):
        SamplingParams(grammar=Choice(CHOICES, 256, 300))


# ------------------------------------------------------------------- drafts under a grammar

PREDICTABLE = [list(b"count: 1 2 3 4 5 "), list(b"letters: a b c d e "),
               list(b"count: 10 11 12 "), list(b"letters: abcdef")]
TEXT_TOKENS = list(b"0123456789abcdefghijklmnopqrstuvwxyz ")


@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
def test_a_grammar_that_accepts_the_free_text_gives_free_decodings_tokens_and_forwards(
        tiny, mode):
    """[0-9a-z ]{40} accepts what free decoding writes after these prompts: every draft is
    validated, so the tokens are free decoding's, in its forwards or one more per request
    (the last drafts wait for their walk); without drafts, one forward per token."""
    generator = Generator(tiny, window=16, max_batch=4)
    free = generator.generate(PREDICTABLE, SamplingParams(max_new_tokens=40), mode=mode)
    assert all(set(r.token_ids) <= set(TEXT_TOKENS) for r in free)  # the premise

    def params():
        return SamplingParams(max_new_tokens=40, stop_token_ids=(256,), grammar=lambda: Repeat(
            TEXT_TOKENS, 40, 256, tiny.config.vocab_size))

    ruled = generator.generate(PREDICTABLE, params(), mode=mode)
    assert [r.token_ids for r in ruled] == [r.token_ids for r in free]
    for constrained, unconstrained in zip(ruled, free):
        assert unconstrained.forwards <= constrained.forwards <= unconstrained.forwards + 1
    undrafted = Generator(tiny, window=16, max_batch=4, grammar_drafts=False).generate(
        PREDICTABLE, params(), mode=mode)
    assert [r.token_ids for r in undrafted] == [r.token_ids for r in free]
    assert [r.forwards for r in undrafted] == [40] * 4


@pytest.mark.parametrize("mode", ["streaming", "blockwise"])
@pytest.mark.parametrize("max_new", [8, 9, 30])
def test_rejected_drafts_are_never_committed_not_even_by_the_early_finish(
        tiny, mode, max_new, monkeypatch):
    """After "count: 1 2 3 4 5 " the model drafts "6 7 8 9 10 ..." in one step; the grammar
    takes "6 7 8 " (or 5 5) and then wants X: the drafts from 9 on are rejected at the next walk
    (with max_new 8 or 9, free decoding's early finish would have committed them)."""
    plans = []

    def walk(*args, **kwargs):
        plans.append(plan_window(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(generator_module, "plan_window", walk)
    choices = [list(b"6 7 8 X"), list(b"6 7 8 XY"), list(b"5 5")]
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(256,),
                            grammar=lambda: Choice(choices, 256, tiny.config.vocab_size))
    generator = Generator(tiny, window=16, max_batch=2)
    results = generator.generate([PREDICTABLE[0], PREDICTABLE[0]], params, mode=mode)
    assert any(plan.rejected >= 0 for plan in plans)  # the rejection path ran
    for result in results:
        body = result.token_ids[:-1] if result.token_ids[-1:] == [256] else result.token_ids
        assert any(body == c[:len(body)] for c in choices), bytes(body)
        if max_new >= 9:
            assert result.token_ids[:-1] in choices and result.token_ids[-1] == 256
