"""Dyn-D2P's accountant: the rigorous epsilon of a noise multiplier that changes every step, and the paper's CLT value.

Step k of Dyn-D2P (``lightning_privdec.algorithms.dyn_d2p``) is the Poisson-subsampled Gaussian mechanism with noise
multiplier 1/mu_k at rate q. Two accountings of the same schedule:

* **rigorous** (reported and enforced): the varying multipliers composed by a sound accountant, ``"rdp"`` (Renyi DP
  of the subsampled Gaussian at integer orders, Mironov, Talwar, Zhang 2019, Sec. 3.3; converted with Balle et al.
  2020 via Opacus's ``get_privacy_spent``; default) or ``"prv"`` (Opacus's PRV accountant, Gopi et al. 2021, on a
  dominating coarsening of the schedule). :class:`GaussianScheduleAccountant` accumulates the RDP vector step by
  step, so the per-step update and the epsilon query are O(1) in the number of steps taken.
* **paper (CLT approximation)**: mu = q sqrt(sum_k (e^{mu_k^2} - 1)) (Prop. 3, eq. 6; Dong, Roth, Su 2019 /
  Bu et al. 2020), converted with eq. 4. A central-limit approximation: for few steps or a large sampling rate it can
  be optimistic (below the true epsilon). Shown, labelled; never used to decide sigma or when to stop.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from opacus.accountants.analysis.rdp import get_privacy_spent
from scipy import optimize, special

from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    GaussianRelease,
    History,
    SubsampledGaussianAccountant,
    _check_delta,
    _check_number,
    _check_sample_rate,
    _epsilon_of_history,
)
from lightning_privdec.privacy.errors import PrivacyConfigError

#: RDP orders of the rigorous accountant. Integer orders only: their RDP has the exact closed form of Mironov et al.
#: 2019, Sec. 3.3, which vectorises over a whole schedule. Opacus's default orders add fractional ones in (1, 11); at
#: epsilon <= 3 the two agree within 0.1% (integer orders are never below them: fewer orders, looser bound).
RDP_ORDERS: tuple[int, ...] = tuple(range(2, 65)) + (72, 80, 96, 128, 160, 192, 256)

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


def check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
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
    epsilon, delta = check_epsilon(epsilon), _check_delta(delta)
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


# ---- the ledger ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GaussianSchedule:
    """Steps whose noise multiplier follows a schedule, at one Poisson rate: what a plan asks
    :meth:`GaussianScheduleAccountant.epsilon_after` about (each step taken is recorded as its own
    :class:`GaussianRelease`)."""

    noise_multipliers: Callable[[int, int], np.ndarray]  # (start, stop) -> sigma_start .. sigma_{stop-1}
    sample_rate: float

    def __post_init__(self) -> None:
        if not callable(self.noise_multipliers):
            raise TypeError(f"noise_multipliers must be a callable (start, stop) -> array, got {self.noise_multipliers!r}")
        object.__setattr__(self, "sample_rate", _check_sample_rate(self.sample_rate))


class GaussianScheduleAccountant(SubsampledGaussianAccountant):
    """A :class:`SubsampledGaussianAccountant` for a noise multiplier that changes every step, with O(1) updates and
    queries.

    The RDP curve of the history (one row per integer order of :data:`RDP_ORDERS`) is accumulated step by step, so
    :meth:`record`, :meth:`epsilon` and :meth:`epsilon_after` cost one step's RDP each, whatever the history's length.
    It equals Opacus's ``RDPAccountant`` on the same history at the same orders. With ``accountant="prv"`` the
    epsilon is Opacus's PRV accountant on the history coarsened to :data:`PRV_SEGMENTS` dominating segments (sound,
    slower; cached per step count). The paper's CLT value (eq. 6) is kept alongside in O(1) too
    (:meth:`clt_epsilon`). The checkpoint format is :class:`SubsampledGaussianAccountant`'s.
    """

    def __init__(self, accountant: str = "rdp", delta: float | None = None) -> None:
        super().__init__(check_rigorous_accountant(accountant), delta=delta)
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

    def _record(self, release: GaussianRelease, steps: int) -> None:
        noise_multiplier, sample_rate = release.noise_multiplier, release.sample_rate
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
        return epsilon_from_rdp(self.rdp, delta, self.orders)

    def _epsilon_after(self, steps: int, release: GaussianRelease | None) -> float:
        if release is None:
            return self.epsilon()
        sigma, q, delta = release.noise_multiplier, release.sample_rate, self._delta(None)
        if self.accountant == "prv":
            return history_epsilon([*self.history, (sigma, q, steps)], delta, "prv")
        return epsilon_from_rdp(self.rdp + steps * self._row(sigma, q), delta, self.orders)

    def clt_mu(self) -> float:
        """The paper's CLT mu of the history (eq. 6, with q_k inside the sum when the rate changes)."""
        return math.sqrt(self._clt_sum)

    def clt_epsilon(self, delta: float | None = None) -> float:
        """Paper (CLT approximation): eq. (6) of the history so far, converted with eq. (4). Not a guarantee."""
        return dp_epsilon_from_gdp(self.clt_mu(), self._delta(delta)) if self._steps else 0.0

    def epsilon_after(self, steps: int, release: GaussianRelease | GaussianSchedule | None = None) -> float:
        """:class:`Accountant`'s query; ``release`` may also be a :class:`GaussianSchedule` (planning only): then
        the next ``steps`` steps follow it from this ledger's step on."""
        if steps == 0 or not isinstance(release, GaussianSchedule):
            return super().epsilon_after(steps, release)
        start, delta, sample_rate = self._steps, self._delta(None), release.sample_rate
        multipliers = release.noise_multipliers(start, start + steps)
        if self.accountant == "prv":
            return history_epsilon([*self.history, *((float(m), sample_rate, 1) for m in multipliers)], delta, "prv")
        rows = subsampled_gaussian_rdp(sample_rate, multipliers, self.orders)
        return epsilon_from_rdp(self.rdp + rows.sum(0), delta, self.orders)

    def metrics(self) -> dict[str, float]:
        """The rigorous epsilon, and the paper's CLT value beside it (labelled: NOT the epsilon spent)."""
        return {"epsilon": self.epsilon(), "epsilon_paper_clt": self.clt_epsilon()}

    def _load_state(self, state: Any) -> None:
        super()._load_state(state)
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
        return (f"GaussianScheduleAccountant(accountant={self.accountant!r}, delta={self.delta!r}, "
                f"steps={self._steps})")


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
