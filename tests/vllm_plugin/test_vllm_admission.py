"""Admission at the engine's rate: ``add_request`` stages a request's state on the host (no
device work), and ``apply_staged_writes`` lands all of a step's admissions in one
host-to-device copy and a fixed number of device ops, however many requests arrived."""

from collections import defaultdict

import pytest
from torch.utils._python_dispatch import TorchDispatchMode
from vllm import SamplingParams

import model_min
from wedlm_kernels.integrations.vllm.state import WeDLMModelState

from .test_vllm_decoding import PROMPTS, reference_generate, vllm_generate

HOST_READS = {"_local_scalar_dense", "nonzero", "item"}


class CountDeviceOps(TorchDispatchMode):
    """Counts the ops that run a kernel (views are not counted) and notes host reads."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **kwargs or {})


@pytest.fixture
def admissions(monkeypatch):
    """Per call: ("add", ops) and ("apply", saves, admissions, resumes, ops)."""
    calls = []
    add_request, apply = WeDLMModelState.add_request, WeDLMModelState.apply_staged_writes

    def counted_add(self, *args, **kwargs):
        with CountDeviceOps() as mode:
            add_request(self, *args, **kwargs)
        calls.append(("add", mode.ops))

    def counted_apply(self):
        saves, staged = len(self._staged_saves), list(self._staged_admissions)
        with CountDeviceOps() as mode:
            apply(self)
        calls.append(("apply", saves, len(staged), any(row[1] >= 0 for row in staged),
                      mode.ops))

    monkeypatch.setattr(WeDLMModelState, "add_request", counted_add)
    monkeypatch.setattr(WeDLMModelState, "apply_staged_writes", counted_apply)
    return calls


def test_admissions_land_in_a_fixed_number_of_device_ops_per_step(engine, reference,
                                                                   admissions):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    # a step admitting 1, then 4, then 2 requests (their prompts fit one step's budget),
    # each after the previous batch left: every apply also saves the rows of those
    got = [vllm_generate(engine, prompts, params)
           for prompts in (PROMPTS[:1], PROMPTS, PROMPTS[1:3])]
    want = [reference_generate(reference, prompts, model_min.SamplingParams(max_new_tokens=10))
            for prompts in (PROMPTS[:1], PROMPTS, PROMPTS[1:3])]
    assert got == want

    adds = [ops for kind, ops, *_ in admissions if kind == "add"]
    assert len(adds) == 7 and all(ops == [] for ops in adds)  # host only
    by_kind = defaultdict(set)
    admitted = set()
    for kind, *rest in admissions:
        if kind == "apply":
            saves, count, resumes, ops = rest
            assert not HOST_READS & set(ops), ops
            by_kind[(saves > 0, count > 0, resumes)].add(len(ops))
            admitted.add((saves > 0, count))
    # the same ops for 1, 4 and 2 admissions: nothing per request
    assert {count for has_saves, count in admitted if has_saves} >= {4, 2}
    assert all(len(counts) == 1 for counts in by_kind.values()), dict(by_kind)
