"""Epsilon of a history of Poisson-subsampled Gaussian steps whose noise multiplier may change every step.

* rigorous: Renyi DP of the subsampled Gaussian at integer orders (:mod:`.rdp`), vectorised
  over a schedule and converted with Balle et al. 2020 (Opacus's ``get_privacy_spent``), or Opacus's PRV accountant
  on a dominating coarsening of the history;
* the CLT approximation of Gaussian DP (Dong, Roth, Su 2019; Bu et al. 2020) and the GDP <-> (epsilon, delta)
  conversions (Dyn-D2P's eqs. 4 and 6): shown, labelled, never used to decide sigma or when to stop.

:class:`~.schedule.GaussianScheduleAccountant` (Dyn-D2P's accountant) and the schedule's calibration are built on these.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from opacus.accountants import GaussianAccountant
from opacus.accountants.analysis import gdp as gdp_analysis
from opacus.accountants.analysis.rdp import get_privacy_spent
from scipy import optimize, special

from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    History,
    _epsilon_of_history,
)
from lightning_privdec.privacy.accounting.rdp import RDP_ORDERS, subsampled_gaussian_rdp
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_number,
    check_sample_rate,
    check_steps,
)

#: the PRV accountant composes one discretised privacy-loss distribution per distinct noise multiplier; a schedule
#: changes it every step, so longer histories are coarsened into this many consecutive segments, each at its smallest
#: noise multiplier and largest rate (a dominating mechanism: the result is an upper bound of the exact PRV epsilon)
PRV_SEGMENTS = 12


class OptimisticAccountingWarning(UserWarning):
    """The paper's CLT epsilon of a schedule is below its rigorous epsilon (the CLT under-states the privacy loss)."""


def check_rigorous_accountant(accountant: Any) -> str:
    if accountant == "gdp":
        raise PrivacyConfigError(
            "accountant='gdp' is the paper's CLT approximation, which Dyn-D2P always reports next to the rigorous "
            "epsilon (paper_epsilon()); choose accountant='rdp' (default) or 'prv' for the epsilon that is enforced"
        )
    if accountant not in ACCOUNTANTS:
        raise PrivacyConfigError(f"unknown accountant {accountant!r}; choose 'rdp' (default) or 'prv'")
    return accountant


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
    epsilon, delta = check_epsilon(epsilon), check_delta(delta)
    high = 1.0
    while gdp_delta(high, epsilon) < delta:  # delta(mu) increases from 0 to 1 with mu
        high *= 2.0
    low = high / 2.0 if high > 1.0 else 1e-12
    return float(optimize.brentq(lambda mu: gdp_delta(mu, epsilon) - delta, low, high, xtol=1e-15, rtol=1e-15))


def dp_epsilon_from_gdp(mu: float, delta: float) -> float:
    """The inverse of P0: the smallest epsilon >= 0 at which a mu-GDP mechanism is (epsilon, delta)-DP (eq. 4)."""
    delta = check_delta(delta)
    mu = check_number(mu, "mu") if not (isinstance(mu, float) and math.isinf(mu)) else mu
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


# ---- the rigorous accountant: RDP of the subsampled Gaussian, vectorised over a schedule ---------------------------
def epsilon_from_rdp(rdp: np.ndarray, delta: float, orders: Sequence[int]) -> float:
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
    accountant = check_rigorous_accountant(accountant)
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
    return epsilon_from_rdp(rdp, delta, orders)


def history_clt_epsilon(history: History, delta: float) -> float:
    """Paper (CLT approximation) epsilon of a history: eq. (6) with q_k inside the sum, converted with eq. (4)."""
    with np.errstate(over="ignore", divide="ignore"):
        total = sum(t * q**2 * float(np.expm1(np.float64(s) ** -2)) for s, q, t in history if t > 0)
    return dp_epsilon_from_gdp(math.sqrt(total), delta) if total > 0 else 0.0


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


def gdp_epsilon_approximation(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """The central-limit (mu-GDP) APPROXIMATION of DP-SGD's epsilon (Dong, Roth, Su 2019, Cor. 5.4 + Cor. 2.13),
    through Opacus's analysis. Not a bound: it can be far below the true epsilon. For display next to a sound value
    only; nothing in the library decides sigma or when to stop with it.

    Opacus searches epsilon in [0, 500] and raises when the root is outside: at ``epsilon = 0`` the mechanism is
    already (0, delta)-DP (returned as 0.0), or epsilon exceeds 500 (returned as ``inf``).
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q, steps, delta = check_sample_rate(sample_rate), check_steps(steps, minimum=1), check_delta(delta)
    if sigma == 0.0:
        return math.inf
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GDP accounting is experimental")
        accountant = GaussianAccountant()
    accountant.history = [(sigma, q, steps)]
    try:
        return float(accountant.get_epsilon(delta=delta))
    except ValueError:
        mu = gdp_analysis.compute_mu_poisson(steps=steps, noise_multiplier=sigma, sample_rate=q)
        if gdp_analysis.delta_eps_mu(eps=0.0, mu=mu) <= delta:
            return 0.0
        return math.inf
