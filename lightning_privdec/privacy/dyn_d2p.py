"""Dyn-D2P's noise schedule and its accounting (Zhu, Huang, Wang, Ji, Xu: Dynamic Differentially Private
Decentralized Learning with Provable Utility Guarantee).

Precomputation, identical at every node before training (Sec. 4 of the paper):

    P0  mu_tot from (eps, delta):  delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)        (eq. 4)
    P1  mu_0 from  J^2 mu_tot^2 = sum_{k<K} (exp((mu_0 rho_mu^{k/K})^2) - 1),  J = 1/q            (eq. 8)
    P2  C_k = C_0 rho_c^{-k/K},  mu_k = mu_0 rho_mu^{k/K},  sigma_k = C_k / mu_k                   (Alg. 1 l. 5, 7, 8)

sigma_k is the standard deviation of the Gaussian noise added to the clipped sum at step k (the paper calls it a
variance), so step k is the Poisson-subsampled Gaussian mechanism with noise multiplier 1/mu_k at rate q. Variants:
``"dyn"`` (both schedules), ``"dyn_c"`` (decaying C_k, constant mu_bar = sqrt(ln(J^2 mu_tot^2 / K + 1)), eq. 9),
``"dyn_mu"`` (constant C, growing mu_k) and ``"const"`` (constant C and mu_bar: the fixed-noise baseline).

Two accountings of the same schedule:

* **paper (CLT approximation)**: mu = q sqrt(sum_k (e^{mu_k^2} - 1)) (Prop. 3, eq. 6; Dong, Roth, Su 2019 /
  Bu et al. 2020), converted with eq. 4. A central-limit approximation: for few steps or a large sampling rate it can
  be optimistic (below the true epsilon), and Prop. 4's linearisation e^x - 1 < 2x needs mu_k <= 1.
* **rigorous**: the same varying noise multipliers 1/mu_k at rate q composed by a sound accountant, ``"rdp"``
  (Renyi DP of the subsampled Gaussian at integer orders, Mironov, Talwar, Zhang 2019, Sec. 3.3; converted with
  Balle et al. 2020 via Opacus's ``get_privacy_spent``; default) or ``"prv"`` (Opacus's PRV accountant, Gopi et al.
  2021, on a dominating coarsening of the schedule). :class:`ScheduleLedger` accumulates the RDP vector step by step,
  so the per-step update and the epsilon query are O(1) in the number of steps taken.

Calibration: ``"rigorous"`` (default) keeps the paper's schedule shape and chooses mu_0 so that the rigorous
accountant spends exactly the target over the planned K steps; ``"paper"`` takes mu_tot and mu_0 exactly as
published (P0, P1), and its rigorous epsilon is reported next to the paper's.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from opacus.accountants.analysis.rdp import get_privacy_spent
from scipy import optimize, special

from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    History,
    PrivacyLedger,
    _check_delta,
    _check_noise_multiplier,
    _check_number,
    _check_sample_rate,
    _check_steps,
    _epsilon_of_history,
)
from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = [
    "CALIBRATIONS",
    "RDP_ORDERS",
    "VARIANTS",
    "DynD2PSchedule",
    "OptimisticAccountingWarning",
    "ScheduleLedger",
    "calibrate_schedule",
    "clt_mu",
    "dp_epsilon_from_gdp",
    "gdp_delta",
    "gdp_mu_from_dp",
    "history_clt_epsilon",
    "history_epsilon",
    "mu_bar",
    "solve_mu0",
    "subsampled_gaussian_rdp",
]

#: ``variant=``: which of the two schedules are dynamic (Sec. 4: Dyn-D2P, Dyn[C]-D2P, Dyn[mu]-D2P, Const-D2P)
VARIANTS: tuple[str, ...] = ("dyn", "dyn_c", "dyn_mu", "const")

#: ``calibration=``: how mu_0 is chosen from the budget
CALIBRATIONS: tuple[str, ...] = ("rigorous", "paper")

#: RDP orders of the rigorous accountant. Integer orders only: their RDP has the exact closed form of Mironov et al.
#: 2019, Sec. 3.3, which vectorises over a whole schedule. Opacus's default orders add fractional ones in (1, 11); at
#: epsilon <= 3 the two agree within 0.1% (integer orders are never below them: fewer orders, looser bound).
RDP_ORDERS: tuple[int, ...] = tuple(range(2, 65)) + (72, 80, 96, 128, 160, 192, 256)

#: the PRV accountant composes one discretised privacy-loss distribution per distinct noise multiplier; a schedule
#: changes it every step, so longer histories are coarsened into this many consecutive segments, each at its smallest
#: noise multiplier and largest rate (a dominating mechanism: the result is an upper bound of the exact PRV epsilon)
PRV_SEGMENTS = 12

#: mu_0 search range of the rigorous calibration (noise multipliers from 1e4 down to 1e-3)
_MU0_MIN, _MU0_MAX = 1e-4, 1e3


class OptimisticAccountingWarning(UserWarning):
    """The paper's CLT epsilon of a schedule is below its rigorous epsilon (the CLT under-states the privacy loss)."""


# ---- validation ---------------------------------------------------------------------------------------------------
def _check_positive(value: Any, name: str) -> float:
    value = _check_number(value, name)
    if value <= 0:
        raise PrivacyConfigError(f"{name} must be > 0, got {value!r}")
    return value


def _check_rho(value: Any, name: str, role: str) -> float:
    value = _check_number(value, name)
    if value < 1.0:
        raise PrivacyConfigError(
            f"{name} must be >= 1, got {value!r}: it is the {role} over the whole run (the paper uses "
            f"1/{name} in {{0.1, ..., 0.8}}, i.e. {name} between 1.25 and 10; 1 keeps it constant)"
        )
    return value


def _check_variant(variant: Any) -> str:
    if variant not in VARIANTS:
        raise PrivacyConfigError(
            f"unknown variant {variant!r}; choose 'dyn' (decaying clip and growing mu, Dyn-D2P), 'dyn_c' (decaying "
            "clip, Dyn[C]-D2P), 'dyn_mu' (growing mu, Dyn[mu]-D2P) or 'const' (fixed noise, Const-D2P)"
        )
    return variant


def _check_calibration(calibration: Any) -> str:
    if calibration not in CALIBRATIONS:
        raise PrivacyConfigError(
            f"unknown calibration {calibration!r}; choose 'rigorous' (mu_0 chosen so that a sound accountant spends "
            "exactly the target; default) or 'paper' (mu_tot and mu_0 as published, eqs. 4 and 8)"
        )
    return calibration


def _check_rigorous_accountant(accountant: Any) -> str:
    if accountant == "gdp":
        raise PrivacyConfigError(
            "accountant='gdp' is the paper's CLT approximation, which Dyn-D2P always reports next to the rigorous "
            "epsilon (paper_epsilon()); choose accountant='rdp' (default) or 'prv' for the epsilon that is enforced"
        )
    if accountant not in ACCOUNTANTS:
        raise PrivacyConfigError(f"unknown accountant {accountant!r}; choose 'rdp' (default) or 'prv'")
    return accountant


def _check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
    epsilon = _check_number(epsilon, name)
    if epsilon <= 0:
        raise PrivacyConfigError(f"{name} must be > 0, got {epsilon!r} (e.g. 0.5, 1 or 3)")
    return epsilon


# ---- P0: Gaussian DP <-> (epsilon, delta)-DP (eq. 4; Dong, Roth, Su 2019, Cor. 2.13) ------------------------------
def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(eps) of a mu-GDP mechanism: Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (eq. 4), in log space."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    first = special.ndtr(-epsilon / mu + mu / 2)
    second = math.exp(epsilon + special.log_ndtr(-epsilon / mu - mu / 2))
    return float(max(0.0, first - second))


def gdp_mu_from_dp(epsilon: float, delta: float) -> float:
    """P0: the mu_tot whose mu-GDP guarantee is (epsilon, delta)-DP with equality in eq. (4) (1-D root find)."""
    epsilon, delta = _check_epsilon(epsilon), _check_delta(delta)
    high = 1.0
    while gdp_delta(high, epsilon) < delta:  # delta(mu) increases from 0 to 1 with mu
        high *= 2.0
    low = high / 2.0 if high > 1.0 else 1e-12
    return float(optimize.brentq(lambda mu: gdp_delta(mu, epsilon) - delta, low, high, xtol=1e-15, rtol=1e-15))


def dp_epsilon_from_gdp(mu: float, delta: float) -> float:
    """The inverse of P0: the smallest epsilon >= 0 at which a mu-GDP mechanism is (epsilon, delta)-DP (eq. 4)."""
    delta = _check_delta(delta)
    mu = _check_number(mu, "mu") if not (isinstance(mu, float) and math.isinf(mu)) else mu
    if mu < 0:
        raise PrivacyConfigError(f"mu must be >= 0, got {mu!r}")
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gdp_delta(mu, high) > delta:  # delta(eps) decreases in eps
        high *= 2.0
        if high > 1e7:
            return math.inf
    return float(optimize.brentq(lambda eps: gdp_delta(mu, eps) - delta, 0.0, high, xtol=1e-14, rtol=1e-15))


def clt_mu(mus: Sequence[float] | np.ndarray, sample_rate: float) -> float:
    """Prop. 3 (eq. 6), the paper's CLT composition: mu = q sqrt(sum_k (e^{mu_k^2} - 1)) for Poisson rate q."""
    mus = np.asarray(mus, dtype=np.float64)
    with np.errstate(over="ignore"):
        return float(sample_rate * math.sqrt(float(np.expm1(mus**2).sum())))


# ---- P1: mu_0 (eq. 8) and mu_bar (eq. 9) ---------------------------------------------------------------------------
def solve_mu0(mu_tot: float, sample_rate: float, steps: int, rho_mu: float) -> float:
    """P1: the mu_0 with J^2 mu_tot^2 = sum_{k<K} (exp((mu_0 rho_mu^{k/K})^2) - 1), J = 1/q (eq. 8; bisection).

    The right-hand side increases with mu_0, so the root is unique.
    """
    mu_tot = _check_positive(mu_tot, "mu_tot")
    q = _check_sample_rate(sample_rate)
    steps = _check_steps(steps, minimum=1)
    rho_mu = _check_rho(rho_mu, "rho_mu", "growth factor of the per-step GDP budget mu_k")
    growth = rho_mu ** (np.arange(steps) / steps)
    target = (mu_tot / q) ** 2

    def excess(mu0: float) -> float:
        with np.errstate(over="ignore"):
            return float(np.expm1((mu0 * growth) ** 2).sum()) - target

    high = 1.0
    while excess(high) < 0:
        high *= 2.0
    return float(optimize.bisect(excess, 0.0, high, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=2000))


def mu_bar(mu_tot: float, sample_rate: float, steps: int) -> float:
    """Eq. (9): the constant per-step budget mu_bar = sqrt(ln(J^2 mu_tot^2 / K + 1)) of Dyn[C]-D2P and Const-D2P."""
    mu_tot = _check_positive(mu_tot, "mu_tot")
    q = _check_sample_rate(sample_rate)
    steps = _check_steps(steps, minimum=1)
    return math.sqrt(math.log1p((mu_tot / q) ** 2 / steps))


# ---- the rigorous accountant: RDP of the subsampled Gaussian, vectorised over a schedule ---------------------------
@functools.lru_cache(maxsize=32)
def _binomial_terms(sample_rate: float, orders: tuple[int, ...]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per order alpha: log(binom(alpha, i) q^i (1-q)^(alpha-i)) and (i^2 - i) / 2 for i = 0..alpha."""
    terms = []
    for alpha in orders:
        i = np.arange(alpha + 1, dtype=np.float64)
        log_binom = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
        log_coef = log_binom + i * math.log(sample_rate) + (alpha - i) * math.log1p(-sample_rate)
        terms.append((log_coef, (i * i - i) / 2.0))
    return tuple(terms)


def subsampled_gaussian_rdp(
    sample_rate: float, noise_multipliers: Sequence[float] | np.ndarray, orders: Sequence[int] = RDP_ORDERS
) -> np.ndarray:
    """RDP of ONE step of the Poisson-subsampled Gaussian mechanism, for each noise multiplier and integer order.

    Mironov, Talwar, Zhang 2019, Sec. 3.3: for integer alpha >= 2,
    ``eps(alpha) = log sum_{i=0..alpha} binom(alpha, i) q^i (1-q)^(alpha-i) exp((i^2 - i) / (2 sigma^2)) / (alpha-1)``
    (the formula of Opacus's ``compute_rdp`` for integer orders, evaluated for a whole schedule at once).
    Returns an array of shape ``(len(noise_multipliers), len(orders))``.
    """
    q = _check_sample_rate(sample_rate)
    orders = tuple(int(a) for a in orders)
    if any(a < 2 for a in orders):
        raise PrivacyConfigError(f"RDP orders must be integers >= 2, got {orders}")
    sigmas = np.atleast_1d(np.asarray(noise_multipliers, dtype=np.float64))
    if (sigmas < 0).any() or not np.isfinite(sigmas).all():
        raise PrivacyConfigError("noise multipliers must be finite and >= 0")
    out = np.empty((sigmas.size, len(orders)))
    if q == 1.0:
        with np.errstate(divide="ignore"):
            return np.asarray(orders, dtype=np.float64)[None, :] / (2.0 * sigmas[:, None] ** 2)
    with np.errstate(divide="ignore"):
        inverse_variance = 1.0 / sigmas**2  # inf for sigma = 0: no privacy
    for column, (alpha, (log_coef, quadratic)) in enumerate(zip(orders, _binomial_terms(q, orders))):
        with np.errstate(invalid="ignore"):
            exponents = log_coef[None, :] + quadratic[None, :] * inverse_variance[:, None]
        exponents[:, 0] = log_coef[0]  # i = 0, 1: the quadratic term is 0 even for sigma = 0
        exponents[:, 1] = log_coef[1]
        out[:, column] = special.logsumexp(exponents, axis=1) / (alpha - 1)
    return out


def _epsilon_from_rdp(rdp: np.ndarray, delta: float, orders: Sequence[int]) -> float:
    """(epsilon, delta) from an RDP curve (Balle et al. 2020, Thm. 21), by Opacus's ``get_privacy_spent``."""
    if not np.any(rdp):
        return 0.0
    if np.isinf(rdp).all():
        return math.inf
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        epsilon, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(epsilon)


def _coarsened(history: History, segments: int) -> History:
    """At most ``segments`` consecutive groups of ``history``, each at its smallest sigma and largest q (dominating)."""
    if len(history) <= segments:
        return list(history)
    total = sum(t for _, _, t in history)
    coarse: History = []
    group: list[tuple[float, float, int]] = []
    done = 0
    for index, entry in enumerate(history):
        group.append(entry)
        done += entry[2]
        if done * segments >= total * (len(coarse) + 1) or index == len(history) - 1:
            coarse.append((min(s for s, _, _ in group), max(q for _, q, _ in group), sum(t for _, _, t in group)))
            group = []
    return coarse


def history_epsilon(history: History, delta: float, accountant: str = "rdp", orders: Sequence[int] = RDP_ORDERS) -> float:
    """Rigorous epsilon of a history ``[(noise_multiplier, q, steps), ...]`` (RDP at ``orders``, or coarsened PRV)."""
    accountant = _check_rigorous_accountant(accountant)
    history = [(float(s), float(q), int(t)) for s, q, t in history if int(t) > 0]
    if not history:
        return 0.0
    if accountant == "prv":
        with warnings.catch_warnings():  # Opacus's PRV domain bound goes through RDP and warns about its orders
            warnings.filterwarnings("ignore", message="Optimal order is the")
            return _epsilon_of_history(_coarsened(history, PRV_SEGMENTS), delta, "prv")
    rdp = np.zeros(len(orders))
    for q in sorted({q for _, q, _ in history}):
        sigmas = np.array([s for s, r, _ in history if r == q])
        counts = np.array([t for _, r, t in history if r == q], dtype=np.float64)
        rdp += (subsampled_gaussian_rdp(q, sigmas, orders) * counts[:, None]).sum(0)
    return _epsilon_from_rdp(rdp, delta, orders)


def history_clt_epsilon(history: History, delta: float) -> float:
    """Paper (CLT approximation) epsilon of a history: eq. (6) with q_k inside the sum, converted with eq. (4)."""
    with np.errstate(over="ignore", divide="ignore"):
        total = sum(t * q**2 * float(np.expm1(np.float64(s) ** -2)) for s, q, t in history if t > 0)
    return dp_epsilon_from_gdp(math.sqrt(total), delta) if total > 0 else 0.0


# ---- the schedule ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DynD2PSchedule:
    """The per-step clip C_k and GDP budget mu_k of one planned run (Algorithm 1, lines 5, 7, 8).

    Args:
        steps: K, the planned number of steps (the exponents are k/K).
        sample_rate: q = B / J, the Poisson rate (the paper's 1/J with one example per step).
        max_grad_norm: C_0 (the constant C_bar of ``"dyn_mu"`` and ``"const"``).
        mu0: mu_0 (the constant mu_bar of ``"dyn_c"`` and ``"const"``).
        rho_c: decay factor of the clip, C_{K} = C_0 / rho_c (used by ``"dyn"`` and ``"dyn_c"``).
        rho_mu: growth factor of mu, mu_K = mu_0 rho_mu (used by ``"dyn"`` and ``"dyn_mu"``).
        variant: ``"dyn"``, ``"dyn_c"``, ``"dyn_mu"`` or ``"const"``; the factor a variant keeps constant is ignored.

    Step k clips each per-sample gradient to C_k and adds N(0, sigma_k^2 I), sigma_k = C_k / mu_k, to the clipped
    sum: the subsampled Gaussian mechanism with noise multiplier 1/mu_k (eq. 3 with sensitivity S = C_k).
    Indices k >= K continue the same formulas (used only when a run is extended past its plan).
    """

    steps: int
    sample_rate: float
    max_grad_norm: float
    mu0: float
    rho_c: float = 1.0
    rho_mu: float = 1.0
    variant: str = "dyn"

    def __post_init__(self) -> None:
        _check_steps(self.steps, minimum=1)
        _check_sample_rate(self.sample_rate)
        _check_positive(self.max_grad_norm, "max_grad_norm")
        _check_positive(self.mu0, "mu0")
        _check_rho(self.rho_c, "rho_c", "decay factor of the clipping bound C_k")
        _check_rho(self.rho_mu, "rho_mu", "growth factor of the per-step GDP budget mu_k")
        _check_variant(self.variant)

    # -- the factors in force
    @property
    def clip_decay(self) -> float:
        """rho_c as used: 1 for the variants with a constant clip."""
        return self.rho_c if self.variant in ("dyn", "dyn_c") else 1.0

    @property
    def mu_growth(self) -> float:
        """rho_mu as used: 1 for the variants with a constant mu."""
        return self.rho_mu if self.variant in ("dyn", "dyn_mu") else 1.0

    # -- step k
    def clip(self, k: int) -> float:
        """C_k = C_0 rho_c^{-k/K} (Algorithm 1, line 5)."""
        return self.max_grad_norm * self.clip_decay ** (-k / self.steps)

    def mu(self, k: int) -> float:
        """mu_k = mu_0 rho_mu^{k/K} (eq. 7; Algorithm 1, line 7)."""
        return self.mu0 * self.mu_growth ** (k / self.steps)

    def sigma(self, k: int) -> float:
        """sigma_k = C_k / mu_k, the noise standard deviation of step k (Algorithm 1, line 8)."""
        return self.clip(k) / self.mu(k)

    def noise_multiplier(self, k: int) -> float:
        """sigma_k / C_k = 1 / mu_k: what the accountant sees at step k."""
        return 1.0 / self.mu(k)

    # -- the whole plan
    def mus(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        k = np.arange(start, self.steps if stop is None else stop)
        return self.mu0 * self.mu_growth ** (k / self.steps)

    def noise_multipliers(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return 1.0 / self.mus(start, stop)

    def history(self, start: int = 0, stop: int | None = None) -> History:
        """The accountant's history of steps ``start..stop-1``: ``[(1/mu_k, q, 1), ...]``."""
        return [(float(s), self.sample_rate, 1) for s in self.noise_multipliers(start, stop)]

    def clt_mu(self, steps: int | None = None) -> float:
        """The paper's CLT composition (eq. 6) of the first ``steps`` steps (default: all K)."""
        return clt_mu(self.mus(0, steps), self.sample_rate)

    def clt_epsilon(self, delta: float, steps: int | None = None) -> float:
        """Paper (CLT approximation): epsilon of eq. (6) converted with eq. (4)."""
        return dp_epsilon_from_gdp(self.clt_mu(steps), delta)

    def rigorous_epsilon(self, delta: float, accountant: str = "rdp", steps: int | None = None) -> float:
        """Epsilon of the first ``steps`` steps (default: all K) by a sound accountant (``"rdp"`` or ``"prv"``)."""
        return history_epsilon(self.history(0, steps), _check_delta(delta), accountant)

    def summary(self, delta: float, accountant: str = "rdp") -> dict[str, Any]:
        """First and last clip and sigma, mu_0, and both epsilons of the whole plan (for logs and the CLI)."""
        last = self.steps - 1
        return {
            "variant": self.variant,
            "steps": self.steps,
            "sample_rate": self.sample_rate,
            "rho_c": self.clip_decay,
            "rho_mu": self.mu_growth,
            "mu0": self.mu0,
            "mu_last": self.mu(last),
            "clip_first": self.clip(0),
            "clip_last": self.clip(last),
            "sigma_first": self.sigma(0),
            "sigma_last": self.sigma(last),
            "mu_clt": self.clt_mu(),
            "epsilon_paper_clt": self.clt_epsilon(delta),
            "epsilon_rigorous": self.rigorous_epsilon(delta, accountant),
        }


def calibrate_schedule(
    target_epsilon: float,
    delta: float,
    steps: int,
    sample_rate: float,
    max_grad_norm: float,
    *,
    rho_c: float = 1.0,
    rho_mu: float = 1.0,
    variant: str = "dyn",
    calibration: str = "rigorous",
    accountant: str = "rdp",
    spent: ScheduleLedger | None = None,
) -> DynD2PSchedule:
    """The schedule of a run of ``steps`` steps (K) for the budget (target_epsilon, delta).

    ``calibration="paper"``: mu_tot by P0 (eq. 4) and mu_0 by P1 (eq. 8; eq. 9 for the constant-mu variants), exactly
    as published. ``calibration="rigorous"``: the same shape (variant, rho_c, rho_mu), with mu_0 chosen by bisection
    so that the rigorous accountant spends the target over the K steps (within 1%, never more).

    ``spent``: a ledger that already holds the first ``spent.steps`` steps of this run (a resumed run with a changed
    plan). The rigorous calibration then chooses mu_0 for history + steps ``spent.steps .. K-1``; the paper's
    calibration has no notion of spent steps and is solved for the whole K (the rigorous ledger still counts them).
    """
    target_epsilon = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(delta)
    steps = _check_steps(steps, minimum=1)
    sample_rate = _check_sample_rate(sample_rate)
    variant = _check_variant(variant)
    calibration = _check_calibration(calibration)
    accountant = _check_rigorous_accountant(accountant)
    shape = dict(steps=steps, sample_rate=sample_rate, max_grad_norm=max_grad_norm, rho_c=rho_c, rho_mu=rho_mu,
                 variant=variant)
    DynD2PSchedule(mu0=1.0, **shape)  # validates the shape with its own messages
    if calibration == "paper":
        mu_tot = gdp_mu_from_dp(target_epsilon, delta)
        mu_growth = rho_mu if variant in ("dyn", "dyn_mu") else 1.0
        if mu_growth == 1.0:
            mu0 = mu_bar(mu_tot, sample_rate, steps)
        else:
            mu0 = solve_mu0(mu_tot, sample_rate, steps, mu_growth)
        return DynD2PSchedule(mu0=mu0, **shape)

    start = 0 if spent is None else spent.steps
    if start >= steps:
        raise PrivacyConfigError(
            f"the plan has {steps} steps but {start} were already taken; plan more steps (max_steps / max_epochs)"
        )
    base = np.zeros(len(RDP_ORDERS)) if spent is None else spent.rdp.copy()
    if spent is not None and _epsilon_from_rdp(base, delta, RDP_ORDERS) >= target_epsilon:
        raise PrivacyConfigError(
            f"epsilon={spent.epsilon(delta):.4f} of target_epsilon={target_epsilon} is already spent: there is no "
            "budget left to train on; raise target_epsilon or start a new run on new data"
        )
    prior = [] if spent is None else list(spent.history)

    def rdp_epsilon(mu0: float) -> float:
        schedule = DynD2PSchedule(mu0=mu0, **shape)
        rows = subsampled_gaussian_rdp(sample_rate, schedule.noise_multipliers(start), RDP_ORDERS)
        return _epsilon_from_rdp(base + rows.sum(0), delta, RDP_ORDERS)

    def prv_epsilon(mu0: float) -> float:
        return history_epsilon(prior + DynD2PSchedule(mu0=mu0, **shape).history(start), delta, "prv")

    mu0 = _bisect_mu0(rdp_epsilon, target_epsilon, _MU0_MIN, rtol=1e-4)
    if accountant == "prv":  # PRV is tighter: start from the RDP solution (usually feasible) and search upwards
        mu0 = _refine_mu0(prv_epsilon, target_epsilon, mu0)
    return DynD2PSchedule(mu0=mu0, **shape)


def _bisect_mu0(epsilon_of: Any, target: float, low: float, rtol: float) -> float:
    """The largest mu_0 (up to ``rtol``) with epsilon_of(mu_0) <= target; epsilon_of increases with mu_0."""
    if epsilon_of(low) > target:
        raise PrivacyConfigError(
            f"target_epsilon={target} cannot be met even with noise multiplier {1 / low:.3g} at every step; raise "
            "target_epsilon or target_delta, or plan fewer steps / a smaller sampling rate"
        )
    high = max(2.0 * low, 1.0)
    while epsilon_of(high) <= target:
        low, high = high, 2.0 * high
        if high > _MU0_MAX:
            raise PrivacyConfigError(
                f"target_epsilon={target} is so large that the noise multiplier would fall below {1 / _MU0_MAX:g}: "
                "no meaningful privacy; lower target_epsilon"
            )
    while high / low - 1.0 > rtol:
        mid = math.sqrt(low * high)
        low, high = (mid, high) if epsilon_of(mid) <= target else (low, mid)
    return low


def _refine_mu0(epsilon_of: Any, target: float, start: float, tolerance: float = 0.005) -> float:
    """Like :func:`_bisect_mu0` for an expensive ``epsilon_of`` (PRV), starting near the answer: a bracket grown by
    10% steps, then regula falsi (Illinois) on log mu_0 until (1 - tolerance) target <= epsilon <= target."""
    low, e_low = start, epsilon_of(start)
    while e_low > target:
        low, e_low = low / 1.1, epsilon_of(low / 1.1)
    high, e_high = low * 1.1, epsilon_of(low * 1.1)
    while e_high <= target:
        low, e_low = high, e_high
        high, e_high = high * 1.1, epsilon_of(high * 1.1)
    true_low = e_low  # the interpolation weights below are Illinois-modified; the stop test uses true values
    side = 0
    for _ in range(30):
        if true_low >= (1.0 - tolerance) * target:
            break
        x_low, x_high = math.log(low), math.log(high)
        g_low, g_high = e_low - target, e_high - target
        x = (x_low * g_high - x_high * g_low) / (g_high - g_low)
        if not x_low < x < x_high:
            x = (x_low + x_high) / 2
        mid = math.exp(x)
        e_mid = epsilon_of(mid)
        if e_mid <= target:
            low, e_low, true_low = mid, e_mid, e_mid
            if side == -1:
                e_high = target + (e_high - target) / 2  # Illinois: halve the stale end's weight
            side = -1
        else:
            high, e_high = mid, e_mid
            if side == 1:
                e_low = target - (target - e_low) / 2
            side = 1
    return low


# ---- the ledger ------------------------------------------------------------------------------------------------------
class ScheduleLedger(PrivacyLedger):
    """A :class:`PrivacyLedger` for a noise multiplier that changes every step, with O(1) updates and queries.

    The RDP curve of the history (one row per integer order of :data:`RDP_ORDERS`) is accumulated step by step, so
    :meth:`record`, :meth:`epsilon` and :meth:`epsilon_if` cost one step's RDP each, whatever the history's length.
    It equals Opacus's ``RDPAccountant`` on the same history at the same orders. With ``accountant="prv"`` the
    epsilon is Opacus's PRV accountant on the history coarsened to :data:`PRV_SEGMENTS` dominating segments (sound,
    slower; cached per step count). The paper's CLT value (eq. 6) is kept alongside in O(1) too
    (:meth:`clt_epsilon`). The checkpoint format is :class:`PrivacyLedger`'s.
    """

    def __init__(self, accountant: str = "rdp", delta: float | None = None) -> None:
        super().__init__(_check_rigorous_accountant(accountant), delta=delta)
        self.orders = RDP_ORDERS
        self.rdp = np.zeros(len(self.orders))
        self._clt_sum = 0.0  # sum_k q_k^2 (e^{mu_k^2} - 1), mu_k = 1 / sigma_k
        self._steps = 0
        self._prv_cache: dict[tuple[int, float], float] = {}

    def _row(self, noise_multiplier: float, sample_rate: float) -> np.ndarray:
        return subsampled_gaussian_rdp(sample_rate, [noise_multiplier], self.orders)[0]

    @staticmethod
    def _clt_term(noise_multiplier: float, sample_rate: float) -> float:
        if noise_multiplier == 0:
            return math.inf
        try:
            return sample_rate**2 * math.expm1(noise_multiplier**-2)
        except OverflowError:
            return math.inf

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        noise_multiplier = _check_noise_multiplier(noise_multiplier)
        sample_rate = _check_sample_rate(sample_rate)
        steps = _check_steps(steps, minimum=1)
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            self.history[-1] = (noise_multiplier, sample_rate, self.history[-1][2] + steps)
        else:
            self.history.append((noise_multiplier, sample_rate, steps))
        self.rdp = self.rdp + steps * self._row(noise_multiplier, sample_rate)
        self._clt_sum += steps * self._clt_term(noise_multiplier, sample_rate)
        self._steps += steps

    @property
    def steps(self) -> int:
        return self._steps

    def epsilon(self, delta: float | None = None) -> float:
        delta = self._delta(delta)
        if self.accountant == "prv":
            key = (self._steps, delta)
            if key not in self._prv_cache:
                self._prv_cache = {key: history_epsilon(self.history, delta, "prv")}
            return self._prv_cache[key]
        return _epsilon_from_rdp(self.rdp, delta, self.orders)

    def epsilon_if(
        self, noise_multiplier: float, sample_rate: float, steps: int = 1, delta: float | None = None
    ) -> float:
        noise_multiplier = _check_noise_multiplier(noise_multiplier)
        sample_rate = _check_sample_rate(sample_rate)
        steps = _check_steps(steps, minimum=1)
        delta = self._delta(delta)
        if self.accountant == "prv":
            return history_epsilon([*self.history, (noise_multiplier, sample_rate, steps)], delta, "prv")
        return _epsilon_from_rdp(self.rdp + steps * self._row(noise_multiplier, sample_rate), delta, self.orders)

    def clt_mu(self) -> float:
        """The paper's CLT mu of the history (eq. 6, with q_k inside the sum when the rate changes)."""
        return math.sqrt(self._clt_sum)

    def clt_epsilon(self, delta: float | None = None) -> float:
        """Paper (CLT approximation): eq. (6) of the history so far, converted with eq. (4). Not a guarantee."""
        return dp_epsilon_from_gdp(self.clt_mu(), self._delta(delta)) if self._steps else 0.0

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.rdp = np.zeros(len(self.orders))
        self._clt_sum = 0.0
        for q in sorted({q for _, q, _ in self.history}):
            sigmas = np.array([s for s, r, _ in self.history if r == q])
            counts = np.array([t for _, r, t in self.history if r == q], dtype=np.float64)
            self.rdp += (subsampled_gaussian_rdp(q, sigmas, self.orders) * counts[:, None]).sum(0)
        self._clt_sum = sum(t * self._clt_term(s, q) for s, q, t in self.history)
        self._steps = sum(t for _, _, t in self.history)
        self._prv_cache = {}

    def __repr__(self) -> str:
        return f"ScheduleLedger(accountant={self.accountant!r}, delta={self.delta!r}, steps={self._steps})"


def certified_steps(
    schedule: DynD2PSchedule, ledger: ScheduleLedger, target_epsilon: float, delta: float, stop: int | None = None
) -> int:
    """The most steps n <= ``stop`` (default K) such that the ledger's history followed by the schedule's steps
    ``ledger.steps .. n-1`` stays within ``target_epsilon`` by the ledger's accountant (bisection on n).

    The budget check of a run that follows its schedule is then ``steps + 1 > n``: O(1) per step.
    """
    start, stop = ledger.steps, schedule.steps if stop is None else stop
    if stop <= start:
        return start

    def epsilon_at(n: int) -> float:
        if ledger.accountant == "prv":
            return history_epsilon(list(ledger.history) + schedule.history(start, n), delta, "prv")
        rows = subsampled_gaussian_rdp(schedule.sample_rate, schedule.noise_multipliers(start, n), ledger.orders)
        return _epsilon_from_rdp(ledger.rdp + rows.sum(0), delta, ledger.orders)

    if epsilon_at(stop) <= target_epsilon:
        return stop
    low, high = start, stop  # epsilon_at(low) <= target (or low = start), epsilon_at(high) > target
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if epsilon_at(mid) <= target_epsilon else (low, mid)
    return low


def warn_if_clt_optimistic(clt_epsilon: float, rigorous_epsilon: float, where: str, accountant: str = "rdp") -> bool:
    """Warn (:class:`OptimisticAccountingWarning`) when the paper's CLT epsilon is below the rigorous one."""
    if clt_epsilon < rigorous_epsilon:
        warnings.warn(
            f"{where}: the paper's CLT accounting (eq. 6, an approximation) gives epsilon={clt_epsilon:.4f}, below "
            f"the rigorous {accountant.upper()} accountant's epsilon={rigorous_epsilon:.4f} for the same noise "
            "schedule; the CLT under-states the privacy loss here (few steps or a large sampling rate). The "
            "rigorous value is the one reported and enforced.",
            OptimisticAccountingWarning,
            stacklevel=3,
        )
        return True
    return False
