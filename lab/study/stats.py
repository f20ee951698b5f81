"""Tests for paired differences over seeds, as the registered study reads them (`lab.study.confirm`): Student's t
(its distribution function in closed form for whole degrees of freedom), the exact sign-flip test, and Holm's
correction over a family of comparisons. Only the standard library."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` (a whole number >= 1) degrees of freedom.

    Closed forms (Abramowitz and Stegun 26.7.3-4) with theta = atan(t / sqrt(df)) give A = P(|T| <= |t|):
    df odd: A = (2 / pi) * (theta + sin(theta) * (cos + 2/3 cos^3 + (2*4)/(3*5) cos^5 + ... up to cos^(df-2)));
    df even: A = sin(theta) * (1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... up to cos^(df-2)). Then P(T <= t) = 1/2 + A/2
    for t >= 0 (symmetry for t < 0)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a whole number >= 1, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        series, term = 0.0, c  # cos, then (2/3) cos^3, ...
        for j in range(1, (df - 1) // 2 + 1):
            if j > 1:
                term *= (2 * j - 2) / (2 * j - 1) * c * c
            series += term
        a = 2 / math.pi * (theta + (s * series if df > 1 else 0.0))
    else:
        series, term = 0.0, 1.0
        for j in range(df // 2):
            if j > 0:
                term *= (2 * j - 1) / (2 * j) * c * c
            series += term
        a = s * series
    p = 0.5 + 0.5 * a
    return p if t >= 0 else 1.0 - p


def t_statistic(values: Sequence[float], shift: float = 0.0) -> float | None:
    """(mean + shift) / (sd / sqrt(n)); None with fewer than 2 values; +-inf when every value is the same."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.fmean(values) + shift, statistics.stdev(values)
    if sd == 0.0:
        return math.copysign(math.inf, mean) if mean else 0.0
    return mean / (sd / math.sqrt(n))


def t_test_p(values: Sequence[float]) -> float | None:
    """Two-sided p of the paired t-test of mean 0 (n - 1 degrees of freedom)."""
    t = t_statistic(values)
    return None if t is None else min(1.0, 2.0 * (1.0 - t_cdf(abs(t), len(values) - 1)))


def noninferiority_p(values: Sequence[float], margin: float) -> float | None:
    """One-sided p of the paired t-test of H0: mean <= -margin (the arm worse by the margin or more) against
    mean > -margin."""
    t = t_statistic(values, shift=margin)
    return None if t is None else 1.0 - t_cdf(t, len(values) - 1)


def sign_flip_p(values: Sequence[float], shift: float = 0.0, two_sided: bool = True) -> float | None:
    """The exact sign-flip (randomisation) p of the paired differences `values` (+ `shift`): every one of the 2^n
    ways of flipping their signs is equally likely under H0 (a distribution symmetric about 0); p is the share of them
    whose sum is at least as far from 0 as the observed one (two-sided), or at least as large (one-sided). With n
    seeds the smallest two-sided p is 2 / 2^n (0.0625 for 5) and the smallest one-sided p 1 / 2^n (0.031)."""
    d = [v + shift for v in values]
    if not d:
        return None
    observed = sum(d)
    tolerance = 1e-12 * max(1.0, sum(abs(x) for x in d))
    hits = 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        total = sum(s * abs(x) for s, x in zip(signs, d))
        if (abs(total) >= abs(observed) - tolerance) if two_sided else (total >= observed - tolerance):
            hits += 1
    return hits / 2 ** len(d)


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (in the input order; None stays None and does not count in the family):
    sorted ascending, the i-th (from 1) of m is multiplied by m - i + 1, capped at 1, and made non-decreasing. A
    comparison is rejected at level alpha when its adjusted p is below alpha; the family-wise error stays <= alpha."""
    present = [(p, i) for i, p in enumerate(p_values) if p is not None]
    m = len(present)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(present)):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted
