"""Decor (Allouah, Koloskova, El Firdoussi, Jaggi, Guerraoui, ICML 2024), Algorithm 1, for one user i and round t.

    1   sample a batch (Poisson, at q = B / J: example level;      :meth:`~.base.PrivateNodeAlgorithm.
        the user's batch: user level)                              private_dataloader`
    2   g_i = Clip(grad; C)  per example, summed (example level),  :meth:`DecorNode.privatize`
        or the batch gradient (user level)
    3   v_ij ~ N(0, sigma_cor^2 I) for j in N_i, v_ij = -v_ji      :func:`decor_perturbation`, from the pairwise
        (from the pairwise secret of edge {i, j})                  secrets (:class:`~lightning_privdec.privacy.
                                                                   pairwise.CorrelatedNoise`)
    4   vbar_i ~ N(0, sigma_cdp^2 I)  (this node's randomness)     :func:`decor_perturbation`
    5   g~_i = g_i + sum_{j in N_i} v_ij + vbar_i                  :meth:`DecorNode.privatize`; the round is
        (alpha, alpha eps_step)-SecRDP, eps_step = (Delta^2 / 2)   :meth:`DecorNode.round_slope` (Thm. 6, Alg. 2-3),
        max_i [(sigma_cdp^2 I + sigma_cor^2 L_H)^-1]_ii            recorded in the :class:`~lightning_privdec.
                                                                   privacy.accounting.secldp.SecLDPAccountant`
    6   x_i^{t+1/2} = x_i^t - eta_t g~_i                           the user's optimizer
    7-8 x_i^{t+1} = sum_j W_ij x_j^{t+1/2}, W symmetric doubly     :meth:`DecorNode.build_gossip` (D-PSGD)
        stochastic

Because v_ij = -v_ji, sum_i sum_{j in N_i} v_ij = 0: the network average only carries the independent noise
(variance sigma_cdp^2 / n), while each message is private against the chosen adversary (SecLDP). The noise pair is
given, or calibrated from the budget before training (App. D.1, :func:`~lightning_privdec.privacy.accounting.secldp.
calibrate_secldp`); ``baseline="ldp"``/``"cdp"`` are the paper's two baselines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import networkx as nx
import torch
from torch import Tensor, nn

from lightning_privdec.algorithms.base import Gossip, PrivateNodeAlgorithm, push_sum_gossip
from lightning_privdec.privacy.accounting.secldp import (
    CalibrationResult,
    SecLDPAccountant,
    SecLDPRelease,
    calibrate_secldp,
)
from lightning_privdec.privacy.accounting.secldp_step import secldp_sensitivity, secldp_step
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats, clip_factor
from lightning_privdec.privacy.rounding import norm_upper_bound
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.local_dp import GaussianMechanism
from lightning_privdec.privacy.noise import NoiseGenerator
from lightning_privdec.privacy.pairwise import CorrelatedNoise, PairwiseSecrets
from lightning_privdec.tensors import round_into_grad, split_like


class CorrelatedNoiseSource(Protocol):
    """sum_{j in N_i} v_ij^(t) for this node: identical-magnitude, opposite-sign noise at both ends of every edge."""

    def sum_for_round(self, round: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor: ...


def decor_perturbation(
    numel: int,
    round_: int,
    *,
    correlated: CorrelatedNoiseSource | None,
    sigma_cdp: float,
    generator: NoiseGenerator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Lines 3-5: sum_{j in N_i} v_ij^(t) + vbar_i, to be added to the clipped gradient."""
    device = torch.device(device)
    noise = generator.normal(numel, sigma_cdp, dtype, device)
    if correlated is not None:
        noise.add_(correlated.sum_for_round(round_, numel, dtype, device))
    return noise


@dataclass(frozen=True)
class DecorOptions:
    """Decor's own arguments, validated once (by the strategy when it is built, before any process starts).

    ``sigma_cdp``, ``sigma_cor``: the noise stds (independent, correlated) on the clipped sum (example level) or the
    clipped batch gradient (user level), or both ``None`` to calibrate them from the budget. ``adversary``:
    ``"eavesdropper"``, ``"curious"`` or a number q of colluders. ``clipping``: ``"per_sample"`` (example level) or
    ``"user"``. ``baseline``: ``None`` (Decor), ``"ldp"`` or ``"cdp"``.
    """

    sigma_cdp: float | None = None
    sigma_cor: float | None = None
    adversary: str | int = "eavesdropper"
    clipping: str = "per_sample"
    baseline: str | None = None

    def __post_init__(self) -> None:
        if self.sigma_cdp is not None and (self.sigma_cdp <= 0 or (self.sigma_cor is not None and self.sigma_cor < 0)):
            raise PrivacyConfigError(f"need sigma_cdp > 0 and sigma_cor >= 0, got {self.sigma_cdp}, {self.sigma_cor}")
        if self.clipping not in ("per_sample", "user"):
            raise PrivacyConfigError(f"clipping must be 'per_sample' or 'user', got {self.clipping!r}")
        adversary = self.adversary
        if not (adversary in ("eavesdropper", "curious") or (isinstance(adversary, int) and adversary >= 0)):
            raise PrivacyConfigError(
                f"adversary must be 'eavesdropper', 'curious' or a number of colluding nodes, got {adversary!r}"
            )
        if self.baseline not in (None, "ldp", "cdp"):
            raise PrivacyConfigError(f"baseline must be None, 'ldp' or 'cdp', got {self.baseline!r}")

    def check_parameters(self, target_epsilon: float | None) -> None:
        """Noise levels or a budget, not both and not neither; a baseline is calibrated from the budget."""
        if (self.sigma_cdp is None) == (target_epsilon is None):
            raise PrivacyConfigError(
                "give the noise levels (sigma_cdp=..., sigma_cor=...) or a budget (target_epsilon=..., "
                "target_delta=...), not both and not neither"
            )
        if self.baseline is not None and target_epsilon is None:
            raise PrivacyConfigError(f"baseline={self.baseline!r} is calibrated from target_epsilon and target_delta")

    @property
    def level(self) -> str:
        return "example" if self.clipping == "per_sample" else "user"


class DecorNode(PrivateNodeAlgorithm):
    """One Decor node on the undirected ``graph``; ``secrets`` (its pairwise keys) are set before the first step."""

    gaussian: GaussianMechanism  # this node's Gaussian noise (made in __init__)
    ledger: SecLDPAccountant

    def __init__(self, parameters: PrivacyParameters, *, graph: nx.Graph, options: DecorOptions, **kwargs: Any) -> None:
        self.options = options
        super().__init__(parameters, **kwargs)
        if options.clipping == "user":
            self.sampler.micro_batch_refusal = (
                "Decor with clipping='user' clips the whole batch gradient of a user at once: accumulate_grad_batches "
                "must be 1 (use clipping='per_sample' to accumulate micro-batches of one logical Poisson batch)"
            )
        self.gaussian = self.gaussian_mechanism()  # line 4's vbar_i
        self.module: nn.Module | None = None
        self.graph = graph
        self.sigma_cdp, self.sigma_cor = options.sigma_cdp, options.sigma_cor
        self.secrets: PairwiseSecrets | None = None
        self.correlated: CorrelatedNoise | None = None
        self.calibration: CalibrationResult | None = None
        self.epsilon_step: float | None = None

    @property
    def level(self) -> str:
        return self.options.level

    @property
    def adversary(self) -> str | int:
        return self.options.adversary

    def make_accountant(self) -> SecLDPAccountant:
        return SecLDPAccountant(self.delta, self.options.level)  # type: ignore[arg-type]

    def attach(self, module: nn.Module, fix_model: bool = False) -> None:
        """Example level: per-sample clipping hooks into the model; user level clips the batch gradient (no
        per-sample machinery)."""
        self.module = module
        if self.options.clipping == "per_sample":
            super().attach(module, fix_model)

    @staticmethod
    def build_gossip(x0: Tensor, *, push_sum_weight: bool = False, **mixing: Any) -> Gossip:
        """Lines 7-8: x_i^{t+1} = sum_j W_ij x_j^{t+1/2} with W symmetric doubly stochastic (D-PSGD: the push-sum
        mixing without its weight, which stays 1; the caller's ``push_sum_weight`` does not apply)."""
        return push_sum_gossip(x0, push_sum_weight=False, **mixing)

    # ---- before training: the noise pair and the per-round slope -------------------------------------------------
    def plan_noise(self, planned_steps: int) -> None:
        C = self.parameters.max_grad_norm
        if self.options.sigma_cdp is None:
            assert self.parameters.target_epsilon is not None
            self.calibration = calibrate_secldp(
                self.parameters.target_epsilon, self.delta, max(1, planned_steps), self.graph, C,
                self.adversary,  # type: ignore[arg-type]
                sample_rate=self.sample_rate if self.level == "example" else None,
            )
            c = self.calibration
            self.sigma_cdp, self.sigma_cor = {
                None: (c.sigma_cdp, c.sigma_cor), "ldp": (c.sigma_ldp, 0.0), "cdp": (c.sigma_cdp_floor, 0.0),
            }[self.options.baseline]
        assert self.sigma_cdp is not None
        self.sigma_cor = self.sigma_cor or 0.0
        self.epsilon_step = self.round_slope(self.sigma_cdp, self.sigma_cor)
        self.noise_multiplier = self.sigma_cdp / C  # reported as sigma_cdp / C
        if self.secrets is not None:
            self.correlated = CorrelatedNoise(self.secrets, self.sigma_cor) if self.sigma_cor > 0 else None

    def round_slope(self, sigma_cdp: float, sigma_cor: float) -> float:
        """eps_step of one round: (Delta^2 / 2) max_i [(sigma_cdp^2 I + sigma_cor^2 L_H)^-1]_ii (Alg. 2-3, Thm. 6);
        the ``"cdp"`` baseline: central DP of the network average, where one node's input moves it by Delta / n."""
        C = self.parameters.max_grad_norm
        if self.options.baseline == "cdp":
            n = self.graph.number_of_nodes()
            return secldp_sensitivity(C, self.level) ** 2 / (2.0 * n * sigma_cdp**2)  # type: ignore[arg-type]
        return secldp_step(
            self.graph, sigma_cdp, sigma_cor, C, self.adversary, level=self.level,  # type: ignore[arg-type]
        )

    def next_release(self) -> SecLDPRelease | None:
        if self.epsilon_step is None:
            return None
        return SecLDPRelease(self.epsilon_step, self.sample_rate if self.level == "example" else None)

    # ---- round t: lines 2-5 --------------------------------------------------------------------------------------
    def privatize(self) -> DPStepStats:
        """Lines 2-5: clip, then add sum_{j in N_i} v_ij^(t) + vbar_i with t = this node's round count."""
        release = self.next_release()
        if release is None or self.module is None:
            raise RuntimeError("DecorNode.privatize called before attach() and private_dataloader()")
        assert self.sigma_cdp is not None
        params = [p for p in self.module.parameters() if p.requires_grad]
        C = self.parameters.max_grad_norm
        sums = None
        if self.options.clipping == "per_sample":
            assert self.expected_batch_size is not None
            stats = DPStepStats.of(self.clipping.clipped_sum(into_grads=False), C, noise_std=0.0)
            sums = self.clipping.take_clipped_sums()  # float64: the noise goes on them before any rounding
            scale = self.expected_batch_size  # and the noisy sum is divided by qJ
        else:
            # the user's whole-batch gradient, unscaled (16-mixed's loss scale); one that overflowed float16 is 0: the
            # privacy unit here is the node's whole batch, so dropping it keeps the sensitivity at C
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            loss_scale = self.clipping.loss_scale  # the strategy tells it the GradScaler's scale
            if loss_scale != 1.0:
                grads = [g / loss_scale for g in grads]
                if not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                    grads = [torch.zeros_like(p) for p in params]
            norms = [norm_upper_bound(g) for g in grads]  # never below the true norm (docs/privacy.md, clipping)
            norm = torch.linalg.vector_norm(torch.stack(norms))
            factor = clip_factor(norm, C)
            for p, g in zip(params, grads):
                p.grad = g * factor
            norm = norm.to(params[0].dtype if params[0].is_floating_point() else torch.float32)
            stats = DPStepStats(batch_size=-1, mean_norm=norm, max_norm=norm, clipped_fraction=(norm > C).float(),
                                noise_std=self.sigma_cdp)
            scale = 1.0
        noise = decor_perturbation(
            sum(p.numel() for p in params), self.steps, correlated=self.correlated, sigma_cdp=self.sigma_cdp,
            generator=self.gaussian.generator, dtype=params[0].dtype, device=params[0].device,
        )
        for k, (p, chunk) in enumerate(zip(params, split_like(noise, params))):
            if sums is None:
                p.grad.add_(chunk)
            else:  # (S + noise) / qJ in float64, rounded to p.grad once
                round_into_grad(p, sums[k].add_(chunk.view_as(p)).div_(scale))
        self.last_step = stats
        return stats

    def noise_summary(self) -> str:
        return (
            f"Decor ({self.level} level, adversary {self.adversary!r}): independent noise sigma_cdp = "
            f"{self.sigma_cdp or 0.0:.4g}, pairwise-cancelling sigma_cor = {self.sigma_cor or 0.0:.4g}, SecLDP accountant"
        )

    # ---- checkpoints (no secrets: a resumed run agrees on new pairwise keys) ---------------------------------------
    def plan_state(self) -> dict[str, Any]:
        return {"sigma_cdp": self.sigma_cdp, "sigma_cor": self.sigma_cor}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        self.sigma_cdp, self.sigma_cor = state["sigma_cdp"], state["sigma_cor"]

