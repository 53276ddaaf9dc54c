"""Batched WeDLM decoding on the public ops (docs/algorithm.md section 4, docs/decoder.md
"Decoding loop around the ops").

A streaming / block-wise decode step is, for the whole batch at once::

    reorder_window -> model forward (rope_kv_append + paged_attention per layer)
      -> lm_head on the mask rows only -> select_tokens -> commit_window

on the live rows of the windows only, packed back to back: before each window step the host
reads back one number, the live-row count, which sizes the packed rows (with CUDA graphs,
rounded up to a row bucket); nothing inside the step synchronises with the host. Every
``poll_every`` steps the host also reads ``finished``, hands back finished requests (and
their cache pages), compacts the batch so they stop costing compute, and admits waiting
requests (prefill fills their cache and computes no logits).
AR mode is the same loop with one token per forward: the prefill's last row predicts the
first token, then each forward feeds the last token.
"""

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

import wedlm_kernels as wk
from wedlm_kernels import window_policy
from wedlm_kernels.requests import bad_words
from wedlm_kernels.requests import params as rp
from wedlm_kernels.requests.grammar import GrammarStep, plan_window
from wedlm_kernels.requests.logprobs import (
    Logprob,
    Records,
    check_mode,
    empty_store,
    keep_filled,
    position_logprobs,
    row_records,
)
from wedlm_kernels.requests.output_ids import never_output_ids, output_bitmask

from .config import is_integer
from .graphs import StepGraphs, bucket_size
from .model import Model
from .state import BatchState, concat
from .tokenizer import Tokenizer

MODES = (*rp.MODES, "ar")  # the window modes of wedlm_kernels.requests.params, and AR

# window="auto": a forward costs about one read of the weights until its matmuls take longer
# than that read, and grows with its rows from there. For a bf16 model (2 bytes and 2 FLOPs
# per weight and row) the crossing is at (matmul FLOP/s) / (copy bytes/s) rows: an H200
# measured 707 TFLOP/s of bf16 matmul and 4.2 TB/s of copy, ~170 rows. Free text commits
# about one token per forward, so a window step feeds about W + 1 rows per sequence; the
# policy keeps B * (W + 1) under this many rows, with the largest window that does.
MEMORY_BOUND_ROWS = window_policy.ROW_BUDGETS["cuda"]  # 160
ROW_READBACKS = ("auto", "every_step", "never")  # Generator(row_readback=...)
AUTO_WINDOWS = (16, 8, 4)  # largest first; the smallest is used above the bound too


def auto_window(batch: int, memory_bound_rows: int = MEMORY_BOUND_ROWS) -> int:
    """The window ``Generator(window="auto")`` decodes a batch of ``batch`` sequences with:
    the largest of :data:`AUTO_WINDOWS` (16, 8, 4) with ``batch * (W + 1) <=
    memory_bound_rows``, else the smallest (4). With the default bound: W = 16 up to 9
    sequences, 8 up to 17, 4 above. Derived from the roofline of a forward (see
    :data:`MEMORY_BOUND_ROWS`), not yet from a GPU sweep; docs/contracts.md."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    for window in AUTO_WINDOWS:
        if batch * (window + 1) <= memory_bound_rows:
            return window
    return AUTO_WINDOWS[-1]
Prompt = Union[str, Sequence[int]]


@dataclass
class SamplingParams:
    """Per-request decoding parameters (docs/algorithm.md section 4).

    Checked, and mapped where a value has a documented meaning, by
    :mod:`wedlm_kernels.requests.params`, the one definition the vLLM plugin checks its
    requests with too (docs/requests.md, "Request parameters"): a bad value raises
    ``ParameterError`` (a ``ValueError``; ``ParameterTypeError``, also a ``TypeError``, for
    a wrong type) naming the field, and the fields hold the values as stored afterwards
    (``threshold=None`` reads back as ``-inf``).
    """

    max_new_tokens: int | None = 256  # None: up to max_position_embeddings
    temperature: float = 0.0  # 0: greedy (at most 2; (0, 0.01) is raised to 0.01)
    top_k: int = 0  # -1 or 0: off
    top_p: float = 1.0  # 1: off
    threshold: float | None = 0.4  # None or <= 0: one token per step
    penalty: float = 0.02  # >= 0
    seed: int | None = None  # None or -1: drawn from the Generator's random generator
    stop_token_ids: tuple[int, ...] = ()  # at most 24 besides the checkpoint's eos ids
    # The logit rules (wk.process_logits, docs/contracts.md): applied to every window slot's
    # logits before the entropy and the selection, in every mode.
    presence_penalty: float = 0.0  # -2 .. 2, subtracted once from tokens generated before
    frequency_penalty: float = 0.0  # -2 .. 2, subtracted per earlier occurrence
    repetition_penalty: float = 1.0  # > 0: divides a positive, multiplies a negative logit
    min_p: float = 0.0  # 0 .. 1: tokens below min_p x the top token's probability cut
    min_tokens: int = 0  # stop ids banned from the first min_tokens outputs
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: Sequence[int] | None = None  # None: every token
    # words (token id lists) never written: a slot's token that would complete one with
    # the known tokens around it is banned (wedlm_kernels.requests.bad_words)
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    # Structured output: a function returning a fresh grammar (wedlm_kernels.requests.grammar.Grammar,
    # masks over the model's vocabulary), called once per request; every output then
    # parses (docs/requests.md, "Structured outputs").
    grammar: Callable[[], Any] | None = None
    # Log-probabilities of the committed tokens (docs/requests.md, "Logprobs"): None, or
    # how many of the most likely tokens each position also lists (0 .. 64; -1: the whole
    # vocabulary, when it has at most 64 tokens). Result.logprobs holds them.
    logprobs: int | None = None
    # Or the tokens each position lists instead of the most likely (vLLM's
    # logprob_token_ids): 1 .. 128 ids of the vocabulary, in order, repeats kept; with
    # logprobs also set, logprobs must equal their count. [] is None.
    logprob_token_ids: Sequence[int] | None = None
    # How the streaming window is sized step by step: None (the Generator's window_policy),
    # "fixed" (W slots) or "adaptive" (wedlm_kernels.window_policy, docs/algorithm.md)
    window_policy: str | None = None

    def __post_init__(self) -> None:
        def name(field: str) -> str:
            return f"SamplingParams.{field}"

        self.max_new_tokens = rp.max_tokens(self.max_new_tokens, name("max_new_tokens"))
        self.temperature, self.top_k, self.top_p = rp.sampling(
            self.temperature, self.top_k, self.top_p,
            (name("temperature"), name("top_k"), name("top_p")))
        self.threshold = rp.entropy_threshold(self.threshold, name("threshold"))
        self.penalty = rp.distance_penalty(self.penalty, name("penalty"))
        self.seed = rp.seed(self.seed, name("seed"))
        self.stop_token_ids = rp.stop_token_ids(self.stop_token_ids, name("stop_token_ids"))
        self.presence_penalty, self.frequency_penalty, self.repetition_penalty = rp.penalties(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
            (name("presence_penalty"), name("frequency_penalty"), name("repetition_penalty")))
        self.min_p = rp.min_p(self.min_p, name("min_p"), self.temperature)
        self.min_tokens = rp.min_tokens(self.min_tokens, name("min_tokens"),
                                        self.max_new_tokens)
        bias = rp.logit_bias(self.logit_bias, name("logit_bias"))
        self.logit_bias = dict(bias) if bias else None
        self.allowed_token_ids = rp.allowed_token_ids(self.allowed_token_ids,
                                                      name("allowed_token_ids"))
        self.bad_words_token_ids = rp.bad_words_token_ids(self.bad_words_token_ids,
                                                          name("bad_words_token_ids"))
        logprobs = rp.logprobs(self.logprobs, name("logprobs"))
        self.logprob_token_ids = rp.logprob_token_ids(
            self.logprob_token_ids, name("logprob_token_ids"), logprobs=self.logprobs)
        self.logprobs = logprobs
        self.window_policy = rp.window_policy(self.window_policy, name("window_policy"))
        if self.grammar is not None and not callable(self.grammar):
            raise rp.ParameterTypeError(
                f"{name('grammar')} must be a function returning a grammar, got "
                f"{type(self.grammar).__name__}", name("grammar"))


def sampling_mode(params: Iterable[SamplingParams], vocab_size: int) -> str:
    """select_tokens' ``sampling`` argument for requests decoded together, from their
    host-side parameters: ``"greedy"`` when every request is greedy (temperature 0),
    ``"temperature"`` when no sampling request uses top-k (``0 < top_k < vocab_size``) or
    top-p (``top_p < 1``), ``"any"`` otherwise. Each mode agrees with the parameters, so the
    tokens are the ones ``"any"`` gives; a narrower mode lets a kernel compiled for it run
    (``WEDLM_KERNELS_SELECT_KERNEL``)."""
    sampling = [p for p in params if not p.temperature <= 0]
    if not sampling:
        return "greedy"
    if any(0 < p.top_k < vocab_size or not p.top_p >= 1 for p in sampling):
        return "any"
    return "temperature"


def num_logprobs(params: SamplingParams) -> int | None:
    """The entries a position of ``params``' logprobs lists besides the committed token
    (vLLM's ``SamplingParams.num_logprobs``): ``logprobs``, else the number of
    ``logprob_token_ids``, else None (no logprobs)."""
    if params.logprobs is not None:
        return params.logprobs
    return len(params.logprob_token_ids) if params.logprob_token_ids else None


def parse_threshold(text: str) -> float | None:
    """A command line's entropy threshold: a number in nats, or ``none`` (one token per
    step, ``SamplingParams.threshold = None``)."""
    return None if text.lower() == "none" else float(text)


@dataclass
class Result:
    token_ids: list[int]
    # "stop" (a stop token was generated), "length", or "error": the request could not go
    # on (its grammar allows no token after its committed ones; ``error`` says why)
    finish_reason: str
    forwards: int  # decode forwards the request took part in (AR: every token's forward)
    rows: int  # live window rows fed over all forwards
    tokens_per_forward: float
    p_cache: float  # generated tokens / rows (paper Eq. 4)
    seed: int  # the seed used (drawn when SamplingParams.seed was None)
    text: str | None = None  # decoded token_ids when the Generator has a tokenizer
    # with SamplingParams.logprobs: per token, its entry and the most likely tokens' of
    # the distribution its slot was filled from (as vLLM's SampleLogprobs, without text);
    # with logprob_token_ids, those tokens' entries instead of the most likely
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None  # why a request ended with finish_reason "error"


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_new: int  # params.max_new_tokens, or the positions the prompt leaves for None
    pages: list[int] = field(default_factory=list)
    grammar: Any = None  # its structured output's grammar, at its committed tokens
    accepted: int = 0  # committed tokens the grammar has accepted
    error: str | None = None  # set when the request cannot go on (it ends with "error")


def row_bucket(live_rows: int, most: int) -> int:
    """The packed rows a CUDA graph is captured for: ``live_rows`` itself up to 16, above
    that the smallest ``(8 + k) * 2**e`` (``k < 8``) that holds them (18, 20, .., 32, 36,
    .., 64, 72, ..), capped at ``most`` (the batch's ``B * 2W``; 0 rows: no step at all).
    Eight buckets per doubling: a step feeds less than 12.5% padding rows at every size, and
    row counts up to 4096 need at most 80 graphs (each captured when first used)."""
    bucket = live_rows
    if bucket > 8:
        step = 1 << (bucket.bit_length() - 4)  # 2^(e) with 8 * 2^e <= live_rows < 16 * 2^e
        bucket = -(-bucket // step) * step
    return min(bucket, most)


def _is_array(value) -> bool:
    """A torch tensor or a numpy array (numpy imported only if the value is one)."""
    return isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"


def _integer_dtype(array) -> bool:
    if isinstance(array, torch.Tensor):
        return not array.dtype.is_floating_point and not array.dtype.is_complex and (
            array.dtype != torch.bool)
    return array.dtype.kind in "iu"


class Generator:
    """Batched WeDLM decoder over a paged KV cache.

    Parameters
    ----------
    model : Model
        From ``model_min.load_model``.
    window : int or "auto"
        Window size ``W`` (slot capacity ``2W``), or ``"auto"``: each
        ``generate`` call picks ``auto_window(min(requests, max_batch))`` (16 for few
        sequences, down to 4 for many; :func:`auto_window`) and leaves it in
        ``self.window``. The window changes which tokens are committed together, so with
        "auto" a request's tokens depend on the size of its batch.
    page_size : int
        KV cache page size in positions.
    max_batch : int
        Most requests decoded at once; more wait for a free row.
    tokenizer : Tokenizer or None
        Optional, for text prompts and ``Result.text``.
    max_cache_tokens : int or None
        KV cache capacity in positions (default
        ``max_batch * (min(max_position_embeddings, 4096) + window)``).
    mask_token_id : int or None
        Overrides ``config.json``'s ``mask_token_id``.
    seed : int or None
        Seeds the generator that draws per-request seeds left as None.
    poll_every : int
        Decode steps between two looks of the host at the batch.
    cuda_graph : bool
        Capture the decode step in CUDA graphs (CUDA only; one graph per batch-size bucket,
        the batch is padded to the bucket).
    logprobs_mode : str
        vLLM's ``logprobs_mode`` (docs/requests.md, "Logprobs").
    grammar_drafts : bool
        Under a grammar, sample the mask slots past the decided ones as drafts, checked by
        the next step's walk (docs/requests.md, "Structured outputs"). False: only the
        decided slots are sampled, one sampled token per step (the rule before drafts;
        for comparison).
    row_readback : str
        How a window step sizes its packed rows (:meth:`_rows_for_step`): ``"auto"``
        (default) feeds all ``B * 2W`` rows without reading the live-row count back when
        CUDA graphs are on and ``B * 2W <= MEMORY_BOUND_ROWS`` (padding rows cost about
        nothing there, the readback a host round trip a step), and reads it back otherwise;
        ``"every_step"`` always reads it back; ``"never"`` never does (every step feeds
        ``B * 2W`` rows; on a CPU each padding row costs compute). The tokens are the same.
    window_policy : str
        How a streaming window is sized, for the requests that leave it to the Generator
        (``SamplingParams.window_policy`` None): ``"fixed"`` (default) keeps ``W`` slots;
        ``"adaptive"`` sizes each sequence's window before each step from what it commits
        (1 to ``W`` slots, :mod:`wedlm_kernels.window_policy`; docs/algorithm.md, "The
        adaptive window"). Block-wise and AR decoding, and requests with a grammar, keep
        their windows.
    min_window : int, optional
        The adaptive window's floor, 1 .. ``window`` (at most the window a ``generate``
        call decodes with): the masks a sequence keeps however little it commits. None
        (default): derived from the device's row budget and ``max_batch``
        (``AdaptiveWindow.for_device``). The vLLM plugin's ``min_window`` is the same
        setting.

    Notes
    -----
    One ``generate`` call at a time per Generator (it is not thread-safe).
    """

    def __init__(
        self,
        model: Model,
        window: int | str = 16,
        page_size: int = 16,
        max_batch: int = 8,
        tokenizer: Tokenizer | None = None,
        *,
        max_cache_tokens: int | None = None,
        mask_token_id: int | None = None,
        seed: int | None = None,
        poll_every: int = 4,
        cuda_graph: bool = False,
        logprobs_mode: str = "raw_logprobs",
        grammar_drafts: bool = True,
        row_readback: str = "auto",
        window_policy: str = "fixed",
        min_window: int | None = None,
    ) -> None:
        self.auto_window = isinstance(window, str) and window == "auto"
        if self.auto_window:
            window = AUTO_WINDOWS[0]  # until a generate call picks one
        try:
            window = rp.window(window, "window")
        except rp.ParameterError as error:
            raise type(error)(f'{error} (or "auto")', error.parameter) from None
        for name, value in (("page_size", page_size), ("max_batch", max_batch),
                            ("poll_every", poll_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if cuda_graph and model.device.type != "cuda":
            raise ValueError("cuda_graph=True needs a model on a CUDA device")
        if max_cache_tokens is not None and (not is_integer(max_cache_tokens)
                                             or max_cache_tokens < 1):
            raise ValueError(f"max_cache_tokens must be a positive int or None, got "
                             f"{max_cache_tokens!r}")
        if not isinstance(grammar_drafts, bool):
            raise TypeError(f"grammar_drafts must be a bool, got {type(grammar_drafts).__name__}")
        if row_readback not in ROW_READBACKS:
            raise ValueError(f"row_readback must be one of {ROW_READBACKS}, got {row_readback!r}")
        if window_policy not in rp.WINDOW_POLICIES:
            raise ValueError(f"window_policy must be one of {rp.WINDOW_POLICIES}, got "
                             f"{window_policy!r}")
        if min_window is not None:
            min_window = rp.window(min_window, "min_window", window)
        self.min_window = min_window
        self.grammar_drafts = grammar_drafts
        self.row_readback = row_readback
        self.window_policy = window_policy
        self.logprobs_mode = check_mode(logprobs_mode)
        self.model = model
        self.window = window
        self.page_size = page_size
        self.max_batch = max_batch
        self.tokenizer = tokenizer
        self.poll_every = poll_every
        self.mask_token_id = mask_token_id if mask_token_id is not None else model.config.mask_token_id
        # The ids no request outputs (wedlm_kernels.requests.output_ids): the mask id and the ids the
        # checkpoint's tokenizer does not decode, -inf in every row a step decides
        known = model.tokenizer_ids
        if known is None and tokenizer is not None:
            known = tokenizer.ids()
        self.never_output_ids = never_output_ids(model.config.vocab_size, self.mask_token_id,
                                                 known)
        self._never_output = torch.tensor(self.never_output_ids, dtype=torch.int64,
                                          device=model.device)
        self._output_mask = output_bitmask(model.config.vocab_size, self.never_output_ids)
        if max_cache_tokens is None:
            max_cache_tokens = max_batch * (min(model.config.max_position_embeddings, 4096) + window)
        self.cache = model.new_cache(-(-max_cache_tokens // page_size), page_size)
        self.rng = torch.Generator()
        if seed is None:
            self.rng.seed()
        else:
            self.rng.manual_seed(seed)
        self.graphs = StepGraphs(self._step) if cuda_graph else None
        # Set to a list to record, per eager streaming/block-wise step, the state as fed,
        # the mask rows' positions and their logits (for tests and debugging).
        self.trace: list[dict] | None = None
        self._owner_ids: list[int | None] = []
        self._mode = "streaming"  # of the current generate call
        self._widths: dict[str, int] = {}  # state widths S, T, K, P, ... of the current call
        self._rules: dict[str, bool] = {}  # the logit rules the current call uses
        self._grammars = False  # whether a request of the current call has a grammar
        self._logprobs = False  # whether a request of the current call asks for logprobs
        self._sampling = "any"  # select_tokens' sampling mode for the current call
        self._device = model.device
        self._holding: list[_Request] = []  # admitted requests whose pages are not freed yet

    # ---------------------------------------------------------------- public entry point

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        mode: str = "streaming",
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[Result]:
        """Decode every prompt; returns one :class:`Result` per prompt, in order.

        ``prompts``: token-id lists, or strings when the Generator has a tokenizer (a
        single prompt may be passed alone). ``params``: one :class:`SamplingParams` for
        all, or one per prompt. ``mode``: "streaming" (WeDLM streaming parallel decoding),
        "blockwise" (the stop-and-wait block baseline) or "ar" (one token per forward).
        ``on_tokens(request_index, new_token_ids)`` is called as tokens are committed
        (at the host's polls, so in bursts of up to ``poll_every`` steps).
        """
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "ar" and self.mask_token_id is None:
            raise ValueError(
                f"mode {mode!r} needs a mask token id, and config.json has no mask_token_id: "
                "pass Generator(..., mask_token_id=ID) (CLI: --mask-token-id ID)"
            )
        vocab = self.model.config.vocab_size
        if mode != "ar" and not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {vocab})")
        prompts = self._prompt_list(prompts)
        if self.auto_window:
            self.window = auto_window(max(1, min(len(prompts), self.max_batch)))
        requests = self._requests(prompts, params, mode)
        if not requests:
            return []
        self._mode = mode
        self._rules = self._rules_of(requests)
        # (host facts, once per call: the step passes the mode without reading a tensor)
        self._sampling = sampling_mode((r.params for r in requests),
                                       self.model.lm_head.shape[0])
        self._grammars = any(r.grammar is not None for r in requests)
        self._adaptive = mode == "streaming" and any(self._adapts(r) for r in requests)
        self._policy = wk.AdaptiveWindow.for_device(self.window, self.max_batch,
                                                    self._device, min_window=self.min_window)
        self._logprobs = any(num_logprobs(r.params) is not None for r in requests)
        self._widths = self._batch_widths(requests)
        if self.model.ensure_positions(max(self._positions(r) for r in requests) + 1):
            if self.graphs is not None:
                self.graphs.clear()
        results: list[Result | None] = [None] * len(requests)
        self._decode(deque(requests), results, on_tokens)
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------- request handling

    @staticmethod
    def _prompt_list(prompts) -> list[Prompt]:
        """A single prompt (a string, a list of token ids, or a 1-D integer tensor or numpy
        array) as a list of one."""
        if _is_array(prompts) and prompts.ndim == 1:
            return [prompts]
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0
            and all(is_integer(t) for t in prompts)
        ):
            prompts = [prompts]
        if isinstance(prompts, (dict, set)) or not isinstance(prompts, Iterable):
            raise TypeError("prompts must be a prompt (text or token ids) or a list of them, "
                            f"got {type(prompts).__name__}")
        return list(prompts)

    def _prompt_ids(self, index: int, prompt) -> list[int]:
        """Token ids of one prompt: text through the tokenizer, or integer ids (a list, a
        tuple, a 1-D integer tensor or numpy array)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (Generator(tokenizer=...))")
            return self.tokenizer.encode(prompt)
        if _is_array(prompt):
            if prompt.ndim != 1 or not _integer_dtype(prompt):
                raise TypeError(f"prompt {index}: a tensor or array prompt must be 1-D of an "
                                f"integer dtype, got shape {list(prompt.shape)} and dtype "
                                f"{prompt.dtype}")
            return [int(t) for t in prompt.tolist()]
        if not isinstance(prompt, Sequence) or not all(is_integer(t) for t in prompt):
            raise TypeError(f"prompt {index}: must be text or a sequence of int token ids, got "
                            f"{prompt!r:.80}")
        return [int(t) for t in prompt]

    def _requests(self, prompts: list[Prompt], params, mode: str) -> list[_Request]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif isinstance(params, (dict, str)) or not isinstance(params, Sequence) or not all(
                isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be a SamplingParams, a list of them (one per prompt) "
                            f"or None, got {params!r:.80}")
        # checked again: a SamplingParams may have been changed since it was made
        params = [replace(p) for p in params]
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        vocab = self.model.config.vocab_size
        # every request is checked before any state changes (seeds drawn, pages taken)
        checked = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            ids = self._prompt_ids(index, prompt)
            rp.stop_token_ids(p.stop_token_ids, f"prompt {index}: stop_token_ids", vocab,
                              self.model.config.eos_token_ids)
            rp.logit_bias(p.logit_bias, f"prompt {index}: logit_bias", vocab)
            rp.allowed_token_ids(p.allowed_token_ids, f"prompt {index}: allowed_token_ids",
                                 vocab)
            logprobs = p.logprobs
            p.logprobs = rp.logprobs(p.logprobs, f"prompt {index}: logprobs", vocab)
            p.logprob_token_ids = rp.logprob_token_ids(
                p.logprob_token_ids, f"prompt {index}: logprob_token_ids", vocab, logprobs)
            rp.bad_words_token_ids(p.bad_words_token_ids,
                                   f"prompt {index}: bad_words_token_ids", vocab)
            if p.bad_words_token_ids and p.grammar is not None:
                raise rp.ParameterError(
                    f"prompt {index}: bad_words_token_ids cannot be combined with a grammar "
                    "(a grammar may force a token a bad word bans)",
                    f"prompt {index}: bad_words_token_ids")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {index}: token ids {bad[:5]} outside [0, {vocab})")
            if mode == "ar" and not ids:
                raise ValueError(f"prompt {index}: AR decoding needs a non-empty prompt")
            max_positions = self.model.config.max_position_embeddings
            max_new = p.max_new_tokens
            if max_new is None:
                max_new = max_positions - len(ids)
                if max_new < 1:
                    raise ValueError(
                        f"prompt {index}: {len(ids)} prompt tokens leave no room for new tokens "
                        f"in the model's max_position_embeddings ({max_positions})")
            if len(ids) + max_new > max_positions:
                raise ValueError(
                    f"prompt {index}: {len(ids)} prompt tokens + max_new_tokens "
                    f"{max_new} exceed the model's max_position_embeddings "
                    f"({max_positions}); positions past it were never trained"
                )
            request = _Request(index, ids, p, 0, max_new)
            self.cache.check_fits(self._positions(request), f"prompt {index}")
            checked.append(request)
        for request in checked:
            seed = request.params.seed
            if seed is None:
                seed = int(torch.randint(-2**63, 2**63 - 1, (1,), generator=self.rng))
            request.seed = seed  # an int64 (SamplingParams checks a given one)
            if request.params.grammar is not None:
                request.grammar = request.params.grammar()
        return checked

    def _positions(self, request: _Request) -> int:
        """Cache positions reserved for a request at admission: prompt + max_new + window
        (the window never reaches past prompt + max_new; the extra window is a margin)."""
        return len(request.prompt) + request.max_new + self.window

    def _batch_widths(self, requests: list[_Request]) -> dict[str, int]:
        vocab = self.model.config.vocab_size
        rules = self._rules
        return {
            "S": 2 * self.window,
            "T": max([r.max_new for r in requests] + [1]),
            "K": max([len(r.params.stop_token_ids) for r in requests] + [1]),
            "P": max([self.cache.pages_for(self._positions(r)) for r in requests] + [1]),
            # the logit rules' widths: 0 when no request of the call uses the rule
            "Kb": max(len(r.params.logit_bias or ()) for r in requests),
            "Vc": vocab if rules["penalties"] else 0,
            "Wa": rp.bitmask_words(vocab) if rules["allowed"] else 0,
            # bad words: the most words and the longest word of a request (0: none)
            "Nb": max(len(r.params.bad_words_token_ids or ()) for r in requests),
            "Lb": max((len(w) for r in requests for w in r.params.bad_words_token_ids or ()),
                      default=0),
            # logprob records: the most entries a request lists besides its token (-1 when
            # no request of the call asks for logprobs), the most top alternatives of a
            # request that names no tokens, the most tokens a request names
            "Kl": max((n for n in map(num_logprobs, (r.params for r in requests))
                       if n is not None), default=-1),
            "Kt": max((r.params.logprobs for r in requests if r.params.logprobs is not None
                       and not r.params.logprob_token_ids), default=0),
            "Cl": max(len(r.params.logprob_token_ids or ()) for r in requests),
        }

    @staticmethod
    def _rules_of(requests: list[_Request]) -> dict[str, bool]:
        """Which logit rules some request of a generate call uses (host facts: a rule no
        request uses is not run, and its state has width 0)."""
        used = [rp.logit_rules_used(r.params) for r in requests]
        return {rule: any(u[rule] for u in used) for rule in rp.LOGIT_RULES}

    def _result(self, request: _Request, tokens: list[int], forwards: int, rows: int,
                logprobs: list[dict[int, Logprob]] | None = None) -> Result:
        stops = set(request.params.stop_token_ids)
        reason = "stop" if tokens and tokens[-1] in stops else "length"
        if request.error is not None:
            reason = "error"
        return Result(
            token_ids=tokens,
            finish_reason=reason,
            forwards=forwards,
            rows=rows,
            tokens_per_forward=len(tokens) / forwards if forwards else 0.0,
            p_cache=len(tokens) / rows if rows else 0.0,
            seed=request.seed,
            text=self.tokenizer.decode(tokens) if self.tokenizer is not None else None,
            logprobs=logprobs,
            error=request.error,
        )

    # ---------------------------------------------------------------- the host loop

    def _decode(self, pending: deque, results: list, on_tokens) -> None:
        state: BatchState | None = None
        owners: list[_Request | None] = []  # request of each batch row (None: padding)
        emitted: dict[int, int] = {}  # tokens already passed to on_tokens, per request
        try:
            while pending or owners:
                live = sum(r is not None for r in owners)
                admitted = []
                while (pending and live + len(admitted) < self.max_batch
                       and self.cache.can_allocate(self._positions(pending[0]))):
                    request = pending.popleft()
                    request.pages = self.cache.allocate(self._positions(request))
                    admitted.append(request)
                    self._holding.append(request)
                if admitted:
                    if live < len(owners):  # drop a graph bucket's padding rows first
                        state, owners = self._compact(state, owners, range(len(owners)))
                    state = concat(state, self._admit(admitted))
                    owners = owners + admitted
                if not owners:
                    raise RuntimeError("no request could be admitted into an empty KV cache")
                state, owners = self._run(state, owners)
                state, owners = self._poll(state, owners, results, emitted, on_tokens)
        finally:  # after an error, give back the pages of the requests still running
            for request in self._holding:
                self.cache.free(request.pages)
            self._holding = []

    @staticmethod
    def _compact(state, owners, rows) -> tuple[BatchState | None, list]:
        """Keep the batch rows ``rows`` that hold a request."""
        keep = [i for i in rows if owners[i] is not None]
        return (state.take(keep) if keep else None), [owners[i] for i in keep]

    def _run(self, state: BatchState, owners: list) -> tuple[BatchState, list]:
        """``poll_every`` decode steps. A window step reads one number back, its live-row
        count (see :meth:`_rows_for_step`); nothing else synchronises with the host."""
        if self.graphs is None or self._grammars:
            self._owner_ids = [r.index for r in owners]
            for _ in range(self.poll_every):
                rows = self._rows_for_step(state)
                if self._grammars:  # (only then: a plain call's _step takes no grammar)
                    self._step(state, num_rows=rows, grammar=self._plan_grammar(state, owners))
                else:
                    self._step(state, num_rows=rows)
            return state, owners
        size = bucket_size(len(owners), self.max_batch)
        padded = state.padded(size, self.mask_token_id or 0)
        owners = owners + [None] * (size - len(owners))
        # a graph replays the Python branches it was captured with: the sampling mode, the
        # rules (min_p and min_tokens change no state shape) and the window policy are part
        # of its key
        variant = (self._sampling, tuple(sorted(self._rules.items())), self._adaptive,
                   self._policy)
        return self.graphs.run(padded, self.poll_every, self._mode, self._rows_for_step,
                               variant), owners

    def _plan_grammar(self, state: BatchState, owners: list) -> GrammarStep | None:
        """Walk each structured request's window with its grammar before a step
        (wedlm_kernels.requests.grammar): its grammar first accepts the tokens committed since the
        last walk. Reads the batch's window and outputs back (one transfer a step: a grammar
        runs on the host). A request whose grammar allows no token after its committed ones
        (its first slot a dead end) ends here, before the step, with finish_reason "error"."""
        constrained = [i for i, r in enumerate(owners)
                       if r is not None and r.grammar is not None]
        if not constrained:
            return None
        slots = state.win_tokens.shape[1]
        host = torch.cat([
            state.out_len[:, None].long(), state.win_len[:, None].long(),
            state.finished[:, None].long(), torch.where(state.win_mask, -1, state.win_tokens),
            state.out_tokens.long()], dim=1).cpu().numpy()
        ar = self._mode == "ar"
        rows_each = 1 if ar else slots
        words = rp.bitmask_words(self.model.config.vocab_size)
        bitmask = torch.full((len(constrained) * rows_each, words), -1, dtype=torch.int32)
        batch = len(owners)
        windows: list[list[int] | None] = [None] * batch
        plans: list[Any] = [None] * batch
        first_rows = [0] * batch
        stuck: list[int] = []
        for order, i in enumerate(constrained):
            request = owners[i]
            out_len, win_len, finished = (int(v) for v in host[i, :3])
            new = host[i, 3 + slots + request.accepted: 3 + slots + out_len].tolist()
            if new and not request.grammar.accept_tokens(str(request.index), new):
                raise RuntimeError(f"request {request.index}: its grammar rejected the "
                                   f"committed tokens {new}")  # the rule makes this a bug
            request.accepted = out_len
            if finished:
                continue
            windows[i] = [-1] if ar else host[i, 3: 3 + min(win_len, slots)].tolist()
            first_rows[i] = order * rows_each
            plans[i] = plan_window(request.grammar, windows[i], bitmask, first_rows[i],
                                   str(request.index), self._output_mask)
            if plans[i].stuck:
                request.error = (
                    f"SamplingParams.grammar: request {request.index}'s grammar allows no "
                    f"token after its {out_len} output tokens and has not ended, so it "
                    "cannot go on")
                stuck.append(i)
                windows[i] = plans[i] = None
        if stuck:  # ended: no row of theirs is decided, no forward counts them
            index = torch.tensor(stuck, dtype=torch.int64, device=self._device)
            state.finished.index_fill_(0, index, True)
            state.win_len.index_fill_(0, index, 0)
        # logit rows: AR one per sequence; a window step W per sequence, its masks in order
        base = list(range(batch)) if ar else [i * self.window for i in range(batch)]
        return GrammarStep.build(windows, plans, first_rows, base, bitmask.numpy(),
                                 self._device, drafts=self.grammar_drafts and not ar)

    def _rows_for_step(self, state: BatchState) -> int | None:
        """The packed rows of the next window step: its live-row count, the one value a step
        reads back (a host round trip; the step then feeds only the live rows instead of
        ``B * 2W``), with CUDA graphs the smallest row bucket that holds it
        (:func:`row_bucket`); or, without a readback (``row_readback``), all ``B * 2W``
        rows, which hold every live row. AR steps feed one row per sequence: None."""
        if self._mode == "ar":
            return None
        most = state.size * state.win_tokens.shape[1]
        if self.row_readback == "never" or (self.row_readback == "auto"
                                            and self.graphs is not None
                                            and most <= MEMORY_BOUND_ROWS):
            return most
        live_rows = int(state.win_len.clamp(0, state.win_tokens.shape[1]).sum())
        if self.graphs is None:
            return live_rows
        return row_bucket(live_rows, state.size * state.win_tokens.shape[1])

    def _poll(self, state, owners, results, emitted, on_tokens):
        """Hand back finished requests, free their pages, compact the batch."""
        # one transfer: finished flags and forward counters
        finished, forwards = torch.stack([state.finished.long(), state.forwards]).tolist()
        for i, request in enumerate(owners):
            # Each of the max_new positions is filled at most once and committed at most
            # once, and every forward fills a mask (the selection always picks a valid mask
            # row) or, with no mask left in the window, commits; so a correct step finishes
            # a request within 2 * max_new forwards (docs/contracts.md). Past that (with a
            # margin of 2) the step makes no progress and would loop forever.
            if request is not None and not finished[i] and forwards[i] > 2 * request.max_new + 2:
                raise RuntimeError(
                    f"request {request.index} is unfinished after {forwards[i]} decode forwards "
                    f"for max_new_tokens={request.max_new}: the decode step makes no progress"
                )
        done = [i for i, r in enumerate(owners) if r is not None and finished[i]]
        if on_tokens is not None or done:
            out_len = state.out_len.tolist()
            out_tokens = state.out_tokens.tolist()
            rows = state.rows.tolist()
        if on_tokens is not None:
            for i, request in enumerate(owners):
                if request is None:
                    continue
                start = emitted.get(request.index, 0)
                if out_len[i] > start:
                    on_tokens(request.index, out_tokens[i][start:out_len[i]])
                    emitted[request.index] = out_len[i]
        for i in done:
            request = owners[i]
            tokens = out_tokens[i][: out_len[i]]
            results[request.index] = self._result(request, tokens, forwards[i], rows[i],
                                                  self._logprobs_of(state, i, request))
            self.cache.free(request.pages)
            self._holding.remove(request)
        if not done:
            return state, owners
        return self._compact(state, owners, [i for i in range(len(owners)) if not finished[i]])

    @staticmethod
    def _logprobs_of(state: BatchState, row: int, request: _Request
                     ) -> list[dict[int, Logprob]] | None:
        """A finished request's logprobs: the records its committed places hold."""
        count = num_logprobs(request.params)
        if count is None:
            return None
        length = int(state.out_len[row])
        ids = state.logprob_ids[row, :length].tolist()
        values = state.logprob_values[row, :length].tolist()
        ranks = state.logprob_ranks[row, :length].tolist()
        return [position_logprobs(i, v, r, count) for i, v, r in zip(ids, values, ranks)]

    # ---------------------------------------------------------------- admission

    def _adapts(self, request: _Request) -> bool:
        """Whether the adaptive window sizes this request's window (streaming requests
        without a grammar, by their window_policy or the Generator's)."""
        policy = request.params.window_policy or self.window_policy
        return policy == "adaptive" and request.params.grammar is None

    def _admit(self, requests: list[_Request]) -> BatchState:
        """Batch state of newly admitted requests, with their prompts prefilled."""
        device, w = self._device, self._widths
        count = len(requests)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        def padded_rows(rows: list[list[int]], width: int, fill: int) -> list[list[int]]:
            return [row + [fill] * (width - len(row)) for row in rows]

        prompt_len = tensor([len(r.prompt) for r in requests], torch.int32)
        max_new = [r.max_new for r in requests]
        block_table = tensor(padded_rows([r.pages for r in requests], w["P"], -1), torch.int32)
        stop_ids = tensor(
            padded_rows([list(r.params.stop_token_ids) for r in requests], w["K"], -1),
            torch.int64,
        )
        ar = self._mode == "ar"
        window_state = wk.new_window_state(
            prompt_len, max_new, 0 if ar else self.window, self.mask_token_id or 0,
            stop_ids=stop_ids, max_output=w["T"], slots=w["S"], device=device)
        state = BatchState(
            **vars(window_state),
            block_table=block_table,
            temperature=tensor([float(r.params.temperature) for r in requests], torch.float32),
            top_k=tensor([r.params.top_k for r in requests], torch.int32),
            top_p=tensor([float(r.params.top_p) for r in requests], torch.float32),
            threshold=tensor([r.params.threshold for r in requests], torch.float32),
            penalty=tensor([float(r.params.penalty) for r in requests], torch.float32),
            seed=tensor([r.seed for r in requests], torch.int64),
            forwards=torch.zeros(count, dtype=torch.int64, device=device),
            rows=torch.zeros(count, dtype=torch.int64, device=device),
            adaptive=tensor([self._adaptive and self._adapts(r) for r in requests], torch.bool),
            **vars(wk.new_policy_state(count, self._policy, device)),
            **self._admit_rules(requests),
            **self._admit_logprobs(requests),
            **self._admit_bad_words(requests),
        )
        if not any(r.prompt for r in requests):
            return state
        last_hidden = self.model.prefill([r.prompt for r in requests], block_table, self.cache)
        if ar:
            # The one prefill that computes logits: the last prompt row predicts position L.
            grammar = self._plan_grammar(state, requests) if self._grammars else None
            # (a request its grammar's walk ended has finished)
            self._ar_commit(state, self.model.logits(last_hidden), ~state.finished, grammar)
        return state

    def _admit_logprobs(self, requests: list[_Request]) -> dict[str, torch.Tensor]:
        """Empty logprob records of newly admitted requests: one place per output index,
        and a spare (wedlm_kernels.requests.logprobs); no place when the call asks for none. And
        the tokens each request names (its logprob_token_ids, -1 padded)."""
        count, width, named = len(requests), self._widths["Kl"], self._widths["Cl"]
        chosen = torch.tensor(
            [list(r.params.logprob_token_ids or ()) + [-1] * (named - len(
                r.params.logprob_token_ids or ())) for r in requests],
            dtype=torch.int64, device=self._device).view(count, named)
        if width < 0:
            store = Records(torch.zeros((count, 0, 0), dtype=torch.int64, device=self._device),
                            torch.zeros((count, 0, 0), device=self._device),
                            torch.zeros((count, 0), dtype=torch.int64, device=self._device))
        else:
            store = empty_store(count, self._widths["T"], width, self._device)
        return dict(logprob_ids=store.token_ids, logprob_values=store.logprobs,
                    logprob_ranks=store.ranks, logprob_chosen=chosen)

    def _admit_bad_words(self, requests: list[_Request]) -> dict[str, torch.Tensor]:
        words = bad_words.pack([[list(w) for w in r.params.bad_words_token_ids or ()]
                                for r in requests], self._device, self._widths["Nb"],
                               self._widths["Lb"])
        if not self._widths["Nb"]:  # no request of the call has bad words: no width
            words = bad_words.BadWords(words.tokens[:, :0, :0], words.lengths[:, :0])
        return dict(bad_tokens=words.tokens, bad_lengths=words.lengths)

    def _bad_word_state(self, s: BatchState):
        """``(words, known, first)`` for wedlm_kernels.requests.bad_words: the window as fed, after
        the committed tail the longest word needs (-1 at prompt positions)."""
        tail_len = max(self._widths["Lb"] - 1, 0)
        index = s.out_len.long()[:, None] - tail_len + torch.arange(tail_len,
                                                                    device=self._device)
        tail = torch.where(index >= 0, s.out_tokens.gather(
            1, index.clamp(0, s.out_tokens.shape[1] - 1)), -1)
        known, first = bad_words.known_tokens(s.win_tokens, s.win_mask, s.win_len,
                                              s.ctx_len, tail)
        return bad_words.BadWords(s.bad_tokens, s.bad_lengths), known, first

    def _logprob_source(self, logits: torch.Tensor, grammar: GrammarStep | None
                        ) -> torch.Tensor | None:
        """The logits a raw logprobs mode reads, taken before the logit rules change them
        in place (a copy only when a rule or a grammar's restore may); None otherwise."""
        if not self._logprobs or self.logprobs_mode.startswith("processed"):
            return None
        return logits.clone() if any(self._rules.values()) or grammar is not None else logits

    def _keep_logprobs(self, s: BatchState, raw: torch.Tensor | None, logits: torch.Tensor,
                       cu_rows: torch.Tensor, row_pos: torch.Tensor, sequence: torch.Tensor,
                       token: torch.Tensor, filled: torch.Tensor) -> None:
        """Keep the records of the rows that fill a slot at the slot's output index
        (``sequence``: each row's batch row)."""
        if not self._logprobs:
            return
        records = row_records(raw if raw is not None else logits, token, self._widths["Kt"],
                              self.logprobs_mode, cu_rows, s.temperature, s.top_k, s.top_p,
                              chosen_ids=s.logprob_chosen if self._widths["Cl"] else None)
        place = row_pos - s.output_start.long()[sequence]
        keep_filled(Records(s.logprob_ids, s.logprob_values, s.logprob_ranks), records,
                    sequence, place, filled)

    def _admit_rules(self, requests: list[_Request]) -> dict[str, torch.Tensor]:
        """The logit rules' state of newly admitted requests (BatchState's fields)."""
        device, w = self._device, self._widths
        count, vocab = len(requests), self.model.config.vocab_size
        params = [r.params for r in requests]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        bias = [sorted((p.logit_bias or {}).items()) for p in params]
        bias_ids = [[t for t, _ in b] + [-1] * (w["Kb"] - len(b)) for b in bias]
        bias_values = [[v for _, v in b] + [0.0] * (w["Kb"] - len(b)) for b in bias]
        prompt_mask = torch.zeros((count, w["Vc"]), dtype=torch.bool, device=device)
        if w["Vc"]:
            rows = [i for i, r in enumerate(requests) for _ in r.prompt]
            ids = [t for r in requests for t in r.prompt]
            prompt_mask[tensor(rows, torch.int64), tensor(ids, torch.int64)] = True
        allowed = torch.full((count, w["Wa"]), -1, dtype=torch.int32, device=device)
        for i, p in enumerate(params):
            if w["Wa"] and p.allowed_token_ids is not None:
                allowed[i] = tensor(rp.allowed_bitmask(p.allowed_token_ids, vocab),
                                    torch.int32)
        return dict(
            output_start=tensor([len(r.prompt) for r in requests], torch.int32),
            presence_penalty=tensor([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=tensor([p.frequency_penalty for p in params], torch.float32),
            repetition_penalty=tensor([p.repetition_penalty for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            min_tokens=tensor([p.min_tokens for p in params], torch.int32),
            bias_ids=tensor(bias_ids, torch.int64).view(count, w["Kb"]),
            bias_values=tensor(bias_values, torch.float32).view(count, w["Kb"]),
            output_counts=torch.zeros((count, w["Vc"]), dtype=torch.int32, device=device),
            prompt_mask=prompt_mask,
            allowed_mask=allowed,
        )

    # ---------------------------------------------------------------- one decode step

    def _apply_rules(self, s: BatchState, logits: torch.Tensor, cu_rows: torch.Tensor,
                     row_pos: torch.Tensor) -> None:
        """The requests' logit rules on this step's logit rows, in place (only the rules
        some request of the call uses)."""
        rules = self._rules
        if not any(rules.values()):
            return
        penalties = rules["penalties"]
        wk.process_logits(
            logits, cu_rows, row_pos, s.output_start, s.temperature,
            min_p=s.min_p if rules["min_p"] else None,
            min_tokens=s.min_tokens if rules["min_tokens"] else None,
            stop_ids=s.stop_ids if rules["min_tokens"] else None,
            bias_ids=s.bias_ids if rules["bias"] else None,
            bias_values=s.bias_values if rules["bias"] else None,
            output_counts=s.output_counts if penalties else None,
            prompt_mask=s.prompt_mask if penalties else None,
            presence_penalty=s.presence_penalty if penalties else None,
            frequency_penalty=s.frequency_penalty if penalties else None,
            repetition_penalty=s.repetition_penalty if penalties else None,
            allowed_mask=s.allowed_mask if rules["allowed"] else None,
        )

    def _count_outputs(self, s: BatchState, out_len_before: torch.Tensor, most: int) -> None:
        """Add the tokens a step committed (at most ``most`` per sequence, after
        ``out_len_before``) to the output counts the penalties read."""
        if not self._rules["penalties"]:
            return
        index = out_len_before.long()[:, None] + torch.arange(most, device=self._device)
        committed = index < s.out_len.long()[:, None]
        tokens = s.out_tokens.gather(1, index.clamp(max=s.out_tokens.shape[1] - 1))
        s.output_counts.scatter_add_(1, torch.where(committed, tokens, 0),
                                     committed.to(torch.int32))

    def _ban_never_output(self, logits: torch.Tensor) -> torch.Tensor:
        """``-inf`` at the ids no request outputs, in every row, in place, before anything
        reads the logits (a grammar's mask, the logprobs, the rules, the entropy, the
        selection; docs/requests.md, "Ids never output"). Returns ``logits``."""
        if self._never_output.numel():
            logits.index_fill_(1, self._never_output, -math.inf)
        return logits

    def _step(self, state: BatchState, mode: str | None = None,
              num_rows: int | None = None, grammar: GrammarStep | None = None) -> None:
        """One decode step of the whole batch, in place, without host synchronisation;
        ``num_rows``: the packed rows of a window step (at least its live rows);
        ``grammar``: the structured requests' walks (:meth:`_plan_grammar`)."""
        mode = mode or self._mode
        if mode == "ar":
            self._ar_step(state, grammar)
        else:
            self._window_step(state, blockwise=mode == "blockwise", num_rows=num_rows,
                              grammar=grammar)

    def _window_step(self, s: BatchState, blockwise: bool, num_rows: int,
                     grammar: GrammarStep | None = None) -> None:
        model, window = self.model, self.window
        batch = s.size
        if num_rows == 0:  # every window is empty: no sequence is live
            return
        input_ids, positions, slot_mapping, _, query_start, n_filled = wk.reorder_window(
            s.win_tokens, s.win_mask, s.win_len, s.ctx_len, s.block_table, self.page_size,
            num_rows,
        )
        hidden = model.forward(
            input_ids, positions, slot_mapping, s.block_table, query_start, s.ctx_len,
            self.cache,
        )
        # each sequence's mask rows (at most W), gathered into W fixed rows per sequence;
        # a mask row predicts its logical position, the rest are padding (row_pos = -1)
        mask_row, cu_rows, row_pos = wk.mask_rows(query_start, n_filled, positions, window)
        logits = self._ban_never_output(model.logits(hidden.index_select(0, mask_row)))
        if grammar is not None:
            row_pos = grammar.mask_logits(logits, row_pos)
        raw = self._logprob_source(logits, grammar)
        row_sequence = torch.arange(batch * window, device=self._device) // window
        if self._widths["Nb"]:  # bad words: ban what would complete one
            words, known, first = self._bad_word_state(s)
            bad_words.ban_bad_words(logits, words, row_sequence, row_pos, known, first)
        self._apply_rules(s, logits, cu_rows, row_pos)
        if grammar is not None:
            grammar.restore_dead_rows(logits)
        token, selected, _ = wk.select_tokens(
            logits, cu_rows, row_pos, s.temperature, s.top_k, s.top_p, s.threshold,
            s.penalty, s.seed, sampling=self._sampling,
        )
        if grammar is not None:
            grammar.settle(selected)
            grammar.remask(s.win_tokens, s.win_mask, self.mask_token_id)
        if self._widths["Nb"]:  # ... and leave unfilled what completes one with this step
            selected = bad_words.unfill_bad_words(selected, token, words, row_sequence,
                                                  row_pos, known, first)
        self._keep_logprobs(s, raw, logits, cu_rows, row_pos, row_sequence, token,
                            selected & (row_pos >= 0))
        if self.trace is not None and self.graphs is None:
            self.trace.append(self._snapshot(s, row_pos, logits))
        live = (s.win_len > 0) & ~s.finished
        s.forwards += live
        s.rows += torch.where(live, s.win_len, 0)
        out_len_before = s.out_len.clone()
        if grammar is not None:  # a window whose fed run a rejected slot cut keeps W slots
            s.win_len.copy_(grammar.cut_windows(s.win_len, window))
        adapt = self._adaptive and not blockwise
        fed = torch.where(live, wk.window_masks(s.win_mask, s.win_len), 0) if adapt else None
        wk.commit_window(
            s.win_tokens, s.win_mask, s.win_len, s.ctx_len, cu_rows, row_pos, token, selected,
            s.out_tokens, s.out_len, s.finished, s.stop_ids, s.max_new, window,
            self.mask_token_id, blockwise, None if grammar is None else grammar.commit_limit,
        )
        if adapt:  # the next step's window lengths
            policy_state = wk.WindowPolicyState(s.commit_rate, s.one_slot_steps)
            decided = (selected & (row_pos >= 0)).view(batch, window).sum(dim=1)
            length = wk.next_window_lengths(fed, decided, policy_state, self._policy)
            wk.resize_windows(s.win_tokens, s.win_mask, s.win_len, length, s.out_len,
                              s.max_new, s.finished, self.mask_token_id or 0,
                              max_output=s.out_tokens.shape[1], enabled=s.adaptive)
        self._count_outputs(s, out_len_before, s.win_tokens.shape[1])

    def _snapshot(self, s: BatchState, row_pos: torch.Tensor, logits: torch.Tensor) -> dict:
        """Copies of what a step was fed and computed (no host synchronisation)."""
        record = {name: t.clone() for name, t in s.tensors().items()}
        record.update(request=list(self._owner_ids), row_pos=row_pos.clone(),
                      logits=logits.detach().clone())
        return record

    def _ar_step(self, s: BatchState, grammar: GrammarStep | None = None) -> None:
        """Feed each sequence's last token (position ``L - 1``), one packed row each; its
        logits predict position ``L``. Finished sequences feed a row that writes no K/V and
        whose logits are ignored (the host drops them at the next poll)."""
        live = ~s.finished
        last_position = (s.ctx_len.long() - 1).clamp(min=0)  # [B]
        last_index = (s.out_len.long() - 1).clamp(min=0)[:, None]
        last_token = s.out_tokens.gather(1, last_index)[:, 0]
        slot_mapping = wk.paged_slots(s.block_table, last_position[:, None], self.page_size,
                                      live[:, None])[:, 0]
        query_start = torch.arange(s.size + 1, dtype=torch.int32, device=self._device)
        hidden = self.model.forward(
            last_token, last_position, slot_mapping, s.block_table, query_start,
            last_position.to(torch.int32), self.cache,
        )
        self._ar_commit(s, self.model.logits(hidden), live, grammar)

    def _ar_commit(self, s: BatchState, logits: torch.Tensor, live: torch.Tensor,
                   grammar: GrammarStep | None = None) -> None:
        """Sample position ``L`` like a select_tokens row (threshold -inf) and append it
        under the stop and length rules."""
        batch = s.size
        logits = self._ban_never_output(logits)
        row_pos = torch.where(live, s.ctx_len.long(), -1)
        cu_rows = torch.arange(batch + 1, dtype=torch.int32, device=self._device)
        if grammar is not None:
            grammar.mask_logits(logits, row_pos)
        raw = self._logprob_source(logits, grammar)
        row_sequence = torch.arange(batch, device=self._device)  # one row per sequence
        if self._widths["Nb"]:  # (every other place of a word is committed: the ban suffices)
            words, known, first = self._bad_word_state(s)
            bad_words.ban_bad_words(logits, words, row_sequence, row_pos, known, first)
        self._apply_rules(s, logits, cu_rows, row_pos)
        if grammar is not None:
            grammar.restore_dead_rows(logits)
        token, _, _ = wk.select_tokens(
            logits, cu_rows, row_pos, s.temperature, s.top_k, s.top_p,
            torch.full_like(s.threshold, -math.inf), s.penalty, s.seed,
            sampling=self._sampling,
        )
        self._keep_logprobs(s, raw, logits, cu_rows, row_pos, row_sequence, token,
                            live & (row_pos >= 0))
        out_len_before = s.out_len.clone()
        index = s.out_len.long().clamp(max=s.out_tokens.shape[1] - 1)[:, None]
        current = s.out_tokens.gather(1, index)
        s.out_tokens.scatter_(1, index, torch.where(live[:, None], token[:, None], current))
        step = live.to(torch.int32)
        s.out_len += step
        s.ctx_len += step
        s.forwards += step
        s.rows += step
        is_stop = (s.stop_ids == token[:, None]).any(dim=1)
        s.finished |= live & (is_stop | (s.out_len >= s.max_new))
        self._count_outputs(s, out_len_before, 1)
