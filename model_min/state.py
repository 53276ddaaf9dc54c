"""The decoder state of a batch (docs/algorithm.md section 6): fixed-shape device tensors, one row
per sequence.

A decode step reads and mutates these tensors in place and nothing else, so it can be
captured in a CUDA graph. Between steps the host may reshape the batch (drop finished rows,
append admitted ones, pad to a graph bucket) with :meth:`BatchState.take`,
:func:`concat` and :meth:`BatchState.padded`.
"""

import math
from dataclasses import dataclass, fields

import torch

# Value of every field in a padding row: an empty, finished sequence without pages (a window
# step feeds none of its rows; an AR step feeds one whose K/V write is dropped and whose
# token is discarded).
_PADDING = {
    "win_tokens": 0,  # replaced by mask_id in padded()
    "win_mask": True,
    "win_len": 0,
    "ctx_len": 0,
    "block_table": -1,
    "out_tokens": 0,
    "out_len": 0,
    "finished": True,
    "stop_ids": -1,
    "max_new": 0,
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "threshold": -math.inf,
    "penalty": 0.0,
    "seed": 0,
    "forwards": 0,
    "rows": 0,
    "adaptive": False,
    "commit_rate": 0.0,
    "one_slot_steps": 0,
    "output_start": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "bias_ids": -1,
    "bias_values": 0.0,
    "output_counts": 0,
    "prompt_mask": False,
    "allowed_mask": -1,
    "logprob_ids": 0,
    "logprob_values": -math.inf,
    "logprob_ranks": 0,
    "logprob_chosen": -1,
    "bad_tokens": -1,
    "bad_lengths": 0,
}


@dataclass
class BatchState:
    win_tokens: torch.Tensor  # [B, S] int64: window tokens in logical slot order
    win_mask: torch.Tensor  # [B, S] bool: True where the slot is still a mask
    win_len: torch.Tensor  # [B] int32: live window slots (0: finished or padding)
    ctx_len: torch.Tensor  # [B] int32: committed tokens, prompt included
    block_table: torch.Tensor  # [B, P] int32: the sequence's cache pages (-1: none)
    out_tokens: torch.Tensor  # [B, T] int64: generated tokens
    out_len: torch.Tensor  # [B] int32
    finished: torch.Tensor  # [B] bool
    stop_ids: torch.Tensor  # [B, K] int64, -1 padded
    max_new: torch.Tensor  # [B] int32
    temperature: torch.Tensor  # [B] fp32 (<= 0: greedy)
    top_k: torch.Tensor  # [B] int32 (0: off)
    top_p: torch.Tensor  # [B] fp32 (1: off)
    threshold: torch.Tensor  # [B] fp32 (-inf: one token per step)
    penalty: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64
    forwards: torch.Tensor  # [B] int64: decode forwards the sequence took part in
    rows: torch.Tensor  # [B] int64: live window rows it fed
    adaptive: torch.Tensor  # [B] bool: the adaptive window sizes its window
    commit_rate: torch.Tensor  # [B] fp32: tokens committed per forward (estimate)
    one_slot_steps: torch.Tensor  # [B] int32: one-slot steps in a row
    # The logit rules (wedlm_kernels.process_logits). Widths are 0 when no request of the
    # generate call uses a rule: Kb bias entries, V counted tokens, ceil(V / 32) mask words.
    output_start: torch.Tensor  # [B] int32: the prompt length (min_tokens' output index 0)
    presence_penalty: torch.Tensor  # [B] fp32
    frequency_penalty: torch.Tensor  # [B] fp32
    repetition_penalty: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32 (0: off)
    min_tokens: torch.Tensor  # [B] int32
    bias_ids: torch.Tensor  # [B, Kb] int64, -1 padded
    bias_values: torch.Tensor  # [B, Kb] fp32
    output_counts: torch.Tensor  # [B, V or 0] int32: committed outputs of each token
    prompt_mask: torch.Tensor  # [B, V or 0] bool: tokens of the prompt
    allowed_mask: torch.Tensor  # [B, ceil(V / 32) or 0] int32 bitmask (all ones: any token)
    # Logprob records (wedlm_kernels.requests.logprobs), one place per output index and a spare; no
    # place when no request of the call asks for logprobs (T1 = T + 1 or 0, K = the most
    # entries a request lists besides its token, C = the most tokens a request names).
    logprob_ids: torch.Tensor  # [B, T1, 1 + K] int64: the token, then the most likely or
    #                            the named tokens
    logprob_values: torch.Tensor  # [B, T1, 1 + K] fp32
    logprob_ranks: torch.Tensor  # [B, T1] int64: the token's rank
    logprob_chosen: torch.Tensor  # [B, C] int64: the named tokens (logprob_token_ids), -1
    #                               padded
    # bad words (wedlm_kernels.requests.bad_words): Nb words of up to Lb tokens (0: no request of
    # the call has any)
    bad_tokens: torch.Tensor  # [B, Nb, Lb] int64, -1 padded
    bad_lengths: torch.Tensor  # [B, Nb] int64 (0: no word)

    @property
    def size(self) -> int:
        return self.win_len.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def signature(self) -> tuple:
        """Shapes and dtypes of every field: two states with the same signature can share
        one captured CUDA graph."""
        return tuple((name, tuple(t.shape), t.dtype) for name, t in self.tensors().items())

    def take(self, indices: list[int]) -> "BatchState":
        """The rows ``indices`` of this batch, as fresh tensors."""
        index = torch.tensor(indices, dtype=torch.int64, device=self.win_len.device)
        return BatchState(**{n: t.index_select(0, index) for n, t in self.tensors().items()})

    def padded(self, size: int, mask_id: int) -> "BatchState":
        """This batch followed by ``size - self.size`` padding rows."""
        extra = size - self.size
        if extra <= 0:
            return self
        parts = {}
        for name, tensor in self.tensors().items():
            value = mask_id if name == "win_tokens" else _PADDING[name]
            pad = torch.full((extra, *tensor.shape[1:]), value, dtype=tensor.dtype,
                             device=tensor.device)
            parts[name] = torch.cat([tensor, pad])
        return BatchState(**parts)

    def copy_(self, other: "BatchState") -> None:
        """Overwrite this batch's tensors in place with ``other``'s (same signature)."""
        for name, tensor in self.tensors().items():
            tensor.copy_(getattr(other, name))


def concat(first: BatchState | None, second: BatchState) -> BatchState:
    if first is None or first.size == 0:
        return second
    return BatchState(
        **{n: torch.cat([t, getattr(second, n)]) for n, t in first.tensors().items()}
    )
