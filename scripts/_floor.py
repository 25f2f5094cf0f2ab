"""The whole-weight floor, shared by the benchmarks (scripts/bench_torch.py,
scripts/bench_ort_stream.py): the Python twin of
src/residency/placement.rs's whole_weight_floor, for the tables' "whole-weight
floor" column."""

import math
from functools import reduce


def whole_weight_floor(sizes, budget):
    """The fewest bytes per step any schedule copying whole weights can copy
    under `budget` (docs/RESIDENCY.md): while a streamed weight of m bytes is
    read, it and every weight never copied are resident, so a step copies at
    least total - kept with kept <= budget - m. Exact: for each candidate m,
    every weight above m kept, the rest chosen by subset sum (a bitset over
    multiples of the sizes' gcd)."""
    total = sum(sizes)
    if total <= budget:
        return 0
    g = reduce(math.gcd, sizes)
    best = total
    for m in sorted(set(sizes)):
        kept = sum(x for x in sizes if x > m)
        room = budget - m - kept
        if room < 0:
            continue
        cap = room // g
        mask = (1 << (cap + 1)) - 1
        reach = 1
        for x in sizes:
            if x <= m:
                reach = (reach | (reach << (x // g))) & mask
        best = min(best, total - kept - (reach.bit_length() - 1) * g)
    return best
