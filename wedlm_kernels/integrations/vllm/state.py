"""WeDLM's decode loop on vLLM's Model Runner V2: the ModelState and the sampler.

vLLM runs a diffusion model through its speculative-decoding data path: once a request's
prompt is prefilled, every step schedules it a canvas of ``C = 2W`` query rows at the
physical positions ``L .. L + C - 1`` (``L``: its committed tokens, vLLM's
``num_computed_tokens``), computes their K/V into its paged cache with its own attention
backend, and hands the rows' logits to the model's sampler, which returns the tokens it
commits. A step of WeDLM maps onto that one to one (docs/vllm.md)::

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
from vllm.logger import init_logger
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput

import wedlm_kernels as wk
from wedlm_kernels.request_params import MAX_STOP_TOKEN_IDS

from .settings import engine_settings, request_values, stop_ids_of

logger = init_logger(__name__)

# Where the values of every per-slot buffer come from: a request field of
# wedlm_kernels.request_params, whose check in the frontend bounds the value to the buffer's
# dtype (add_request stores the checked value), or the decode loop itself (values it
# derives from committed tokens, lengths and the engine's settings).
# tests/vllm_plugin/test_vllm_fuzz.py fails on a buffer missing here or out of its bound.
BUFFER_SOURCES = {
    "win_tokens": "loop", "win_mask": "loop", "win_len": "window", "ctx_len": "loop",
    "finished": "loop", "max_new": "max_tokens", "stop_ids": "stop_token_ids",
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
    "threshold": "entropy_threshold", "penalty": "distance_penalty", "seed": "seed",
    "block_window": "window", "stalled": "loop", "forwards": "loop", "rows": "loop",
    "row_counts": "loop", "_stalled_host": "loop",
}


def _owners(starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The request of each packed row: ``i`` with ``starts[i] <= row < starts[i + 1]``
    (``starts`` [B + 1], cumulative; rows past the end go to the last request)."""
    return torch.searchsorted(starts[1:], rows, right=True).clamp(max=starts.numel() - 2)


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
    stalled      [M] int32     decode steps since the request last committed a token
    ============ ============= ====================================================
    """

    num_new_sampled_tokens_per_step = 0  # a step commits 0 .. C tokens, all "drafts"
    # vLLM embeds prompt embeddings before prepare_inputs rewrites the canvas ids
    supports_prompt_embeds = False

    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        hf_config = self.model_config.hf_config
        self.settings = engine_settings(vllm_config.additional_config)
        self.mask_token_id = int(hf_config.mask_token_id)
        self.window = self.settings.window
        slots, width = self.max_num_reqs, self.settings.canvas_length

        def buffer(shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.win_tokens = buffer((slots, width), torch.int64, self.mask_token_id)
        self.win_mask = buffer((slots, width), torch.bool, True)
        self.win_len = buffer((slots,), torch.int32)
        self.ctx_len = buffer((slots,), torch.int32)
        self.finished = buffer((slots,), torch.bool, True)
        self.max_new = buffer((slots,), torch.int32)
        # A request's stop ids: its stop_token_ids (at most MAX_STOP_TOKEN_IDS besides the
        # checkpoint's eos ids, checked in the frontend), the generation config's eos ids
        # vLLM adds to them, and the tokenizer's eos
        # (SamplingParams.update_from_generation_config): never more than this.
        self.num_stop_ids = MAX_STOP_TOKEN_IDS + len(hf_config.wedlm_eos_ids) + 1
        self.stop_ids = buffer((slots, self.num_stop_ids), torch.int64, -1)
        self.temperature = buffer((slots,), torch.float32)
        self.top_k = buffer((slots,), torch.int32)
        self.top_p = buffer((slots,), torch.float32, 1.0)
        self.threshold = buffer((slots,), torch.float32)
        self.penalty = buffer((slots,), torch.float32)
        self.seed = buffer((slots,), torch.int64)
        self.block_window = buffer((slots,), torch.int32)
        self.stalled = buffer((slots,), torch.int32)
        # Per request, as model_min counts them: decode forwards it was live in, and the
        # live window rows it fed (across preemptions); kept (on the device) for a while
        # after it finishes.
        self.forwards = buffer((slots,), torch.int64)
        self.rows = buffer((slots,), torch.int64)
        self._finished_counts: dict[str, torch.Tensor] = {}
        # Output tokens a request had committed each time it resumed after preemption.
        self._restarts: dict[str, list[int]] = {}
        # Rows fed to decode steps and the live window rows among them (the rest pad the
        # fixed canvas): [fed, live], summed over the engine's life (row_stats()).
        self.row_counts = buffer((2,), torch.int64)
        # Host copy of `stalled`, written without waiting after every sampler call and
        # read before the next step (the progress guard); pinned on CUDA.
        pin = torch.device(device).type == "cuda"
        self._stalled_host = torch.zeros(slots, dtype=torch.int32, pin_memory=pin)
        self._stalled_view = self._stalled_host.numpy()
        self._stalled_event = torch.cuda.Event() if pin else None
        # A correct step fills a mask whenever the window holds one and commits the
        # leading run otherwise, so a request commits within W + 1 steps (block-wise too);
        # the guard allows 4W + 2 (twice the canvas, and two).
        self.max_stalled_steps = 2 * width + 2

        # Host-side facts about each slot, written when a request arrives.
        self._slot_of: dict[str, int] = {}
        self._request_of = [""] * slots
        self._block_window = np.zeros(slots, dtype=np.int32)  # block_window's host copy
        self._step: dict[str, Any] | None = None  # what prepare_inputs leaves the sampler

    # ------------------------------------------------------------------ requests

    def add_request(self, req_index: int, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        params = new_req_data.sampling_params
        if params is None:  # not reachable: vLLM's frontend refuses pooling for this model
            raise ValueError("WeDLM models generate text; pooling requests are not served")
        # checked by the frontend (settings.check_request), so this cannot raise
        values = request_values(self.settings, params)
        settings = values.settings
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
                         "applied on the device", new_req_data.req_id, len(stops),
                         self.num_stop_ids, self.num_stop_ids)
            stops = stops[: self.num_stop_ids]
        # an unseeded request draws from numpy's global generator, which vLLM seeds alike
        # on every rank (tensor-parallel ranks must commit the same tokens)
        seed = values.seed if values.seed is not None else int(np.random.randint(0, 2**63 - 1))
        slot = req_index
        if generated > 0:
            self._restarts.setdefault(new_req_data.req_id, []).append(generated)
        self._slot_of[new_req_data.req_id] = slot
        self._request_of[slot] = new_req_data.req_id
        self._block_window[slot] = settings.window if settings.mode == "blockwise" else 0

        # The window restarts from the committed tokens: all masks, min(w, max_new) live.
        self.win_tokens[slot].fill_(self.mask_token_id)
        self.win_mask[slot].fill_(True)
        self.win_len[slot].fill_(min(settings.window, remaining))
        self.ctx_len[slot].fill_(len(tokens))
        self.finished[slot].fill_(remaining == 0)
        self.max_new[slot].fill_(remaining)
        self.stop_ids[slot].fill_(-1)
        for index, stop in enumerate(stops):  # fills: no copy from pageable host memory
            self.stop_ids[slot, index].fill_(stop)
        self.temperature[slot].fill_(values.temperature)
        self.top_k[slot].fill_(values.top_k)
        self.top_p[slot].fill_(values.top_p)
        self.threshold[slot].fill_(settings.entropy_threshold)
        self.penalty[slot].fill_(settings.distance_penalty)
        self.seed[slot].fill_(seed)
        self.block_window[slot].fill_(int(self._block_window[slot]))
        self.stalled[slot].fill_(0)
        self._stalled_view[slot] = 0
        # a resumed request goes on counting from where its preemption left it
        earlier = self._finished_counts.pop(new_req_data.req_id, None) if generated else None
        if earlier is None:
            self.forwards[slot].fill_(0)
            self.rows[slot].fill_(0)
        else:
            self.forwards[slot].copy_(earlier[0])
            self.rows[slot].copy_(earlier[1])

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._request_of[slot] = ""
            self._stalled_view[slot] = 0
            # a device-side copy: nothing waits for it
            self._finished_counts[req_id] = torch.stack([self.forwards[slot], self.rows[slot]])
            while len(self._finished_counts) > 4096:
                oldest = next(iter(self._finished_counts))
                self._finished_counts.pop(oldest)
                self._restarts.pop(oldest, None)

    # ------------------------------------------------------------------ a decode step

    def _check_progress(self) -> None:
        """Fail a request that has committed nothing for more steps than a correct step
        allows, from the host copy of the counters the last sampler call wrote (read once
        it has landed; it is never waited for)."""
        if self._stalled_event is not None and not self._stalled_event.query():
            return
        stuck = np.flatnonzero(self._stalled_view > self.max_stalled_steps)
        for slot in stuck:
            if self._request_of[slot]:
                raise NoProgressError(
                    f"WeDLM request {self._request_of[slot]!r} committed no token in "
                    f"{int(self._stalled_view[slot])} decode steps (a correct step commits "
                    f"within {self.window + 1}): the decode step makes no progress")

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
        # its window (the step's token budget ran out, or max_model_len trims the canvas
        # of a request with steps in flight) decodes the part that fits: its filled slots
        # past the canvas are dropped, as in a preemption, and the window grows back.
        win_len = self.win_len.index_select(0, slots)
        live_len = torch.where(self.finished.index_select(0, slots), 0,
                               torch.minimum(win_len, canvas_rows.to(torch.int32)))
        # Every canvas row is fed from the window state: the live slots, then masks
        # (slots >= win_len are masks), so the padding rows sit after the live ones and no
        # live row attends to them.
        feed_len = canvas_rows.to(torch.int32)
        ctx_len = self.ctx_len.index_select(0, slots)
        no_pages = torch.full((num_reqs, 1), -1, dtype=torch.int32, device=slots.device)
        ids, positions, _, _, packed_start, n_filled = wk.reorder_window(
            self.win_tokens.index_select(0, slots), self.win_mask.index_select(0, slots),
            feed_len, ctx_len, no_pages, 1, num_tokens,
        )
        packed_start = packed_start[:-1].long()

        # vLLM row t of request i: canvas row j = t - canvas_start[i] when 0 <= j < C.
        row = torch.arange(num_tokens, device=slots.device)
        owner = _owners(query_start, row)
        j = row - canvas_start[owner]
        on_canvas = (j >= 0) & (j < canvas_rows[owner])
        source = (packed_start[owner] + j).clamp(0, num_tokens - 1)
        batch_ids = input_batch.input_ids[:num_tokens]
        batch_positions = input_batch.positions[:num_tokens]
        batch_ids.copy_(torch.where(on_canvas, ids[source], batch_ids))
        batch_positions.copy_(torch.where(on_canvas, positions[source], batch_positions))

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
        self._step = {"slots": slots, "live_len": live_len, "row_pos": row_pos,
                      "query_len": (query_start[1:] - query_start[:-1]).to(torch.int32),
                      "num_logits": num_logits.to(torch.int32),
                      "slots_np": input_batch.idx_mapping_np[:num_reqs]}
        return model_inputs

    def custom_sampler(self, sampler: Any) -> tuple[Any, None]:
        return WeDLMSampler(self, sampler), None

    def request_stats(self, req_id: str) -> dict[str, int] | None:
        """A request's decode forwards and live window rows (as model_min's
        ``Result.forwards`` and ``Result.rows``) and ``restarts``, the output tokens it had
        each time it resumed after a preemption; None if unknown (reads the device)."""
        # vLLM's engine ids are the caller's id with a suffix: "<id>-<8 hex digits>"
        def matches(engine_id: str) -> bool:
            return engine_id == req_id or engine_id.rpartition("-")[0] == req_id

        finished = [c for i, c in self._finished_counts.items() if matches(i)]
        running = [self._slot_of[i] for i in self._slot_of if matches(i)]
        if running:
            counts = torch.stack([self.forwards[running[-1]], self.rows[running[-1]]])
        elif finished:
            counts = finished[-1]
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

    def __call__(self, logits: torch.Tensor, input_batch, *args) -> SamplerOutput:
        state, num_reqs = self.state, input_batch.num_reqs
        step = state._step if input_batch.num_draft_tokens > 0 else None
        if step is None:  # prefill chunks (or a dummy run): nothing is committed
            zeros = torch.zeros(num_reqs, dtype=torch.int32, device=logits.device)
            return SamplerOutput(sampled_token_ids=self._no_tokens[:num_reqs, :1],
                                 logprobs_tensors=None, num_nans=None, num_sampled=zeros,
                                 num_rejected=zeros.clone())
        state._step = None
        slots, live_len = step["slots"], step["live_len"]

        def take(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.index_select(0, slots)

        cu_rows = input_batch.cu_num_logits[: num_reqs + 1]
        token, selected, _ = wk.select_tokens(
            logits, cu_rows, step["row_pos"], take(state.temperature), take(state.top_k),
            take(state.top_p), take(state.threshold), take(state.penalty), take(state.seed),
        )
        win_tokens, win_mask = take(state.win_tokens), take(state.win_mask)
        ctx_len, finished = take(state.ctx_len), take(state.finished)
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
        new_len = torch.where(block_window > 0, 0, live_len).to(torch.int32)
        wk.commit_window(win_tokens, win_mask, new_len, ctx_len, cu_rows, step["row_pos"],
                         token, selected, out_tokens, out_len, finished, stop_ids, max_new,
                         state.window, state.mask_token_id, False)
        # Block-wise requests, one call per block size in the batch (host-side facts).
        windows = state._block_window[step["slots_np"]]
        for window in np.unique(windows[windows > 0]).tolist():
            group = block_window == window
            group_len = torch.where(group, live_len, 0).to(torch.int32)
            wk.commit_window(win_tokens, win_mask, group_len, ctx_len, cu_rows,
                             step["row_pos"], token, selected, out_tokens, out_len, finished,
                             stop_ids, max_new, int(window), state.mask_token_id, True)
            new_len = torch.where(group, group_len, new_len)

        stepped = live_len > 0
        committed = out_len
        state.forwards.index_add_(0, slots, stepped.long())
        state.rows.index_add_(0, slots, live_len.long())
        state.win_tokens.index_copy_(0, slots, win_tokens)
        state.win_mask.index_copy_(0, slots, win_mask)
        state.win_len.index_copy_(0, slots, torch.where(stepped, new_len, take(state.win_len)))
        state.ctx_len.index_copy_(0, slots, ctx_len)
        state.finished.index_copy_(0, slots, finished)
        state.max_new.index_copy_(0, slots, max_new - committed)
        stalled = take(state.stalled)
        stalled = torch.where(stepped, torch.where(committed > 0, 0, stalled + 1), stalled)
        state.stalled.index_copy_(0, slots, stalled)
        state._stalled_host.copy_(state.stalled, non_blocking=True)
        if state._stalled_event is not None:
            state._stalled_event.record()

        num_rejected = torch.where(step["num_logits"] > 0, step["query_len"] - committed, 0)
        return SamplerOutput(sampled_token_ids=out_tokens[:, :width].contiguous(),
                             logprobs_tensors=None,
                             num_nans=None, num_sampled=committed,
                             num_rejected=num_rejected.to(torch.int32))
