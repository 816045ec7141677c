"""Philox4x32-10: a counter-based generator, random numbers that are a pure function of where
they are.

A counter-based generator (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC 2011) maps (counter, key) to random bits with a keyed bijection: there is no
state to advance, so any number of a stream is computed directly from its index, in any
order, on any device. That is what dropout masks need here (minidist/autograd/dropout_keys.py):
a rank computes only its own slice of a mask (its rows, its heads, its positions, one tile of
the attention weights) and gets exactly the numbers one process would have used there. cuRAND
and PyTorch's CUDA dropout use the same generator.

One call: counter (c0, c1, c2, c3) and key (k0, k1), four 32-bit words and two, give four
32-bit words. Each of the 10 rounds multiplies two counter words by fixed odd constants,
keeps the high and low halves of the 64-bit products, and mixes them with the other two words
and the key; the key is bumped by two Weyl constants between rounds:

    hi0:lo0 = M0 * c0          hi1:lo1 = M1 * c2
    (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    (k0, k1) <- (k0 + W0, k1 + W1) mod 2**32

Written in xp code on uint64 arrays holding 32-bit words (a 32 x 32 -> 64-bit product fits),
so numpy and cupy run the same lines: elementwise over whole arrays of counters.
Tests: tests/test_dropout_keys.py (Random123's known answers, uniformity).
"""
import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57          # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85          # the key schedule's Weyl increments
MASK32 = 0xFFFFFFFF
ROUNDS = 10


def philox4x32(counter, key, xp=np, rounds=ROUNDS):
    """The four output words of Philox4x32-`rounds`, uint64 arrays holding 32 bits each.

    counter: four integer arrays (or ints) of 32-bit words, broadcast together; key: two
    ints (k0, k1), the same for every counter. The round is written with out= into six
    arrays allocated once (on the host, allocating temporaries made it 2x slower)."""
    shape = np.broadcast_shapes(*(np.shape(c) for c in counter))
    c0, c1, c2, c3 = (xp.array(xp.broadcast_to(xp.asarray(c, dtype=xp.uint64), shape))
                      for c in counter)
    p0, p1 = xp.empty(shape, xp.uint64), xp.empty(shape, xp.uint64)
    k0, k1 = int(key[0]) & MASK32, int(key[1]) & MASK32
    m0, m1, low, shift = (xp.uint64(v) for v in (M0, M1, MASK32, 32))
    for r in range(rounds):
        if r:                                                      # bump the key
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        xp.multiply(c0, m0, out=p0)                                # hi0:lo0, < 2**64
        xp.multiply(c2, m1, out=p1)                                # hi1:lo1
        xp.right_shift(p1, shift, out=c0)                          # c0 = hi1 ^ c1 ^ k0
        c0 ^= c1
        c0 ^= xp.uint64(k0)
        xp.bitwise_and(p1, low, out=c1)                            # c1 = lo1
        xp.right_shift(p0, shift, out=c2)                          # c2 = hi0 ^ c3 ^ k1
        c2 ^= c3
        c2 ^= xp.uint64(k1)
        xp.bitwise_and(p0, low, out=c3)                            # c3 = lo0
    return c0, c1, c2, c3


def to_unit_float32(word, xp=np):
    """32 random bits -> float32 in [0, 1): the top 24 bits times 2**-24 (every value exact,
    the same on any device)."""
    return (word >> xp.uint64(8)).astype(xp.float32) * xp.float32(2.0 ** -24)
