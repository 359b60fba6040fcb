"""Dyn-D2P: SGP with a dynamic clip and noise schedule (Zhu, Huang, Wang, Ji, Xu).

Algorithm 1, per node i and step k = 0..K-1 (paper's line numbers):

    3-4   Poisson-sample a batch at q = B / J, per-sample gradients at the de-biased z_i^k
    5-6   clip each to C_k = C_0 rho_c^{-k/K}
    7-9   mu_k = mu_0 rho_mu^{k/K}, sigma_k = C_k / mu_k, add this node's N(0, sigma_k^2 I) to the clipped sum
          (lightning_privdec.algorithms.dyn_d2p, run by PrivateDecentralizedStrategy.transform_gradients)
    10    x_i^{k+1/2} = x_i^k - gamma (g_i^k + N_i^k)   (the user's optimizer applied to the numerator)
    11-14 push-sum over the time-varying directed graph: x_i^{k+1} = sum_j P^k_ij x_j^{k+1/2},
          w_i^{k+1} = sum_j P^k_ij w_j^k, z_i^{k+1} = x_i^{k+1} / w_i^{k+1}
          (lightning_privdec.algorithms.mixing, run by the base strategy after the update)

mu_0 comes from the budget before training (P0-P2, lightning_privdec.privacy.dyn_d2p). Differences from the paper, on
purpose: Poisson mini-batches at q = B / J instead of one example (J = 1/q in eqs. 8-9); the clipped sum is divided
by the expected batch size qJ; by default mu_0 is calibrated with a rigorous accountant instead of the paper's CLT
composition (``calibration="paper"`` gives the published one, reported next to its rigorous epsilon).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_privdec.privacy import PrivacyConfigError
from lightning_privdec.privacy.dyn_d2p import _check_calibration, _check_rho, _check_rigorous_accountant, _check_variant
from lightning_privdec.algorithms.dyn_d2p import DynD2PPrivacyEngine
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


class DynD2PStrategy(PrivateDecentralizedStrategy):
    """Dyn-D2P: push-sum (SGP) over a time-varying directed graph + local DP-SGD with scheduled clip and noise.

    Args:
        max_grad_norm: C_0, the initial clip (the constant C_bar of ``"dyn_mu"`` and ``"const"``).
        rho_c: decay factor of the clip over the run, C_{K} = C_0 / rho_c (>= 1; the paper's grid has 1/rho_c in
            {0.1, ..., 0.8}). Used by ``"dyn"`` and ``"dyn_c"``.
        rho_mu: growth factor of the per-step GDP budget, mu_K = mu_0 rho_mu (>= 1). Used by ``"dyn"`` and
            ``"dyn_mu"``.
        variant: ``"dyn"`` (Dyn-D2P), ``"dyn_c"`` (Dyn[C]-D2P), ``"dyn_mu"`` (Dyn[mu]-D2P) or ``"const"``
            (Const-D2P, the fixed-noise baseline).
        calibration: ``"rigorous"`` (default): mu_0 such that the rigorous accountant spends exactly
            ``target_epsilon`` over the planned steps. ``"paper"``: mu_tot and mu_0 as published (eqs. 4, 8, 9);
            the rigorous epsilon is still the one reported and enforced (training stops early if the published
            schedule would exceed the target; a warning at setup gives both numbers).
        target_epsilon, target_delta: the per-node budget (required: the whole schedule derives from it).
        accountant: ``"rdp"`` (default) or ``"prv"``; the paper's CLT value is always available as
            ``strategy.privacy.paper_epsilon()`` and logged by PrivacyBudgetCallback as
            ``privacy/epsilon_paper_clt/...``.
        Other arguments: see :class:`PrivateDecentralizedStrategy` (``grad_sample_mode="ghost"`` clips at C_k too).

    Example::

        DynD2PStrategy(max_grad_norm=4.0, rho_c=2.0, rho_mu=2.0, target_epsilon=1.0, target_delta=1e-5)
    """

    default_weights = "push-sum"
    required_mixing = "column"
    requires_symmetric_graph = False
    shared_options = ("rho_c", "rho_mu", "variant", "calibration")

    def __init__(
        self,
        topology: Any = "exponential-one-peer",
        compressor: Any = None,
        *,
        max_grad_norm: float,
        rho_c: float = 2.0,
        rho_mu: float = 2.0,
        variant: str = "dyn",
        calibration: str = "rigorous",
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        accountant: str = "rdp",
        noise_multiplier: float | None = None,
        **kwargs: Any,
    ) -> None:
        if noise_multiplier is not None:
            raise PrivacyConfigError(
                "DynD2PStrategy sets the noise multiplier 1/mu_k of every step from the budget; do not pass "
                "noise_multiplier (pass target_epsilon and target_delta; variant='const' gives a fixed noise level)"
            )
        if target_epsilon is None or target_delta is None:
            raise PrivacyConfigError(
                "DynD2PStrategy needs target_epsilon=... and target_delta=...: its clip and noise schedule are "
                "derived from the budget (e.g. target_epsilon=1.0, target_delta=1e-5)"
            )
        self.rho_c = _check_rho(rho_c, "rho_c", "decay factor of the clipping bound C_k")
        self.rho_mu = _check_rho(rho_mu, "rho_mu", "growth factor of the per-step GDP budget mu_k")
        self.variant = _check_variant(variant)
        self.calibration = _check_calibration(calibration)
        _check_rigorous_accountant(accountant)
        super().__init__(
            topology,
            compressor,
            max_grad_norm=max_grad_norm,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            accountant=accountant,
            **kwargs,
        )

    def make_privacy_engine(self) -> DynD2PPrivacyEngine:
        return DynD2PPrivacyEngine(
            self.privacy_parameters,
            rho_c=self.rho_c,
            rho_mu=self.rho_mu,
            variant=self.variant,
            calibration=self.calibration,
            rank=self.global_rank,
            device=self.root_device,
            grad_sample_mode=self.grad_sample_mode,
            noise_seed=self.noise_seed,
            secure_mode=self.secure_mode,
        )

    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)
        engine = self.privacy
        if isinstance(engine, DynD2PPrivacyEngine) and engine.schedule is not None and loader is not dataloader:
            s, k = engine.schedule, engine.steps
            rank_zero_info(
                f"Dyn-D2P ({s.variant}, calibration={self.calibration}): K={s.steps} steps at q={s.sample_rate:.4g}, "
                f"mu_tot={engine.mu_tot:.4g} (eq. 4), mu_0={s.mu0:.4g}, clip {s.clip(k):.4g} -> {s.clip(s.steps - 1):.4g}, "
                f"sigma {s.sigma(k):.4g} -> {s.sigma(s.steps - 1):.4g}; epsilon of the plan: "
                f"{engine.plan_epsilon:.4f} ({self.privacy_parameters.accountant}, enforced), "
                f"{engine.plan_paper_epsilon:.4f} (paper, CLT approximation); "
                f"{engine.certified_steps} steps fit into target_epsilon={self.privacy_parameters.target_epsilon}"
            )
        return loader
