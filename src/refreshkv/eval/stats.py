"""Percentile bootstrap intervals for `refreshkv report`.

Both statistics are macro means over strata (tasks); a single task is the one-stratum case:

- `macro_mean`: the mean over tasks of each task's mean score;
- `macro_ratio`: the ratio of macro means of (method, full) score pairs of the same examples, e.g. the per-task
  `vs full` = mean(method) / mean(full) over the examples the method shares with `full`.

Each of `RESAMPLES` (1000) resamples draws, within every task, as many examples as the task has, with replacement
(a stratified bootstrap: every task keeps its weight); a pair is drawn as a whole, so the method and `full` are
resampled on the same examples. The interval is the `LEVEL` (95%) percentile interval: the 2.5th and 97.5th
empirical quantiles (values attained by a resample) of the 1000 resampled statistics. The generator is seeded with
`SEED` (0) on every call, so a report is the same every time it is made.

Rules at the edges:
- NaN / infinite values are left out (a pair with either one), as `report.mean` does; a task left with none drops out.
- An interval needs two examples in some task: with one per task every resample is the point, so the interval is
  None (not shown) rather than a width-zero interval that would claim certainty.
- A ratio whose `full` mean is 0 is undefined: the estimate is None (no ratio, no interval). A resample whose `full`
  mean is 0 counts as +inf (the method infinitely above `full`), or is left out when the method's mean is 0 too.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

RESAMPLES = 1000
SEED = 0
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Estimate:
    value: float | None
    interval: tuple[float, float] | None = None

    @property
    def contains_one(self) -> bool:
        """The interval holds 1: a ratio whose difference from `full` is within bootstrap noise."""
        return self.interval is not None and self.interval[0] <= 1.0 <= self.interval[1]


def _finite(values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def macro_mean(strata: list[list[float | None]]) -> Estimate:
    """Mean over tasks of each task's mean of `values`, with its interval."""
    arrays = [[(v,) for v in values if _finite((v,))] for values in strata]
    return _bootstrap(arrays, lambda means: means[..., 0].mean(-1))


def macro_ratio(strata: list[list[tuple[float | None, float | None]]]) -> Estimate:
    """Macro mean of the methods' values / macro mean of full's, over (method, full) pairs per task."""
    arrays = [[pair for pair in pairs if _finite(pair)] for pairs in strata]
    return _bootstrap(arrays, _ratio)


def _ratio(means: np.ndarray) -> np.ndarray:
    """Macro mean of column 0 / of column 1; a zero denominator gives inf, or NaN over a zero numerator too."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return means[..., 0].mean(-1) / means[..., 1].mean(-1)


def _resampled_means(rows: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(resamples, columns): column means of `rows` at the drawn indices, one 1-D gather per column (a 2-D gather
    is ~10x slower)."""
    return np.stack([np.ascontiguousarray(column)[draws].mean(-1) for column in rows.T], axis=-1)


def _bootstrap(strata: list[list[tuple]], statistic) -> Estimate:
    """`statistic` maps task means, shaped (..., tasks, columns), to one value per leading index."""
    arrays = [np.asarray(rows, dtype=float) for rows in strata if rows]
    if not arrays:
        return Estimate(None)
    point = float(statistic(np.stack([a.mean(0) for a in arrays])))
    if not math.isfinite(point):  # only a ratio to a zero mean of full
        return Estimate(None)
    if max(len(a) for a in arrays) < 2:
        return Estimate(point)
    rng = np.random.default_rng(SEED)
    means = np.stack([_resampled_means(a, rng.integers(0, len(a), (RESAMPLES, len(a)))) for a in arrays], axis=1)
    samples = statistic(means)
    samples = samples[~np.isnan(samples)]  # 0 / 0: no ratio in that resample
    if not len(samples):
        return Estimate(point)
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail], method="inverted_cdf")
    return Estimate(point, (float(low), float(high)))
