"""Philox4x32-10, the counter-based random stream of ``select_tokens``.

Philox (Salmon, Moraes, Dror and Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3", SC11)
maps a 128-bit counter and a 64-bit key to 128 random bits with ten rounds of

    hi0, lo0 = high and low 32 bits of 0xD2511F53 * c0
    hi1, lo1 = high and low 32 bits of 0xCD9E8D57 * c2
    (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

with the key bumped by the Weyl constants (0x9E3779B9, 0xBB67AE85) between rounds.

``select_tokens`` draws one number per (sequence seed, absolute position, vocabulary index):
key ``(seed & 0xffffffff, (seed >> 32) & 0xffffffff)`` (the seed's 64 two's-complement bits),
counter ``(v >> 2, p & 0xffffffff, (p >> 32) & 0xffffffff, 0)``, so one Philox call serves
four consecutive vocabulary indices; output word ``v & 3`` is ``x``, which gives
``u = ((x >> 8) + 0.5) * 2**-24`` and the Gumbel noise ``g = -log(-log(u))``.

:func:`philox4x32_10` is the textbook scalar form in Python integers; the numpy functions
compute the same stream for many counters at once in uint64 (a product of two 32-bit
numbers fits in 64 bits, so every step is exact).
"""

import numpy as np

MULTIPLIER_0 = 0xD2511F53
MULTIPLIER_1 = 0xCD9E8D57
WEYL_0 = 0x9E3779B9
WEYL_1 = 0xBB67AE85
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def philox4x32_10(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> tuple[int, int, int, int]:
    """The four 32-bit output words for one 128-bit counter and 64-bit key."""
    c0, c1, c2, c3 = (c & MASK32 for c in counter)
    k0, k1 = (k & MASK32 for k in key)
    for round_index in range(ROUNDS):
        if round_index > 0:
            k0 = (k0 + WEYL_0) & MASK32
            k1 = (k1 + WEYL_1) & MASK32
        product0 = MULTIPLIER_0 * c0
        product1 = MULTIPLIER_1 * c2
        hi0, lo0 = product0 >> 32, product0 & MASK32
        hi1, lo1 = product1 >> 32, product1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def seed_key(seed: int) -> tuple[int, int]:
    """Key words of a (possibly negative) 64-bit seed: its low and high 32 bits."""
    return seed & MASK32, (seed >> 32) & MASK32


def position_counter(vocab_index: int, position: int) -> tuple[int, int, int, int]:
    """Counter of vocabulary index ``vocab_index`` at absolute position ``position`` (shared
    by the four indices ``4 * (vocab_index >> 2) .. + 3``)."""
    return (vocab_index >> 2) & MASK32, position & MASK32, (position >> 32) & MASK32, 0


def vocab_word(seed: int, position: int, vocab_index: int) -> int:
    """The word ``x`` of one vocabulary index, from the scalar :func:`philox4x32_10`."""
    words = philox4x32_10(position_counter(vocab_index, position), seed_key(seed))
    return words[vocab_index & 3]


def philox4x32_10_numpy(
    counter: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    key: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`philox4x32_10` on broadcastable arrays of 32-bit values (returned as uint64)."""
    mask = np.uint64(MASK32)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & mask for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & mask for k in key)
    for round_index in range(ROUNDS):
        if round_index > 0:
            k0 = (k0 + np.uint64(WEYL_0)) & mask
            k1 = (k1 + np.uint64(WEYL_1)) & mask
        product0 = np.uint64(MULTIPLIER_0) * c0
        product1 = np.uint64(MULTIPLIER_1) * c2
        hi0, lo0 = product0 >> np.uint64(32), product0 & mask
        hi1, lo1 = product1 >> np.uint64(32), product1 & mask
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_word(seed: int, position: int, vocab_indices: np.ndarray) -> np.ndarray:
    """The word ``x`` (uint64 holding a 32-bit value) of each vocabulary index: output word
    ``v & 3`` of the Philox call at counter ``(v >> 2, position low, position high, 0)``."""
    key0, key1 = seed_key(seed)
    vocab_indices = np.asarray(vocab_indices, dtype=np.uint64)
    zeros = np.zeros_like(vocab_indices)
    counter = (
        vocab_indices >> np.uint64(2),
        zeros + np.uint64(position & MASK32),
        zeros + np.uint64((position >> 32) & MASK32),
        zeros,
    )
    words = np.stack(philox4x32_10_numpy(counter, (np.uint64(key0), np.uint64(key1))))
    lane = (vocab_indices & np.uint64(3)).astype(np.intp)
    return np.take_along_axis(words, lane[None], axis=0)[0]


def uniform_from_word(word: np.ndarray) -> np.ndarray:
    """``u = ((x >> 8) + 0.5) * 2**-24`` in float64 (exact: 25 significant bits)."""
    top_bits = np.asarray(word, dtype=np.uint64) >> np.uint64(8)
    return (top_bits.astype(np.float64) + 0.5) * 2.0**-24


def gumbel_from_word(word: np.ndarray) -> np.ndarray:
    """Gumbel noise ``-log(-log(u))`` in float64 for words ``x``."""
    return -np.log(-np.log(uniform_from_word(word)))


def uniform(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """``u`` for vocabulary indices ``0 .. vocab_size-1`` at (seed, position), float64."""
    return uniform_from_word(philox_word(seed, position, np.arange(vocab_size)))


def gumbel(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Gumbel noise for vocabulary indices ``0 .. vocab_size-1`` at (seed, position), float64."""
    return gumbel_from_word(philox_word(seed, position, np.arange(vocab_size)))
