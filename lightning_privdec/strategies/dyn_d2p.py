"""Dyn-D2P (Zhu, Huang, Wang, Ji, Xu): SGP with a dynamic clip and noise schedule. The algorithm, its schedule
and Algorithm 1 line by line: :mod:`lightning_privdec.algorithms.dyn_d2p`; its accountant:
:mod:`lightning_privdec.privacy.accounting.schedule`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_privdec.algorithms.dyn_d2p import DynD2PNode, DynD2POptions
from lightning_privdec.privacy import PrivacyParameters
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
    shared_options = ("options",)

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
        self.options = DynD2POptions(rho_c=rho_c, rho_mu=rho_mu, variant=variant, calibration=calibration)
        super().__init__(
            topology, compressor, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon, target_delta=target_delta, accountant=accountant, **kwargs,
        )

    def privacy_config(self, **arguments: Any) -> PrivacyParameters:
        """The budget, required (the whole schedule derives from it); a noise multiplier is refused. Built and
        checked once, here."""
        parameters = PrivacyParameters(**arguments)
        DynD2POptions.check_parameters(parameters)
        parameters = parameters.validate()
        self.options.check_clip_schedule(parameters.max_grad_norm)
        return parameters

    @property
    def calibration(self) -> str:
        return self.options.calibration

    node_algorithm_class = DynD2PNode

    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)
        node = self.privacy
        if isinstance(node, DynD2PNode) and node.schedule is not None and loader is not dataloader:
            s, k = node.schedule, node.steps
            rank_zero_info(
                f"Dyn-D2P ({s.variant}, calibration={self.calibration}): K={s.steps} steps at q={s.sample_rate:.4g}, "
                f"mu_tot={node.mu_tot:.4g} (eq. 4), mu_0={s.mu0:.4g}, clip {s.clip(k):.4g} -> {s.clip(s.steps - 1):.4g}, "
                f"sigma {s.sigma(k):.4g} -> {s.sigma(s.steps - 1):.4g}; epsilon of the plan: "
                f"{node.plan_epsilon:.4f} ({self.privacy_parameters.accountant}, enforced), "
                f"{node.plan_paper_epsilon:.4f} (paper, CLT approximation); "
                f"{node.certified_steps} steps fit into target_epsilon={self.privacy_parameters.target_epsilon}"
                f"{node.privacy_caveat}"
            )
        return loader
