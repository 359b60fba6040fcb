"""One node's privacy machinery for Decor: clipping, pairwise-cancelling plus local noise, SecLDP accounting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch
from torch import nn

from lightning_privdec.algorithms.decor import decor_perturbation
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats, clip_factor
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.pairwise import CorrelatedNoise, PairwiseSecrets
from lightning_privdec.privacy.secldp import (
    CalibrationResult,
    calibrate_secldp,
    secldp_epsilon,
    secldp_epsilon_example_level,
    secldp_sensitivity,
    secldp_step,
)


class DecorPrivacyEngine(DPCSGPNode):
    """Decor Algorithm 1, lines 2-5 for one node, accounted with the SecLDP accountant.

    ``clipping="per_sample"`` (example-level privacy): Poisson-sampled per-example gradients clipped to C and summed;
    the correlated noise sum_j v_ij and the local noise vbar_i are added to the sum (sensitivity C), which is then
    divided by the expected batch size. ``clipping="user"`` (user-level privacy, the paper's theory): the batch
    gradient is clipped to C and noised (sensitivity 2C for a replaced user).

    Args:
        graph: the undirected communication graph (for the accountant).
        adversary: ``"eavesdropper"``, ``"curious"`` or a number q of colluding nodes.
        sigma_cdp, sigma_cor: the noise levels; both ``None`` with a target in ``parameters``: calibrated before
            training (Decor App. D.1, :func:`calibrate_secldp`).
        baseline: ``None`` (Decor), ``"ldp"`` (sigma_cor = 0, sigma_cdp at the LDP level: every message private on
            its own) or ``"cdp"`` (sigma_cor = 0, sigma_cdp = sigma_LDP / sqrt(n) on the complete graph: the level a
            trusted aggregator would need; its epsilon is the CENTRAL one, for the average model only).
    """

    fixed_noise_multiplier = False  # its noise follows its own plan

    def __init__(
        self,
        parameters: PrivacyParameters,
        *,
        graph: nx.Graph,
        adversary: str | int,
        sigma_cdp: float | None,
        sigma_cor: float | None,
        clipping: str,
        baseline: str | None = None,
        rank: int,
        device: torch.device,
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
        noise_seed: int | None = None,
        secure_mode: bool = False,
    ) -> None:
        super().__init__(
            parameters, rank=rank, device=device, grad_sample_mode=grad_sample_mode, noise_seed=noise_seed,
            secure_mode=secure_mode,
        )
        self.graph, self.adversary, self.clipping, self.baseline = graph, adversary, clipping, baseline
        self.sigma_cdp, self.sigma_cor = sigma_cdp, sigma_cor
        self.secrets: PairwiseSecrets | None = None
        self.correlated: CorrelatedNoise | None = None
        self.calibration: CalibrationResult | None = None
        self._within: tuple[tuple[Any, ...], int] | None = None  # cache of _steps_within
        self.epsilon_step: float | None = None
        self._steps = 0

    @property
    def supports_micro_batches(self) -> bool:  # type: ignore[override]
        return self.clipping == "per_sample"

    micro_batch_refusal = (
        "Decor with clipping='user' clips the whole batch gradient of a user at once: accumulate_grad_batches must "
        "be 1 (use clipping='per_sample' to accumulate micro-batches of one logical Poisson batch)"
    )

    @property
    def level(self) -> str:
        return "example" if self.clipping == "per_sample" else "user"

    def noise_summary(self) -> str:
        return (
            f"Decor ({self.level} level, adversary {self.adversary!r}): independent noise sigma_cdp = "
            f"{self.sigma_cdp or 0.0:.4g}, pairwise-cancelling sigma_cor = {self.sigma_cor or 0.0:.4g}, SecLDP accountant"
        )

    def attach(self, module: nn.Module, fix_model: bool = False) -> None:
        if self.clipping == "per_sample":
            super().attach(module, fix_model)
        else:  # user level clips the batch gradient: no per-sample machinery
            self._module = module

    # ---- planning ------------------------------------------------------------------------------------------------
    def plan_noise(self, planned_steps: int) -> None:
        target = self.parameters.target_epsilon
        if self.sigma_cdp is None:
            assert target is not None
            self.calibration = calibrate_secldp(
                target,
                self.delta,
                max(1, planned_steps),
                self.graph,
                self.parameters.max_grad_norm,
                self.adversary,  # type: ignore[arg-type]
                sample_rate=self.sample_rate if self.level == "example" else None,
            )
            choice = {
                None: (self.calibration.sigma_cdp, self.calibration.sigma_cor),
                "ldp": (self.calibration.sigma_ldp, 0.0),
                "cdp": (self.calibration.sigma_cdp_floor, 0.0),
            }
            self.sigma_cdp, self.sigma_cor = choice[self.baseline]
        self.sigma_cor = self.sigma_cor or 0.0
        n = self.graph.number_of_nodes()
        if self.baseline == "cdp":  # central DP of the network average: one node's input moves it by Delta / n
            delta_sens = secldp_sensitivity(self.parameters.max_grad_norm, self.level)  # type: ignore[arg-type]
            self.epsilon_step = delta_sens**2 / (2.0 * n * self.sigma_cdp**2)
        else:
            self.epsilon_step = secldp_step(
                self.graph, self.sigma_cdp, self.sigma_cor, self.parameters.max_grad_norm, self.adversary,  # type: ignore[arg-type]
                level=self.level,  # type: ignore[arg-type]
            )
        self.noise_multiplier = self.sigma_cdp / self.parameters.max_grad_norm  # reported as sigma_cdp / C
        self.planned_steps = planned_steps
        if self.secrets is not None:
            self.correlated = CorrelatedNoise(self.secrets, self.sigma_cor) if self.sigma_cor > 0 else None

    # ---- the step ------------------------------------------------------------------------------------------------
    def privatize(self) -> DPStepStats:
        """Lines 2-5: clip, then add sum_{j in N_i} v_ij^(t) + vbar_i with t = this node's step counter."""
        if self.sigma_cdp is None or self._module is None:
            raise RuntimeError("DecorPrivacyEngine.privatize called before attach() and private_dataloader()")
        params = [p for p in self._module.parameters() if p.requires_grad]
        C = self.parameters.max_grad_norm
        if self.clipping == "per_sample":
            assert self.expected_batch_size is not None
            stats = self.clip_and_noise(C, noise_multiplier=0.0)  # p.grad = clipped sum / qJ
            scale = self.expected_batch_size  # the noise goes on the clipped sum, before the division
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            factor = clip_factor(norm, C)
            for p, g in zip(params, grads):
                p.grad = g * factor
            stats = DPStepStats(batch_size=-1, mean_norm=norm, max_norm=norm, clipped_fraction=(norm > C).float(),
                                noise_std=self.sigma_cdp)
            scale = 1.0
        numel = sum(p.numel() for p in params)
        noise = decor_perturbation(
            numel, self._steps, correlated=self.correlated, sigma_cdp=self.sigma_cdp,
            generator=self.noise_generator, dtype=params[0].dtype, device=params[0].device,
        ).div_(scale)
        offset = 0
        for p in params:
            p.grad.add_(noise[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._steps += 1
        self.last_step = stats
        return stats

    # ---- accounting ----------------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self._steps

    def _epsilon_after(self, steps: int) -> float:
        if self.epsilon_step is None or steps == 0:
            return 0.0
        if self.level == "example":
            assert self.sample_rate is not None
            return secldp_epsilon_example_level(self.epsilon_step, steps, self.delta, self.sample_rate)
        return secldp_epsilon(self.epsilon_step, steps, self.delta)

    def epsilon(self) -> float:
        """(epsilon, delta)-SecLDP spent so far against the configured adversary (SecLDP accountant)."""
        return self._epsilon_after(self._steps)

    def next_step_exceeds_budget(self) -> bool:
        target = self.parameters.target_epsilon
        return target is not None and self.epsilon_step is not None and self._steps + 1 > self._steps_within(target)

    def _steps_within(self, target: float) -> int:
        """The most steps whose epsilon stays within ``target``; epsilon grows with the steps, so this is found once
        per (step level, q, delta, target) by a doubling and bisection search instead of one accountant call per step."""
        key = (self.epsilon_step, self.sample_rate, self.delta, self.level, target)
        if self._within is None or self._within[0] != key:
            fits, beyond = 0, max(1, int(self.planned_steps or 1))
            while self._epsilon_after(beyond) <= target and beyond < 2**40:
                fits, beyond = beyond, 2 * beyond
            while beyond - fits > 1:
                middle = (fits + beyond) // 2
                fits, beyond = (middle, beyond) if self._epsilon_after(middle) <= target else (fits, middle)
            self._within = (key, fits)
        return self._within[1]

    # ---- checkpoints (no secrets: a resumed run agrees on new pairwise keys) ---------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps, "sigma_cdp": self.sigma_cdp, "sigma_cor": self.sigma_cor, **self.generator_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["steps"]) < self._steps:
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint has {state['steps']} private steps but this node has already taken "
                f"{self._steps}; restoring it would forget spent privacy. Resume into a fresh Trainer."
            )
        self._steps = int(state["steps"])
        self.sigma_cdp, self.sigma_cor = state["sigma_cdp"], state["sigma_cor"]
        self.load_generator_state(state)
