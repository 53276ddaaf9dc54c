"""Train the tiny WeDLM demo model from scratch on CPU.

    python -m model_min.train_tiny --out model_min/tiny_wedlm            # the shipped model
    python -m model_min.train_tiny --out /tmp/m --steps 20 --quiet        # a quick smoke run

The model is a small Qwen3-style decoder (standard Qwen safetensors names, so
``model_min.load_model`` reads it like any real checkpoint) trained with the WeDLM
objective on text generated here, tokenized byte by byte.

The WeDLM objective (paper section 4, "dual-stream masking")
------------------------------------------------------------
Every training sequence ``x[0..N)`` is fed twice in one forward of ``2N`` rows:

* the **clean stream**: ``x`` at positions ``0..N-1``, plain causal attention, trained with
  the usual shifted next-token loss (so AR decoding of the same weights is meaningful);
* the **masked stream**: ``x`` cut into blocks of ``B`` tokens. Half of the blocks are
  masked whole; in the others ``k`` uniform in ``1..n`` of the block's ``n`` tokens are
  (mask ratio ``r = k / n``). Masked tokens are replaced by the mask token and moved
  behind the block's observed tokens (topological reordering: a stable partition, observed
  first). Every row keeps its **logical** RoPE position. A masked-stream row of a block
  starting at position ``s`` attends to the clean stream at positions ``< s`` (the
  committed prefix a decode step finds in the KV cache) and, causally in the reordered
  order, to the rows of its own block: exactly what
  ``reorder_window`` + ``paged_attention`` show a window at decode time. A mask row predicts
  the token at its own position (no shift). Blocks start at multiples of ``B``; with
  ``--random-phase`` the grid starts at a random phase per batch (a first block of 1 to
  ``B`` tokens), since a decode window's committed prefix ends anywhere (docs/contracts.md
  says why the shipped model does without it). Whole masked blocks are what every decode
  window starts as (the window after a prompt, and its refilled tail after each commit):
  with ``k`` uniform alone they are 1 block in 16, and the model then committed wrong
  digits with confidence where a count lengthens (``count: 99 `` -> ``100 100``; see
  docs/decoder.md, "Training objective of the demo model").

Loss per sequence: ``(L_mask + L_ar) / 2`` with
``L_mask = sum over masked tokens of CE / r_block, divided by N`` (the 1/ratio weighting of
the masked-diffusion ELBO) and ``L_ar`` the mean next-token cross-entropy of the clean
stream.

The data mixes low-entropy text (counting, multiplication tables, arithmetic progressions,
letter/day/month cycles, a phrase repeated) with higher-entropy text (sentences drawn from
a small grammar), packed into sequences of ``N`` bytes with an end-of-text token between
finished documents. Counts often start at 0..12 or just before 10, 100 or 1000 (where the
numbers lengthen, the hardest place for a parallel decoder to put each digit), and tables
and cycles often start at their first item: the prompts a user types first. The
low-entropy families are what streaming decoding turns into many tokens per forward; the
sentences are where it falls back to about one.

Deterministic: the same seed, thread count and torch build give the same weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------- tokenizer

NUM_BYTES = 256
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
EOS_ID = NUM_BYTES  # 256
MASK_ID = NUM_BYTES + 1  # 257
VOCAB_SIZE = 264  # 256 bytes + 2 special tokens, padded to a multiple of 8


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ``tokenizers``
    ByteLevel pre-tokenizer and decoder use)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(NUM_BYTES):
        if byte not in printable:
            printable.append(byte)
            chars.append(NUM_BYTES + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def tokenizer_json() -> dict:
    """A byte-level ``tokenizer.json`` for the ``tokenizers`` package: token id = byte value
    (a BPE model without merges over the ByteLevel alphabet), plus the end-of-text and mask
    tokens as special tokens."""
    byte_chars = _byte_to_unicode()
    vocab = {byte_chars[byte]: byte for byte in range(NUM_BYTES)}
    special = [(EOS_ID, EOS_TOKEN), (MASK_ID, MASK_TOKEN)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for token_id, content in special
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (its UTF-8 bytes), as the saved tokenizer produces them."""
    return list(text.encode("utf-8"))


# --------------------------------------------------------------------------- data

NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
MONTHS = ("january february march april may june july august september october november "
          "december").split()
NOUNS = ("cat dog bird fox tree river house city road boat cloud stone garden window book "
         "teacher child farmer king song star moon apple horse lamp").split()
ADJECTIVES = ("small big red green old young quiet bright dark happy slow quick warm cold "
              "tall little").split()
VERBS = "sees finds likes follows paints visits builds carries watches remembers".split()
PLACES = "near the river|in the garden|on the road|under the tree|by the window".split("|")


def _cycle(items: list[str], start: int, separator: str, length: int) -> str:
    out, i = [], start
    while sum(len(s) + len(separator) for s in out) < length:
        out.append(items[i % len(items)])
        i += 1
    return separator.join(out)


def count_start(rng: random.Random, step: int) -> int:
    """Where a count starts: a third of the time at 0..12 steps (the first prompt a user
    types), a third just before 10, 100 or 1000 (so that the number lengthens within the
    first items, which a parallel decoder must place exactly), otherwise log-uniform in
    [1, 1000)."""
    draw = rng.random()
    if draw < 1 / 3:
        start = rng.randrange(0, 13) * step
    elif draw < 2 / 3:
        start = rng.choice([10, 100, 1000]) - step * rng.randrange(1, 8)
    else:
        start = int(10 ** rng.uniform(0, 3))
    return max(0, start // step * step)


def pattern_document(rng: random.Random, length: int) -> str:
    """A low-entropy document of at least ``length`` characters: once its header (and, for
    the repeat family, the phrase) is read, every later character is determined. Tables and
    cycles start at their first item a third of the time, the way a user starts them."""
    family = rng.choice(["count"] * 6 + ["table", "table", "progression", "letters", "days",
                                         "months", "numbers", "repeat", "repeat"])
    from_first = rng.random() < 1 / 3
    if family == "count":
        step = rng.choice([1, 1, 1, 2, 5, 10])
        header = "count: " if step == 1 else f"count by {step}: "
        body, n = [], count_start(rng, step)
        while len(header) + sum(len(b) + 1 for b in body) < length:
            body.append(str(n))
            n += step
        return header + " ".join(body)
    if family == "table":
        a = rng.randrange(2, 13)
        start = 1 if from_first else rng.randrange(1, 6)
        items = [f"{a}x{i}={a * i}" for i in range(start, start + 60)]
        return f"table of {a}: " + _cycle(items, 0, ", ", length)
    if family == "progression":
        a, b = rng.randrange(0, 50), rng.randrange(1, 10)
        items = [f"{a + i}+{b}={a + i + b}" for i in range(80)]
        return "sums: " + _cycle(items, 0, "; ", length)
    if family == "letters":
        letters = "abcdefghijklmnopqrstuvwxyz"
        if rng.random() < 0.5:
            letters = letters.upper()
        separator = rng.choice(["", " ", ", "])
        start = 0 if from_first else rng.randrange(26)
        return "letters: " + _cycle(list(letters), start, separator, length)
    if family == "days":
        return "days: " + _cycle(DAYS, 0 if from_first else rng.randrange(7), ", ", length)
    if family == "months":
        return "months: " + _cycle(MONTHS, 0 if from_first else rng.randrange(12), ", ", length)
    if family == "numbers":
        return "numbers: " + _cycle(NUMBER_WORDS, rng.randrange(13), " ", length)
    phrase = " ".join(rng.choice(ADJECTIVES + NOUNS) for _ in range(rng.randrange(2, 5)))
    return "repeat: " + _cycle([phrase], 0, " | ", length)


def sentence_document(rng: random.Random) -> str:
    """A higher-entropy document: one or two sentences from a small grammar."""
    def sentence() -> str:
        subject = f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        obj = f"a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        tail = f" {rng.choice(PLACES)}" if rng.random() < 0.5 else ""
        return f"{subject} {rng.choice(VERBS)} {obj}{tail}."
    return " ".join(sentence() for _ in range(rng.randrange(1, 3)))


def training_sequence(rng: random.Random, length: int) -> list[int]:
    """``length`` token ids: finished documents separated by end-of-text, and (most of the
    time) a pattern document that runs to the end of the sequence."""
    ids: list[int] = []
    pattern_last = rng.random() < 0.75
    while len(ids) < length:
        room = length - len(ids)
        if pattern_last and (room < 64 or rng.random() < 0.5):
            ids += encode(pattern_document(rng, room + 8))
            break
        ids += encode(sentence_document(rng)) + [EOS_ID]
    return ids[:length]


# --------------------------------------------------------------------------- model


@dataclass
class TinyConfig:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    vocab_size: int = VOCAB_SIZE
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024

    def to_config_json(self) -> dict:
        """``config.json`` in the Qwen3 layout (with the WeDLM ``mask_token_id``)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **asdict(self),
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": EOS_ID,
            "eos_token_id": EOS_ID,
            "mask_token_id": MASK_ID,
        }


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-halves RoPE; ``x [B, heads, rows, D]``, ``cos/sin [B, 1, rows, D/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TinyQwen3(torch.nn.Module):
    """Qwen3 forward (pre-norm, per-head q/k RMSNorm before RoPE, GQA, SiLU MLP, untied
    head) with explicit positions and an explicit boolean attention mask."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = c = config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.weights = torch.nn.ParameterDict()
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                  "model.norm.weight": (c.hidden_size,),
                  "lm_head.weight": (c.vocab_size, c.hidden_size)}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (c.hidden_size,),
                p + "self_attn.q_proj.weight": (q_size, c.hidden_size),
                p + "self_attn.k_proj.weight": (kv_size, c.hidden_size),
                p + "self_attn.v_proj.weight": (kv_size, c.hidden_size),
                p + "self_attn.o_proj.weight": (c.hidden_size, q_size),
                p + "self_attn.q_norm.weight": (c.head_dim,),
                p + "self_attn.k_norm.weight": (c.head_dim,),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            })
        self.names = list(shapes)
        for name, shape in shapes.items():
            if name.endswith("norm.weight") or "layernorm" in name:
                value = torch.ones(shape)
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(2 * c.num_hidden_layers)
                value = torch.randn(shape) * std
            # ParameterDict keys may not contain dots
            self.weights[name.replace(".", "/")] = torch.nn.Parameter(value)

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "/")]

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        return {name: self.w(name).detach().contiguous().clone() for name in self.names}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, rows, V]`` of ``input_ids [B, rows]`` at RoPE ``positions [B, rows]``;
        ``attention_mask [rows, rows]`` (bool, True = may attend)."""
        c = self.config
        batch, rows = input_ids.shape
        inv_freq = c.rope_theta ** (-torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        angles = positions.float()[..., None] * inv_freq  # [B, rows, D/2]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        group = c.num_attention_heads // c.num_key_value_heads
        x = F.embedding(input_ids, self.w("model.embed_tokens.weight"))
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = _rms_norm(x, self.w(p + "input_layernorm.weight"), c.rms_norm_eps)
            q = F.linear(h, self.w(p + "self_attn.q_proj.weight"))
            k = F.linear(h, self.w(p + "self_attn.k_proj.weight"))
            v = F.linear(h, self.w(p + "self_attn.v_proj.weight"))
            q = q.view(batch, rows, c.num_attention_heads, c.head_dim).transpose(1, 2)
            k = k.view(batch, rows, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            v = v.view(batch, rows, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            q = _rope(_rms_norm(q, self.w(p + "self_attn.q_norm.weight"), c.rms_norm_eps), cos, sin)
            k = _rope(_rms_norm(k, self.w(p + "self_attn.k_norm.weight"), c.rms_norm_eps), cos, sin)
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            attention = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
            attention = attention.transpose(1, 2).reshape(batch, rows, -1)
            x = x + F.linear(attention, self.w(p + "self_attn.o_proj.weight"))
            h = _rms_norm(x, self.w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            gate = F.linear(h, self.w(p + "mlp.gate_proj.weight"))
            up = F.linear(h, self.w(p + "mlp.up_proj.weight"))
            x = x + F.linear(F.silu(gate) * up, self.w(p + "mlp.down_proj.weight"))
        x = _rms_norm(x, self.w("model.norm.weight"), c.rms_norm_eps)
        return F.linear(x, self.w("lm_head.weight"))


# --------------------------------------------------------------------------- objective


def block_bounds(length: int, block: int, phase: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` of the masked-stream blocks of a sequence of ``length`` positions: a
    block starts at 0 and at every position ``p`` with ``(p + phase) % block == 0``, so the
    first block holds ``block - phase`` positions and the last may be short."""
    block_of = _block_of(length, block, phase).tolist()
    starts = [p for p in range(length) if p == 0 or block_of[p] != block_of[p - 1]]
    return list(zip(starts, starts[1:] + [length]))


def _block_of(length: int, block: int, phase: int) -> torch.Tensor:
    """Block number of every position ``0..length)`` (see :func:`block_bounds`)."""
    return (torch.arange(length) + phase) // block


def dual_stream_mask(length: int, block: int, phase: int = 0) -> torch.Tensor:
    """``[2N, 2N]`` bool attention mask: rows ``0..N)`` are the clean stream (causal), rows
    ``N..2N)`` the masked stream in reordered order; a masked-stream row of a block starting
    at position ``s`` (:func:`block_bounds`) sees the clean rows at positions ``< s`` and its
    own block's rows up to itself."""
    index = torch.arange(length)
    block_of = _block_of(length, block, phase)
    block_start = (block_of * block - phase).clamp(min=0)
    mask = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
    mask[:length, :length] = index[None, :] <= index[:, None]
    mask[length:, :length] = index[None, :] < block_start[:, None]
    mask[length:, length:] = (block_of[None, :] == block_of[:, None]) & (
        index[None, :] <= index[:, None]
    )
    return mask


def masked_stream(
    tokens: torch.Tensor, block: int, generator: torch.Generator, phase: int = 0,
    all_masked: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build the masked stream of ``tokens [B, N]`` cut into the blocks of
    :func:`block_bounds` (``block``, ``phase``). A block is masked whole with probability
    ``all_masked``, else ``k`` uniform in ``1..n`` of its ``n`` tokens are.

    Returns ``(input_ids, positions, targets, weights)``, each ``[B, N]`` in reordered
    (physical) order: observed tokens of a block first, then its masks; ``targets`` is the
    original token of every mask row; ``weights`` is ``1 / r`` on mask rows and 0 on
    observed rows.
    """
    batch, length = tokens.shape
    # Work on ``phase`` padding slots + the sequence + padding up to whole blocks: slot j is
    # position j - phase, and every block is a row of ``block`` slots.
    blocks = -(-(length + phase) // block)
    slot = torch.arange(blocks * block).view(blocks, block)
    position = slot - phase
    real = (position >= 0) & (position < length)  # [blocks, block]
    real_count = real.sum(-1)  # positions per block, >= 1
    # per block: k ~ uniform{1..n} masked tokens of its n positions (ratio r = k / n),
    # chosen uniformly among them
    draw = torch.rand(batch, blocks, 1, generator=generator)
    num_masked = (draw * real_count[:, None]).long() + 1
    if all_masked > 0:  # (no draw otherwise: the random stream stays that of older runs)
        whole = torch.rand(batch, blocks, 1, generator=generator) < all_masked
        num_masked = torch.where(whole, real_count[:, None], num_masked)
    keys = torch.rand(batch, blocks, block, generator=generator).masked_fill(~real, 2.0)
    ranks = keys.argsort(dim=-1).argsort(dim=-1)  # padding slots rank last
    is_mask = (ranks < num_masked) & real  # [B, blocks, block]
    # stable partition of each block: leading padding, observed slots, mask slots, trailing
    # padding (slot order kept within each); dropping the padding leaves N rows
    kind = torch.where(real, 1 + is_mask.long(), torch.where(position < 0, 0, 3))
    order = (kind * block + torch.arange(block)).argsort(dim=-1)  # [B, blocks, block]
    keep = slice(phase, phase + length)
    positions = (slot[:, :1] + order - phase).reshape(batch, -1)[:, keep]
    original = tokens.gather(1, positions)
    reordered_mask = is_mask.gather(-1, order).reshape(batch, -1)[:, keep]
    input_ids = torch.where(reordered_mask, torch.full_like(original, MASK_ID), original)
    ratio = (num_masked.float() / real_count[:, None]).expand(batch, blocks, block)
    weights = reordered_mask.float() / ratio.reshape(batch, -1)[:, keep]
    return input_ids, positions, original, weights


def wedlm_loss(model: TinyQwen3, tokens: torch.Tensor, block: int, attention_mask: torch.Tensor,
               generator: torch.Generator, phase: int = 0,
               all_masked: float = 0.0) -> tuple[torch.Tensor, float, float]:
    """``(loss, masked loss, AR loss)`` of one batch ``tokens [B, N]`` (module docstring);
    ``attention_mask`` is ``dual_stream_mask(N, block, phase)``."""
    batch, length = tokens.shape
    masked_ids, masked_positions, targets, weights = masked_stream(tokens, block, generator,
                                                                   phase, all_masked)
    clean_positions = torch.arange(length).expand(batch, length)
    logits = model(torch.cat([tokens, masked_ids], dim=1),
                   torch.cat([clean_positions, masked_positions], dim=1), attention_mask)
    vocab = logits.shape[-1]
    ar_loss = F.cross_entropy(logits[:, : length - 1].reshape(-1, vocab),
                              tokens[:, 1:].reshape(-1))
    token_loss = F.cross_entropy(logits[:, length:].reshape(-1, vocab), targets.reshape(-1),
                                 reduction="none")
    mask_loss = (token_loss * weights.reshape(-1)).sum() / (batch * length)
    return 0.5 * (mask_loss + ar_loss), mask_loss.item(), ar_loss.item()


# --------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    steps: int = 4400
    batch_size: int = 16
    seq_len: int = 128
    block: int = 16  # masked-stream block size (the decode window of the demo)
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    random_phase: bool = False  # blocks start at a random phase per batch (dual_stream_mask)
    all_masked: float = 0.5  # probability that a block is masked whole (masked_stream)


def train(model_config: TinyConfig, train_config: TrainConfig, log=print) -> TinyQwen3:
    """Train a fresh model; deterministic for a given seed and thread count."""
    t = train_config
    if t.seq_len % t.block:
        raise ValueError(f"seq_len={t.seq_len} must be a multiple of block={t.block}")
    torch.manual_seed(t.seed)
    rng = random.Random(t.seed)
    generator = torch.Generator().manual_seed(t.seed)
    model = TinyQwen3(model_config)
    decay = [p for n, p in model.weights.items() if not n.endswith("norm/weight")]
    no_decay = [p for n, p in model.weights.items() if n.endswith("norm/weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < t.warmup:
            return t.lr * (step + 1) / t.warmup
        progress = (step - t.warmup) / max(1, t.steps - t.warmup)
        return t.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    masks = [dual_stream_mask(t.seq_len, t.block, phase)
             for phase in range(t.block if t.random_phase else 1)]
    start = time.perf_counter()
    running = None
    for step in range(t.steps):
        tokens = torch.tensor([training_sequence(rng, t.seq_len) for _ in range(t.batch_size)])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        phase = rng.randrange(t.block) if t.random_phase else 0  # (module docstring)
        loss, mask_loss, ar_loss = wedlm_loss(model, tokens, t.block, masks[phase], generator,
                                              phase, t.all_masked)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        values = (loss.item(), mask_loss, ar_loss)
        running = values if running is None else tuple(0.95 * r + 0.05 * v
                                                      for r, v in zip(running, values))
        if step % 50 == 0 or step == t.steps - 1:
            elapsed = time.perf_counter() - start
            log(f"step {step:5d}/{t.steps}  loss {running[0]:.3f}  masked {running[1]:.3f}  "
                f"ar {running[2]:.3f}  lr {lr_at(step):.2e}  {elapsed:6.0f} s")
    return model


def save(model: TinyQwen3, train_config: TrainConfig, out: Path) -> None:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` and
    ``tokenizer.json`` (a checkpoint ``model_min.load_model`` reads)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_config_json()
    config["training"] = {"objective": "wedlm dual-stream", **asdict(train_config),
                          "torch": torch.__version__, "threads": torch.get_num_threads()}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": EOS_ID, "bos_token_id": EOS_ID}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False) + "\n")
    save_file(model.state_dict_for_save(), str(out / "model.safetensors"),
              metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m model_min.train_tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--random-phase", action="store_true",
                        help="start each batch's masked-stream blocks at a random phase")
    parser.add_argument("--all-masked", type=float, default=defaults.all_masked,
                        help="probability that a masked-stream block is masked whole")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (the weights depend on it; 1 gives the same "
                             "weights on every machine)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if not 0.0 <= args.all_masked <= 1.0:
        parser.error(f"--all-masked is a probability in [0, 1], got {args.all_masked}")
    train_config = TrainConfig(steps=args.steps, batch_size=args.batch_size,
                               seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                               random_phase=args.random_phase, all_masked=args.all_masked,
                               warmup=min(defaults.warmup, max(1, args.steps // 10)))
    log = (lambda *_: None) if args.quiet else (lambda text: print(text, flush=True))
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    try:
        start = time.perf_counter()
        model = train(TinyConfig(), train_config, log)
        save(model, train_config, args.out)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    log(f"wrote {args.out} in {time.perf_counter() - start:.0f} s; "
        f"model.safetensors sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
