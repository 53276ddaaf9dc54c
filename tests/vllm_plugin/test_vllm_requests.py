"""Requests arriving and leaving mid-flight, preemption, prefix caching and chunked prefill
through vLLM, each against model_min on the same prompts."""

from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm import request_stats

from .conftest import WINDOW
from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate


def run_engine(engine, schedule: dict[int, list], max_steps: int = 500) -> dict[str, list]:
    """Step ``engine.llm_engine`` by hand; at step k, do ``schedule[k]``: ("add", id, prompt,
    params) or ("abort", id). Returns the final token ids of every finished request."""
    llm_engine = engine.llm_engine
    finished: dict[str, list] = {}
    for step in range(max_steps):
        for action in schedule.get(step, []):
            if action[0] == "add":
                _, request_id, prompt, params = action
                llm_engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            else:
                llm_engine.abort_request([action[1]])
        for output in llm_engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        if step > max(schedule) and not llm_engine.has_unfinished_requests():
            return finished
    raise AssertionError(f"requests unfinished after {max_steps} engine steps")


def test_requests_added_and_aborted_mid_flight(engine, reference):
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, top_k=30, seed=5, ignore_eos=True)
    finished = run_engine(engine, {
        0: [("add", "first", PROMPTS[0], greedy), ("add", "doomed", PROMPTS[1], greedy)],
        3: [("add", "late", PROMPTS[3], sampled)],
        5: [("abort", "doomed")],
        7: [("add", "after-abort", PROMPTS[2], greedy)],
    })
    assert "doomed" not in finished
    want_greedy = reference_generate(reference, [PROMPTS[0], PROMPTS[2]],
                                     model_min.SamplingParams(max_new_tokens=48))
    want_late = reference_generate(reference, [PROMPTS[3]], model_min.SamplingParams(
        max_new_tokens=30, temperature=0.8, top_k=30, seed=5))
    stats = request_stats(engine, ["first", "after-abort", "late"])
    assert (finished["first"], stats["first"]["forwards"]) == want_greedy[0][:2]
    assert (finished["after-abort"], stats["after-abort"]["forwards"]) == want_greedy[1][:2]
    assert (finished["late"], stats["late"]["forwards"]) == want_late[0][:2]


def test_a_long_prompt_is_prefilled_in_chunks(engine, reference):
    # 150 prompt tokens through a 64-token step budget: three prefill chunks, the first
    # ones alongside other requests' decode steps
    long_prompt = (list(b"The quick brown fox jumps over the lazy dog. ") * 4)[:150]
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    got = vllm_generate(engine, prompts, SamplingParams(max_tokens=20, temperature=0,
                                                        ignore_eos=True))
    want = reference_generate(reference, prompts, model_min.SamplingParams(max_new_tokens=20))
    assert got == want


def test_prefix_caching_reuses_committed_kv(engine, reference):
    # the second request's prompt is the first one's prompt and output: its blocks are
    # the first request's committed K/V, which must be plain AR K/V
    prompt = list(b"Once upon a time, in a land far away, there lived a ")
    first = engine.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0]
    continued = prompt + list(first.outputs[0].token_ids)
    second = engine.generate([{"prompt_token_ids": continued}],
                             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0]
    assert second.num_cached_tokens >= 64  # two 32-token blocks of committed K/V
    want = reference_generate(reference, [continued], model_min.SamplingParams(
        max_new_tokens=16))
    assert list(second.outputs[0].token_ids) == want[0][0]


def test_a_request_given_part_of_its_canvas_decodes_what_fits(engines, reference):
    # the fixed canvas and a 40-token step budget: two canvases of 16 rows, and 8 rows for
    # the third request, fewer than its window; it decodes the part that fits instead of
    # waiting (the live canvas meets this when a step's budget runs out mid-window)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with engines.own(max_num_batched_tokens=40,
                     additional_config={"wedlm": {"window": WINDOW, "canvas": "fixed"}}
                     ) as engine:
        got = vllm_generate(engine, PROMPTS[:3], params)
    want = reference_generate(reference, PROMPTS[:3], model_min.SamplingParams(
        max_new_tokens=30))
    assert got[:2] == want[:2]  # full canvases: as model_min
    tokens, forwards, rows = got[2]
    assert len(tokens) == 30 and forwards > 0
    assert rows < want[2][2]  # it fed fewer live rows than an untruncated window would


def test_preempted_requests_resume_their_window_and_decode_as_alone(engines, reference):
    # 10 cache blocks of 32 positions for 20 requests of 3 to 4 blocks each, half of them
    # seeded samples: vLLM preempts requests again and again and resumes them later (the
    # prompt and the committed tokens prefilled anew). Each resumes the window it left
    # (its filled, uncommitted slots included), so each decodes exactly as alone.
    count = 20
    bases = [PROMPTS[1], PROMPTS[3], PROMPTS[0], list(b"Once upon a time")]
    prompts = [(bases[i % 4] * 2)[: 20 + (i * 7) % 30] for i in range(count)]
    settings = [dict(max_tokens=60 + (i % 3) * 10, temperature=0.8 if i % 2 else 0.0,
                     top_k=20, seed=100 + i) for i in range(count)]
    with engines.own(num_gpu_blocks_override=10) as engine:
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                                  [SamplingParams(ignore_eos=True, **kw) for kw in settings],
                                  use_tqdm=False)
        stats = request_stats(engine, [o.request_id for o in outputs])
    restarts = [stats[o.request_id]["restarts"] for o in outputs]
    assert sum(map(len, restarts)) >= 20, f"{restarts}: the test needs a smaller cache"
    for prompt, kw, output in zip(prompts, settings, outputs):
        alone = reference_generate(reference, [prompt], model_min.SamplingParams(
            max_new_tokens=kw["max_tokens"], temperature=kw["temperature"],
            top_k=kw["top_k"], seed=kw["seed"]))[0]
        assert (list(output.outputs[0].token_ids), stats[output.request_id]["forwards"]
                ) == alone[:2]
