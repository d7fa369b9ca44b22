"""The documents' shuffle, one permutation per epoch: grain's `MapDataset.shuffle` order, computed a whole epoch at a
time.

Grain draws each epoch's permutation index by index (`index_shuffle`: a 4-round Simon cipher over at least 16
bits, walked until it lands inside the dataset), so each index of a dataset of n documents costs about 2^16 / n
cipher rounds: 0.5 ms at 32 documents, 2 ms at 8 (a trusted set, a test corpus). Here the cipher runs once over its
whole 16-bit domain in numpy and the walks are taken by pointer jumping: the same permutation (a test compares it
with grain's for every index), about 2.5 ms per epoch whatever n. Datasets of more than 2^16 documents, where the
walks are short, keep grain's own per-index call.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

BITS = 8  # the cipher's word: its block (2 words) is the 16 bits of the smallest domain grain uses
DOMAIN = 1 << (2 * BITS)
ROUNDS = 4
M32 = 0xFFFFFFFF


def round_keys(seed: int, rounds: int = ROUNDS) -> list[int]:
    """The cipher's round keys: C++'s `std::seed_seq{seed}.generate` of `rounds` 32-bit words (its algorithm is
    fixed by the C++ standard, [rand.util.seedseq])."""
    n, s, out = rounds, 1, [0x8B8B8B8B] * rounds
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    mix = lambda x: x ^ (x >> 27)
    for k in range(max(s + 1, n)):
        r1 = (1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & M32
        r2 = (r1 + (s if k == 0 else (k % n) + seed if k <= s else k % n)) & M32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & M32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & M32
        out[k % n] = r2
    for k in range(max(s + 1, n), max(s + 1, n) + n):
        r3 = (1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & M32)) & M32
        r4 = (r3 - k % n) & M32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return out


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint8(r)) | (x >> np.uint8(BITS - r))  # uint8: the bits shifted out are dropped


def _f(x: np.ndarray) -> np.ndarray:
    return (_rotl(x, 1) & x) ^ _rotl(x, 2)  # Simon's round function; an 8-bit word rotated by 8 is itself


def cipher(values: np.ndarray, seed: int) -> np.ndarray:
    """The 16-bit block cipher that grain's shuffle walks, on every value at once (its words as uint8: a quarter of
    the time of int64 words)."""
    left, right = ((values >> BITS) & 0xFF).astype(np.uint8), (values & 0xFF).astype(np.uint8)
    keys = round_keys(seed)
    for k1, k2 in zip(keys[0::2], keys[1::2]):
        left = left ^ _f(right) ^ np.uint8(k1 & 0xFF)
        right = right ^ _f(left) ^ np.uint8(k2 & 0xFF)
    return (left.astype(np.int64) << BITS) | right


@functools.lru_cache(maxsize=64)
def permutation(n: int, seed: int) -> np.ndarray:
    """Where grain's shuffle with `seed` sends each of the indices 0 .. n-1 of an epoch (1 < n <= 2^16)."""
    jump = cipher(np.arange(DOMAIN, dtype=np.int64), seed)
    # pointer jumping: jump[x] is a later value of x's walk and none in between is below n; a value that is not below
    # n is passed over by jumping from where it jumps to
    for _ in range(2 * BITS + 1):
        passed = jump >= n
        if not passed[:n].any():
            break
        jump = np.where(passed, jump[jump], jump)
    out = jump[:n].astype(np.uint16)  # n <= 2^16: 128 KiB at most, per cached epoch
    out.flags.writeable = False
    return out


class EpochShuffleMapDataset(grain.MapDataset):
    """`parent.shuffle(seed)`: the same elements in the same order, each epoch's permutation computed at once."""

    def __init__(self, parent: grain.MapDataset, seed: int):
        super().__init__(parent)
        self._seed = int(seed)

    def __len__(self) -> int:
        return len(self._parent)

    def __str__(self) -> str:
        return "EpochShuffleMapDataset"

    def _shuffled_index(self, index: int) -> int:
        length = len(self._parent)
        epoch, index_in_epoch = divmod(index, length)
        seed = (self._seed + epoch) % 2**32  # grain's seed for the epoch
        if 1 < length <= DOMAIN:
            shuffled = int(permutation(length, seed)[index_in_epoch])
        else:
            shuffled = grain.experimental.index_shuffle(index_in_epoch, max_index=length - 1, seed=seed,
                                                       rounds=ROUNDS)
        return shuffled + epoch * length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[self._shuffled_index(index)]
