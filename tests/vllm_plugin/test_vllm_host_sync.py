"""The decode hooks never read a device value on the host: WeDLMModelState.prepare_inputs
and WeDLMSampler.__call__ run under a torch function mode that fails on every host read
(``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero`` and the other ops with a
data-dependent shape, ``bool()``/``int()``/``float()`` of a tensor), so vLLM may capture
them in CUDA graphs on a GPU."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from vllm import SamplingParams

from wedlm_kernels.integrations.vllm.state import WeDLMModelState, WeDLMSampler

from .test_vllm_decoding import PROMPTS

HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.argwhere,
    torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
    torch.unique_consecutive, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__array__,
}


class HostReadError(AssertionError):
    pass


class ForbidHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS or (func is torch.where and len(args) + len(kwargs) == 1):
            raise HostReadError(f"host read during a decode hook: {func.__qualname__}")
        if func is torch.repeat_interleave and "output_size" not in kwargs:
            raise HostReadError("repeat_interleave without output_size (data-dependent)")
        return func(*args, **kwargs)


@pytest.fixture
def forbid_host_reads(monkeypatch):
    calls = {"prepare_inputs": 0, "sampler": 0}

    def guarded(name, method):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            with ForbidHostReads():
                return method(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(WeDLMModelState, "prepare_inputs",
                        guarded("prepare_inputs", WeDLMModelState.prepare_inputs))
    monkeypatch.setattr(WeDLMSampler, "__call__", guarded("sampler", WeDLMSampler.__call__))
    return calls


def test_the_mode_catches_host_reads():
    tensor = torch.arange(4)
    for read in (lambda: tensor.sum().item(), lambda: tensor.tolist(), lambda: tensor.cpu(),
                 lambda: tensor.nonzero(), lambda: bool(tensor[0]), lambda: int(tensor[1]),
                 lambda: torch.where(tensor > 1)):
        with pytest.raises(HostReadError), ForbidHostReads():
            read()


def test_decode_steps_read_nothing_back(engine, forbid_host_reads):
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9, seed=3,
                       ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True,
                       extra_args={"wedlm_mode": "blockwise", "wedlm_window": 4}),
        SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[32]),
    ]
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                              use_tqdm=False)
    assert all(o.finished for o in outputs)
    # the hooks ran, on decode steps and on prefill steps
    assert forbid_host_reads["prepare_inputs"] > 5 and forbid_host_reads["sampler"] > 5


def test_the_logit_rules_read_nothing_back(engine, forbid_host_reads):
    """process_logits on the step's rows and the counts' update after the commit."""
    rules = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                 min_p=0.1, min_tokens=4, logit_bias={53: 2.0},
                 allowed_token_ids=list(range(32, 127)))
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True, **rules),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(n=2, max_tokens=12, temperature=0.7, seed=9, **rules)]
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params,
                              use_tqdm=False)
    assert all(o.finished for o in outputs)
    assert forbid_host_reads["sampler"] > 5


def test_logprobs_and_bad_words_read_nothing_back(engine, forbid_host_reads):
    """The records of the filled slots, the committed ones laid out for vLLM, and the bad
    words' ban, unfill and tail (the step's widths are host facts)."""
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True,
                             logprobs=3, bad_words=["e", "the"]),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                             bad_words=["a b"], presence_penalty=0.5)]
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params,
                              use_tqdm=False)
    assert all(o.finished for o in outputs)
    assert outputs[0].outputs[0].logprobs and outputs[1].outputs[0].logprobs
    assert forbid_host_reads["sampler"] > 5
