"""CPGT: Compressed differentially Private Gradient Tracking (Xie, Yi, Wang, Cao, Ren), as a Lightning strategy.

Per optimizer step on node i (Algorithm 1; the strategy's flow in parentheses):

    closure, privatize   g_k = grad f_i(x_i(k)), per-sample gradients clipped to C, averaged over q J (no Gaussian
                     noise), then y_i(k) = u_i(k) + g_k written into p.grad (eq. (10) with one gradient per step)
                     (:class:`~lightning_privdec.algorithms.cpgt.CPGTNode`)
    optimizer        x_i(k) - alpha y_i(k): plain SGD, lr = alpha, no momentum, no weight decay
    gossip.step      Laplace noise d q^k on x and y, compressed differences to the neighbours, replicas, and
                     x_i(k+1) = x_i^a + gamma sum_j w_ij (x_j^c - x_i^c) - alpha y_i(k) (eqs. (5)-(12))

over a static undirected graph with doubly-stochastic (Metropolis) weights. The privacy is pure epsilon-DP of the
node's MESSAGES over the whole run (Theorem 2's coupling, delta = 0). It does not cover the node's clean state: the
trained model x_i(K) (and a checkpoint, which holds x and the tracker) reveals y(K-1) exactly; publish a network
average or a noisy x^a instead. See docs/privacy.md, "CPGT", for what it assumes and what it means for neural
networks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_privdec.algorithms.cpgt import CPGTNode, CPGTOptions
from lightning_privdec.privacy import PrivacyConfigError, PrivacyParameters
from lightning_privdec.privacy.accounting.cpgt import tracker_noise_offset
from lightning_privdec.privacy.accounting.gaussian import check_accountant
from lightning_privdec.tensors import split_like
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy

class CPGTStrategy(PrivateDecentralizedStrategy):
    """CPGT (DiaDSP with ``compressor=None``, ``consensus_step=1``) with per-sample clipping and Laplace noise.

    Example::

        CPGTStrategy(topology="ring", compressor=TopK(0.1), consensus_step=0.2, noise_x=0.05, noise_y=0.05,
                     lipschitz=0.1, max_grad_norm=1.0)  # noise_decay="auto": q chosen from alpha and L at setup
        # with torch.optim.SGD(model.parameters(), lr=alpha): Theorem 2 needs alpha L < 1/2

    Args:
        consensus_step: gamma.
        noise_x, noise_y: the Laplace scales d_x, d_y of the state and tracking noise (round k uses d q^k). Or give
            ``target_epsilon`` alone and d_x = d_y is calibrated before training.
        noise_decay: q in (0, 1): Theorem 2 needs q > (alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2. ``"auto"``
            (default): chosen at setup, once alpha (the learning rate) is known, as the q in that interval that
            minimises epsilon x the fixed point's offset by the accumulated tracker noise (Remark 2;
            :func:`~lightning_privdec.privacy.accounting.cpgt.auto_noise_decay`; alpha = 0.5, L = 0.1: q = 0.666).
        lipschitz: L, the smoothness constant assumed for every node's (clipped, averaged) loss gradient; required,
            no default. Theorem 2 needs alpha < 1/(2L). For a neural network this is an assumption the user makes,
            not a fact the library can check (docs/privacy.md).
        max_grad_norm: the per-sample clipping bound C; the adjacency distance is 2 C / (q J).
        sensitivity: override the adjacency distance (an l2 bound on the change of the node's gradient).
        sensitivity_norm: ``"l2"`` (default; epsilon carries sqrt(d) because the Laplace loss is an l1 norm) or
            ``"l1"`` when an explicit ``sensitivity`` and ``lipschitz`` are l1 quantities (L then bounds the gradient
            map from l1 to l1).
        accounting: ``"sound"`` (default; the bound Theorem 2's proof gives, for the whole run), ``"theorem2"`` (the
            paper's eq. (23) verbatim, smaller than its proof supports) or ``"finite"`` (the same coupling over the
            steps taken, without the linear-difference Assumption 4: grows with every step; training stops before
            ``target_epsilon``).
        target_epsilon: calibrate the noise to it (without noise_x/noise_y), or refuse a run whose epsilon exceeds it
            (kept in :class:`~lightning_privdec.algorithms.cpgt.CPGTOptions` with the Laplace scales).
        target_delta: accepted for a uniform command line and unused: CPGT is pure DP (delta = 0).
        noise_multiplier: must be ``None`` or 0: CPGT adds no Gaussian noise.
        accountant: accepted for a uniform command line and unused (CPGT's epsilon is a closed-form bound);
            ``"gdp"`` is refused as in every strategy.
        Other arguments: see :class:`PrivateDecentralizedStrategy` (``noise_seed``, ``grad_sample_mode``, ...).
    """

    default_weights = "metropolis"
    required_mixing = "doubly"
    requires_symmetric_graph = True
    shared_options = ("options",)

    def __init__(
        self,
        topology: Any = "ring",
        compressor: Any = None,
        *,
        noise_decay: float | str = "auto",
        lipschitz: float | None = None,
        max_grad_norm: float,
        noise_x: float | None = None,
        noise_y: float | None = None,
        sensitivity: float | None = None,
        sensitivity_norm: str = "l2",
        accounting: str = "sound",
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        noise_multiplier: float | None = None,
        accountant: str = "rdp",
        **kwargs: Any,
    ) -> None:
        check_accountant(accountant)  # unused by CPGT, but "gdp" is refused everywhere alike
        if kwargs.get("secure_mode"):
            raise PrivacyConfigError(
                "secure_mode=True mitigates floating-point attacks on the Gaussian sampler (Opacus's secure mode); "
                "CPGT draws Laplace noise, for which no such mitigation is implemented. Drop secure_mode, or use a "
                "Gaussian strategy (DPCSGPStrategy, DynD2PStrategy, ...) if you need it"
            )
        if noise_multiplier not in (None, 0, 0.0):
            raise PrivacyConfigError(
                f"CPGT adds Laplace noise in the gossip, not Gaussian noise to gradients: noise_multiplier must be "
                f"None or 0, got {noise_multiplier}; set noise_x and noise_y (or target_epsilon) instead"
            )
        self.options = CPGTOptions(
            noise_decay=noise_decay, lipschitz=lipschitz, noise_x=noise_x, noise_y=noise_y, sensitivity=sensitivity,
            sensitivity_norm=sensitivity_norm, accounting=accounting, target_epsilon=target_epsilon,
        )
        # the base strategy checks the node's budget (the options' target_epsilon) after every step and at a resume
        # (rounds replayed after a crash are charged in every accounting)
        super().__init__(topology, compressor, max_grad_norm=max_grad_norm, **kwargs)

    def privacy_config(self, *, max_grad_norm: float, **_: Any) -> PrivacyParameters:  # type: ignore[override]
        """Only the clip bound C: CPGT's budget (pure epsilon-DP, no delta) and its noise are in :attr:`options`."""
        return PrivacyParameters(max_grad_norm=max_grad_norm).validate(level_required=False)

    # ---- setup ---------------------------------------------------------------------------------------------------
    def make_topology(self, world_size: int):  # type: ignore[no-untyped-def]
        topology = super().make_topology(world_size)
        if not topology.is_static:
            raise PrivacyConfigError(
                f"CPGT needs a static undirected graph (its replicas x_j^c follow one fixed set of neighbours); "
                f"{topology.name!r} changes every round. Use 'ring', 'torus', 'complete' or an nx.Graph."
            )
        return topology

    node_algorithm_class = CPGTNode

    def _check_optimization(self, trainer: pl.Trainer) -> None:
        super()._check_optimization(trainer)
        if trainer.lr_scheduler_configs:
            raise PrivacyConfigError(
                "CPGT's privacy bound and its convergence use a constant step size alpha: remove the learning-rate "
                "scheduler from configure_optimizers"
            )
        if trainer.gradient_clip_val:
            raise PrivacyConfigError(
                "gradient_clip_val would clip the tracking direction y(k), not the gradients: remove it (per-sample "
                "clipping to max_grad_norm already bounds every example's influence)"
            )

    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)
        node = self.privacy
        if isinstance(node, CPGTNode) and node.noise_x is not None and loader is not dataloader:
            bound = (
                f"epsilon = {node.run_epsilon:.4g} for the whole run ({node.accounting}; the paper's eq. (23): "
                f"{node.epsilon_theorem2:.4g})" if node.run_epsilon is not None
                else "epsilon growing with every step (finite accounting)"
            )
            rank_zero_warn(
                "CPGT's epsilon covers the messages each node sends, under the paper's assumptions: every node's "
                f"gradient map is L-smooth with L = {node.lipschitz} (your assumption) and"
                + (" one example changes it by a constant vector (Assumption 4, false for neural networks; "
                   "accounting='finite' drops it)" if node.accounting != "finite" else " nothing more")
                + ". It does not cover a node's own final model x_i(K), which reveals its tracker, nor the "
                "network average of the clean models: publish the noisy x^a the node already sent instead."
                + node.privacy_caveat
            )
            auto = " (auto)" if self.options.noise_decay == "auto" else ""
            rank_zero_info(
                f"CPGT: Laplace noise d_x = {node.noise_x:.4g}, d_y = {node.noise_y:.4g}, decay q = "
                f"{node.noise_decay:.4g}{auto}, alpha = {node.alpha}, L = {node.lipschitz}, adjacency distance "
                f"{node.sensitivity:.4g}, d = {node.dimension}: {bound}, delta = 0{node.privacy_caveat}"
            )
        return loader

    def check_plan(self) -> None:
        assert isinstance(self.privacy, CPGTNode)
        self._warn_about_the_tracker_noise(self.privacy)

    def _warn_about_the_tracker_noise(self, node: CPGTNode) -> None:
        """Before training: when the y-noise the trackers keep forever is larger than what the clipped gradients can
        cancel (:func:`~lightning_privdec.privacy.accounting.cpgt.tracker_noise_offset` > C) there is no fixed point
        and the models drift. Noise calibrated from ``target_epsilon`` alone (the defaults) is then refused, since
        defaults must train; noise the user set by hand gets a warning."""
        C = self.privacy_parameters.max_grad_norm
        offset = tracker_noise_offset(node.noise_y, node.noise_decay, node.dimension, self.world_size)  # type: ignore[arg-type]
        if offset <= C:
            return
        target = self.options.target_epsilon
        calibrated = self.options.noise_x is None and target is not None
        fix = (f"raise target_epsilon to about {target * offset / C:.3g} or more (the noise scales as 1/epsilon)"
               if calibrated else f"lower noise_y to about {node.noise_y * C / offset:.3g} or less")  # type: ignore[operator]
        message = (
            f"CPGT: the trackers keep every round's y-noise forever (Remark 2); its network mean has expected norm "
            f"{offset:.3g} = noise_y sqrt(2 d / ((1 - q^2) n)) with noise_y = {node.noise_y:.4g}, q = "
            f"{node.noise_decay:.4g}, d = {node.dimension}, n = {self.world_size}, "
            f"above C = {C:g}, the most the mean clipped gradient can cancel: there is no fixed point, and the models "
            f"drift instead of converging (near chance, or stopped by the divergence guard). To train, {fix}, or use "
            "fewer parameters; CPGT's pure epsilon-DP carries sqrt(d) (docs/privacy.md, \"CPGT\")."
        )
        if calibrated:
            raise PrivacyConfigError(message)
        rank_zero_warn(message)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def _load_debiased_parameters(self, node: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        x = node["gossip"]["x"]  # CPGT evaluates at x itself (no push-sum weight)
        parameters = [p for p in self.lightning_module.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, value in zip(parameters, split_like(x, parameters)):
                p.copy_(value)
