"""vLLM's sampling parameters beyond temperature, top-k and top-p, served by WeDLM decoding:
the penalties, min_p, min_tokens, logit_bias and allowed_token_ids (applied to every window
slot's logits by ``wedlm_kernels.process_logits``, docs/contracts.md) and ``n > 1``. Each
decodes model_min's tokens in model_min's forwards, greedy and seeded, alone and mixed in
one batch with requests that use none of them."""

import pytest
from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm import request_stats

from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

EOS = 256  # the tiny model's
# One request per rule (vLLM's field names, model_min's are the same).
RULES = {
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 0.7},
    "repetition_penalty": {"repetition_penalty": 1.6},
    "negative_penalties": {"presence_penalty": -0.5, "frequency_penalty": -0.3,
                           "repetition_penalty": 0.8},
    "min_p": {"min_p": 0.3},
    "logit_bias": {"logit_bias": {53: 4.0, 32: -3.0, 101: 2.5}},
    "allowed_token_ids": {"allowed_token_ids": [32, 48, 49, 50, 51, 52, 101, 108]},
    "everything": {"presence_penalty": 0.4, "frequency_penalty": 0.2,
                   "repetition_penalty": 1.2, "min_p": 0.05, "logit_bias": {50: 1.0},
                   "allowed_token_ids": list(range(32, 127))},
}


def both(fields: dict, seed: int | None, max_tokens: int = 24, **vllm_only):
    """The request as vLLM and as model_min take it (temperature 0.9 when seeded)."""
    sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {"temperature": 0}
    return (SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling, **fields,
                           **vllm_only),
            model_min.SamplingParams(max_new_tokens=max_tokens, **sampling, **fields))


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_decodes_model_mins_tokens_in_its_forwards(engine, reference, rule, seed):
    served, wanted = both(RULES[rule], seed)
    assert vllm_generate(engine, PROMPTS, served) == reference_generate(reference, PROMPTS,
                                                                        wanted)


def test_rules_change_the_tokens(engine, reference):
    """(Not a vacuous pass: each rule changes the greedy output of some prompt.)"""
    plain = [tokens for tokens, _, _ in vllm_generate(engine, PROMPTS, both({}, None)[0])]
    for rule in ("presence_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids"):
        ruled = [tokens for tokens, _, _ in vllm_generate(engine, PROMPTS,
                                                           both(RULES[rule], None)[0])]
        assert ruled != plain, rule
    allowed = set(RULES["allowed_token_ids"]["allowed_token_ids"])
    ruled = vllm_generate(engine, PROMPTS, both(RULES["allowed_token_ids"], 3)[0])
    assert all(set(tokens) <= allowed for tokens, _, _ in ruled)


def test_a_batch_mixes_rules_with_plain_requests(engine, reference):
    """Slots that held a penalised or restricted request before serve a plain one exactly:
    the state a rule leaves behind is neutral for a request without it."""
    names = sorted(RULES)
    for round_ in range(2):
        chosen = [names[(round_ * 4 + i) % len(names)] for i in range(3)] + [None]
        pairs = [both(RULES[name] if name else {}, seed=5 + i if i % 2 else None)
                 for i, name in enumerate(chosen)]
        got = vllm_generate(engine, PROMPTS, [served for served, _ in pairs])
        want = reference_generate(reference, PROMPTS, [wanted for _, wanted in pairs])
        assert got == want, chosen


@pytest.mark.parametrize("seed", [None, 4], ids=["greedy", "seeded"])
def test_min_tokens_bans_the_stop_ids_before_it(engine, reference, seed):
    """With eos and a stop id among the stops, no stop is committed before min_tokens
    outputs, and the request decodes as model_min does (whose stop ids are eos and the
    request's)."""
    stops = [32, 101]
    served, _ = both({"min_tokens": 12, "stop_token_ids": stops}, seed, max_tokens=30)
    served.ignore_eos = False
    got = vllm_generate(engine, PROMPTS, served)
    sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {}
    want = reference_generate(reference, PROMPTS, model_min.SamplingParams(
        max_new_tokens=30, min_tokens=12, stop_token_ids=[*stops, EOS], **sampling))
    assert got == want
    for tokens, _, _ in got:
        assert not set(tokens[:12]) & {*stops, EOS}
    # without min_tokens, some prompt stops earlier: the rule did something
    plain, _ = both({"stop_token_ids": stops}, seed, max_tokens=30)
    plain.ignore_eos = False
    assert any(len(tokens) < 12 for tokens, _, _ in vllm_generate(engine, PROMPTS, plain))


def test_n_sequences_decode_as_model_min_with_vllms_child_seeds(engine, reference):
    """vLLM's front end fans n out as n requests, child i seeded seed + i: each decodes as
    model_min decodes it alone with that seed."""
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=40, ignore_eos=True,
                            presence_penalty=0.5)
    [output] = engine.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    got = sorted((o.index, list(o.token_ids)) for o in output.outputs)
    want = [(i, reference_generate(reference, [PROMPTS[0]], model_min.SamplingParams(
        max_new_tokens=16, temperature=1.0, seed=40 + i, presence_penalty=0.5))[0][0])
        for i in range(3)]
    assert got == want
    assert len({tuple(tokens) for _, tokens in got}) > 1  # the seeds differ
    stats = request_stats(engine, [f"{i}_{output.request_id}" for i in range(3)])
    assert all(stats[f"{i}_{output.request_id}"] is not None for i in range(3))


def test_n_with_a_seed_past_int64_for_a_child_is_refused(engine, reference):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="seed"):
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
            n=2, temperature=1.0, seed=2**63 - 1, max_tokens=4), use_tqdm=False)
    served, wanted = both({}, None, max_tokens=8)  # the engine still serves
    assert vllm_generate(engine, PROMPTS[:1], served) == reference_generate(
        reference, PROMPTS[:1], wanted)


def test_a_slot_forgets_the_rules_of_its_last_request(engine, reference):
    """A request after a ruled one takes the slot it left (vLLM's free list), beside a
    request that uses the same rule (so the step runs it): the bitmask, bias, penalties and
    min_tokens the earlier request stored in the slot change nothing."""
    harsh = {"allowed_token_ids": [32], "logit_bias": {53: 50.0}, "repetition_penalty": 2.0,
             "presence_penalty": 2.0, "min_tokens": 20}
    mild = {"allowed_token_ids": list(range(256)), "logit_bias": {40: 0.5},
            "repetition_penalty": 1.1, "presence_penalty": 0.1, "min_tokens": 2}
    plain_served, plain_wanted = both({}, None)
    for field in harsh:
        ruled, _ = both({field: harsh[field]}, None)
        vllm_generate(engine, PROMPTS[:1], ruled)
        beside_served, beside_wanted = both({field: mild[field]}, None)
        got = vllm_generate(engine, PROMPTS[:2], [plain_served, beside_served])
        assert got == reference_generate(reference, PROMPTS[:2],
                                         [plain_wanted, beside_wanted]), field


# The tiny model's ids no request outputs: the mask id (257) and the ids its tokenizer
# lacks (258 .. 263); wedlm_kernels.requests.output_ids, docs/requests.md "Ids never output"
NEVER = [257, 258, 259, 260, 261, 262, 263]


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
@pytest.mark.parametrize("fields", [
    {"logit_bias": {token: 100.0 for token in NEVER}},
    {"allowed_token_ids": [*NEVER, 97, 98, 99]},
], ids=["logit_bias", "allowed_token_ids"])
def test_the_mask_and_ids_the_tokenizer_lacks_are_never_output(engine, reference, fields,
                                                              seed):
    served, wanted = both(fields, seed)
    got = vllm_generate(engine, PROMPTS, served)
    assert got == reference_generate(reference, PROMPTS, wanted)
    assert all(not set(NEVER) & set(tokens) and len(tokens) == 24 for tokens, _, _ in got)


def test_the_engine_reads_the_ids_never_output_as_model_min_does(engine, reference):
    model, _ = reference
    hf_config = engine.llm_engine.vllm_config.model_config.hf_config
    assert hf_config.wedlm_never_output == NEVER == list(
        model_min.Generator(model).never_output_ids)


def test_rules_that_leave_only_such_ids_leave_nothing(engine, reference):
    """allowed_token_ids of ids never output leaves no token, as rules that ban the whole
    vocabulary do (allowed_token_ids=[eos] with min_tokens banning eos): every row is
    empty and gives token 0 (select_tokens), in model_min's forwards."""
    only_never, wanted = both({"allowed_token_ids": [257, 260]}, None, max_tokens=6)
    got = vllm_generate(engine, PROMPTS, only_never)
    nothing, _ = both({"allowed_token_ids": [EOS], "min_tokens": 6}, None, max_tokens=6)
    nothing.ignore_eos = False
    assert got == vllm_generate(engine, PROMPTS, nothing) == reference_generate(
        reference, PROMPTS, wanted)
    assert all(tokens == [0] * 6 for tokens, _, _ in got)
