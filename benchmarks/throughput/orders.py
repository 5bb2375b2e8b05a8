"""In which order the variants run: balanced, so no variant always follows the same one."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of ``range(n)`` in which every item directly follows
    every other equally often (n orders for even n, 2n for odd n), so no variant
    always runs right after the same one (a run disturbs the next: caches, memory)."""
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def run_order(names: Sequence[str], rep: int) -> list[str]:
    """The order of ``names`` in repetition ``rep`` (a row of ``balanced_orders``)."""
    rows = balanced_orders(len(names))
    return [names[i] for i in rows[rep % len(rows)]]


def rotate(xs: Sequence[str], k: int) -> list[str]:
    xs = list(xs)
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]
