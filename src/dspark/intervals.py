"""Student-t confidence intervals of a mean, shared by evaluation summaries (over prompts) and sweep reports (over
replicate runs). Torch-free and scipy.special-only, so reports import it cheaply."""

from __future__ import annotations

import math
from collections.abc import Iterable


def t_quantile(n: int, confidence: float = 0.95) -> float:
    """Student-t quantile with n − 1 degrees of freedom (scipy.special: a fraction of scipy.stats' import time)."""
    from scipy.special import stdtrit

    return float(stdtrit(n - 1, 0.5 + confidence / 2.0))


def t_quantile_df(df: float, confidence: float = 0.95) -> float:
    """Two-sided Student-t quantile with `df` degrees of freedom (any positive real: a Welch–Satterthwaite df;
    math.inf gives the normal quantile, 1.96 at 95%)."""
    from scipy.special import stdtrit

    if not df > 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    return float(stdtrit(df, 0.5 + confidence / 2.0))


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| ≥ |t|) for a Student-t T with `df` degrees of freedom (math.inf: normal)."""
    from scipy.special import stdtr

    return float(2.0 * stdtr(df, -abs(t)))


def finite_values(values: Iterable[float | None]) -> list[float]:
    """The values that are neither None nor NaN/inf, as floats."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci(values: Iterable[float | None], *, confidence: float = 0.95) -> tuple[float, float]:
    """(mean, Student-t half-width) over the finite values; NaN mean without values, NaN half-width with one."""
    finite = finite_values(values)
    n = len(finite)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(finite) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1))
    return mean, t_quantile(n, confidence) * sd / math.sqrt(n)
