"""The empirical lower bound on epsilon of "Privacy Auditing with One (1) Training Run" (Steinke, Nasr, Jagielski,
NeurIPS 2023).

m canaries are each included in the training data independently with probability 1/2 (S_i = +1) or left out
(S_i = -1). After the run the auditor scores every canary, guesses "in" for the k+ highest scores, "out" for the k-
lowest and abstains on the rest: r = k+ + k- guesses, of which v are correct. If the run is (epsilon, delta)-DP for
each canary's inclusion, the number of correct guesses W satisfies (their Theorem 3 with Proposition 5, the
computation of their Appendix D), with p = e^epsilon / (1 + e^epsilon):

    P[W >= v]  <=  P[Binomial(r, p) >= v]  +  2 m delta * max_{i = 1..v} P[v - i <= Binomial(r, p) < v] / i.

That right-hand side is the p-value of the observation under the hypothesis "the run is (epsilon, delta)-DP"; the
audit rejects the hypothesis when it falls below 1 - confidence, and the empirical lower bound is the largest epsilon
rejected. It is a statement about the run, not about the auditor: a correct mechanism has bound <= its epsilon with
probability >= confidence, whatever the scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import expit
from scipy.stats import binom

__all__ = ["GuessOutcome", "default_guess_counts", "epsilon_lower_bound", "guess", "p_value", "score_audit"]


def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not v <= r <= m:
        raise ValueError(f"need correct guesses v <= guesses r <= canaries m; got v={v}, r={r}, m={m}")


def _check_probability(value: float, name: str, *, open_interval: bool = False) -> float:
    value = float(value)
    inside = 0.0 < value < 1.0 if open_interval else 0.0 <= value <= 1.0
    if not inside:
        raise ValueError(f"{name} must lie in {'(0, 1)' if open_interval else '[0, 1]'}, got {value!r}")
    return value


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """P[at least v of r guesses correct] for an (epsilon, delta)-DP run with m canaries (the bound above)."""
    _check_counts(m, r, v)
    delta = _check_probability(delta, "delta")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if v == 0:
        return 1.0
    p = float(expit(epsilon))  # accuracy of epsilon-DP randomized response
    tail = float(binom.sf(v - 1, r, p))  # P[Binomial(r, p) >= v]
    if delta == 0.0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    below = np.cumsum(binom.pmf(v - i, r, p))  # P[v - i <= Binomial(r, p) < v]
    return min(1.0, tail + 2.0 * m * delta * float(np.max(below / i)))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, confidence: float = 0.95) -> float:
    """The largest epsilon whose p-value is below 1 - confidence (0 if even epsilon = 0 is not rejected).

    Bisection to 1e-6: the p-value grows with epsilon (the binomial tail grows with p).
    """
    _check_counts(m, r, v)
    alpha = 1.0 - _check_probability(confidence, "confidence", open_interval=True)
    if p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < alpha:
        low, high = high, 2.0 * high
        if high > 1e4:  # pragma: no cover - unreachable for finite r (the tail at v <= r is >= p^r)
            return math.inf
    while high - low > 1e-6:
        mid = (low + high) / 2.0
        low, high = (mid, high) if p_value(m, r, v, mid, delta) < alpha else (low, mid)
    return low


@dataclass(frozen=True)
class GuessOutcome:
    """One audit's guesses and the bound they give."""

    epsilon: float  # the empirical lower bound
    guesses: int  # r
    correct: int  # v
    positive_guesses: int  # k+
    negative_guesses: int  # k-
    confidence: float  # the confidence of the bound (after the correction for trying several r)


def guess(
    scores: np.ndarray, included: np.ndarray, positive: int, negative: int, rng: np.random.Generator
) -> tuple[int, int]:
    """Guess "in" for the ``positive`` highest scores and "out" for the ``negative`` lowest; return (r, v).

    Ties are broken at random (with ``rng``), so equal scores carry no information about the truth.
    """
    m = len(scores)
    if positive < 0 or negative < 0 or positive + negative > m:
        raise ValueError(f"need 0 <= k+ + k- <= m = {m}; got k+={positive}, k-={negative}")
    order = rng.permutation(m)
    ranked = order[np.argsort(scores[order], kind="stable")]  # ascending, ties in random order
    correct = int(np.sum(included[ranked[m - positive :]])) if positive else 0
    correct += int(np.sum(~included[ranked[:negative]]))
    return positive + negative, correct


def default_guess_counts(m: int) -> list[int]:
    """The r tried by :func:`score_audit` by default: 2%, 5%, 10%, 20%, 50% and 100% of m (even, k+ = k- = r/2)."""
    counts = {2 * max(1, round(f * m / 2)) for f in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)}
    return sorted(r for r in counts if r <= m)


def score_audit(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    guess_counts: Sequence[int] | None = None,
    seed: int = 0,
) -> GuessOutcome:
    """The one-run audit from the canaries' scores (higher = more likely included) and the truth.

    Tries each r of ``guess_counts`` (k+ = k- = r / 2) and reports the largest bound. Trying several r is paid for
    with a Bonferroni correction: each is evaluated at confidence ``1 - (1 - confidence) / len(guess_counts)``, so the
    reported bound holds at ``confidence`` overall.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and included {included.shape} must be two vectors of length m")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite")
    m = len(scores)
    counts = default_guess_counts(m) if guess_counts is None else [int(r) for r in guess_counts]
    if not counts or any(r < 1 or r > m for r in counts):
        raise ValueError(f"guess counts must lie in [1, m = {m}], got {counts}")
    level = 1.0 - (1.0 - _check_probability(confidence, "confidence", open_interval=True)) / len(counts)
    rng = np.random.default_rng(seed)
    best: GuessOutcome | None = None
    for r in counts:
        positive = r - r // 2
        r, v = guess(scores, included, positive, r // 2, rng)
        epsilon = epsilon_lower_bound(m, r, v, delta, level)
        if best is None or epsilon > best.epsilon:
            best = GuessOutcome(epsilon, r, v, positive, r - positive, confidence)
    assert best is not None
    return best
