"""The Philox4x32-10 stream behind ``select_tokens`` sampling.

The reference (pure Python and numpy) is pinned to the published Random123 known answers;
the int64 torch implementation of ``wedlm_kernels.ops.philox`` must reproduce the integer
stream bit for bit, and its fp32 Gumbel noise must match the float64 one.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from reference import philox
from wedlm_kernels.ops import philox as stream

MASK32 = 0xFFFFFFFF

# Random123's known-answer vectors for philox4x32_10 (its tests/kat_vectors, also quoted in
# Random123-Boost libs/random/test/test_philox.cpp and TensorFlow's Philox tests):
# (counter, key, output).
RANDOM123_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

word32 = st.integers(0, MASK32)
int64 = st.integers(-(2**63), 2**63 - 1)


@pytest.mark.parametrize("counter,key,expected", RANDOM123_KAT)
def test_scalar_reference_matches_random123_known_answers(counter, key, expected):
    assert philox.philox4x32_10(counter, key) == expected


@pytest.mark.parametrize("counter,key,expected", RANDOM123_KAT)
def test_numpy_reference_matches_random123_known_answers(counter, key, expected):
    words = philox.philox4x32_10_numpy(
        tuple(np.array([c], dtype=np.uint64) for c in counter),
        tuple(np.array([k], dtype=np.uint64) for k in key),
    )
    assert tuple(int(w[0]) for w in words) == expected


@pytest.mark.parametrize("counter,key,expected", RANDOM123_KAT)
def test_torch_philox_matches_random123_known_answers(counter, key, expected):
    words = stream.philox4x32_10(
        tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key)
    )
    assert tuple(int(w[0]) for w in words) == expected


def test_stream_at_seed_zero_position_zero_is_the_zero_known_answer_word_by_word():
    # key (0, 0) and counter (0, 0, 0, 0) serve indices 0..3: the four words of the first
    # known answer, in order; index 4 starts the next counter
    first_answer = list(RANDOM123_KAT[0][2])
    bits = stream.philox_bits(torch.tensor([0]), torch.tensor([0]), 5)
    assert bits[0, :4].tolist() == first_answer
    assert [int(w) for w in philox.philox_word(0, 0, np.arange(4))] == first_answer
    assert int(bits[0, 4]) == philox.philox4x32_10((1, 0, 0, 0), (0, 0))[0]


@given(
    counters=st.lists(st.tuples(word32, word32, word32, word32), min_size=1, max_size=20),
    keys=st.lists(st.tuples(word32, word32), min_size=1, max_size=20),
)
def test_numpy_and_torch_philox_match_scalar_on_random_counters_and_keys(counters, keys):
    count = min(len(counters), len(keys))
    counters, keys = counters[:count], keys[:count]
    expected = [philox.philox4x32_10(c, k) for c, k in zip(counters, keys)]

    numpy_words = philox.philox4x32_10_numpy(
        tuple(np.array([c[i] for c in counters], dtype=np.uint64) for i in range(4)),
        tuple(np.array([k[i] for k in keys], dtype=np.uint64) for i in range(2)),
    )
    torch_words = stream.philox4x32_10(
        tuple(torch.tensor([c[i] for c in counters]) for i in range(4)),
        tuple(torch.tensor([k[i] for k in keys]) for i in range(2)),
    )
    for n, words in enumerate(expected):
        assert tuple(int(w[n]) for w in numpy_words) == words
        assert tuple(int(w[n]) for w in torch_words) == words


@given(
    seeds=st.lists(int64, min_size=1, max_size=4),
    positions=st.lists(
        st.one_of(st.integers(0, 5000), st.integers(2**32 - 3, 2**32 + 3),
                  st.integers(0, 2**63 - 1)),
        min_size=1, max_size=4,
    ),
    vocab_size=st.integers(1, 300),
)
@example(seeds=[-(2**63), -1, 0, 2**63 - 1], positions=[0, 2**32 - 1, 2**32, 2**63 - 1],
         vocab_size=1)
def test_torch_stream_matches_reference_bit_for_bit(seeds, positions, vocab_size):
    """Negative seeds (two's complement key), seeds and positions above 2**32 included."""
    rows = min(len(seeds), len(positions))
    seeds, positions = seeds[:rows], positions[:rows]
    bits = stream.philox_bits(torch.tensor(seeds), torch.tensor(positions), vocab_size)
    assert bits.shape == (rows, vocab_size) and bits.dtype == torch.int64
    for r in range(rows):
        expected = philox.philox_word(seeds[r], positions[r], np.arange(vocab_size))
        assert bits[r].tolist() == [int(x) for x in expected]
        # spot-check the documented key and counter layout with the scalar textbook form
        seed, position = seeds[r], positions[r]
        key = (seed & MASK32, (seed >> 32) & MASK32)
        for v in {0, vocab_size - 1, vocab_size // 2}:
            counter = (v >> 2, position & MASK32, (position >> 32) & MASK32, 0)
            assert int(bits[r, v]) == philox.philox4x32_10(counter, key)[v & 3]
            assert int(bits[r, v]) == philox.vocab_word(seed, position, v)


def test_uniform_lies_strictly_inside_the_unit_interval_on_the_odd_2_pow_minus_25_grid():
    words = np.concatenate(
        [np.array([0, 255, 256, 2**31 - 1, 2**31, 2**32 - 256, MASK32], dtype=np.uint64),
         philox.philox_word(12345, 678, np.arange(20000))]
    )
    u = philox.uniform_from_word(words)
    assert np.all(u > 0) and np.all(u < 1)
    scaled = u * 2.0**25  # exact in float64: u = (2 * (x >> 8) + 1) * 2**-25
    assert np.all(scaled == np.floor(scaled)) and np.all(scaled % 2 == 1)
    # u itself needs 25 bits above 1/2, but the smaller of u and 1 - u is always exact in
    # fp32, which is what the fp32 Gumbel evaluation relies on.
    nearer_edge = np.minimum(u, 1.0 - u)
    assert np.all(nearer_edge.astype(np.float32).astype(np.float64) == nearer_edge)
    assert u.min() == 2.0**-25 and u.max() == 1.0 - 2.0**-25


def test_uniform_has_the_mean_and_variance_of_a_uniform_variable():
    seeds = torch.randint(-(2**62), 2**62, (100,))
    positions = torch.randint(0, 2**40, (100,))
    bits = stream.philox_bits(seeds, positions, 1000)
    u = philox.uniform_from_word(bits.numpy().astype(np.uint64)).ravel()
    n = u.size
    # 6 standard errors: a false failure has probability about 2e-9 each.
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / n)
    centred_square = (u - 0.5) ** 2  # mean 1/12, variance 1/80 - 1/144
    assert abs(centred_square.mean() - 1 / 12) < 6 * math.sqrt((1 / 80 - 1 / 144) / n)


def test_every_output_bit_is_set_half_of_the_time():
    seeds = torch.randint(-(2**62), 2**62, (50,))
    positions = torch.randint(0, 2**20, (50,))
    bits = stream.philox_bits(seeds, positions, 2000).flatten()
    n = bits.numel()
    for bit in range(32):
        frequency = ((bits >> bit) & 1).double().mean().item()
        assert abs(frequency - 0.5) < 6 * math.sqrt(0.25 / n), bit


def test_fp32_gumbel_matches_float64_including_the_extreme_words():
    # The words whose u is closest to 0 and 1 are where a naive fp32 evaluation fails:
    # ((2**24 - 1) + 0.5) * 2**-24 rounds to 1.0 in fp32 and gives g = +inf.
    edge_words = [0, 1, 255, 256, 2**31 - 256, 2**31 - 1, 2**31, 2**31 + 256,
                  2**32 - 512, 2**32 - 257, 2**32 - 256, MASK32]
    random_words = torch.randint(0, 2**32, (5000,)).tolist()
    words = edge_words + random_words
    actual = stream.gumbel_from_bits(torch.tensor(words))
    expected = torch.from_numpy(philox.gumbel_from_word(np.array(words, dtype=np.uint64)))
    assert actual.dtype == torch.float32
    assert torch.isfinite(actual).all()
    # fp32 evaluation of two logs of exact inputs: a few ulps of |g| (|g| <= 17.4)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=1e-6)


@given(seed=int64, position=st.integers(0, 2**63 - 1), vocab_size=st.integers(1, 500))
@example(seed=-1, position=2**32 - 1, vocab_size=1)
@example(seed=2**63 - 1, position=2**63 - 1, vocab_size=500)
def test_philox_gumbel_matches_reference_gumbel(seed, position, vocab_size):
    actual = stream.philox_gumbel(torch.tensor([seed]), torch.tensor([position]), vocab_size)
    expected = torch.from_numpy(philox.gumbel(seed, position, vocab_size))
    torch.testing.assert_close(actual[0].double(), expected, rtol=1e-6, atol=1e-6)
