"""The random stream of ``select_tokens`` sampling: Philox4x32-10 and the Gumbel transform.

docs/contracts.md "select_tokens" defines the stream: key ``(seed low, seed high)``,
counter ``(v >> 2, position low, position high, 0)``, the word of vocabulary index ``v`` is
output word ``v & 3``, ``u = ((x >> 8) + 0.5) * 2**-24`` and ``g = -log(-log(u))``. Two
forms compute it bit for bit: plain int64 tensor arithmetic (the PyTorch implementation)
and ``@triton.jit`` helpers (the kernels), with a test kernel that exposes the latter.
"""

import torch
import triton
import triton.language as tl

from ._triton import KernelVariant

# Philox4x32-10 constants (Salmon et al., SC11): round multipliers and key increments.
PHILOX_MULTIPLIER_0 = 0xD2511F53
PHILOX_MULTIPLIER_1 = 0xCD9E8D57
PHILOX_WEYL_0 = 0x9E3779B9
PHILOX_WEYL_1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------
# Philox4x32-10 in int64 tensor arithmetic.
#
# Every 32-bit word is held in an int64 tensor with a value in [0, 2**32). The 32x32-bit
# products of a round would need 64 unsigned bits, so the variable operand is split into
# 16-bit halves: with a = a_hi * 2**16 + a_lo, t = a_hi * m and s = a_lo * m stay below
# 2**48, and a * m = t * 2**16 + s gives
#     low word  = ((t mod 2**16) * 2**16 + s) mod 2**32
#     high word = (t + s // 2**16) // 2**16.
# ----------------------------------------------------------------------------------------


def _mul_hi_lo(word: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``word * multiplier`` without int64 overflow."""
    high_product = (word >> 16) * multiplier
    low_product = (word & 0xFFFF) * multiplier
    low = (((high_product & 0xFFFF) << 16) + low_product) & MASK32
    high = (high_product + (low_product >> 16)) >> 16
    return high, low


def philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on broadcastable int64 tensors holding 32-bit values (in [0, 2**32))."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + PHILOX_WEYL_0) & MASK32
            k1 = (k1 + PHILOX_WEYL_1) & MASK32
        hi0, lo0 = _mul_hi_lo(c0, PHILOX_MULTIPLIER_0)
        hi1, lo1 = _mul_hi_lo(c2, PHILOX_MULTIPLIER_1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_bits(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The random word of every (row, vocabulary index): ``[R, V]`` int64.

    ``seed`` and ``position`` are ``[R]`` int64; the key is the seed's two 32-bit halves
    (two's complement), the counter of index ``v`` is ``(v >> 2, position low, position high,
    0)`` and its word is output ``v & 3``: one Philox call serves four consecutive indices.
    """
    seed = seed.unsqueeze(1)
    position = position.unsqueeze(1)
    quads = torch.arange((vocab_size + 3) // 4, device=seed.device, dtype=torch.int64)
    counter = (quads.unsqueeze(0), position & MASK32, (position >> 32) & MASK32,
               torch.zeros_like(position))
    key = (seed & MASK32, (seed >> 32) & MASK32)
    words = torch.stack(torch.broadcast_tensors(*philox4x32_10(counter, key)), dim=-1)
    return words.flatten(-2)[:, :vocab_size]


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log(u))``, ``u = ((bits >> 8) + 0.5) * 2**-24``, in fp32.

    ``u`` has 25 significant bits, so in fp32 it is exact only below 1/2, where
    ``(bits >> 8) < 2**23``; above, ``1 - u`` is exact instead. ``-log(u)`` is therefore
    computed as ``-log(u)`` below 1/2 and ``-log1p(-(1 - u))`` above, accurate to a few fp32
    ulps everywhere (rounding ``u`` itself would turn the largest ``u`` into 1 and
    ``g`` into ``+inf``).
    """
    top = bits >> 8
    lower_half = top < (1 << 23)
    u_lower = (top.float() + 0.5) * 2.0**-24
    one_minus_u_upper = ((1 << 24) - top).float().sub(0.5).mul(2.0**-24)
    neg_log_u = torch.where(lower_half, -torch.log(u_lower), -torch.log1p(-one_minus_u_upper))
    return -torch.log(neg_log_u)


def philox_gumbel(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise of every (row, vocabulary index): ``[R, V]`` fp32."""
    return gumbel_from_bits(philox_bits(seed, position, vocab_size))


# ----------------------------------------------------------------------------------------
# The same in Triton.
# ----------------------------------------------------------------------------------------

_PHILOX_MUL0 = tl.constexpr(PHILOX_MULTIPLIER_0)
_PHILOX_MUL1 = tl.constexpr(PHILOX_MULTIPLIER_1)
_PHILOX_KEY_STEP0 = tl.constexpr(PHILOX_WEYL_0)
_PHILOX_KEY_STEP1 = tl.constexpr(PHILOX_WEYL_1)
_PHILOX_ROUNDS = tl.constexpr(PHILOX_ROUNDS)


@triton.jit
def philox4x32_words(quad, position, seed):
    """Philox4x32-10 at counter (quad, position low, position high, 0) with key (seed low,
    seed high): the four uint32 output words; quad is a uint32 tensor."""
    c0 = quad
    c1 = tl.zeros_like(quad) + position.to(tl.uint32)
    c2 = tl.zeros_like(quad) + (position >> 32).to(tl.uint32)
    c3 = tl.zeros_like(quad)
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    for round_index in tl.static_range(_PHILOX_ROUNDS):
        if round_index > 0:
            k0 = k0 + _PHILOX_KEY_STEP0
            k1 = k1 + _PHILOX_KEY_STEP1
        hi0 = tl.umulhi(c0, _PHILOX_MUL0)
        lo0 = c0 * _PHILOX_MUL0
        hi1 = tl.umulhi(c2, _PHILOX_MUL1)
        lo1 = c2 * _PHILOX_MUL1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def gumbel_from_word(word):
    """g = -log(-log(u)), u = ((word >> 8) + 0.5) * 2^-24, in fp32 (see gumbel_from_bits).

    Below u = 1/2, u is exact; above, 1 - u is exact and -log(u) = -log1p(-(1 - u)) with
    log1p(y) = y * log(1 + y) / ((1 + y) - 1) (exact division of the rounding error out;
    y itself when 1 + y rounds to 1)."""
    top = (word >> 8).to(tl.int32)  # < 2^24
    u_lower = (top.to(tl.float32) + 0.5) * 5.9604644775390625e-08
    one_minus_u = ((16777216 - top).to(tl.float32) - 0.5) * 5.9604644775390625e-08
    y = -tl.minimum(one_minus_u, 0.5)  # -(1 - u) where it is used (u > 1/2)
    one_plus_y = 1.0 + y
    rounded_to_one = one_plus_y == 1.0
    denominator = tl.where(rounded_to_one, 1.0, one_plus_y - 1.0)
    log1p_y = tl.where(
        rounded_to_one, y, tl.math.div_rn(y * tl.log(one_plus_y), denominator)
    )
    neg_log_u = tl.where(top < 8388608, -tl.log(u_lower), -log1p_y)
    return -tl.log(neg_log_u)


@triton.jit
def _random_stream_debug_kernel(
    seed_ptr,  # [N] int64
    position_ptr,  # [N] int64
    vocab_index_ptr,  # [N] int64
    word_ptr,  # [N] int64: the random word of the vocabulary index (out unless WORDS_GIVEN)
    gumbel_ptr,  # [N] fp32 out: the Gumbel noise of that word
    count,
    WORDS_GIVEN: tl.constexpr,  # transform the given words instead of drawing them
    BLOCK: tl.constexpr,
):
    """The sampling kernels' random stream for explicit (seed, position, v) triples, or
    their Gumbel transform of explicit words, for tests."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < count
    if WORDS_GIVEN:
        word = tl.load(word_ptr + index, mask=mask, other=0).to(tl.uint32)
    else:
        seed = tl.load(seed_ptr + index, mask=mask, other=0)
        position = tl.load(position_ptr + index, mask=mask, other=0)
        vocab_index = tl.load(vocab_index_ptr + index, mask=mask, other=0)
        w0, w1, w2, w3 = philox4x32_words((vocab_index >> 2).to(tl.uint32), position, seed)
        lane = vocab_index & 3
        word = tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))
        tl.store(word_ptr + index, word.to(tl.int64), mask=mask)
    tl.store(gumbel_ptr + index, gumbel_from_word(word), mask=mask)


_DEBUG_BLOCK = 1024


def philox_gumbel_triton(
    seed: torch.Tensor, position: torch.Tensor, vocab_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling kernels' random stream for ``[N]`` int64 (seed, position, vocabulary
    index) triples: (random word as int64, Gumbel noise fp32). For tests."""
    word = torch.empty(seed.shape[0], dtype=torch.int64, device=seed.device)
    return word, _random_stream(seed, position, vocab_index, word, words_given=False)


def gumbel_from_bits_triton(words: torch.Tensor) -> torch.Tensor:
    """The sampling kernels' Gumbel transform of ``[N]`` int64 32-bit words. For tests."""
    return _random_stream(words, words, words, words.contiguous(), words_given=True)


def _random_stream(seed, position, vocab_index, word, words_given: bool) -> torch.Tensor:
    count = word.shape[0]
    gumbel = torch.empty(count, dtype=torch.float32, device=word.device)
    if count:
        _random_stream_debug_kernel[(triton.cdiv(count, _DEBUG_BLOCK),)](
            seed.contiguous(), position.contiguous(), vocab_index.contiguous(), word, gumbel,
            count, WORDS_GIVEN=words_given, BLOCK=_DEBUG_BLOCK,
        )
    return gumbel


def kernel_variants() -> list[KernelVariant]:
    """The test kernel's two specialisations (compiled for sm_90 with select_tokens')."""
    variants = []
    for words_given in (False, True):
        variants.append(KernelVariant(
            name=f"random_stream_debug{'_words_given' if words_given else ''}",
            kernel=_random_stream_debug_kernel,
            signature={"seed_ptr": "*i64", "position_ptr": "*i64", "vocab_index_ptr": "*i64",
                       "word_ptr": "*i64", "gumbel_ptr": "*fp32", "count": "i32",
                       "WORDS_GIVEN": "constexpr", "BLOCK": "constexpr"},
            constexprs={"WORDS_GIVEN": words_given, "BLOCK": _DEBUG_BLOCK},
        ))
    return variants
