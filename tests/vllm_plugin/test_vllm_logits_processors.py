"""vLLM's custom logits processors (Model Runner V2's ``LogitsProcessor``, given to the engine
as ``logits_processors=[...]``) served on WeDLM's window rows (docs/vllm.md, "Custom logits
processors"): a row that decides a slot at logical position ``q`` is shown to them as the
prediction of position ``q`` (``pos = q - 1``, ``input_ids`` the token at ``q - 1``).

Two processors that restate built-in rules (an allowed set, and stop ids banned before an
output index read from ``pos``) decode model_min's tokens and forwards under those rules; a
third records what every ``apply()`` sees, checked against the requests' outputs."""

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

import model_min

from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

EOS = 256  # the tiny model's
MASK = 257


class AllowedSet(LogitsProcessor):
    """``extra_args={"allowed": [ids]}``: every other token of the request's rows to -inf."""

    def __init__(self, vllm_config, req_states):
        self.allowed = torch.ones((req_states.max_num_reqs, req_states.vocab_size),
                                  dtype=torch.bool, device=req_states.device)

    def add_request(self, req_idx, sampling_params):
        allowed = (sampling_params.extra_args or {}).get("allowed")
        self.allowed[req_idx] = allowed is None
        if allowed is not None:
            self.allowed[req_idx, allowed] = True
        return allowed is not None

    def apply(self, logits, ctx):
        return logits.masked_fill_(~self.allowed[ctx.expanded_idx_mapping.long()],
                                   float("-inf"))


class EarlyStopBan(LogitsProcessor):
    """``extra_args={"early_ban": [count, ids...]}``: the ids banned from every row that
    predicts an output index below ``count`` (``pos + 1 - prompt_len``): min_tokens."""

    def __init__(self, vllm_config, req_states):
        self.req_states = req_states
        self.count = torch.zeros(req_states.max_num_reqs, dtype=torch.int64,
                                 device=req_states.device)
        self.banned = torch.zeros((req_states.max_num_reqs, req_states.vocab_size),
                                  dtype=torch.bool, device=req_states.device)

    def add_request(self, req_idx, sampling_params):
        rule = (sampling_params.extra_args or {}).get("early_ban")
        self.count[req_idx] = rule[0] if rule else 0
        self.banned[req_idx] = False
        if rule:
            self.banned[req_idx, rule[1:]] = True
        return bool(rule)

    def apply(self, logits, ctx):
        slot = ctx.expanded_idx_mapping.long()
        output_index = ctx.pos + 1 - self.req_states.prompt_len.gpu[slot].long()
        early = (output_index < self.count[slot])[:, None]
        return logits.masked_fill_(early & self.banned[slot], float("-inf"))


class Recorder(LogitsProcessor):
    """Records what ``apply()`` sees for the requests with ``extra_args={"record": 1}``."""

    seen: list[dict] = []

    def __init__(self, vllm_config, req_states):
        self.req_states = req_states

    def add_request(self, req_idx, sampling_params):
        return bool((sampling_params.extra_args or {}).get("record"))

    def apply(self, logits, ctx):
        slot = ctx.expanded_idx_mapping.long()
        Recorder.seen.append({
            "slot": slot.tolist(), "pos": ctx.pos.tolist(), "input_ids": ctx.input_ids.tolist(),
            "local": ctx.expanded_local_pos.tolist(), "slots": ctx.idx_mapping.tolist(),
            "slots_np": ctx.idx_mapping_np.tolist(), "dtype": logits.dtype,
            "upper": ctx.seq_lens_upper_bound_np.tolist(),
            "total_len": self.req_states.total_len.gpu[slot].tolist(),
            "prompt_len": self.req_states.prompt_len.gpu[slot].tolist()})
        return logits


@pytest.fixture(scope="module")
def engine(engines):
    """An engine of its own, with the three processors."""
    with engines.own(logits_processors=[AllowedSet, EarlyStopBan, Recorder]) as llm:
        yield llm


def sampling(seed: int | None) -> dict:
    return {"temperature": 0.9, "seed": seed} if seed is not None else {"temperature": 0}


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_a_processor_banning_tokens_decodes_as_allowed_token_ids(engine, reference, seed):
    allowed = [32, 48, 49, 50, 51, 52, 101, 108]
    got = vllm_generate(engine, PROMPTS, SamplingParams(
        max_tokens=24, ignore_eos=True, extra_args={"allowed": allowed}, **sampling(seed)))
    assert got == reference_generate(reference, PROMPTS, model_min.SamplingParams(
        max_new_tokens=24, allowed_token_ids=allowed, **sampling(seed)))
    assert all(set(tokens) <= set(allowed) for tokens, _, _ in got)


@pytest.mark.parametrize("seed", [None, 4], ids=["greedy", "seeded"])
def test_a_processor_reading_pos_decodes_as_min_tokens(engine, reference, seed):
    """The processor bans the stops from the rows whose ``pos + 1`` is an output index below
    12: model_min's min_tokens, so ``pos`` is the predicted slot's position minus one."""
    stops = [32, 101]
    got = vllm_generate(engine, PROMPTS, SamplingParams(
        max_tokens=30, stop_token_ids=stops, extra_args={"early_ban": [12, *stops, EOS]},
        **sampling(seed)))
    assert got == reference_generate(reference, PROMPTS, model_min.SamplingParams(
        max_new_tokens=30, min_tokens=12, stop_token_ids=[*stops, EOS], **sampling(seed)))
    # without the processor some prompt stops earlier: the rule did something
    plain = vllm_generate(engine, PROMPTS, SamplingParams(
        max_tokens=30, stop_token_ids=stops, **sampling(seed)))
    assert any(len(tokens) < 12 for tokens, _, _ in plain)


def test_a_batch_mixes_processed_and_plain_requests(engine, reference):
    """A processor's requests beside plain ones (and the slots they leave behind) decode as
    model_min's, the plain ones as if alone."""
    allowed = [48, 49, 50, 51, 52]
    for _ in range(2):
        params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                 extra_args={"allowed": allowed} if i % 2 else None)
                  for i in range(4)]
        want = [model_min.SamplingParams(max_new_tokens=16,
                                         allowed_token_ids=allowed if i % 2 else None)
                for i in range(4)]
        assert vllm_generate(engine, PROMPTS, params) == reference_generate(
            reference, PROMPTS, want)


def test_processors_see_each_row_as_its_slots_prediction(engine):
    """Every row a processor sees: its request's slot; ``pos + 1`` at most vLLM's bound;
    ``input_ids`` the committed token at ``pos`` below the committed length, else the
    token its slot ends with or the mask id. The rows that decide cover every output
    position, and the logits are float32."""
    Recorder.seen.clear()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                            extra_args={"record": 1})
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                              use_tqdm=False)
    assert Recorder.seen
    final = {}  # slot -> the tokens of the request it held (each slot serves one here)
    for step in Recorder.seen:
        assert step["dtype"] == torch.float32
        assert step["slots"] == step["slots_np"]
        for row, slot in enumerate(step["slot"]):
            b = step["slots"].index(slot)
            assert step["pos"][row] + 1 <= step["upper"][b]
            assert step["local"][row] == row - step["slot"].index(slot)
            final.setdefault(slot, None)
    assert len(final) == len(PROMPTS)
    tokens_of = {}
    for step in Recorder.seen:  # which request each slot held: its prompt length
        for row, slot in enumerate(step["slot"]):
            tokens_of.setdefault(slot, step["prompt_len"][row])
    by_prompt_len = {len(p): p + list(o.outputs[0].token_ids)
                     for p, o in zip(PROMPTS, outputs)}
    predicted = {slot: set() for slot in final}
    for step in Recorder.seen:
        for row, slot in enumerate(step["slot"]):
            sequence = by_prompt_len[tokens_of[slot]]
            pos, token = step["pos"][row], step["input_ids"][row]
            if pos < step["total_len"][row]:
                assert token == sequence[pos], (pos, token)
            else:
                assert token in (MASK, sequence[pos]), (pos, token)
            predicted[slot].add(pos + 1)
    for slot, positions in predicted.items():
        prompt_len = tokens_of[slot]
        assert set(range(prompt_len, prompt_len + 20)) <= positions


def test_a_processor_sees_no_row_of_a_request_it_declined_when_none_asks(engine, reference):
    """With no request of the step taken by a processor, none is called, and the plain
    requests decode as model_min's."""
    Recorder.seen.clear()
    got = vllm_generate(engine, PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                        ignore_eos=True))
    assert not Recorder.seen
    assert got == reference_generate(reference, PROMPTS,
                                     model_min.SamplingParams(max_new_tokens=12))
