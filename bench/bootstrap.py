"""Percentile bootstrap intervals for the benches' paired figures (whole pairs are resampled: a pair shares
the machine's state of its moment, so pairs, not single runs, are the independent units)."""

from __future__ import annotations

import random
from typing import Callable, Sequence


def interval(n: int, stat: Callable[[Sequence[int]], float], level: float = 0.95, resamples: int = 4000,
             seed: int = 0) -> tuple[float, float]:
    """The `level` percentile bootstrap interval of `stat` over n pairs; `stat` gets a resample's pair indices."""
    if n < 1:
        raise ValueError("a bootstrap interval needs at least one pair")
    rng = random.Random(seed)
    stats = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return stats[int((1 - level) / 2 * (resamples - 1))], stats[int((1 + level) / 2 * (resamples - 1))]
