"""The statistics of an experiment's result table, small and exact (no SciPy).

* :func:`summary`: mean, sample standard deviation and the 95 % confidence interval of the
  mean (Student's t with n - 1 degrees of freedom);
* :func:`welch`: Welch's unequal-variance t-test of two samples (two-sided);
* :func:`paired`: the paired t-test of per-input differences (two-sided).

Student's t distribution function is computed from the regularised incomplete beta function
(continued fraction, Lentz's method), accurate to about 1e-12; its quantile by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-15
_TINY = 1e-300


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (Numerical Recipes' betacf)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


def two_sided_p(t: float, df: float) -> float:
    return min(1.0, 2.0 * t_cdf(-abs(t), df))


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def variance(values: Sequence[float]) -> float:
    """The sample variance (n - 1); 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    m = mean(values)
    return math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    sd: float
    ci_low: float
    ci_high: float

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {
            "n": self.n,
            "mean": self.mean,
            "sd": self.sd,
            "ci95": [self.ci_low, self.ci_high],
        }


def summary(values: Sequence[float], confidence: float = 0.95) -> Summary:
    """Mean, standard deviation and the ``confidence`` interval of the mean (one value: the
    interval is the value itself; it has no spread to estimate)."""
    if not values:
        raise ValueError("no values to summarise")
    m = mean(values)
    n = len(values)
    sd = math.sqrt(variance(values))
    if n < 2:
        return Summary(n, m, 0.0, m, m)
    half = t_ppf(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return Summary(n, m, sd, m - half, m + half)


@dataclass(frozen=True)
class TestResult:
    test: str
    t: float
    df: float
    p: float
    difference: float  # mean of the first minus mean of the second

    def as_dict(self) -> dict[str, float | str]:
        return {
            "test": self.test,
            "t": self.t,
            "df": self.df,
            "p": self.p,
            "difference": self.difference,
        }


def _degenerate(test: str, difference: float, df: float) -> TestResult:
    """No spread at all: the samples differ surely (p 0) or not at all (p 1)."""
    if difference == 0:
        return TestResult(test, 0.0, df, 1.0, 0.0)
    return TestResult(test, math.copysign(math.inf, difference), df, 0.0, difference)


def welch(a: Sequence[float], b: Sequence[float]) -> TestResult | None:
    """Welch's t-test of ``a`` against ``b`` (None: fewer than two values in one)."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = variance(a) / len(a), variance(b) / len(b)
    difference = mean(a) - mean(b)
    if va + vb == 0:
        return _degenerate("welch", difference, len(a) + len(b) - 2)
    t = difference / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return TestResult("welch", t, df, two_sided_p(t, df), difference)


def paired(a: Sequence[float], b: Sequence[float]) -> TestResult | None:
    """The paired t-test of ``a[i] - b[i]`` (None: fewer than two pairs)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples of different sizes ({len(a)} and {len(b)})")
    if len(a) < 2:
        return None
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    d, sd = mean(diffs), math.sqrt(variance(diffs))
    df = len(diffs) - 1
    if sd == 0:
        return _degenerate("paired", d, df)
    t = d / (sd / math.sqrt(len(diffs)))
    return TestResult("paired", t, df, two_sided_p(t, df), d)
