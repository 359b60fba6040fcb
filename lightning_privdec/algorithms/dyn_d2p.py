"""One node's privacy machinery for Dyn-D2P: the DP-SGD step with a scheduled clip C_k and noise sigma_k."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.dyn_d2p import (
    DynD2PSchedule,
    ScheduleLedger,
    _check_calibration,
    _check_rho,
    _check_rigorous_accountant,
    _check_variant,
    calibrate_schedule,
    certified_steps,
    gdp_mu_from_dp,
    history_clt_epsilon,
    history_epsilon,
    warn_if_clt_optimistic,
)
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.privacy.errors import PrivacyConfigError


class DynD2PPrivacyEngine(DPCSGPNode):
    """Dyn-D2P Algorithm 1, lines 3-9, for one node: Poisson sampling at q, per-sample clipping to C_k, this node's
    own N(0, sigma_k^2 I) on the clipped sum, division by qJ; step k recorded in a ledger of varying multipliers.

    The schedule (:class:`DynD2PSchedule`) is planned before training from the budget and the planned steps K
    (``max_steps`` or ``max_epochs`` x batches), identically on every node of equal shard size. Step k is this
    node's ledger count, so a resumed run continues the schedule where its checkpoint left it.

    Budget: the rigorous accountant (``"rdp"`` or ``"prv"``) is the one reported by :meth:`epsilon` and the one
    enforced. At planning time the engine computes how many steps of the schedule fit into ``target_epsilon``
    (:func:`certified_steps`); the per-step budget check is then a comparison. With ``calibration="rigorous"`` that
    is the whole plan. With ``calibration="paper"`` the published schedule may cost more than the target under the
    rigorous accountant: a warning gives both numbers at setup and training stops, on every node together, at the
    last step that keeps the rigorous epsilon within the target. The paper's CLT value is available as
    :meth:`paper_epsilon`, labelled as such, and is never used as the epsilon spent.

    Resume: with the same plan (K, q and schedule arguments) the loaded schedule continues at the ledger's step.
    With a changed plan, the schedule is re-planned for the new K at the same step index: the rigorous calibration
    picks mu_0 so that the spent history plus the remaining steps spend the target (never more); the paper's
    calibration re-solves P0/P1 for the new K and the rigorous budget check still counts the history.
    """

    fixed_noise_multiplier = False  # its noise follows its own plan

    def __init__(
        self,
        parameters: PrivacyParameters,
        *,
        rho_c: float,
        rho_mu: float,
        variant: str = "dyn",
        calibration: str = "rigorous",
        rank: int,
        device: torch.device,
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
        noise_seed: int | None = None,
        secure_mode: bool = False,
    ) -> None:
        if parameters.target_epsilon is None or parameters.target_delta is None:
            raise PrivacyConfigError(
                "Dyn-D2P derives its whole noise schedule from the budget: pass target_epsilon=... and "
                "target_delta=... (e.g. target_epsilon=1.0, target_delta=1e-5)"
            )
        if parameters.noise_multiplier is not None:
            raise PrivacyConfigError(
                "Dyn-D2P sets a different noise multiplier 1/mu_k at every step from the budget; do not pass "
                "noise_multiplier (use variant='const' for a fixed noise level)"
            )
        _check_rigorous_accountant(parameters.accountant)
        super().__init__(
            parameters, rank=rank, device=device, grad_sample_mode=grad_sample_mode, noise_seed=noise_seed,
            secure_mode=secure_mode,
        )
        self.rho_c = _check_rho(rho_c, "rho_c", "decay factor of the clipping bound C_k")
        self.rho_mu = _check_rho(rho_mu, "rho_mu", "growth factor of the per-step GDP budget mu_k")
        self.variant = _check_variant(variant)
        self.calibration = _check_calibration(calibration)
        self.ledger: ScheduleLedger = ScheduleLedger(parameters.accountant, delta=parameters.delta_for_reporting)
        self.schedule: DynD2PSchedule | None = None
        self.mu_tot = gdp_mu_from_dp(float(parameters.target_epsilon), float(parameters.target_delta))
        self.certified_steps: int = 0
        self.plan_epsilon: float | None = None  # rigorous epsilon of the whole plan (history included)
        self.plan_paper_epsilon: float | None = None
        self._plan_key: tuple[Any, ...] | None = None

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

    # ---- planning ------------------------------------------------------------------------------------------------
    def _schedule_key(self, planned_steps: int) -> tuple[Any, ...]:
        p = self.parameters
        return (planned_steps, self.sample_rate, self.variant, self.rho_c, self.rho_mu, self.calibration,
                float(p.max_grad_norm), float(p.target_epsilon), float(p.target_delta), p.accountant)  # type: ignore[arg-type]

    def plan_noise(self, planned_steps: int) -> None:
        """P0-P2 for a plan of ``planned_steps`` steps in all (Sec. 4; see the class docstring for resumes)."""
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
                accountant=self.parameters.accountant, spent=self.ledger if spent and self.calibration == "rigorous" else None,
            )
        self._plan_key = key
        self.planned_steps = planned_steps
        self._plan = (planned_steps, self.sample_rate)
        self.certified_steps = certified_steps(self.schedule, self.ledger, target, delta)
        history = list(self.ledger.history) + self.schedule.history(spent, planned_steps)
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
        self.noise_multiplier = self.schedule.noise_multiplier(spent)

    # ---- step k ------------------------------------------------------------------------------------------------------
    def _require_schedule(self) -> DynD2PSchedule:
        if self.schedule is None:
            raise RuntimeError("DynD2PPrivacyEngine used before private_dataloader() planned its schedule")
        return self.schedule

    @property
    def current_clip(self) -> float:
        """C_k of the next step k = :attr:`steps` (Algorithm 1, line 5)."""
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

    def privatize(self) -> DPStepStats:
        """Lines 5-9 at step k: clip each example to C_k, sum, add N(0, sigma_k^2 I), divide by qJ; record 1/mu_k."""
        schedule = self._require_schedule()
        if self.per_sample is None and self.ghost is None:
            raise RuntimeError("DynD2PPrivacyEngine.privatize called before attach()")
        assert self.sample_rate is not None and self.expected_batch_size is not None
        k = self.steps
        clip, noise_multiplier = schedule.clip(k), schedule.noise_multiplier(k)
        if self.ghost is not None and self._ghost_norms is not None and self.ghost.max_grad_norm != clip:
            raise RuntimeError(f"ghost clipping ran at C={self.ghost.max_grad_norm:g}, but step {k} needs C_k={clip:g}")
        self.last_step = self.clip_and_noise(clip, noise_multiplier)
        self.ledger.record(noise_multiplier, self.sample_rate)
        self.noise_multiplier = schedule.noise_multiplier(k + 1)
        return self.last_step

    # ---- budget ------------------------------------------------------------------------------------------------------
    def epsilon(self) -> float:
        """Rigorous epsilon spent so far (the ledger's accountant, RDP or PRV) at :attr:`delta`."""
        return self.ledger.epsilon()

    def paper_epsilon(self) -> float:
        """Paper (CLT approximation): eq. (6) of the steps taken, converted with eq. (4). Not a guarantee."""
        return self.ledger.clt_epsilon()

    def next_step_exceeds_budget(self) -> bool:
        """Whether one more scheduled step would take the rigorous epsilon past the target (O(1): see planning)."""
        if self.schedule is None:
            return False
        return self.steps + 1 > self.certified_steps

    # ---- checkpoints -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledger, the schedule and the plan it was made for (plain types; generators only with a noise_seed)."""
        state: dict[str, Any] = {
            "ledger": self.ledger.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "schedule": None if self.schedule is None else dataclasses.asdict(self.schedule),
            "plan_key": None if self._plan_key is None else list(self._plan_key),
        }
        state.update(self.generator_state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a checkpointed ledger and schedule. Never rolls back (fewer saved steps are refused)."""
        if "schedule" not in state:
            raise PrivacyConfigError(
                f"node {self.rank}: this checkpoint was not written by Dyn-D2P (no schedule in its privacy state); "
                "resume it with the strategy that wrote it"
            )
        saved_steps = sum(int(t) for _, _, t in state["ledger"]["history"])
        if saved_steps < self.ledger.steps:
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint's privacy ledger has {saved_steps} steps but this node has already "
                f"spent {self.ledger.steps}; restoring it would forget spent privacy. Resume into a fresh Trainer."
            )
        self.ledger.load_state_dict(state["ledger"])
        self.noise_multiplier = state["noise_multiplier"]
        self.schedule = None if state["schedule"] is None else DynD2PSchedule(**state["schedule"])
        self._plan_key = None if state["plan_key"] is None else tuple(state["plan_key"])
        self.load_generator_state(state)
