"""PrivSGP-VR (Zhu, Huang, Wang, Xu, IJCAI 2024): stochastic gradient push with SAGA variance reduction and local DP.

Each node keeps a table of every example's clipped gradient (filled at the common start, Algorithm 1 lines 1-3),
releases the SAGA-corrected gradient of its Poisson batch with its own Gaussian noise (lines 5-8), takes the user's
optimizer step and gossips by push-sum over a time-varying directed graph (lines 9-14):
:class:`~lightning_privdec.algorithms.privsgp_vr.PrivSGPVRNode`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_privdec.algorithms.privsgp_vr import DEFAULT_MAX_TABLE_BYTES, PrivSGPVRNode, PrivSGPVROptions
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy

class PrivSGPVRStrategy(PrivateDecentralizedStrategy):
    """PrivSGP-VR: push-sum SGP over a time-varying directed graph + the SAGA-corrected, noised gradient.

    Example::

        PrivSGPVRStrategy(topology="exponential-one-peer", max_grad_norm=1.0, target_epsilon=3.0,
                          target_delta=1e-5)

    Args:
        accounting: ``"sound"`` (default; the table mean is charged at every step, the sampled correction with
            amplification, noise split optimally between the two), ``"paper"`` (Theorem 2's formula: sensitivity 3C
            amplified at rate q; reported for comparison, not a proven guarantee) or ``"no_amplification"``.
        max_table_bytes: the table holds J x d clipped gradients per node; above this many bytes the run is refused
            before training (default 2 GiB).
        table_init: ``"full"`` (the paper: every example's gradient at z^0, one extra pass over the shard before the
            first step, and again after a resume) or ``"zeros"`` (a standard SAGA start; no extra pass).
        table_dtype: storage precision of the table; ``torch.bfloat16`` halves its memory (rows are re-clipped after
            the cast, so the privacy bound holds).
        noise_multiplier: s / C, the std of the noise on the released sum in units of C (or give the budget).
        Other arguments: see :class:`PrivateDecentralizedStrategy` (``max_grad_norm``, ``target_epsilon``,
        ``target_delta``, ``accountant`` ("rdp" or "prv"), ``grad_sample_mode`` ("bookkeeping", the default, writes each
        example's gradient straight into a reused B x d buffer; "hooks" or "functorch"; ghost clipping has no
        per-sample gradients to store and is refused), ...).

    Checkpoints hold the ledger, the noise, the split and everything the other strategies keep, never the table (it
    is per-sample-gradient data): a resumed run rebuilds it at the resumed parameters.

    Choosing the batch: the sound accounting charges the table mean (q sum_j t_j, eq. (6)) at every step, so below
    q ~ 0.5 the released gradient carries ~3x the noise of PrivSGP's at equal epsilon whatever the batch; above it the
    joint analysis (sensitivity (2 - q) C) wins and the noise per example falls with q. The digits quick start uses
    q = 0.76, 20 epochs, lr 1.0 (docs/privacy.md, "PrivSGP-VR").
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
        accounting: str = "sound",
        max_table_bytes: float = DEFAULT_MAX_TABLE_BYTES,
        table_init: str = "full",
        table_dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> None:
        self.options = PrivSGPVROptions(accounting, max_table_bytes, table_init, table_dtype)
        self.options.check(kwargs.get("accountant", "rdp"), kwargs.get("grad_sample_mode", DEFAULT_GRAD_SAMPLE_MODE))
        super().__init__(topology, compressor, **kwargs)

    @property
    def accounting(self) -> str:
        return self.options.accounting

    node_algorithm_class = PrivSGPVRNode

    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)
        node = self.privacy
        if isinstance(node, PrivSGPVRNode) and loader is not dataloader and node.noise_multiplier is not None:
            entries = ", ".join(f"({s:.4g}, q={q:.4g})" for s, q in node.noise.entries(node.sample_rate))
            rank_zero_info(
                f"PrivSGP-VR: noise std {node.noise_multiplier:.4g} C on the released sum "
                f"(accounting={node.accounting!r}"
                + (f", split rho={node.split:.3f}" if node.split is not None else "")
                + (", joint analysis: one Gaussian, sensitivity (2 - q) C"
                   if node.accounting == "sound" and node.split is None else "")
                + f"); per step the ledger composes {entries}; table {node.table.num_rows} x {node.table.dim} "
                f"({node.table.nbytes / 1024**2:.1f} MiB, {str(self.options.table_dtype).replace('torch.', '')}, "
                f"init {self.options.table_init!r})"
            )
        return loader
