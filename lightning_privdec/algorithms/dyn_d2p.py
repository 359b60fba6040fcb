"""Dyn-D2P (Zhu, Huang, Wang, Ji, Xu: Dynamic Differentially Private Decentralized Learning with Provable Utility
Guarantee), Algorithm 1, for one node i.

Before training, identically at every node (Sec. 4):

    P0  mu_tot from (eps, delta) by eq. (4)                                          :func:`calibrate_schedule`
    P1  mu_0 from J^2 mu_tot^2 = sum_{k<K} (exp((mu_0 rho_mu^{k/K})^2) - 1), J = 1/q (eq. 8; eq. 9 for a constant
        mu_bar)                                                                          :func:`solve_mu0`, :func:`mu_bar`
    P2  C_k = C_0 rho_c^{-k/K}, mu_k = mu_0 rho_mu^{k/K}, sigma_k = C_k / mu_k                   :class:`DynD2PSchedule`

Per step k = 0..K-1 (the paper's line numbers; the strategy calls the pieces in this order):

    3-4   Poisson-sample a batch at q = B / J, per-sample gradients at z_i^k      (LocalDPSGD, the user's training_step)
    5-6   clip each to C_k                                                                  :meth:`DynD2PNode.privatize`
    7-9   add this node's own N(0, sigma_k^2 I) to the clipped sum, divide by qJ; record noise multiplier 1/mu_k
          (:class:`~lightning_privdec.privacy.accounting.GaussianScheduleAccountant`)   :meth:`DynD2PNode.privatize`
    10    x_i^{k+1/2} = x_i^k - gamma (g_i^k + N_i^k)                         the user's optimizer, on the numerator x
    11-14 push-sum over the time-varying directed graph: x_i^{k+1} = sum_j P^k_ij x_j^{k+1/2}, w_i^{k+1} likewise,
          z_i^{k+1} = x_i^{k+1} / w_i^{k+1}                              :func:`~.base.push_sum_gossip` (``mixing.py``)

Variants: ``"dyn"`` (both schedules), ``"dyn_c"`` (decaying C_k, constant mu_bar), ``"dyn_mu"`` (constant C,
growing mu_k), ``"const"`` (the fixed-noise baseline). Differences from the paper, on purpose: Poisson mini-batches at
q = B / J instead of one example (J = 1/q in eqs. 8-9); the clipped sum is divided by the expected batch size qJ; by
default mu_0 is calibrated with a rigorous accountant (RDP or PRV) instead of the paper's CLT composition
(``calibration="paper"`` gives the published one; its rigorous epsilon is the one reported and enforced).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import optimize

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy.accounting.gaussian import (
    GaussianRelease,
    History,
    _check_delta,
    _check_number,
    _check_sample_rate,
    _check_steps,
)
from lightning_privdec.privacy.accounting.schedule import (
    RDP_ORDERS,
    GaussianSchedule,
    GaussianScheduleAccountant,
    check_epsilon,
    check_rigorous_accountant,
    clt_mu,
    dp_epsilon_from_gdp,
    epsilon_from_rdp,
    gdp_mu_from_dp,
    history_clt_epsilon,
    history_epsilon,
    subsampled_gaussian_rdp,
    warn_if_clt_optimistic,
)
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError

#: ``variant=``: which of the two schedules are dynamic (Sec. 4: Dyn-D2P, Dyn[C]-D2P, Dyn[mu]-D2P, Const-D2P)
VARIANTS: tuple[str, ...] = ("dyn", "dyn_c", "dyn_mu", "const")

#: ``calibration=``: how mu_0 is chosen from the budget
CALIBRATIONS: tuple[str, ...] = ("rigorous", "paper")

#: mu_0 search range of the rigorous calibration (noise multipliers from 1e4 down to 1e-3)
_MU0_MIN, _MU0_MAX = 1e-4, 1e3



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
    delta = _check_delta(delta)
    steps = _check_steps(steps, minimum=1)
    sample_rate = _check_sample_rate(sample_rate)
    variant = _check_variant(variant)
    calibration = _check_calibration(calibration)
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




# ---- the node ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DynD2POptions:
    """Dyn-D2P's own arguments, validated once (by the strategy when it is built, before any process starts)."""

    rho_c: float = 2.0
    rho_mu: float = 2.0
    variant: str = "dyn"
    calibration: str = "rigorous"

    def __post_init__(self) -> None:
        _check_rho(self.rho_c, "rho_c", "decay factor of the clipping bound C_k")
        _check_rho(self.rho_mu, "rho_mu", "growth factor of the per-step GDP budget mu_k")
        _check_variant(self.variant)
        _check_calibration(self.calibration)

    @staticmethod
    def check_parameters(parameters: PrivacyParameters) -> None:
        """The whole schedule derives from the budget: a target is required and a noise multiplier refused."""
        if parameters.noise_multiplier is not None:
            raise PrivacyConfigError(
                "Dyn-D2P sets the noise multiplier 1/mu_k of every step from the budget; do not pass "
                "noise_multiplier (pass target_epsilon and target_delta; variant='const' gives a fixed noise level)"
            )
        if parameters.target_epsilon is None or parameters.target_delta is None:
            raise PrivacyConfigError(
                "Dyn-D2P needs target_epsilon=... and target_delta=...: its clip and noise schedule are derived from "
                "the budget (e.g. target_epsilon=1.0, target_delta=1e-5)"
            )
        check_rigorous_accountant(parameters.accountant)


class DynD2PNode(PrivateNodeAlgorithm):
    """One Dyn-D2P node: lines 5-9 at step k = its ledger's count, so a resumed run continues the schedule.

    The schedule is planned before training from the budget and the planned steps K (``max_steps`` or
    ``max_epochs`` x batches), identically on every node of equal shard size. The rigorous accountant's epsilon is the
    one reported and enforced: at planning time the node finds how many steps of the schedule fit into
    ``target_epsilon`` (:meth:`Accountant.steps_within`), and the per-step budget check is then a comparison. With
    ``calibration="rigorous"`` that is the whole plan; with ``calibration="paper"`` the published schedule may cost
    more, and training stops, on every node together, at the last step within the target (a warning at setup gives
    both numbers). Resumed with a changed plan, the schedule is re-planned for the new K at the same step index.
    """

    def __init__(self, parameters: PrivacyParameters, *, options: DynD2POptions, **mechanics: Any) -> None:
        options.check_parameters(parameters)
        self.options = options
        self.rho_c, self.rho_mu, self.variant, self.calibration = (
            options.rho_c, options.rho_mu, options.variant, options.calibration
        )
        super().__init__(parameters, **mechanics)
        self.schedule: DynD2PSchedule | None = None
        self.mu_tot = gdp_mu_from_dp(float(parameters.target_epsilon), float(parameters.target_delta))
        self.certified_steps: int = 0
        self.plan_epsilon: float | None = None  # rigorous epsilon of the whole plan (history included)
        self.plan_paper_epsilon: float | None = None
        self._plan_key: tuple[Any, ...] | None = None

    def make_accountant(self) -> GaussianScheduleAccountant:
        return GaussianScheduleAccountant(self.parameters.accountant, delta=self.parameters.delta_for_reporting)

    # ---- P0-P2 ---------------------------------------------------------------------------------------------------
    def _schedule_key(self, planned_steps: int) -> tuple[Any, ...]:
        p = self.parameters
        return (planned_steps, self.sample_rate, self.variant, self.rho_c, self.rho_mu, self.calibration,
                float(p.max_grad_norm), float(p.target_epsilon), float(p.target_delta), p.accountant)  # type: ignore[arg-type]

    def plan_noise(self, planned_steps: int) -> None:
        """P0-P2 for a plan of ``planned_steps`` steps in all (see the class docstring for resumes)."""
        assert self.sample_rate is not None
        key = self._schedule_key(planned_steps)
        target, delta = float(self.parameters.target_epsilon), float(self.parameters.target_delta)  # type: ignore[arg-type]
        spent = self.ledger.steps
        if self.schedule is None or self._plan_key != key:
            if self.schedule is not None and spent:
                warnings.warn(
                    f"node {self.rank}: resumed with a different plan ({planned_steps} steps at q={self.sample_rate:.4g} "
                    f"instead of the checkpoint's {self._plan_key[0] if self._plan_key else '?'}); the Dyn-D2P "
                    f"schedule is re-planned for the new K from step {spent} on",
                    UserWarning,
                    stacklevel=2,
                )
            self.schedule = calibrate_schedule(
                target, delta, planned_steps, self.sample_rate, self.parameters.max_grad_norm,
                rho_c=self.rho_c, rho_mu=self.rho_mu, variant=self.variant, calibration=self.calibration,
                accountant=self.parameters.accountant,
                spent=self.ledger if spent and self.calibration == "rigorous" else None,
            )
        self._plan_key = key
        schedule = self.schedule
        self.certified_steps = spent + self.ledger.steps_within(
            target, GaussianSchedule(schedule.noise_multipliers, schedule.sample_rate), limit=schedule.steps - spent
        )
        history = list(self.ledger.history) + schedule.history(spent, planned_steps)
        self.plan_epsilon = history_epsilon(history, delta, self.parameters.accountant)
        self.plan_paper_epsilon = history_clt_epsilon(history, delta)
        if self.calibration == "paper":
            where = f"Dyn-D2P calibration='paper' (node {self.rank}, {planned_steps} steps, q={self.sample_rate:.4g})"
            if warn_if_clt_optimistic(self.plan_paper_epsilon, self.plan_epsilon, where, self.parameters.accountant):
                if self.certified_steps < planned_steps:
                    warnings.warn(
                        f"{where}: the target epsilon={target} is enforced with the rigorous accountant, so training "
                        f"stops after {self.certified_steps} of {planned_steps} steps. Use calibration='rigorous' to "
                        "fit the same schedule shape into the budget.",
                        UserWarning,
                        stacklevel=2,
                    )
        self.noise_multiplier = schedule.noise_multiplier(spent)

    # ---- step k: lines 5-9 ---------------------------------------------------------------------------------------
    def _require_schedule(self) -> DynD2PSchedule:
        if self.schedule is None:
            raise RuntimeError("DynD2PNode used before private_dataloader() planned its schedule")
        return self.schedule

    @property
    def current_clip(self) -> float:
        """C_k of the next step k = :attr:`steps` (line 5)."""
        return self._require_schedule().clip(self.steps)

    @property
    def current_noise_std(self) -> float:
        """sigma_k = C_k / mu_k of the next step, the std of the noise on the clipped sum (line 8)."""
        return self._require_schedule().sigma(self.steps)

    @property
    def step_max_grad_norm(self) -> float:
        return self.current_clip

    def ghost_backward(self, per_sample_losses: torch.Tensor) -> None:
        """Ghost clipping at this step's bound C_k."""
        assert self.ghost is not None
        self.ghost.max_grad_norm = self.current_clip
        super().ghost_backward(per_sample_losses)

    def next_release(self) -> GaussianRelease | None:
        if self.schedule is None or self.sample_rate is None:
            return None
        return GaussianRelease(self.schedule.noise_multiplier(self.steps), self.sample_rate)

    def privatize(self) -> DPStepStats:
        """Lines 5-9 at step k: clip each example to C_k, sum, add N(0, sigma_k^2 I), divide by qJ."""
        schedule = self._require_schedule()
        if self.per_sample is None and self.ghost is None:
            raise RuntimeError("DynD2PNode.privatize called before attach()")
        assert self.sample_rate is not None and self.expected_batch_size is not None
        k = self.steps
        clip, noise_multiplier = schedule.clip(k), schedule.noise_multiplier(k)
        if self.ghost is not None and self._ghost_norms is not None and self.ghost.max_grad_norm != clip:
            raise RuntimeError(f"ghost clipping ran at C={self.ghost.max_grad_norm:g}, but step {k} needs C_k={clip:g}")
        self.last_step = self.clip_and_noise(clip, noise_multiplier)
        self.noise_multiplier = schedule.noise_multiplier(k + 1)
        return self.last_step

    # ---- budget ------------------------------------------------------------------------------------------------------
    def paper_epsilon(self) -> float:
        """Paper (CLT approximation): eq. (6) of the steps taken, converted with eq. (4). Not a guarantee."""
        return self.ledger.clt_epsilon()

    def next_step_exceeds_budget(self) -> bool:
        """Whether one more scheduled step would take the rigorous epsilon past the target (counted at planning)."""
        return self.schedule is not None and self.steps + 1 > self.certified_steps

    def step_metrics(self) -> dict[str, float]:
        return {**super().step_metrics(), "max_grad_norm": self.current_clip, "noise_std": self.current_noise_std}

    def noise_summary(self) -> str:
        if self.schedule is None:
            return "Dyn-D2P schedule not planned"
        s, last = self.schedule, max(0, self.schedule.steps - 1)
        return (
            f"Dyn-D2P schedule ({self.variant}, {s.steps} steps): clip C {s.clip(0):.4g} -> {s.clip(last):.4g}, "
            f"noise multiplier {s.noise_multiplier(0):.4g} -> {s.noise_multiplier(last):.4g}, Poisson q = "
            f"{self.sample_rate or 0.0:.4g}, {self.ledger.accountant} accountant (the paper's CLT value: "
            f"{self.paper_epsilon():.4g})"
        )

    # ---- checkpoints -------------------------------------------------------------------------------------------------
    def plan_state(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "schedule": None if self.schedule is None else dataclasses.asdict(self.schedule),
            "plan_key": None if self._plan_key is None else list(self._plan_key),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "schedule" not in state:
            raise PrivacyConfigError(
                f"node {self.rank}: this checkpoint was not written by Dyn-D2P (no schedule in its privacy state); "
                "resume it with the strategy that wrote it"
            )
        super().load_state_dict(state)

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        self.noise_multiplier = state["noise_multiplier"]
        self.schedule = None if state["schedule"] is None else DynD2PSchedule(**state["schedule"])
        self._plan_key = None if state["plan_key"] is None else tuple(state["plan_key"])
