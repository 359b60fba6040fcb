"""Dyn-D2P's schedule (P0-P2 of its Sec. 4: the per-step clip C_k and noise multiplier 1/mu_k, calibrated to the
budget) and its accountant: the rigorous epsilon of a noise multiplier that changes every step, and the paper's CLT
value.

Step k of Dyn-D2P (``lightning_privdec.algorithms.dyn_d2p``) is the Poisson-subsampled Gaussian mechanism with noise
multiplier 1/mu_k at rate q. Two accountings of the same schedule:

* **rigorous** (reported and enforced): the varying multipliers composed by a sound accountant, ``"rdp"`` (Renyi DP
  of the subsampled Gaussian at integer orders, Mironov, Talwar, Zhang 2019, Sec. 3.3; converted with Balle et al.
  2020 via Opacus's ``get_privacy_spent``; default) or ``"prv"`` (Opacus's PRV accountant, Gopi et al. 2021, on a
  dominating coarsening of the schedule). :class:`GaussianScheduleAccountant` accumulates the RDP vector step by step, so the
  per-step update and the epsilon query are O(1) in the number of steps taken.
* **paper (CLT approximation)**: mu = q sqrt(sum_k (e^{mu_k^2} - 1)) (Prop. 3, eq. 6; Dong, Roth, Su 2019 /
  Bu et al. 2020), converted with eq. 4. A central-limit approximation: for few steps or a large sampling rate it can
  be optimistic (below the true epsilon). Shown, labelled; never used to decide sigma or when to stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize

from lightning_privdec.privacy.accounting.composition import (
    RDP_ORDERS,
    check_rigorous_accountant,
    clt_mu,
    dp_epsilon_from_gdp,
    epsilon_from_rdp,
    gdp_mu_from_dp,
    history_epsilon,
    subsampled_gaussian_rdp,
)
from lightning_privdec.privacy.accounting.gaussian import (
    GaussianRelease,
    History,
    SubsampledGaussianAccountant,
)
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import (
    check_choice,
    check_delta,
    check_epsilon,
    check_factor,
    check_positive,
    check_sample_rate,
    check_steps,
)

#: ``variant=``: which of the two schedules are dynamic (Sec. 4: Dyn-D2P, Dyn[C]-D2P, Dyn[mu]-D2P, Const-D2P)
VARIANTS: tuple[str, ...] = ("dyn", "dyn_c", "dyn_mu", "const")

#: ``calibration=``: how mu_0 is chosen from the budget
CALIBRATIONS: tuple[str, ...] = ("rigorous", "paper")

#: mu_0 search range of the rigorous calibration (noise multipliers from 1e4 down to 1e-3)
_MU0_MIN, _MU0_MAX = 1e-4, 1e3



# ---- validation ---------------------------------------------------------------------------------------------------
def check_variant(variant: Any) -> str:
    return check_choice(variant, VARIANTS, (
        f"unknown variant {variant!r}; choose 'dyn' (decaying clip and growing mu, Dyn-D2P), 'dyn_c' (decaying "
        "clip, Dyn[C]-D2P), 'dyn_mu' (growing mu, Dyn[mu]-D2P) or 'const' (fixed noise, Const-D2P)"
    ))


def check_calibration(calibration: Any) -> str:
    return check_choice(calibration, CALIBRATIONS, (
        f"unknown calibration {calibration!r}; choose 'rigorous' (mu_0 chosen so that a sound accountant spends "
        "exactly the target; default) or 'paper' (mu_tot and mu_0 as published, eqs. 4 and 8)"
    ))


RHO_C_ROLE = "decay factor of the clipping bound C_k"
RHO_MU_ROLE = "growth factor of the per-step GDP budget mu_k"


# ---- P1: mu_0 (eq. 8) and mu_bar (eq. 9) ---------------------------------------------------------------------------
def solve_mu0(mu_tot: float, sample_rate: float, steps: int, rho_mu: float) -> float:
    """P1: the mu_0 with J^2 mu_tot^2 = sum_{k<K} (exp((mu_0 rho_mu^{k/K})^2) - 1), J = 1/q (eq. 8; bisection).

    The right-hand side increases with mu_0, so the root is unique.
    """
    mu_tot = check_positive(mu_tot, "mu_tot")
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps, minimum=1)
    rho_mu = check_factor(rho_mu, "rho_mu", RHO_MU_ROLE)
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
    mu_tot = check_positive(mu_tot, "mu_tot")
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps, minimum=1)
    return math.sqrt(math.log1p((mu_tot / q) ** 2 / steps))


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
        check_steps(self.steps, minimum=1)
        check_sample_rate(self.sample_rate)
        check_positive(self.max_grad_norm, "max_grad_norm")
        check_positive(self.mu0, "mu0")
        check_factor(self.rho_c, "rho_c", RHO_C_ROLE)
        check_factor(self.rho_mu, "rho_mu", RHO_MU_ROLE)
        check_variant(self.variant)

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
        return history_epsilon(self.history(0, steps), check_delta(delta), accountant)

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
    spent: GaussianScheduleAccountant | None = None,
) -> DynD2PSchedule:
    """The schedule of a run of ``steps`` steps (K) for the budget (target_epsilon, delta).

    ``calibration="paper"``: mu_tot by P0 (eq. 4) and mu_0 by P1 (eq. 8; eq. 9 for the constant-mu variants), exactly
    as published. ``calibration="rigorous"``: the same shape (variant, rho_c, rho_mu), with mu_0 chosen by bisection
    so that the rigorous accountant spends the target over the K steps (within 1%, never more).

    ``spent``: a ledger that already holds the first ``spent.steps`` steps of this run (a resumed run with a changed
    plan). The rigorous calibration then chooses mu_0 for history + steps ``spent.steps .. K-1``; the paper's
    calibration has no notion of spent steps and is solved for the whole K (the rigorous ledger still counts them).
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    steps = check_steps(steps, minimum=1)
    sample_rate = check_sample_rate(sample_rate)
    variant = check_variant(variant)
    calibration = check_calibration(calibration)
    accountant = check_rigorous_accountant(accountant)
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
    if spent is not None and epsilon_from_rdp(base, delta, RDP_ORDERS) >= target_epsilon:
        raise PrivacyConfigError(
            f"epsilon={spent.epsilon(delta):.4f} of target_epsilon={target_epsilon} is already spent: there is no "
            "budget left to train on; raise target_epsilon or start a new run on new data"
        )
    prior = [] if spent is None else list(spent.history)

    def rdp_epsilon(mu0: float) -> float:
        schedule = DynD2PSchedule(mu0=mu0, **shape)
        rows = subsampled_gaussian_rdp(sample_rate, schedule.noise_multipliers(start), RDP_ORDERS)
        return epsilon_from_rdp(base + rows.sum(0), delta, RDP_ORDERS)

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
@dataclass(frozen=True)
class GaussianSchedule:
    """Steps whose noise multiplier follows a schedule, at one Poisson rate: what a plan asks
    :meth:`GaussianScheduleAccountant.epsilon_after` about (each step taken is recorded as its own :class:`GaussianRelease`)."""

    noise_multipliers: Callable[[int, int], np.ndarray]  # (start, stop) -> sigma_start .. sigma_{stop-1}
    sample_rate: float

    def __post_init__(self) -> None:
        if not callable(self.noise_multipliers):
            raise TypeError(f"noise_multipliers must be a callable (start, stop) -> array, got {self.noise_multipliers!r}")
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))


class GaussianScheduleAccountant(SubsampledGaussianAccountant):
    """A :class:`SubsampledGaussianAccountant` for a noise multiplier that changes every step, with O(1) updates and queries.

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


