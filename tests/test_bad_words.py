"""bad_words on a window (wedlm_kernels.requests.bad_words, docs/requests.md "Bad words"): the ban
and the unfill against the literal reference (reference/bad_words.py) on random windows
over a tiny vocabulary (many matches), the guarantee (a simulated decode never writes a
word), and model_min: no output holds a bad word, in every mode, with tokens the model
writes without the rule."""

import random
from pathlib import Path

import pytest
import torch

from model_min import Generator, SamplingParams, load_model
from reference import bad_words as ref
from wedlm_kernels.requests import bad_words as bw

TINY = Path(__file__).resolve().parent.parent / "model_min" / "tiny_wedlm"
VOCAB = 5


def random_case(rng: random.Random, batch: int = 3, slots: int = 6, word_len: int = 3):
    """Words, and per sequence a committed tail (prompt positions -1) and a window."""
    words = [[[rng.randrange(VOCAB) for _ in range(rng.randint(1, word_len))]
              for _ in range(rng.randint(0, 3))] for _ in range(batch)]
    tail_len = word_len - 1
    ctx_len = [rng.randint(tail_len, 20) for _ in range(batch)]
    prompt_len = [rng.randint(0, c) for c in ctx_len]
    tail = [[rng.randrange(VOCAB) if c - tail_len + t >= p else -1 for t in range(tail_len)]
            for c, p in zip(ctx_len, prompt_len)]
    win_len = [rng.randint(0, slots) for _ in range(batch)]
    win_mask = [[rng.random() < 0.5 or s >= n for s in range(slots)] for n in win_len]
    win_tokens = [[rng.randrange(VOCAB) for _ in range(slots)] for _ in range(batch)]
    return words, ctx_len, tail, win_len, win_mask, win_tokens


def tensors(case, word_len: int = 3):
    words, ctx_len, tail, win_len, win_mask, win_tokens = case
    packed = bw.pack(words, torch.device("cpu"), word_len=word_len)
    known, first = bw.known_tokens(torch.tensor(win_tokens), torch.tensor(win_mask),
                                   torch.tensor(win_len, dtype=torch.int32),
                                   torch.tensor(ctx_len, dtype=torch.int32),
                                   torch.tensor(tail).view(len(words), word_len - 1))
    return packed, known, first


def known_map(case, b: int) -> dict[int, int]:
    _, ctx_len, tail, win_len, win_mask, win_tokens = case
    tail_len = len(tail[b])
    known = {ctx_len[b] - tail_len + t: v for t, v in enumerate(tail[b]) if v >= 0}
    known.update({ctx_len[b] + s: win_tokens[b][s] for s in range(win_len[b])
                  if not win_mask[b][s]})
    return known


def rows_of(case):
    """One row per slot (row_pos: the mask slots' positions, else -1)."""
    _, ctx_len, _, win_len, win_mask, _ = case
    slots = len(win_mask[0])
    row_sequence = torch.arange(len(ctx_len) * slots) // slots
    row_pos = torch.tensor([ctx_len[b] + s if s < win_len[b] and win_mask[b][s] else -1
                            for b in range(len(ctx_len)) for s in range(slots)])
    return row_sequence, row_pos


@pytest.mark.parametrize("seed", range(40))
def test_the_ban_is_the_references(seed):
    rng = random.Random(seed)
    case = random_case(rng)
    words, known, first = tensors(case)
    row_sequence, row_pos = rows_of(case)
    logits = torch.randn((row_pos.shape[0], VOCAB), generator=torch.Generator().manual_seed(seed))
    before = logits.clone()
    bw.ban_bad_words(logits, words, row_sequence, row_pos, known, first)
    for r in range(row_pos.shape[0]):
        b = int(row_sequence[r])
        banned = set() if row_pos[r] < 0 else ref.banned_tokens(int(row_pos[r]),
                                                               known_map(case, b), case[0][b])
        got = {v for v in range(VOCAB) if logits[r, v] == float("-inf")}
        assert got == banned, (seed, r)
        kept = [v for v in range(VOCAB) if v not in banned]
        assert torch.equal(logits[r, kept], before[r, kept])


@pytest.mark.parametrize("seed", range(40))
def test_the_unfill_is_the_references(seed):
    rng = random.Random(1000 + seed)
    case = random_case(rng)
    words, known, first = tensors(case)
    row_sequence, row_pos = rows_of(case)
    selected = torch.tensor([rng.random() < 0.7 for _ in range(row_pos.shape[0])])
    selected[::5] = True  # some padding rows selected too: never filled
    token = torch.tensor([rng.randrange(VOCAB) for _ in range(row_pos.shape[0])])
    after = bw.unfill_bad_words(selected, token, words, row_sequence, row_pos, known, first)
    for b in range(len(case[1])):
        rows = [r for r in range(row_pos.shape[0]) if row_sequence[r] == b]
        fills = {int(row_pos[r]): int(token[r]) for r in rows if selected[r] and row_pos[r] >= 0}
        refused = ref.refused_fills(fills, known_map(case, b), case[0][b])
        for r in rows:
            expected = bool(selected[r]) and not (row_pos[r] >= 0 and int(row_pos[r]) in refused)
            assert bool(after[r]) == expected, (seed, r)


@pytest.mark.parametrize("seed", range(30))
def test_a_simulated_decode_never_writes_a_word_and_always_fills(seed):
    """Fill a window of masks over several steps, each step choosing tokens at random among
    those the ban leaves and filling a random subset: the final text holds no word, and
    every step fills at least its leftmost selected mask."""
    rng = random.Random(seed)
    words = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] for _ in range(3)]
    if all(len(w) == 1 for w in words):
        words.append([0, 1])
    slots, tail_len = 8, 2
    window = [-1] * slots
    packed = bw.pack([words], torch.device("cpu"), word_len=3)
    row_sequence = torch.zeros(slots, dtype=torch.int64)
    while -1 in window:
        known, first = bw.known_tokens(
            torch.tensor([[max(t, 0) for t in window]]), torch.tensor([[t < 0 for t in window]]),
            torch.tensor([slots], dtype=torch.int32), torch.tensor([tail_len], dtype=torch.int32),
            torch.full((1, tail_len), -1))
        row_pos = torch.tensor([tail_len + s if window[s] < 0 else -1 for s in range(slots)])
        logits = torch.zeros((slots, VOCAB))
        bw.ban_bad_words(logits, packed, row_sequence, row_pos, known, first)
        allowed = [[v for v in range(VOCAB) if logits[r, v] == 0] for r in range(slots)]
        open_rows = (row_pos >= 0) & torch.tensor([bool(a) for a in allowed])
        if not torch.equal(open_rows, row_pos >= 0):
            pytest.skip("the ban leaves some slot no token (the vocabulary is tiny)")
        token = torch.tensor([rng.choice(a or [0]) for a in allowed])
        selected = torch.tensor([rng.random() < 0.6 for _ in range(slots)]) & open_rows
        if not selected.any():
            selected[int(open_rows.nonzero()[0])] = True
        kept = bw.unfill_bad_words(selected, token, packed, row_sequence, row_pos, known, first)
        assert kept[int(selected.nonzero()[0])]  # the leftmost fill is never refused
        for s in range(slots):
            if kept[s]:
                window[s] = int(token[s])
    assert not ref.contains_word(window, words), (window, words)


def test_the_tail_keeps_the_last_committed_tokens():
    tail = torch.tensor([[-1, -1, 7], [1, 2, 3]])
    out = torch.tensor([[9, 8, 0, 0], [4, 0, 0, 0]])
    assert bw.committed_tail(tail, out, torch.tensor([2, 0])).tolist() == [[7, 9, 8],
                                                                           [1, 2, 3]]


# ------------------------------------------------------------------ model_min


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(TINY)


PROMPTS = [list(b"The cat sat on"), list(b"1, 2, 3,"), list(b"Once upon a time there")]


@pytest.mark.parametrize("mode", ["streaming", "blockwise", "ar"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_model_min_never_commits_a_bad_word(tiny, mode, sampling):
    """Words taken from what the model writes without the rule (pairs and a single token
    it writes): with the rule none of them appears, and the outputs change."""
    generator = Generator(tiny, window=8, max_batch=3)
    params = SamplingParams(max_new_tokens=40, threshold=1.0, **sampling)
    plain = generator.generate(PROMPTS, params, mode=mode)
    words = sorted({tuple(r.token_ids[i: i + 2]) for r in plain
                    for i in range(0, len(r.token_ids) - 1, 7)})[:6]
    words = [list(w) for w in words] + [[plain[0].token_ids[0]]]
    assert all(ref.contains_word(r.token_ids, words) for r in plain[:1])
    ruled = generator.generate(PROMPTS, SamplingParams(
        max_new_tokens=40, threshold=1.0, bad_words_token_ids=words, **sampling), mode=mode)
    for result in ruled:
        assert not ref.contains_word(result.token_ids, words), result.token_ids
        assert len(result.token_ids) == 40
    assert [r.token_ids for r in ruled] != [r.token_ids for r in plain]
    if mode != "ar":
        assert any(r.forwards < len(r.token_ids) for r in ruled)  # still parallel


def test_bad_words_with_a_grammar_are_refused_by_name(tiny):
    with pytest.raises(ValueError, match="bad_words_token_ids cannot be combined"):
        Generator(tiny, window=4).generate([[1, 2]], SamplingParams(
            bad_words_token_ids=[[5]], grammar=lambda: None))
