"""Dyn-D2P (Zhu, Huang, Wang, Ji, Xu: Dynamic Differentially Private Decentralized Learning with Provable Utility
Guarantee), Algorithm 1, for one node i.

Before training, identically at every node (Sec. 4), in :mod:`lightning_privdec.privacy.accounting.schedule`:

    P0  mu_tot from (eps, delta) by eq. (4)                                     :func:`~.schedule.calibrate_schedule`
    P1  mu_0 from J^2 mu_tot^2 = sum_{k<K} (exp((mu_0 rho_mu^{k/K})^2) - 1), J = 1/q (eq. 8; eq. 9 for a constant
        mu_bar)                                                               :func:`~.schedule.solve_mu0`, ``mu_bar``
    P2  C_k = C_0 rho_c^{-k/K}, mu_k = mu_0 rho_mu^{k/K}, sigma_k = C_k / mu_k     :class:`~.schedule.DynD2PSchedule`
                                                                          (planned by :meth:`DynD2PNode.plan_noise`)

Per step k = 0..K-1 (the paper's line numbers; the strategy calls the pieces in this order):

    3-4   Poisson-sample a batch at q = B / J, per-sample gradients at z_i^k    (the node's sampler, training_step)
    5-6   clip each to C_k (the node's per-sample clipping, at C_k from the plan)       :meth:`DynD2PNode.privatize`
    7-9   add this node's own N(0, sigma_k^2 I) to the clipped sum, divide by qJ; record noise multiplier 1/mu_k
          (:class:`~lightning_privdec.privacy.accounting.schedule.GaussianScheduleAccountant`)          :meth:`DynD2PNode.privatize`
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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy.accounting.composition import (
    check_rigorous_accountant,
    gdp_mu_from_dp,
    history_clt_epsilon,
    history_epsilon,
    warn_if_clt_optimistic,
)
from lightning_privdec.privacy.accounting.gaussian import GaussianRelease
from lightning_privdec.privacy.accounting.schedule import (
    CALIBRATIONS,
    RHO_C_ROLE,
    RHO_MU_ROLE,
    VARIANTS,
    DynD2PSchedule,
    GaussianSchedule,
    GaussianScheduleAccountant,
    calibrate_schedule,
    check_calibration,
    check_variant,
)
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.local_dp import GaussianMechanism
from lightning_privdec.privacy.validation import MIN_MAX_GRAD_NORM, check_factor

__all__ = ["CALIBRATIONS", "VARIANTS", "DynD2PNode", "DynD2POptions", "DynD2PSchedule", "calibrate_schedule"]


# ---- the node ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DynD2POptions:
    """Dyn-D2P's own arguments, validated once (by the strategy when it is built, before any process starts)."""

    rho_c: float = 2.0
    rho_mu: float = 2.0
    variant: str = "dyn"
    calibration: str = "rigorous"

    def __post_init__(self) -> None:
        check_factor(self.rho_c, "rho_c", RHO_C_ROLE)
        check_factor(self.rho_mu, "rho_mu", RHO_MU_ROLE)
        check_variant(self.variant)
        check_calibration(self.calibration)

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

    def check_clip_schedule(self, max_grad_norm: float) -> None:
        """The schedule's last clip bound C_0 / rho_c (P2) must be one the clipping accepts
        (:data:`~lightning_privdec.privacy.validation.MIN_MAX_GRAD_NORM`), checked before training."""
        last = max_grad_norm / self.rho_c
        if last < MIN_MAX_GRAD_NORM:
            raise PrivacyConfigError(
                f"Dyn-D2P's clip bound falls from max_grad_norm={max_grad_norm!r} to max_grad_norm / rho_c = {last:.3g}, "
                "below 2^-26 (1.5e-8), the smallest clipping bound whose float32 rounding the clipping bounds cover: "
                "raise max_grad_norm or lower rho_c"
            )


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

    gaussian: GaussianMechanism  # this node's Gaussian noise (made in __init__)

    def __init__(self, parameters: PrivacyParameters, *, options: DynD2POptions, **mechanics: Any) -> None:
        self.options = options
        self.rho_c, self.rho_mu, self.variant, self.calibration = (
            options.rho_c, options.rho_mu, options.variant, options.calibration
        )
        super().__init__(parameters, **mechanics)
        self.gaussian = self.gaussian_mechanism()
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
        self.clipping.max_grad_norm = schedule.clip(spent)  # ghost clipping clips in the backward pass: C_k set now

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

    def next_release(self) -> GaussianRelease | None:
        if self.schedule is None or self.sample_rate is None:
            return None
        return GaussianRelease(self.schedule.noise_multiplier(self.steps), self.sample_rate)

    def privatize(self) -> DPStepStats:
        """Lines 5-9 at step k: clip each example to C_k, sum, add N(0, sigma_k^2 I), divide by qJ."""
        schedule, clipping = self._require_schedule(), self.clipping
        if clipping.hooks is None or self.expected_batch_size is None:
            raise RuntimeError("DynD2PNode.privatize called before attach()")
        k = self.steps
        clip, noise_multiplier = schedule.clip(k), schedule.noise_multiplier(k)
        if clipping.ghost is not None and clipping.max_grad_norm != clip:  # ghost clipping clipped in the backward
            raise RuntimeError(f"ghost clipping ran at C={clipping.max_grad_norm:g}, but step {k} needs C_k={clip:g}")
        clipping.max_grad_norm = clip
        norms = clipping.clipped_sum(into_grads=False)
        self.last_step = self.gaussian.noise_clipped_sum(
            clipping.parameters, norms, max_grad_norm=clip, noise_multiplier=noise_multiplier,
            expected_batch_size=self.expected_batch_size, clipped_sums=clipping.take_clipped_sums(),
        )
        self.noise_multiplier = schedule.noise_multiplier(k + 1)
        clipping.max_grad_norm = schedule.clip(k + 1)
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
