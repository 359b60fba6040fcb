"""DP-CSGP (Zhu, Zhao, Huang, Zhou, Ji, Xu), Algorithm 1, and its baselines PrivSGP and DP^2-SGD, for one node i.

Per step t (the paper's line numbers; the strategy calls the pieces in this order):

    8-10  Poisson-sample a batch at q = B / J (the node's ``sampler``), per-sample gradients at z_i clipped to C,
          summed (its ``clipping``), plus this node's own N(0, sigma^2 C^2 I) (its ``gaussian``), divided by qJ
                                                                                      :meth:`DPCSGPNode.privatize`
          (accounted as one Poisson-subsampled Gaussian release (sigma, q):           :meth:`DPCSGPNode.next_release`)
    11    x_i^{t+1/2} = w_i^t - eta (g_i + N_i)                             the user's optimizer, on the numerator x
    1-7   q_i = Q(x_i - x_hat_i); send {q_i, y_i}; receive; x_hat_j += q_j; w_i = x_i - x_hat_i + sum_j a_ij x_hat_j;
          y_i = sum_j a_ij y_j; z_i = w_i / y_i                     :func:`~.base.push_sum_gossip` (``mixing.py``)

PrivSGP is the same node with exact messages (no compressor); DP^2-SGD mixes with doubly-stochastic weights and no
push-sum weight (D-PSGD). Differences from the paper, on purpose: a common public initialisation with x_hat = x at
the start (keeps X - X_hat = 0 at t = 1); sigma calibrated by a sound numerical accountant (RDP or PRV) instead of
Proposition 2, whose constant c2 is never given (docs/privacy.md); Poisson mini-batches instead of one example.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy.accounting import GaussianRelease, SubsampledGaussianAccountant, smallest_noise
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.local_dp import GaussianMechanism


class DPCSGPNode(PrivateNodeAlgorithm):
    """One DP-CSGP / PrivSGP / DP^2-SGD node: local DP-SGD with a fixed sigma, accounted as a subsampled Gaussian."""

    gaussian: GaussianMechanism  # this node's Gaussian noise (made in __init__)

    fixed_noise_multiplier = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gaussian = self.gaussian_mechanism()
        self._plan: tuple[int, float] | None = None  # (planned steps, q) that noise_multiplier was set for

    def make_accountant(self) -> SubsampledGaussianAccountant:
        return SubsampledGaussianAccountant(self.parameters.accountant, delta=self.parameters.delta_for_reporting)

    def plan_noise(self, planned_steps: int) -> None:
        """Fix sigma for ``planned_steps`` steps in all. A fresh run calibrates to the target over the whole plan; a
        resumed run with the same plan keeps its sigma; with another plan it calibrates the remaining steps so that
        history plus remainder spends the target, never more."""
        assert self.sample_rate is not None
        plan, spent = (planned_steps, self.sample_rate), self.ledger.steps
        if self.parameters.noise_multiplier is not None or spent == 0:
            self.noise_multiplier = self.parameters.resolve(self.sample_rate, planned_steps)
        elif self._plan != plan or self.noise_multiplier is None:
            self.noise_multiplier = self.calibrate_remaining(max(1, planned_steps - spent))
        self._plan = plan

    def calibrate_remaining(self, remaining: int) -> float:
        """The sigma with which ``remaining`` more steps at q spend what is left of ``target_epsilon``."""
        target, spent = float(self.parameters.target_epsilon), self.ledger.epsilon()  # type: ignore[arg-type]
        if spent >= target:
            raise PrivacyConfigError(
                f"node {self.rank} has already spent epsilon={spent:.4f} of target_epsilon={target}: "
                "there is no budget left to train on; raise target_epsilon or start a new run on new data"
            )
        return smallest_noise(
            lambda sigma: self.ledger.epsilon_after(remaining, GaussianRelease(sigma, self.sample_rate)) <= target,
            low=1e-3, high=1.0, rtol=1e-4, most=1e6, where=f"the remaining budget of node {self.rank}",
        )

    def next_release(self) -> GaussianRelease | None:
        if self.noise_multiplier is None or self.sample_rate is None:
            return None
        return GaussianRelease(self.noise_multiplier, self.sample_rate)

    def privatize(self) -> DPStepStats:
        """Lines 8-10: clip each example to C, sum, add N(0, sigma^2 C^2 I), divide by qJ."""
        if self.clipping.hooks is None or self.noise_multiplier is None or self.expected_batch_size is None:
            raise RuntimeError("DPCSGPNode.privatize called before attach() and private_dataloader()")
        norms = self.clipping.clipped_sum(into_grads=False)
        self.last_step = self.gaussian.noise_clipped_sum(
            self.clipping.parameters, norms, max_grad_norm=self.clipping.max_grad_norm,
            noise_multiplier=self.noise_multiplier, expected_batch_size=self.expected_batch_size,
            clipped_sums=self.clipping.take_clipped_sums(),
        )
        return self.last_step

    def noise_summary(self) -> str:
        return (
            f"Gaussian noise sigma = {self.noise_multiplier or 0.0:.4g} x C (C = {self.parameters.max_grad_norm:g}), "
            f"Poisson q = {self.sample_rate or 0.0:.4g}, {self.ledger.accountant} accountant"
        )

    def plan_state(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "plan": list(self._plan) if self._plan is not None else None}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        self.noise_multiplier = state["noise_multiplier"]
        self._plan = (int(state["plan"][0]), float(state["plan"][1])) if state["plan"] is not None else None
