"""The order of rows: a keyed bijection of any range, so an epoch's order holds no index."""

from __future__ import annotations


import torch



def keyed_hash(*xs: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the keys of :func:`permute`."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & (1 << 64) - 1)) * 0xBF58476D1CE4E5B9 & (1 << 64) - 1
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & (1 << 64) - 1
    return h ^ (h >> 29)


def permute(i: torch.Tensor, n: int, key: int) -> torch.Tensor:
    """Where positions ``i`` go in a pseudo-random ordering of ``range(n)`` chosen by ``key``: a keyed bijection
    (a four-round Feistel network on the next even power of two, walked back into range), so an epoch's order over
    any number of rows costs memory only for the positions asked."""
    x = i.to(torch.int64).clone()
    if n <= 1:
        return x
    half = ((n - 1).bit_length() + 1) // 2
    low = (1 << half) - 1
    keys = [keyed_hash(key, r) & low for r in range(4)]
    out = torch.ones_like(x, dtype=torch.bool)
    while bool(out.any()):  # cycle walking: a value beyond n goes round again; every cycle holds one below n
        y = x[out]
        left, right = y >> half, y & low
        for k in keys:
            f = (right ^ k) * 0x45D9F3B & 0xFFFFFFFF
            f = (f ^ (f >> 16)) * 0x45D9F3B & 0xFFFFFFFF
            left, right = right, left ^ ((f ^ (f >> 16)) & low)
        x[out] = left << half | right
        out = x >= n
    return x
