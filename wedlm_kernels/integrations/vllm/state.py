"""WeDLM's decode loop on vLLM's Model Runner V2: the ModelState and the sampler.

vLLM runs a diffusion model through its speculative-decoding data path: once a request's
prompt is prefilled, every step schedules it a canvas of ``C`` query rows (the live
canvas: the ``W + p'`` rows its window holds, reported through ``next_canvas``; the fixed
canvas: ``2W``) at the physical positions ``L .. L + C - 1`` (``L``: its committed tokens,
vLLM's ``num_computed_tokens``), computes their K/V into its paged cache with its own
attention backend, and hands the rows' logits to the model's sampler, which returns the
tokens it commits. A step of WeDLM maps onto that one to one (docs/vllm.md)::

    prepare_inputs:  reorder_window on the request's window state; the canvas rows take its
                     ids and logical RoPE positions (live rows first, padding masks after)
    forward:         vLLM's (K/V of row j at physical position L + j, causal attention)
    sampler:         select_tokens on the mask rows, commit_window; the committed tokens
                     are the sampled tokens (num_sampled), the other rows are "rejected"

so vLLM advances ``num_computed_tokens`` by exactly the committed tokens, whose K/V is the
plain AR K/V of the topological-reordering invariant, and the next step's canvas starts
after them. The window state lives in slot-indexed device buffers (one row per vLLM request
slot, the same addresses every step); ``prepare_inputs`` and the sampler gather and scatter
rows with device index tensors and never read a device value on the host, so vLLM may
capture the forward in CUDA graphs. The host decides only from what it already holds
(``cu_num_logits_np``, the modes and windows it stored when a request arrived).
"""

from typing import Any

import numpy as np
import torch
import vllm
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext
from vllm.v1.worker.gpu.sample.output import SamplerOutput

import wedlm_kernels as wk
from wedlm_kernels.requests import bad_words as bw
from wedlm_kernels.requests import logprobs as lp
from wedlm_kernels.requests import params as rp
from wedlm_kernels.requests.grammar import GrammarStep, WindowPlan
from wedlm_kernels.requests.params import (
    FLOAT32_MAX,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
)

from . import live_canvas, structured
from .scheduler import max_steps_without_commit
from .settings import engine_settings, request_values, stop_ids_of

logger = init_logger(__name__)

# Where the values of every per-slot buffer come from: a request field of
# wedlm_kernels.requests.params, whose check in the frontend bounds the value to the buffer's
# dtype (add_request stages the checked value), or the decode loop itself (values it
# derives from committed tokens, lengths and the engine's settings; the packed storage).
# tests/vllm_plugin/test_vllm_fuzz.py fails on a buffer missing here or out of its bound.
BUFFER_SOURCES = {
    "win_tokens": "loop", "win_mask": "loop", "win_len": "window", "ctx_len": "loop",
    "finished": "loop", "max_new": "max_tokens", "stop_ids": "stop_token_ids",
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
    "threshold": "entropy_threshold", "penalty": "distance_penalty", "seed": "seed",
    "block_window": "window", "request_window": "window", "stalled": "loop", "forwards": "loop", "rows": "loop",
    # the adaptive window (wedlm_kernels.window_policy): whether it sizes the slot's window
    # (its window_policy and mode) and what it remembers
    "adaptive": "loop", "commit_rate": "loop", "one_slot_steps": "loop",
    "row_counts": "loop", "_int64": "loop", "_int32": "loop", "_float32": "loop",
    "_bool": "loop", "_host_int32": "loop", "_host_window": "loop", "_saved": "loop",
    "_window_columns": "loop",
    "_kept_columns": "loop",
    # the logit rules (wk.process_logits); output_counts, prompt_mask and allowed_mask are
    # allocated when the first request that uses them arrives
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "min_p": "min_p", "min_tokens": "min_tokens",
    "output_start": "loop", "bias_ids": "logit_bias", "bias_values": "loop",
    "output_counts": "loop", "prompt_mask": "loop", "allowed_mask": "allowed_token_ids",
    # bad words (wedlm_kernels.requests.bad_words), allocated with the first request that has any:
    # the words, their lengths and each slot's last committed outputs
    "bad_tokens": "bad_words_token_ids", "bad_lengths": "loop", "bad_tail": "loop",
    # (and logprob_store, the logprob records of wedlm_kernels.requests.logprobs, written by the loop
    # alone: token ids of the logits' argsort or of logprob_token_ids, fp32 values, ranks
    # up to the vocabulary); the ids a request names, allocated with the first that does
    "logprob_chosen": "logprob_token_ids",
    # the ids no request outputs (the checkpoint's mask id and tokenizer, read at startup)
    "never_output": "loop",
}
# The host-side flag of a slot per rule group (the sampler passes a group to process_logits
# only when a request of the step uses it).
RULES = rp.LOGIT_RULES
# vLLM's built-in logits processors (bias, penalties, bad words), which WeDLM's rules replace;
# every other processor of vLLM's sampler is a custom one (--logits-processors, or a
# vllm.logits_processors entry point), run on the window's rows
BUILTIN_PROCESSORS = "vllm.v1.worker.gpu.sample."


def _owners(starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The request of each packed row: ``i`` with ``starts[i] <= row < starts[i + 1]``
    (``starts`` [B + 1], cumulative; rows past the end go to the last request)."""
    return torch.searchsorted(starts[1:], rows, right=True).clamp(max=starts.numel() - 2)


def _float_bits(value: float) -> int:
    """A float32's bit pattern as an integer (how the packed int64 rows carry floats)."""
    return int(np.array(value, dtype=np.float32).view(np.int32))


_INT_BOUNDS = {torch.int64: (INT64_MIN, INT64_MAX), torch.int32: (-INT32_MAX - 1, INT32_MAX),
               torch.bool: (0, 1)}


def _stored(name: str, value, dtype: torch.dtype) -> int:
    """``value`` as a packed row carries it in a ``dtype`` column: an integer in the dtype's
    range, or a float32's bit pattern. The frontend's check bounds every value first, so
    this cannot raise for a checked request; if a value past its buffer got here anyway, it
    raises (stopping the engine, as a failed ``fill_`` did) instead of storing a wrapped
    integer or a float saturated to infinity."""
    if dtype == torch.float32:
        if value == value and abs(value) != float("inf") and abs(value) > FLOAT32_MAX:
            raise OverflowError(f"{name} = {value!r} does not fit its float32 buffer")
        return _float_bits(value)
    low, high = _INT_BOUNDS[dtype]
    if not low <= value <= high:
        raise OverflowError(f"{name} = {value!r} does not fit its {dtype} buffer")
    return value


def sampling_mode(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  vocab_size: int) -> str:
    """select_tokens' ``sampling`` argument for a step's requests, from their host-side
    parameters (one entry each): ``"greedy"`` when every request is greedy (temperature
    <= 0), ``"temperature"`` when no sampling request uses top-k (``0 < top_k <
    vocab_size``) or top-p (``top_p < 1``), ``"any"`` otherwise. Each mode agrees with the
    parameters, so the tokens are the ones ``"any"`` gives; a narrower mode lets a kernel
    compiled for it run (``WEDLM_KERNELS_SELECT_KERNEL``)."""
    samples = ~(temperature <= 0)
    if not samples.any():
        return "greedy"
    filtered = samples & (((top_k > 0) & (top_k < vocab_size)) | ~(top_p >= 1))
    return "any" if filtered.any() else "temperature"


class NoProgressError(RuntimeError):
    """A request committed no token for more decode steps than a correct step allows."""


class WeDLMModelState(DefaultModelState):
    """Per-request WeDLM window state and the input rewrite of each decode step.

    Buffers, ``M`` = ``max_num_seqs`` slots, ``S = 2W`` window slots, ``K`` stop ids
    (``num_stop_ids``; where each buffer's values come from: ``BUFFER_SOURCES``):

    ============ ============= ====================================================
    win_tokens   [M, S] int64  window tokens in logical slot order (masks: mask id)
    win_mask     [M, S] bool   True where the slot is still a mask
    win_len      [M] int32     live slots (0: finished)
    ctx_len      [M] int32     committed tokens, prompt included (``L``)
    finished     [M] bool      stopped on the device (stop id or length)
    max_new      [M] int32     tokens the request may still commit
    stop_ids     [M, K] int64  eos and stop_token_ids, -1 padded
    temperature, top_k, top_p, threshold, penalty, seed: [M], select_tokens' per-sequence
    block_window [M] int32     a block-wise request's block size (0: streaming)
    request_window [M] int32   the request's window w (its live slots after a commit)
    stalled      [M] int32     decode steps since the request last committed a token
    forwards     [M] int64     decode forwards the request was live in (model_min's count)
    rows         [M] int64     live window rows it fed
    adaptive     [M] bool      the adaptive window sizes its window (window_policy)
    commit_rate  [M] float32   the adaptive window's estimate of its tokens per forward
    one_slot_steps [M] int32   the adaptive window's one-mask steps in a row
    ============ ============= ====================================================

    Storage: the buffers of one dtype are column ranges of one tensor (``_int64``,
    ``_int32``, ``_float32``, ``_bool``), so a slot's whole state is one packed int64 row
    (float32 values as their bit patterns, booleans as 0/1): the requests a step admits
    are staged on the host and land in one host-to-device copy and four scatters
    (:meth:`apply_staged_writes`, as vLLM's own states stage their writes), and a removed
    request's state is saved as one row, which a preempted request resumes from.
    """

    num_new_sampled_tokens_per_step = 0  # a step commits 0 .. C tokens, all "drafts"
    # vLLM embeds prompt embeddings before prepare_inputs rewrites the canvas ids
    supports_prompt_embeds = False

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        hf_config = self.model_config.hf_config
        self.settings = engine_settings(vllm_config.additional_config)
        self.mask_token_id = int(hf_config.mask_token_id)
        # the ids no request outputs (wedlm_kernels.requests.output_ids, read by the config hook):
        # -inf in every logit row before the request's rules
        self.never_output = torch.tensor(hf_config.wedlm_never_output, dtype=torch.int64,
                                         device=device)
        self.window = self.settings.window
        slots, width = self.max_num_reqs, self.settings.canvas_length
        # The adaptive window's settings (wedlm_kernels.window_policy): W the engine's window,
        # the floor the engine's min_window or the device's row budget over max_num_seqs
        # (the engine's, not a step's batch: a request's windows do not depend on its
        # batch, and equal model_min's Generator(max_batch=max_num_seqs)'s)
        self.window_policy = wk.AdaptiveWindow.for_device(
            self.window, slots, device, min_window=self.settings.min_window)
        self._adaptive = np.zeros(slots, dtype=bool)  # host copy of `adaptive`
        # A request's stop ids: its stop_token_ids (at most MAX_STOP_TOKEN_IDS besides the
        # checkpoint's eos ids, checked in the frontend), the generation config's eos ids
        # vLLM adds to them, and the tokenizer's eos
        # (SamplingParams.update_from_generation_config): never more than this.
        self.num_stop_ids = stops = MAX_STOP_TOKEN_IDS + len(hf_config.wedlm_eos_ids) + 1

        # Live canvas: each step schedules a request its window's rows, counted on the
        # device by the previous step and read on the host with its output (next_canvas,
        # through live_canvas's patch). Asynchronous scheduling plans a step before the
        # previous one's output is back, so it feeds the fixed canvas of 2W rows. (Under
        # pipeline parallelism the plugin's scheduler keeps a request out of the pipeline
        # until its step's output is in, so the live canvas stays exact there.)
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # Pipeline parallelism: every stage feeds the canvas (the first stage its ids, every
        # stage the logical RoPE positions), and only the last one samples, so only the
        # last stage's window moves. It hands each request's window to the other stages
        # through vLLM's own draft-token path: its sampler writes the window into the
        # request's draft-token row (req_states.draft_tokens, a filled slot's token and -1
        # for a mask), which vLLM's pipeline handler broadcasts with the step's sampled
        # tokens and lands in the other stages' rows before the request's next step; they
        # feed from that row (docs/vllm.md, "Pipeline parallelism").
        self.pipeline = vllm_config.parallel_config.pipeline_parallel_size > 1
        self.window_from_drafts = self.pipeline and not get_pp_group().is_last_rank
        self.live_canvas = self.settings.canvas == "live" and not self.async_scheduling
        if self.live_canvas:
            section = vllm_config.additional_config or {}
            chosen = isinstance(section, dict) and "canvas" in (section.get("wedlm") or {})
            try:
                live_canvas.check_version(vllm.__version__)
                live_canvas.install()
            except live_canvas.LiveCanvasError as error:
                if chosen:  # asked for by name: refuse to start
                    raise
                logger.warning("WeDLM: %s. Feeding the fixed canvas of %d rows per request.",
                               error, width)
                self.live_canvas = False
        elif self.settings.canvas == "live":
            logger.info("WeDLM: asynchronous scheduling is on, so each decode step feeds "
                        "the fixed canvas of %d rows per request (docs/vllm.md)", width)
        # Structured outputs: the windows of structured requests reach the scheduler
        # through next_canvas (the same patch, with either canvas), and their grammar rows
        # reach this state's sampler (structured.install); vLLM releases the patches were
        # not written for refuse structured outputs in the request check.
        self._structured = np.zeros(slots, dtype=bool)  # a host fact per slot
        self._grammar: tuple[list[str], np.ndarray] | None = None  # the step's rows
        if live_canvas.is_patched_version(vllm.__version__):
            if not self.live_canvas:
                try:
                    live_canvas.install()
                except live_canvas.LiveCanvasError as error:
                    logger.warning("WeDLM: %s; structured outputs cannot be served", error)
            structured.register(self)

        def buffer(columns, dtype):
            return torch.zeros((slots, columns), dtype=dtype, device=device)

        # Column layout of the packed row: name -> (first column, columns, group).
        self._layout: dict[str, tuple[int, int, torch.dtype]] = {}
        groups = {torch.int64: [("win_tokens", width), ("stop_ids", stops), ("seed", 1),
                                ("forwards", 1), ("rows", 1), ("bias_ids", MAX_LOGIT_BIAS)],
                  # win_len and stalled first: the host reads them back every step
                  torch.int32: [("win_len", 1), ("stalled", 1), ("ctx_len", 1),
                                ("max_new", 1), ("top_k", 1), ("block_window", 1),
                                ("request_window", 1), ("min_tokens", 1), ("output_start", 1),
                                ("one_slot_steps", 1)],
                  torch.float32: [("temperature", 1), ("top_p", 1), ("threshold", 1),
                                  ("penalty", 1), ("presence_penalty", 1),
                                  ("frequency_penalty", 1), ("repetition_penalty", 1),
                                  ("min_p", 1), ("bias_values", MAX_LOGIT_BIAS),
                                  ("commit_rate", 1)],
                  torch.bool: [("win_mask", width), ("finished", 1), ("adaptive", 1)]}
        self._group_span: dict[torch.dtype, tuple[int, int]] = {}
        column = 0
        for dtype, fields in groups.items():
            group_start = column
            storage = buffer(sum(n for _, n in fields), dtype)
            setattr(self, {torch.int64: "_int64", torch.int32: "_int32",
                           torch.float32: "_float32", torch.bool: "_bool"}[dtype], storage)
            for name, count in fields:
                view = storage[:, column - group_start: column - group_start + count]
                setattr(self, name, view if count > 1 else view[:, 0])
                self._layout[name] = (column, count, dtype)
                column += count
            self._group_span[dtype] = (group_start, column)
        self.packed_columns = column
        self.win_tokens.fill_(self.mask_token_id)
        self.win_mask.fill_(True)
        self.finished.fill_(True)
        self.stop_ids.fill_(-1)
        self.top_p.fill_(1.0)
        self.bias_ids.fill_(-1)
        self.repetition_penalty.fill_(1.0)
        # The rules' vocabulary-wide state, [slots, V] and [slots, ceil(V / 32)], allocated
        # when the first request that uses it arrives (a server that never sees a penalty
        # or allowed_token_ids does not hold it): a slot's rows are written at admission.
        self.vocab_size = self.model_config.get_vocab_size()
        self.output_counts: torch.Tensor | None = None  # committed outputs of each token
        self.prompt_mask: torch.Tensor | None = None  # tokens of the prompt
        self.allowed_mask: torch.Tensor | None = None  # allowed_token_ids as a bitmask
        # Host facts: which rule groups each slot's request uses, and the admissions'
        # vocabulary-wide rows staged for apply_staged_writes.
        self._rules = {rule: np.zeros(slots, dtype=bool) for rule in RULES}
        # Host facts: each slot's temperature, top_k and top_p as stored (a free slot's:
        # greedy), from which the sampler picks select_tokens' sampling mode per step.
        self._sampling_params = np.zeros((3, slots), dtype=np.float64)
        self._sampling_params[2] = 1.0
        self._staged_counts: list[tuple[int, list[int], list[int]]] = []  # slot, prompt, out
        self._staged_allowed: list[tuple[int, list[int]]] = []  # slot, bitmask words
        # Logprobs (wedlm_kernels.requests.logprobs): each window slot's record, kept from the step
        # that fills it to the one that commits it, at place (logical position mod the
        # window's capacity), [slots, capacity + 1, 1 + K]; allocated with the first
        # request that asks for logprobs. The alternatives each slot's request asks for
        # (-1: none) is a host fact; a removed request's records are kept for its resume.
        self.logprobs_mode = lp.check_mode(self.model_config.logprobs_mode,
                                           "model_config.logprobs_mode")
        self.logprob_store: lp.Records | None = None
        self._num_logprobs = np.full(slots, -1, dtype=np.int32)
        # logprob_token_ids: each slot's named ids [slots, 128] (-1: padding), allocated
        # with the first request that names some; their count per slot is a host fact
        self.logprob_chosen: torch.Tensor | None = None
        self._num_chosen = np.zeros(slots, dtype=np.int32)
        self._saved_records: dict[str, tuple[int, lp.Records]] = {}  # request -> (K, records)
        # Bad words (wedlm_kernels.requests.bad_words): each slot's words [slots, 128, 16] and their
        # lengths, and the last 15 outputs it committed (the left context a word may need);
        # allocated with the first request that has bad words. Host facts: each slot's
        # number of words and longest word; admissions staged for apply_staged_writes.
        self.bad_tokens: torch.Tensor | None = None
        self.bad_lengths: torch.Tensor | None = None
        self.bad_tail: torch.Tensor | None = None
        self._bad_word_count = np.zeros(slots, dtype=np.int32)
        self._bad_word_len = np.zeros(slots, dtype=np.int32)
        self._staged_bad_words: list[tuple[int, tuple, list[int]]] = []  # slot, words, outputs

        # Rows fed to decode steps and the live window rows among them: [fed, live],
        # summed over the engine's life (row_stats()).
        self.row_counts = torch.zeros(2, dtype=torch.int64, device=device)
        # Host copies of _int32 (win_len, stalled, ...), one per sampler call in turn,
        # copied without waiting: next_canvas reads `win_len` from the latest once the
        # step's output is on the host (synchronous scheduling: it has landed), and the
        # progress guard reads `stalled` from the one before, which has landed under
        # asynchronous scheduling too (vLLM took that step's output before it scheduled
        # this one), so every tensor-parallel rank reads the same. Pinned on CUDA.
        pin = torch.device(device).type == "cuda"
        self._host_int32 = torch.zeros((2, slots, self._int32.shape[1]), dtype=torch.int32,
                                       pin_memory=pin)
        self._host_views = self._host_int32.numpy()
        # and, while a structured request runs, the windows (a filled slot's token, -1 for
        # a mask), which next_canvas reports and the sampler maps grammar rows by
        self._host_window = torch.zeros((2, slots, width), dtype=torch.int64, pin_memory=pin)
        self._host_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._host_turn = 0  # the buffer the next sampler call copies into
        # The plugin's scheduler ends a request that commits nothing in more than 4W + 2
        # steps (scheduler.max_steps_without_commit); this state's guard is the backstop
        # where no scheduler does (a scheduler_cls of the user's own, a vLLM release the
        # plugin's scheduler was not written for): past twice that it stops the engine.
        self.max_stalled_steps = 2 * max_steps_without_commit(self.window)

        # Admissions staged on the host: row i = [slot, saved row or -1, packed state].
        # Removals staged too: their rows are saved (into _saved) before a new request
        # may take their slot. Two pinned buffers in turn, as vLLM's own staging: one may
        # still be in a copy while the next step stages into the other.
        self._staging = [torch.zeros((2 * slots, 2 + column), dtype=torch.int64,
                                     pin_memory=pin) for _ in range(2)]
        self._staging_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._staging_turn = 0
        self._staged_admissions: list[np.ndarray] = []
        self._staged_saves: list[tuple[int, int]] = []  # (slot, saved row)
        # Saved states of removed requests (a preempted request resumes from its row; a
        # finished one's row keeps its counts for request_stats): a ring of rows, the
        # oldest overwritten first, at most 64 MiB and at least two per slot.
        ring = max(2 * slots, min(4096, (64 << 20) // (8 * column)))
        self._saved = torch.zeros((ring, column), dtype=torch.int64, device=device)
        self._saved_row: dict[str, tuple[int, int]] = {}  # request -> (row, host win_len)
        self._saved_owner = [""] * ring
        self._next_saved_row = 0
        self._reserved_rows: set[int] = set()  # rows resumes of this step will read
        # Which columns a resumed request takes from its saved row: its window (when the
        # saved state is at the resume point, checked on the device), and always its
        # counts and its seed (an unseeded request keeps the seed it drew).
        def columns(*names):
            mask = torch.zeros(column, dtype=torch.bool)
            for name in names:
                first, count, _ = self._layout[name]
                mask[first: first + count] = True
            return mask.to(device)
        self._window_columns = columns("win_tokens", "win_mask", "win_len", "stalled",
                                       "commit_rate", "one_slot_steps")
        self._kept_columns = columns("forwards", "rows", "seed")
        # Output tokens a request had committed each time it resumed after preemption.
        self._restarts: dict[str, list[int]] = {}

        # Host-side facts about each slot, written when a request arrives.
        self._slot_of: dict[str, int] = {}
        self._request_of = [""] * slots
        self._block_window = np.zeros(slots, dtype=np.int32)  # block_window's host copy
        self._step: dict[str, Any] | None = None  # what prepare_inputs leaves the sampler

    # ------------------------------------------------------------------ requests

    def add_request(self, req_index: int, new_req_data) -> None:
        """Stage a request's state (no device work: :meth:`apply_staged_writes` lands the
        step's admissions together)."""
        super().add_request(req_index, new_req_data)
        params = new_req_data.sampling_params
        if params is None:  # not reachable: vLLM's frontend refuses pooling for this model
            raise ValueError("WeDLM models generate text; pooling requests are not served")
        # checked by the frontend (settings.check_request), so this cannot raise
        values = request_values(self.settings, params)
        settings = values.settings
        request_id = new_req_data.req_id
        prompt = new_req_data.prompt_token_ids or []
        tokens = new_req_data.prefill_token_ids or prompt
        generated = len(tokens) - len(prompt)  # > 0 when a preempted request resumes
        # vLLM sets an unset max_tokens to the room the prompt leaves; max_model_len is
        # below 2**31 (the config hook), so every length here fits int32
        max_tokens = values.max_tokens if values.max_tokens is not None else self.max_model_len
        remaining = max(0, min(max_tokens - generated, self.max_model_len - len(tokens)))
        stops = stop_ids_of(params)
        if len(stops) > self.num_stop_ids:  # not reachable (see __init__); never raise here
            logger.error("WeDLM request %s has %d stop ids, more than %d; the first %d are "
                         "applied on the device", request_id, len(stops),
                         self.num_stop_ids, self.num_stop_ids)
            stops = stops[: self.num_stop_ids]
        # an unseeded request draws from numpy's global generator, which vLLM seeds alike
        # on every rank (tensor-parallel ranks must commit the same tokens)
        seed = values.seed if values.seed is not None else int(np.random.randint(0, 2**63 - 1))
        slot = req_index
        self._slot_of[request_id] = slot
        self._request_of[slot] = request_id
        self._block_window[slot] = settings.window if settings.mode == "blockwise" else 0
        self._structured[slot] = getattr(params, "structured_outputs", None) is not None
        self._sampling_params[:, slot] = values.temperature, values.top_k, values.top_p
        # (a grammar walks fixed windows, as in model_min)
        self._adaptive[slot] = (settings.window_policy == "adaptive"
                                and settings.mode == "streaming" and not self._structured[slot])
        win_len = min(settings.window, remaining)
        saved_row = -1
        # A request vLLM removed before (preempted, with or without committed tokens)
        # takes back its saved row; the device checks it is at the resume point.
        saved = self._saved_row.pop(request_id, None)
        if saved is not None:
            saved_row, win_len = saved
            self._reserved_rows.add(saved_row)  # no save may reuse it before it is read
        if generated > 0:
            self._restarts.setdefault(request_id, []).append(generated)
            if saved is None:
                logger.warning("WeDLM request %s resumes without its saved window (more "
                               "requests left than the saved-state ring holds): its window "
                               "restarts from its committed tokens", request_id)

        # A fresh window after the committed tokens: all masks, min(w, max_new) live.
        row = np.zeros(2 + self.packed_columns, dtype=np.int64)
        row[0], row[1] = slot, saved_row
        packed = row[2:]
        values_of = {
            "win_tokens": self.mask_token_id, "stop_ids": -1, "seed": seed,
            "win_len": min(settings.window, remaining), "ctx_len": len(tokens),
            "max_new": remaining, "top_k": values.top_k,
            "block_window": int(self._block_window[slot]), "request_window": settings.window,
            "temperature": values.temperature, "top_p": values.top_p,
            "threshold": settings.entropy_threshold, "penalty": settings.distance_penalty,
            "win_mask": 1, "finished": int(remaining == 0),
            "presence_penalty": values.presence_penalty,
            "frequency_penalty": values.frequency_penalty,
            "repetition_penalty": values.repetition_penalty, "min_p": values.min_p,
            "min_tokens": values.min_tokens, "output_start": len(prompt), "bias_ids": -1,
            "bias_values": 0.0, "adaptive": int(self._adaptive[slot]),
            "commit_rate": self.window_policy.parallel_rate + 1.0,  # (new_policy_state's)
        }  # stalled, forwards, rows, one_slot_steps: 0
        for name, value in values_of.items():
            first, count, dtype = self._layout[name]
            packed[first: first + count] = _stored(name, value, dtype)
        first = self._layout["stop_ids"][0]
        packed[first: first + len(stops)] = stops
        self._admit_rules(slot, values, prompt, tokens[len(prompt):], packed)
        self._admit_bad_words(slot, params, tokens[len(prompt):])
        if not self._admit_logprobs(slot, request_id, params, saved is not None):
            row[1] = -1  # its records were not kept: its window restarts (with a warning)
            win_len = min(settings.window, remaining)
            logger.warning("WeDLM request %s resumes without the logprobs of its window's "
                           "filled slots: its window restarts from its committed tokens",
                           request_id)
        self._staged_admissions.append(row)
        # what next_canvas reports after this step, and the guard's count
        self._host_views[:, slot, 0] = win_len
        self._host_views[:, slot, 1] = 0

    def _admit_rules(self, slot: int, values, prompt: list[int], outputs: list[int],
                     packed: np.ndarray) -> None:
        """The request's logit rules: its bias entries into its packed row, the host flags,
        and (for penalties and allowed_token_ids) its vocabulary-wide rows, staged."""
        first = self._layout["bias_ids"][0]
        packed[first: first + len(values.logit_bias)] = [t for t, _ in values.logit_bias]
        first = self._layout["bias_values"][0]
        packed[first: first + len(values.logit_bias)] = [
            _float_bits(b) for _, b in values.logit_bias]
        used = rp.logit_rules_used(values)
        for rule, on in used.items():
            self._rules[rule][slot] = on
        if used["penalties"]:
            if self.output_counts is None:
                self.output_counts = torch.zeros((self.max_num_reqs, self.vocab_size),
                                                 dtype=torch.int32, device=self.device)
                self.prompt_mask = torch.zeros((self.max_num_reqs, self.vocab_size),
                                               dtype=torch.bool, device=self.device)
            self._staged_counts.append((slot, list(prompt), list(outputs)))
        if used["allowed"] and self.allowed_mask is None:
            self.allowed_mask = torch.full((self.max_num_reqs, rp.bitmask_words(
                self.vocab_size)), -1, dtype=torch.int32, device=self.device)
        if self.allowed_mask is not None:  # every admitted request sets its slot's row
            self._staged_allowed.append((slot, rp.allowed_bitmask(
                values.allowed_token_ids, self.vocab_size) if used["allowed"] else None))

    def _admit_bad_words(self, slot: int, params, outputs: list[int]) -> None:
        """The request's bad words (as vLLM tokenized them, checked in the frontend) and
        its committed outputs' tail, staged (none for a request without bad words, once
        the buffers exist: a slot's rows never keep its last request's words); the host
        facts."""
        words = rp.bad_words_token_ids(getattr(params, "bad_words_token_ids", None),
                                       "bad_words", self.vocab_size) or ()
        self._bad_word_count[slot] = len(words)
        self._bad_word_len[slot] = max(map(len, words), default=0)
        if words and self.bad_tokens is None:
            self.bad_tokens = torch.full(
                (self.max_num_reqs, rp.MAX_BAD_WORDS, rp.MAX_BAD_WORD_TOKENS), -1,
                dtype=torch.int64, device=self.device)
            self.bad_lengths = torch.zeros((self.max_num_reqs, rp.MAX_BAD_WORDS),
                                           dtype=torch.int64, device=self.device)
            self.bad_tail = torch.full((self.max_num_reqs, rp.MAX_BAD_WORD_TOKENS - 1), -1,
                                       dtype=torch.int64, device=self.device)
        if self.bad_tokens is not None:  # every admitted request sets its slot's rows
            self._staged_bad_words.append((slot, words, outputs))

    def _apply_staged_bad_words(self) -> None:
        """Land the admissions' words and tails: one host-to-device copy each."""
        staged, self._staged_bad_words = self._staged_bad_words, []
        if not staged:
            return
        tail_len = rp.MAX_BAD_WORD_TOKENS - 1
        tokens = np.full((len(staged), rp.MAX_BAD_WORDS, rp.MAX_BAD_WORD_TOKENS), -1,
                         dtype=np.int64)
        lengths = np.zeros((len(staged), rp.MAX_BAD_WORDS), dtype=np.int64)
        tails = np.full((len(staged), tail_len), -1, dtype=np.int64)
        for index, (_, words, outputs) in enumerate(staged):
            for j, word in enumerate(words):
                tokens[index, j, : len(word)] = word
                lengths[index, j] = len(word)
            last = outputs[-tail_len:]
            if last:
                tails[index, tail_len - len(last):] = last
        slots = torch.tensor([slot for slot, _, _ in staged], device=self.device)
        self.bad_tokens.index_copy_(0, slots, torch.from_numpy(tokens).to(self.device))
        self.bad_lengths.index_copy_(0, slots, torch.from_numpy(lengths).to(self.device))
        self.bad_tail.index_copy_(0, slots, torch.from_numpy(tails).to(self.device))

    def _admit_logprobs(self, slot: int, request_id: str, params, resumes: bool) -> bool:
        """The request's logprobs: the host fact, the store (allocated with the first
        request that asks), and a resumed request's records put back in its new slot.
        False when a resumed request asks for logprobs and its records were not kept."""
        saved = self._saved_records.pop(request_id, None)
        count = rp.logprobs(getattr(params, "logprobs", None), "logprobs", self.vocab_size)
        # (checked by the frontend, as the rest: this cannot raise)
        chosen = rp.logprob_token_ids(getattr(params, "logprob_token_ids", None),
                                      "logprob_token_ids", self.vocab_size,
                                      getattr(params, "logprobs", None))
        if chosen is not None:  # vLLM's num_logprobs: the named ids' count
            count = len(chosen)
        self._num_logprobs[slot] = -1 if count is None else count
        self._num_chosen[slot] = 0 if chosen is None else len(chosen)
        if chosen is not None and self.logprob_chosen is None:
            self.logprob_chosen = torch.full((self.max_num_reqs, rp.MAX_LOGPROB_TOKEN_IDS), -1,
                                             dtype=torch.int64, device=self.device)
        if self.logprob_chosen is not None and count is not None:  # no slot keeps stale ids
            row = torch.full((rp.MAX_LOGPROB_TOKEN_IDS,), -1, dtype=torch.int64)
            row[: len(chosen or ())] = torch.tensor(chosen or (), dtype=torch.int64)
            self.logprob_chosen[slot].copy_(row.to(self.device))
        if count is None:
            return True
        columns = max(min(rp.MAX_LOGPROBS, self.vocab_size), count)
        if self.logprob_store is None:
            self.logprob_store = lp.empty_store(
                self.max_num_reqs, self.settings.canvas_length, columns, self.device)
        elif self.logprob_store.token_ids.shape[2] < 1 + columns:  # wider for named ids
            self.logprob_store = lp.widen_store(self.logprob_store, columns)
        if not resumes:
            return True
        if saved is None:
            return False
        # (a device copy, ordered after every step before: the records as the request left)
        _, records = saved
        store = self.logprob_store
        columns = records.token_ids.shape[1]
        store.token_ids[slot, :, :columns] = records.token_ids
        store.token_ids[slot, :, columns:] = 0
        store.logprobs[slot, :, :columns] = records.logprobs
        store.logprobs[slot, :, columns:] = float("-inf")
        store.ranks[slot] = records.ranks
        return True

    def _apply_staged_rules(self) -> None:
        """Land the admissions' vocabulary-wide rows: each penalised request's prompt mask
        and output counts (a resumed request's outputs counted again), each slot's allowed
        bitmask (all ones without allowed_token_ids). One host-to-device copy each."""
        counts, allowed = self._staged_counts, self._staged_allowed
        self._staged_counts, self._staged_allowed = [], []
        if counts:
            slots = torch.tensor([slot for slot, _, _ in counts], device=self.device)
            self.output_counts.index_fill_(0, slots, 0)
            self.prompt_mask.index_fill_(0, slots, False)
            # one copy: [slot, token, is_output] per token
            rows = [(slot, token, 0) for slot, prompt, _ in counts for token in prompt] + [
                (slot, token, 1) for slot, _, outputs in counts for token in outputs]
            if rows:
                staged = torch.tensor(rows, dtype=torch.int64).to(self.device,
                                                                  non_blocking=True)
                slot, token, is_output = staged.unbind(1)
                prompt_rows = is_output == 0
                self.prompt_mask.index_put_((slot[prompt_rows], token[prompt_rows]),
                                            torch.tensor(True, device=self.device))
                self.output_counts.index_put_(
                    (slot, token), is_output.to(torch.int32), accumulate=True)
        if allowed:
            words = rp.bitmask_words(self.vocab_size)
            host = np.full((len(allowed), words), -1, dtype=np.int32)
            for index, (_, bitmask) in enumerate(allowed):
                if bitmask is not None:
                    host[index] = bitmask
            slots = torch.tensor([slot for slot, _ in allowed], device=self.device)
            self.allowed_mask.index_copy_(0, slots, torch.from_numpy(host).to(self.device))

    def remove_request(self, req_id: str) -> None:
        """Stage the saving of the request's state (finished or preempted: vLLM does not say
        which), to happen before another request takes its slot."""
        super().remove_request(req_id)
        slot = self._slot_of.pop(req_id, None)
        if slot is None:
            return
        self._request_of[slot] = ""
        self._structured[slot] = self._adaptive[slot] = False
        self._sampling_params[:, slot] = 0.0, 0, 1.0
        self._bad_word_count[slot] = self._bad_word_len[slot] = 0
        count = int(self._num_logprobs[slot])
        self._num_logprobs[slot] = -1
        self._num_chosen[slot] = 0
        if count >= 0:  # its records, for a resume (copies on the device; nothing waits)
            store = self.logprob_store
            self._saved_records[req_id] = (count, lp.Records(
                store.token_ids[slot, :, : 1 + count].clone(),
                store.logprobs[slot, :, : 1 + count].clone(), store.ranks[slot].clone()))
        row = self._next_saved_row
        while row in self._reserved_rows:  # a resume of this step has yet to read it
            row = (row + 1) % len(self._saved_owner)
        self._next_saved_row = (row + 1) % len(self._saved_owner)
        evicted = self._saved_owner[row]
        if evicted and self._saved_row.get(evicted, (None,))[0] == row:
            del self._saved_row[evicted]
            self._restarts.pop(evicted, None)
            self._saved_records.pop(evicted, None)
        self._saved_owner[row] = req_id
        self._saved_row[req_id] = (row, int(self._host_views[1 - self._host_turn, slot, 0]))
        self._staged_saves.append((slot, row))
        self._host_views[:, slot, 1] = 0

    def _pack(self, slots: torch.Tensor) -> torch.Tensor:
        """The packed rows [n, packed_columns] int64 of ``slots``."""
        return torch.cat([self._int64.index_select(0, slots),
                          self._int32.index_select(0, slots).long(),
                          self._float32.index_select(0, slots).view(torch.int32).long(),
                          self._bool.index_select(0, slots).long()], dim=1)

    def _unpack(self, slots: torch.Tensor, packed: torch.Tensor) -> None:
        """Write packed rows [n, packed_columns] into ``slots``."""
        def span(dtype):
            first, end = self._group_span[dtype]
            return packed[:, first:end]
        self._int64.index_copy_(0, slots, span(torch.int64))
        self._int32.index_copy_(0, slots, span(torch.int32).int())
        self._float32.index_copy_(0, slots, span(torch.float32).int().view(torch.float32))
        self._bool.index_copy_(0, slots, span(torch.bool).bool())

    def apply_staged_writes(self) -> None:
        """Land the step's staged removals and admissions: one host-to-device copy, the
        removed slots' rows saved, the admitted rows (a resumed request's window taken from
        its saved row) scattered into their slots."""
        super().apply_staged_writes()
        self._apply_staged_rules()
        self._apply_staged_bad_words()
        saves, admissions = self._staged_saves, self._staged_admissions
        if not saves and not admissions:
            return
        turn = self._staging_turn
        self._staging_turn = 1 - turn
        staging, event = self._staging[turn], self._staging_events[turn]
        if event is not None:
            event.synchronize()  # the copy from two steps ago (long done in practice)
        host = staging.numpy()
        for index, (slot, row) in enumerate(saves):
            host[index, :2] = slot, row
        if admissions:
            host[len(saves): len(saves) + len(admissions)] = np.stack(admissions)
        resumes = any(row[1] >= 0 for row in admissions)
        self._staged_saves, self._staged_admissions = [], []
        self._reserved_rows.clear()
        staged = staging[: len(saves) + len(admissions)].to(self.device, non_blocking=True)
        if event is not None:
            event.record()
        if saves:
            self._saved.index_copy_(0, staged[: len(saves), 1],
                                    self._pack(staged[: len(saves), 0]))
        if admissions:
            admitted = staged[len(saves):]
            packed = admitted[:, 2:]
            if resumes:
                saved_row = admitted[:, 1]
                saved = self._saved.index_select(0, saved_row.clamp(min=0))
                ctx = self._layout["ctx_len"][0]
                at_resume_point = (saved_row >= 0) & (saved[:, ctx] == packed[:, ctx])
                take = ((saved_row >= 0)[:, None] & self._kept_columns) | (
                    at_resume_point[:, None] & self._window_columns)
                packed = torch.where(take, saved, packed)
            self._unpack(admitted[:, 0], packed)

    # ------------------------------------------------------------------ a decode step

    def _check_progress(self) -> None:
        """Stop the engine when a request has committed nothing for twice the steps after
        which the plugin's scheduler ends it (so only where no scheduler of the plugin's
        runs: the worker cannot end one request), from the host copy of the counters the
        sampler call before the last one wrote (it has landed: nothing waits)."""
        earlier = self._host_turn  # the copy before the latest (see __init__)
        if self._host_events[earlier] is not None:
            self._host_events[earlier].synchronize()  # landed: does not wait
        stalled = self._host_views[earlier, :, 1]
        stuck = np.flatnonzero(stalled > self.max_stalled_steps)
        for slot in stuck:
            if self._request_of[slot]:
                raise NoProgressError(
                    f"WeDLM request {self._request_of[slot]!r} committed no token in "
                    f"{int(stalled[slot])} decode steps (a correct step commits "
                    f"within {self.window + 1}): the decode step makes no progress, and "
                    "no scheduler of the plugin's ends the request (docs/vllm.md, \"When a "
                    "request fails\")")

    def next_canvas(self, drafts):
        """The draft token lists vLLM sizes each request's next canvas by (called through
        live_canvas's patch after a step's output is on the host): with the live canvas,
        ``n`` entries with ``n`` the live slots its window holds now (``win_len``, which the
        step's sampler copied to the host with the output), at least 1 (a request the
        device finished is finished on the host too, and vLLM skips it); with the fixed
        canvas, as many as vLLM's list. The entries are ``-1``, except for a structured
        request: its window (a filled slot's token, ``-1`` for a mask), which the scheduler
        walks with the request's grammar (:mod:`.structured`)."""
        structured = bool(self._structured.any())
        if not self.live_canvas and not structured:
            return drafts
        latest = 1 - self._host_turn
        if self._host_events[latest] is not None:
            self._host_events[latest].synchronize()  # before the step's output copy: landed
        counts = self._host_views[latest, :, 0]
        windows = self._host_window[latest].numpy()
        width = self.settings.canvas_length
        req_ids, lists = list(drafts.req_ids), []
        # every structured request's window, in the step's batch or not (one vLLM's length
        # bound skipped is walked from its window after its last step)
        listed = set(drafts.req_ids)
        req_ids += [self._request_of[slot] for slot in np.flatnonzero(self._structured)
                    if self._request_of[slot] not in listed]
        for index, request_id in enumerate(req_ids):
            tokens = drafts.draft_token_ids[index] if index < len(drafts.req_ids) else None
            slot = self._slot_of.get(request_id)
            if slot is None:
                lists.append(tokens)
                continue
            asked = width if tokens is None else len(tokens)
            rows = min(asked, max(1, int(counts[slot]))) if self.live_canvas else asked
            if self._structured[slot]:
                live = min(int(counts[slot]), rows)
                lists.append(windows[slot, :live].tolist() + [-1] * (rows - live))
            else:
                lists.append([-1] * rows)
        return type(drafts)(req_ids, lists)

    def owns_batch(self, input_batch) -> bool:
        """Whether ``input_batch`` is the batch this state prepared for the step now being
        sampled (structured.install routes its grammar rows here)."""
        return self._step is not None and self._step.get("batch") is input_batch

    def take_grammar(self, req_ids: list[str], bitmask: np.ndarray) -> None:
        """The step's grammar rows (scheduler: structured.StructuredWindows), for the
        sampler."""
        self._grammar = (req_ids, bitmask)

    def grammar_step(self, input_batch) -> tuple[GrammarStep | None, list[int]]:
        """The step's structured requests (:mod:`wedlm_kernels.requests.grammar`): what the sampler
        does for them, and the batch indices of requests held this step (their fed window
        is not the one the scheduler walked: they commit nothing and are walked again)."""
        taken, self._grammar = self._grammar, None
        num_reqs, width = input_batch.num_reqs, self.settings.canvas_length
        cu_logits = input_batch.cu_num_logits_np[: num_reqs + 1]
        slots_np = input_batch.idx_mapping_np[:num_reqs]
        # a structured request with logit rows but no grammar rows (not reachable with the
        # plugin's scheduler) is held, never sampled without its grammar
        req_ids, bitmask = taken if taken is not None else ([], None)
        walked = set(req_ids)
        unwalked = [b for b in range(num_reqs) if self._structured[slots_np[b]]
                    and cu_logits[b + 1] > cu_logits[b]
                    and input_batch.req_ids[b] not in walked]
        if taken is None:
            nothing = [None] * num_reqs  # (one commit limit per request: none)
            return (GrammarStep.build(nothing, nothing, [0] * num_reqs, [0] * num_reqs,
                                      np.zeros((0, 1), np.int32), self.device,
                                      held_rows=self._rows_of(unwalked, cu_logits))
                    if unwalked else None), unwalked
        index_of = {req_id: i for i, req_id in enumerate(input_batch.req_ids[:num_reqs])}
        latest = 1 - self._host_turn  # the copy of the previous sampler call: the fed window
        if self._host_events[latest] is not None:
            self._host_events[latest].synchronize()  # its output was taken: landed
        counts, windows = self._host_views[latest, :, 0], self._host_window[latest].numpy()
        batch_rows = [int(cu_logits[index_of[r] + 1] - cu_logits[index_of[r]]) for r in req_ids]
        meta = bitmask[sum(batch_rows):]
        fed: list[list[int] | None] = [None] * num_reqs
        plans: list[WindowPlan | None] = [None] * num_reqs
        first_rows, mask_row_base = [0] * num_reqs, [0] * num_reqs
        held, first_row = list(unwalked), 0
        for i, (req_id, rows) in enumerate(zip(req_ids, batch_rows)):
            b = index_of[req_id]
            slot = int(slots_np[b])
            plan, key, ended = structured.plan_of(meta[i])
            live = min(int(counts[slot]), rows, width)
            window = windows[slot, :live].tolist()
            if ended or structured.window_key(window + [-1] * (rows - live)) != key:
                held.append(b)  # (an ended request: its scheduler ends it after the step)
            else:
                fed[b], plans[b] = window, plan
                first_rows[b] = first_row
                mask_row_base[b] = int(cu_logits[b]) + sum(t >= 0 for t in window)
            first_row += rows
        step = GrammarStep.build(fed, plans, first_rows, mask_row_base, bitmask, self.device,
                                 held_rows=self._rows_of(held, cu_logits))
        return step, held

    @staticmethod
    def _rows_of(batch_indices: list[int], cu_logits: np.ndarray) -> list[int]:
        """The logit rows of the given requests of the batch."""
        return [row for b in batch_indices for row in range(int(cu_logits[b]),
                                                             int(cu_logits[b + 1]))]

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        self._check_progress()
        model_inputs = super().prepare_inputs(input_batch, req_states)
        self._step = None
        if input_batch.num_draft_tokens == 0:  # prefill chunks only: vLLM's rows as they are
            return model_inputs
        num_reqs, width = input_batch.num_reqs, self.settings.canvas_length
        num_tokens = input_batch.num_tokens
        slots = input_batch.idx_mapping[:num_reqs]
        query_start = input_batch.query_start_loc[: num_reqs + 1].long()
        cu_logits = input_batch.cu_num_logits[: num_reqs + 1]
        num_logits = (cu_logits[1:] - cu_logits[:-1]).long()  # [B]: canvas rows, 0: prefill
        canvas_start = query_start[1:] - num_logits  # a prompt's tail may precede its canvas
        canvas_rows = num_logits.clamp(max=width)

        # The live window of each request this step. A request given fewer canvas rows than
        # its window (the step's token budget ran out, or vLLM trimmed the canvas at
        # max_model_len counting a step in flight) decodes the part that fits: its filled
        # slots past the canvas are dropped, and the sampler refills the window to w after
        # the commit.
        win_len = self.win_len.index_select(0, slots)
        live_len = torch.where(self.finished.index_select(0, slots), 0,
                               torch.minimum(win_len, canvas_rows.to(torch.int32)))
        # Every canvas row is fed from the window state: the live slots, then masks
        # (slots >= win_len are masks), so the padding rows sit after the live ones and no
        # live row attends to them.
        feed_len = canvas_rows.to(torch.int32)
        batch_ids = input_batch.input_ids[:num_tokens]
        batch_positions = input_batch.positions[:num_tokens]
        if self.window_from_drafts:
            # A stage before the last: the window the last stage handed over after the
            # request's previous step, and the committed length from vLLM's position of
            # canvas row 0 (L, the same on every stage)
            window = req_states.draft_tokens.index_select(0, slots)
            win_tokens = torch.where(window < 0, self.mask_token_id, window)
            win_mask = window < 0
            ctx_len = batch_positions[canvas_start.clamp(0, num_tokens - 1)].to(torch.int32)
        else:
            win_tokens = self.win_tokens.index_select(0, slots)
            win_mask = self.win_mask.index_select(0, slots)
            ctx_len = self.ctx_len.index_select(0, slots)
        no_pages = torch.full((num_reqs, 1), -1, dtype=torch.int32, device=slots.device)
        ids, positions, _, _, packed_start, n_filled = wk.reorder_window(
            win_tokens, win_mask, feed_len, ctx_len, no_pages, 1, num_tokens)
        packed_start = packed_start[:-1].long()

        # vLLM row t of request i: canvas row j = t - canvas_start[i] when 0 <= j < C.
        row = torch.arange(num_tokens, device=slots.device)
        owner = _owners(query_start, row)
        j = row - canvas_start[owner]
        on_canvas = (j >= 0) & (j < canvas_rows[owner])
        source = (packed_start[owner] + j).clamp(0, num_tokens - 1)
        batch_ids.copy_(torch.where(on_canvas, ids[source], batch_ids))
        batch_positions.copy_(torch.where(on_canvas, positions[source], batch_positions))
        if self.window_from_drafts:  # no sampler here: nothing to leave it
            return model_inputs

        # Logit row k of request i is its canvas row k - cu_logits[i]; the live mask rows
        # (n_filled .. live_len - 1) predict their logical positions, the rest are padding.
        total_logits = int(input_batch.cu_num_logits_np[num_reqs])
        logit_row = torch.arange(total_logits, device=slots.device)
        logit_owner = _owners(cu_logits.long(), logit_row)
        k = logit_row - cu_logits[logit_owner].long()
        is_mask_row = (k >= n_filled[logit_owner]) & (k < live_len[logit_owner])
        row_pos = torch.where(
            is_mask_row, positions[(packed_start[logit_owner] + k).clamp(0, num_tokens - 1)], -1)

        self.row_counts += torch.stack([canvas_rows.sum(), live_len.sum().long()])
        self._step = {"batch": input_batch, "slots": slots, "live_len": live_len,
                      "row_pos": row_pos, "logit_owner": logit_owner,
                      "query_len": (query_start[1:] - query_start[:-1]).to(torch.int32),
                      "num_logits": num_logits.to(torch.int32),
                      "slots_np": input_batch.idx_mapping_np[:num_reqs]}
        return model_inputs

    def window_rows(self, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The windows of ``slots`` (default: every slot) as draft-token rows [n, S]
        int64: a filled slot's token, -1 for a mask (what the last pipeline stage hands
        the others, and what a structured request's window reports to the scheduler)."""
        if slots is None:
            return torch.where(self.win_mask, -1, self.win_tokens)
        return torch.where(self.win_mask.index_select(0, slots), -1,
                           self.win_tokens.index_select(0, slots))

    def publish_windows(self, slots: torch.Tensor, draft_tokens: torch.Tensor) -> None:
        """On the last pipeline stage: the windows of ``slots`` into their draft-token
        rows (``req_states.draft_tokens`` [max_num_reqs, S] int64), which vLLM broadcasts
        to the other stages after the step (nothing when there is one stage)."""
        if self.pipeline:
            draft_tokens.index_copy_(0, slots.long(), self.window_rows(slots))

    def _copy_counters_to_host(self) -> None:
        """win_len and stalled to the host (next_canvas, the progress guard), on this
        stream ahead of vLLM's output copy, which waits for it."""
        turn = self._host_turn
        self._host_turn = 1 - turn
        self._host_int32[turn].copy_(self._int32, non_blocking=True)
        if self._structured.any():
            self._host_window[turn].copy_(self.window_rows(), non_blocking=True)
        if self._host_events[turn] is not None:
            self._host_events[turn].record()

    def custom_sampler(self, sampler: Any) -> tuple[Any, None]:
        # vLLM's own sampler (with the custom logits processors it built, if any) stays
        # inside WeDLM's: its add_request and staged writes keep the processors' state
        return WeDLMSampler(self, sampler), None

    def request_stats(self, req_id: str) -> dict[str, int] | None:
        """A request's decode forwards and live window rows (as model_min's
        ``Result.forwards`` and ``Result.rows``) and ``restarts``, the output tokens it had
        each time it resumed after a preemption; None if unknown (reads the device)."""
        # vLLM's engine ids are the caller's id with a suffix: "<id>-<8 hex digits>"
        def matches(engine_id: str) -> bool:
            return engine_id == req_id or engine_id.rpartition("-")[0] == req_id

        forwards, rows = self._layout["forwards"][0], self._layout["rows"][0]
        running = [self._slot_of[i] for i in self._slot_of if matches(i)]
        removed = [row for i, (row, _) in self._saved_row.items() if matches(i)]
        if running:
            counts = torch.stack([self.forwards[running[-1]], self.rows[running[-1]]])
        elif removed:
            pending = {row: slot for slot, row in self._staged_saves}
            if removed[-1] in pending:  # not saved yet: its slot still holds it
                slot = pending[removed[-1]]
                counts = torch.stack([self.forwards[slot], self.rows[slot]])
            else:
                counts = self._saved[removed[-1], [forwards, rows]]
        else:
            return None
        forwards, rows = (int(v) for v in counts.tolist())
        restarts = [n for i, points in self._restarts.items() if matches(i) for n in points]
        return {"forwards": forwards, "rows": rows, "restarts": restarts}

    def row_stats(self) -> dict[str, int]:
        """Rows fed to decode steps and the live window rows among them, since the engine
        started (reads the device; for metrics and tests, not for the step)."""
        fed, live = (int(v) for v in self.row_counts.tolist())
        return {"rows_fed": fed, "live_rows": live}


class WeDLMSampler:
    """select_tokens + commit_window on the logits of a step's canvas rows.

    Called as vLLM's sampler, ``(logits [total_logits, V], input_batch) -> SamplerOutput``:
    per request ``num_sampled`` = the tokens it commits this step (``sampled_token_ids[i,
    :num_sampled]``) and ``num_rejected = query_len - num_sampled``, so vLLM keeps exactly
    the committed positions' K/V.
    """

    def __init__(self, state: WeDLMModelState, base_sampler: Any) -> None:
        self.state = state
        self.base = base_sampler
        self.req_states = base_sampler.req_states
        self.compute_nans = False
        self._no_tokens = torch.zeros((state.max_num_reqs, 1), dtype=torch.int64,
                                      device=state.device)
        self.custom_processors = [
            processor for processor in getattr(base_sampler, "logits_processors", ())
            if not type(processor).__module__.startswith(BUILTIN_PROCESSORS)]

    # What vLLM's runner reads from a sampler besides calling it.
    @property
    def penalties_state(self):
        return self.base.penalties_state

    @property
    def sampling_states(self):
        return self.base.sampling_states

    def add_request(self, req_index: int, sampling_params) -> None:
        self.base.add_request(req_index, sampling_params)

    def apply_staged_writes(self) -> None:
        self.base.apply_staged_writes()

    def _apply_rules(self, logits: torch.Tensor, cu_rows: torch.Tensor,
                     row_pos: torch.Tensor, slots: torch.Tensor, rules: dict[str, bool]
                     ) -> None:
        """process_logits on the step's logit rows, with the rule groups in ``rules``."""
        state = self.state

        def take(buffer: torch.Tensor | None) -> torch.Tensor | None:
            return None if buffer is None else buffer.index_select(0, slots)

        def group(on: bool, *buffers):
            return [take(buffer) if on else None for buffer in buffers]

        min_tokens, stop_ids = group(rules["min_tokens"], state.min_tokens, state.stop_ids)
        bias_ids, bias_values = group(rules["bias"], state.bias_ids, state.bias_values)
        counts, prompt_mask, presence, frequency, repetition = group(
            rules["penalties"], state.output_counts, state.prompt_mask,
            state.presence_penalty, state.frequency_penalty, state.repetition_penalty)
        wk.process_logits(
            logits, cu_rows, row_pos, take(state.output_start), take(state.temperature),
            min_p=take(state.min_p) if rules["min_p"] else None, min_tokens=min_tokens,
            stop_ids=stop_ids, bias_ids=bias_ids, bias_values=bias_values,
            output_counts=counts, prompt_mask=prompt_mask, presence_penalty=presence,
            frequency_penalty=frequency, repetition_penalty=repetition,
            allowed_mask=take(state.allowed_mask) if rules["allowed"] else None)

    def _run_custom_processors(self, logits: torch.Tensor, input_batch, step: dict,
                               row_pos: torch.Tensor) -> torch.Tensor:
        """vLLM's custom logits processors on the step's rows, each row presented as the
        prediction of its slot's token (docs/vllm.md, "Custom logits processors"): a row
        that decides the slot at logical position ``q`` has ``pos = q - 1`` and
        ``input_ids`` the token at ``q - 1`` (committed, filled, or the mask id where that
        slot is undecided); a row that decides nothing (a filled slot's, padding) is shown
        as the request's last committed position, and what a processor writes there is
        never read. The logits are float32, as vLLM hands them to its processors."""
        state = self.state
        num_logits = logits.shape[0]
        owner, slots = step["logit_owner"], step["slots"]
        row_slot = slots.long()[owner]  # [R]
        ctx_len = state.ctx_len.index_select(0, slots).long()[owner]  # [R]
        pos = torch.where(row_pos >= 0, row_pos - 1, ctx_len - 1)
        place = (pos - ctx_len).clamp(0, state.win_tokens.shape[1] - 1)
        window_token = torch.where(state.win_mask[row_slot, place], state.mask_token_id,
                                   state.win_tokens[row_slot, place])
        committed = self.req_states.all_token_ids.gpu[row_slot, pos.clamp(min=0)]
        context = LogitsContext(
            expanded_idx_mapping=input_batch.expanded_idx_mapping[:num_logits],
            idx_mapping=slots, idx_mapping_np=step["slots_np"],
            expanded_local_pos=input_batch.expanded_local_pos[:num_logits],
            input_ids=torch.where(pos < ctx_len, committed.long(), window_token.long()),
            pos=pos,
            seq_lens_upper_bound_np=input_batch.seq_lens_cpu_upper_bound.numpy()[
                : input_batch.num_reqs])
        if logits.dtype != torch.float32:
            logits = logits.float()
        for processor in self.custom_processors:
            logits = processor.apply(logits, context)
        return logits

    def _bad_words(self, step: dict, live_len: torch.Tensor, row_pos: torch.Tensor
                   ) -> tuple | None:
        """The step's bad words, as :func:`wedlm_kernels.requests.bad_words.ban_bad_words` takes
        them after the logits (None when no request of the step has any)."""
        state = self.state
        slots_np, slots = step["slots_np"], step["slots"]
        num_words = int(state._bad_word_count[slots_np].max(initial=0))
        if num_words == 0:
            return None
        word_len = int(state._bad_word_len[slots_np].max())
        words = bw.BadWords(state.bad_tokens.index_select(0, slots)[:, :num_words, :word_len],
                            state.bad_lengths.index_select(0, slots)[:, :num_words])
        tail = state.bad_tail.index_select(0, slots)
        known, first = bw.known_tokens(
            state.win_tokens.index_select(0, slots), state.win_mask.index_select(0, slots),
            live_len, state.ctx_len.index_select(0, slots),
            tail[:, tail.shape[1] - (word_len - 1):])
        return words, step["logit_owner"], row_pos, known, first

    def _resize_windows(self, slots: torch.Tensor, fed: torch.Tensor, decided: torch.Tensor,
                        win_tokens: torch.Tensor, win_mask: torch.Tensor,
                        new_len: torch.Tensor, max_new: torch.Tensor, finished: torch.Tensor,
                        stepped: torch.Tensor) -> None:
        """The adaptive window after a step's commit (model_min's rule, the request's own
        window as its ``W``): the policy's state of ``slots`` moves with the masks each
        window was fed (``fed``) and filled (``decided``), and each adaptive request's
        window (``win_tokens``, ``win_mask``, ``new_len``: the step's, in place) gets the
        slots past its leading filled run that the policy gives it."""
        state = self.state
        policy_state = wk.WindowPolicyState(state.commit_rate.index_select(0, slots),
                                            state.one_slot_steps.index_select(0, slots))
        adaptive = state.adaptive.index_select(0, slots)
        masks = wk.next_window_lengths(torch.where(adaptive, fed, 0), decided, policy_state,
                                       state.window_policy,
                                       max_window=state.request_window.index_select(0, slots))
        wk.resize_windows(win_tokens, win_mask, new_len, masks, torch.zeros_like(new_len),
                          max_new, finished, state.mask_token_id, INT32_MAX,
                          enabled=adaptive & stepped)
        state.commit_rate.index_copy_(0, slots, policy_state.commit_rate)
        state.one_slot_steps.index_copy_(0, slots, policy_state.one_slot_steps)

    def _keep_logprobs(self, logits: torch.Tensor, token: torch.Tensor, selected: torch.Tensor,
                       cu_rows: torch.Tensor, row_pos: torch.Tensor, slots: torch.Tensor,
                       owner: torch.Tensor, slots_np: np.ndarray) -> None:
        """Keep the record of every row that fills a slot, at its place: its logical
        position modulo the window's capacity (a window's live slots never share one).
        ``owner``: each logit row's request (prepare_inputs'). The widths are host facts:
        the most alternatives a request without named ids asks for, the most ids one
        names."""
        state = self.state
        named = state._num_chosen[slots_np]
        top_k = max(0, int(state._num_logprobs[slots_np][named == 0].max(initial=0)))
        num_named = int(named.max(initial=0))
        chosen = (state.logprob_chosen.index_select(0, slots)[:, :num_named]
                  if num_named else None)
        records = lp.row_records(
            logits, token, top_k, state.logprobs_mode, cu_rows,
            state.temperature.index_select(0, slots), state.top_k.index_select(0, slots),
            state.top_p.index_select(0, slots), chosen_ids=chosen)
        lp.keep_filled(state.logprob_store, records, slots[owner],
                       row_pos.remainder(state.settings.canvas_length), selected & (row_pos >= 0))

    def _committed_logprobs(self, slots: torch.Tensor, committed_from: torch.Tensor,
                            committed: torch.Tensor, cu_rows: torch.Tensor, num_logits: int,
                            num_logprobs: int, input_batch) -> LogprobsTensors:
        """The committed tokens' records in vLLM's layout for several tokens a request:
        request ``i``'s ``j``-th committed token on logits row ``cu_num_logits[i] + j`` (a
        request commits at most as many tokens as it has rows); the other rows are never
        read (vLLM reads ``num_sampled[i]`` rows from ``cu_num_logits[i]``)."""
        capacity = self.state.settings.canvas_length
        order = torch.arange(capacity, device=slots.device)
        places = (committed_from.long()[:, None] + order).remainder(capacity)  # [B, S]
        records = lp.take(self.state.logprob_store, slots, places, num_logprobs)
        target = cu_rows[:-1].long()[:, None] + order
        target = torch.where(order < committed[:, None], target, num_logits)  # spare row
        token_ids = records.token_ids.new_zeros((num_logits + 1, 1 + num_logprobs))
        values = records.logprobs.new_full((num_logits + 1, 1 + num_logprobs), float("-inf"))
        ranks = records.ranks.new_zeros(num_logits + 1)
        token_ids.index_put_((target,), records.token_ids)
        values.index_put_((target,), records.logprobs)
        ranks.index_put_((target,), records.ranks)
        num_reqs = slots.shape[0]
        return LogprobsTensors(
            token_ids[:num_logits], values[:num_logits], ranks[:num_logits],
            cu_num_generated_tokens=input_batch.cu_num_logits_np[: num_reqs + 1].tolist())

    def __call__(self, logits: torch.Tensor, input_batch, *args) -> SamplerOutput:
        state, num_reqs = self.state, input_batch.num_reqs
        step = state._step if input_batch.num_draft_tokens > 0 else None
        if step is None:  # prefill chunks (or a dummy run): nothing is committed
            state._copy_counters_to_host()  # a resumed window's live count, for next_canvas
            # the windows the requests' first decode steps feed (a resumed request's is
            # its saved one), for the other pipeline stages
            state.publish_windows(input_batch.idx_mapping[:num_reqs],
                                  self.req_states.draft_tokens)
            zeros = torch.zeros(num_reqs, dtype=torch.int32, device=logits.device)
            return SamplerOutput(sampled_token_ids=self._no_tokens[:num_reqs, :1],
                                 logprobs_tensors=None, num_nans=None, num_sampled=zeros,
                                 num_rejected=zeros.clone())
        # the structured requests' grammar rows (before state._step is cleared: it names
        # the batch they belong to)
        grammar, held = state.grammar_step(input_batch)
        state._step = None
        slots, live_len, row_pos = step["slots"], step["live_len"], step["row_pos"]
        if held:  # not touched this step (commit_window skips a window of 0 live slots)
            held_index = torch.tensor(held, dtype=torch.int64)
            if live_len.is_cuda:
                held_index = held_index.pin_memory()
            live_len = live_len.index_fill(
                0, held_index.to(live_len.device, non_blocking=True), 0)

        def take(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.index_select(0, slots)

        cu_rows = input_batch.cu_num_logits[: num_reqs + 1]
        # the requests' logit rules, the groups some request of the step uses (host facts)
        rules = {rule: bool(state._rules[rule][step["slots_np"]].any()) for rule in RULES}
        # the ids no request outputs first (docs/requests.md, "Ids never output"), then
        # the grammar's masks, as vLLM applies them
        if state.never_output.numel():
            logits.index_fill_(1, state.never_output, float("-inf"))
        if grammar is not None:
            row_pos = grammar.mask_logits(logits, row_pos)
        # logprobs: the most alternatives a request of the step asks for (a host fact;
        # -1: none), and in a raw mode the logits before the rules change them in place
        num_logprobs = int(state._num_logprobs[step["slots_np"]].max(initial=-1))
        # vLLM's custom logits processors, when one of them (or a built-in rule) takes a
        # request of the step (a host fact vLLM's sampler keeps)
        custom = bool(self.custom_processors) and bool(
            self.base.needs_logits_processing[step["slots_np"]].any())
        raw = None
        if num_logprobs >= 0 and state.logprobs_mode.startswith("raw"):
            changed = any(rules.values()) or grammar is not None or custom
            raw = logits.clone() if changed else logits
        # bad words (host facts: the most words and the longest word of the step's
        # requests): ban what would complete one, before the rules (as vLLM orders them)
        bad_words = self._bad_words(step, live_len, row_pos)
        if bad_words is not None:
            bw.ban_bad_words(logits, *bad_words)
        # vLLM's order: bias and penalties, the custom processors, then min_p
        before = {**rules, "min_p": rules["min_p"] and not custom}
        if any(before.values()):
            self._apply_rules(logits, cu_rows, row_pos, slots, before)
        if custom:
            logits = self._run_custom_processors(logits, input_batch, step, row_pos)
            if rules["min_p"]:
                self._apply_rules(logits, cu_rows, row_pos, slots,
                                  {rule: rule == "min_p" for rule in RULES})
        if grammar is not None:
            grammar.restore_dead_rows(logits)
        # the narrowest sampling mode the step's requests allow (host facts)
        temperature, top_k, top_p = state._sampling_params[:, step["slots_np"]]
        sampling = sampling_mode(temperature, top_k, top_p, logits.shape[-1])
        token, selected, _ = wk.select_tokens(
            logits, cu_rows, row_pos, take(state.temperature), take(state.top_k),
            take(state.top_p), take(state.threshold), take(state.penalty), take(state.seed),
            sampling=sampling,
        )
        win_tokens, win_mask = take(state.win_tokens), take(state.win_mask)
        if grammar is not None:  # every decided slot filled; rejected ones masked again
            grammar.settle(selected)
            grammar.remask(win_tokens, win_mask, state.mask_token_id)
        if bad_words is not None:  # ... and leave unfilled what completes one with this step
            selected = bw.unfill_bad_words(selected, token, *bad_words)
        ctx_len, finished = take(state.ctx_len), take(state.finished)
        if num_logprobs >= 0:  # the records of the slots this step fills
            self._keep_logprobs(raw if raw is not None else logits, token, selected,
                                cu_rows, row_pos, slots, step["logit_owner"],
                                step["slots_np"])
            committed_from = ctx_len.clone()
        max_new, stop_ids = take(state.max_new), take(state.stop_ids)
        width = state.settings.canvas_length
        # This step's commits only: at most S = 2W (early finish included). commit_window's
        # length limit is min(max_new, capacity) and it refills the window up to that limit
        # minus the commits, capped at S; a capacity of 2S + 1 leaves both rules exact
        # (a request with more than 2S + 1 tokens to go can neither end on length nor have
        # its refill capped in one step).
        out_tokens = torch.zeros((num_reqs, 2 * width + 1), dtype=torch.int64,
                                 device=logits.device)
        out_len = torch.zeros(num_reqs, dtype=torch.int32, device=logits.device)
        block_window = take(state.block_window)
        # a grammar's walk: at most the slots it validated are committed, and a window whose
        # fed run a rejected slot cut keeps its W slots (wedlm_kernels.requests.grammar)
        commit_len = live_len if grammar is None else grammar.cut_windows(
            live_len, take(state.request_window))
        commit_limit = None if grammar is None else grammar.commit_limit
        new_len = torch.where(block_window > 0, 0, commit_len).to(torch.int32)
        # the adaptive window (a host fact: a request of the step uses it): the masks each
        # window was fed and how many of them the step filled, for its next window's size
        adaptive = bool(state._adaptive[step["slots_np"]].any())
        if adaptive:
            fed = wk.window_masks(win_mask, live_len)
            filled = (selected & (row_pos >= 0)).to(torch.int32)
            decided = torch.zeros_like(fed).index_add_(0, step["logit_owner"], filled)
        wk.commit_window(win_tokens, win_mask, new_len, ctx_len, cu_rows, row_pos,
                         token, selected, out_tokens, out_len, finished, stop_ids, max_new,
                         state.window, state.mask_token_id, False, commit_limit)
        # Block-wise requests, one call per block size in the batch (host-side facts).
        windows = state._block_window[step["slots_np"]]
        for window in np.unique(windows[windows > 0]).tolist():
            group = block_window == window
            group_len = torch.where(group, commit_len, 0).to(torch.int32)
            wk.commit_window(win_tokens, win_mask, group_len, ctx_len, cu_rows,
                             row_pos, token, selected, out_tokens, out_len, finished,
                             stop_ids, max_new, int(window), state.mask_token_id, True,
                             commit_limit)
            new_len = torch.where(group, group_len, new_len)

        stepped = live_len > 0
        committed = out_len
        if state.bad_tail is not None:  # the committed outputs' tail, for the next step
            state.bad_tail.index_copy_(0, slots, bw.committed_tail(
                state.bad_tail.index_select(0, slots), out_tokens, committed))
        if rules["penalties"]:  # the step's commits join the counts the penalties read
            counted = torch.arange(out_tokens.shape[1], device=logits.device) < committed[:, None]
            state.output_counts.index_put_(
                (slots[:, None].expand_as(out_tokens), out_tokens), counted.to(torch.int32),
                accumulate=True)
        # A window the canvas cut short (the step's token budget ran out, or vLLM trimmed
        # the canvas at max_model_len with a step in flight) refills to the request's
        # window: commit_window's refill only adds as many masks as it committed, so a
        # cut window would otherwise shrink, to 0 once it commits all it kept. (An uncut
        # window already holds that many slots: this changes nothing there.)
        grown = torch.minimum(take(state.request_window), max_new - committed)
        new_len = torch.where(stepped & ~finished & (new_len < grown), grown, new_len)
        if adaptive:  # each adaptive window resized to the slots the policy gives it
            self._resize_windows(slots, fed, decided, win_tokens, win_mask, new_len,
                                 max_new - committed, finished, stepped)
        # The progress guard counts the steps of every request decoding in this batch,
        # a window of 0 live slots included.
        decoding = (step["num_logits"] > 0) & ~take(state.finished)
        state.forwards.index_add_(0, slots, stepped.long())
        state.rows.index_add_(0, slots, live_len.long())
        state.win_tokens.index_copy_(0, slots, win_tokens)
        state.win_mask.index_copy_(0, slots, win_mask)
        state.win_len.index_copy_(0, slots, torch.where(stepped, new_len, take(state.win_len)))
        state.ctx_len.index_copy_(0, slots, ctx_len)
        state.finished.index_copy_(0, slots, finished)
        state.max_new.index_copy_(0, slots, max_new - committed)
        stalled = take(state.stalled)
        stalled = torch.where(decoding, torch.where(committed > 0, 0, stalled + 1), stalled)
        state.stalled.index_copy_(0, slots, stalled)
        state._copy_counters_to_host()
        state.publish_windows(slots, self.req_states.draft_tokens)

        num_rejected = torch.where(step["num_logits"] > 0, step["query_len"] - committed, 0)
        logprobs = None
        if num_logprobs >= 0:
            logprobs = self._committed_logprobs(slots, committed_from, committed, cu_rows,
                                                logits.shape[0], num_logprobs, input_batch)
        return SamplerOutput(sampled_token_ids=out_tokens[:, :width].contiguous(),
                             logprobs_tensors=logprobs,
                             num_nans=None, num_sampled=committed,
                             num_rejected=num_rejected.to(torch.int32))
