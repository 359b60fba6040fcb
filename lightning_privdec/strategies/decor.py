"""Decor: decentralized SGD with pairwise-cancelling correlated noise (Allouah et al., ICML 2024).

Per round each node clips its gradient, adds sum_{j in N_i} v_ij (v_ij = -v_ji, drawn from a secret only the two
ends of edge {i, j} share) plus its own independent noise, takes a local step and gossips with a symmetric
doubly-stochastic W (Algorithm 1). The correlated noise cancels in the network average, so the average model only
carries the small independent noise, while every single message stays private against the chosen adversary (SecLDP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import networkx as nx
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_privdec.privacy import PrivacyConfigError, PrivacyParameters
from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.algorithms.decor import DecorNode, DecorOptions
from lightning_privdec.privacy.pairwise import (
    PairwiseSecrets,
    exchange_public_keys,
    load_or_create_key_file,
    verify_agreement,
)
from lightning_privdec.privacy.accounting.secldp_step import collusion_level
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


class CorrelatedNoiseStrategy(PrivateDecentralizedStrategy):
    """Decor over an undirected graph, with SecLDP accounting.

    Args:
        sigma_cdp, sigma_cor: noise standard deviations (independent, correlated), in the units of the clipped sum of
            per-example gradients (``clipping="per_sample"``) or of the clipped batch gradient (``"user"``). Or
            give ``target_epsilon`` and ``target_delta`` and the pair is calibrated before training.
        adversary: ``"eavesdropper"`` (sees every message, knows no secret), ``"curious"`` (each node knows its own
            secrets; needs a 2-connected graph) or an integer q of colluding nodes.
        clipping: ``"per_sample"`` (example-level privacy, Poisson sampling) or ``"user"`` (user-level privacy).
        baseline: ``"ldp"`` (sigma_cor = 0, independent noise at the local-DP level, any undirected topology) or
            ``"cdp"`` (sigma_cor = 0, sigma_LDP / sqrt(n): the paper's CDP level, defined on the complete graph and
            usable on any graph as an accuracy reference; its epsilon is central DP of the network average, not a
            per-message guarantee): the paper's two baselines, calibrated from the budget.
        key_file_dir: keep each node's X25519 private key in ``<dir>/node_<rank>.key`` (mode 0600, outside the
            checkpoint) so that a resumed run re-derives the same pairwise streams; by default a resumed run agrees
            on fresh keys (privacy is the same; bit-exact replay of the noise is lost).
    """

    default_weights = "metropolis"
    required_mixing = "doubly"
    requires_symmetric_graph = True
    shared_options = ("options",)
    supports_robust_clip = True  # its one message is the node's model
    local_options = ("key_file_dir",)  # a per-node path

    def __init__(
        self,
        topology: Any = "ring",
        compressor: Any = None,
        *,
        max_grad_norm: float,
        sigma_cdp: float | None = None,
        sigma_cor: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        adversary: str | int = "eavesdropper",
        clipping: str = "per_sample",
        baseline: str | None = None,
        key_file_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.options = DecorOptions(sigma_cdp, sigma_cor, adversary, clipping, baseline)
        self.options.check_parameters(target_epsilon)
        self.key_file_dir = key_file_dir
        super().__init__(topology, compressor, max_grad_norm=max_grad_norm, target_epsilon=target_epsilon,
                         target_delta=target_delta, **kwargs)
        if self.compressor is not None:
            raise PrivacyConfigError(
                f"CorrelatedNoiseStrategy does not support compressor={self.compressor}: Decor's correlated noise "
                "v_ij = -v_ji cancels in the network average only when every message arrives whole, and neither the "
                "paper's Algorithm 1 nor its SecLDP accounting has compression; a compressor would leave part of that "
                "noise in the model. Use compressor=None, or DPCSGPStrategy for compressed private gossip."
            )

    def privacy_config(self, **arguments: Any) -> PrivacyParameters:
        """C and the budget (target_epsilon needs target_delta); the noise pair, or the choice to calibrate it from
        the budget, is in :attr:`options` (checked there)."""
        return PrivacyParameters(**arguments).validate(level_required=False)

    @property
    def adversary(self) -> str | int:
        return self.options.adversary

    @property
    def baseline(self) -> str | None:
        return self.options.baseline

    def make_topology(self, world_size: int):  # type: ignore[no-untyped-def]
        topology = super().make_topology(world_size)
        graph = nx.Graph(topology.union_graph())
        q = collusion_level(self.adversary, world_size)  # type: ignore[arg-type]
        if q >= 1 and world_size > 2 and not nx.is_biconnected(graph):
            raise PrivacyConfigError(
                f"adversary={self.adversary!r} needs a 2-connected graph: on {topology.name} some node has a "
                "neighbour whose removal disconnects it, and that neighbour can subtract all of its correlated noise. "
                "Use 'ring', 'torus' or 'complete', or adversary='eavesdropper'."
            )
        return topology

    node_algorithm_class = DecorNode

    def node_algorithm_options(self) -> dict[str, Any]:
        assert self.topology is not None
        return {"graph": nx.Graph(self.topology.union_graph()), "options": self.options}

    def _key_file(self) -> str | None:
        return None if self.key_file_dir is None else f"{self.key_file_dir}/node_{self.global_rank}.key"

    def agreement_private_key(self) -> X25519PrivateKey:
        """With a roster, the key signed at setup is the one Decor's secrets come from: the key file's if kept."""
        key_file = self._key_file()
        return super().agreement_private_key() if key_file is None else load_or_create_key_file(Path(key_file))

    def connect_node_algorithm(self, node: PrivateNodeAlgorithm) -> None:
        assert self.topology is not None and isinstance(node, DecorNode)
        # Pairwise secrets: real X25519 key agreement with every neighbour (public keys travel, secrets never do).
        # With a roster, only from the keys every node signed at setup (a substituted key was refused there).
        neighbours = sorted(nx.Graph(self.topology.union_graph()).neighbors(self.global_rank))
        if self.membership is not None:
            if self._agreement_key is None:
                raise RuntimeError(f"node {self.global_rank}: the signed setup's key is gone before Decor's agreement")
            secrets = PairwiseSecrets(self.global_rank, neighbours, private_key=self._agreement_key)
            secrets.agree(self.membership.agreement_keys, context=self.membership.run_id)
        else:
            secrets = PairwiseSecrets(self.global_rank, neighbours, key_file=self._key_file())
            secrets.agree(exchange_public_keys(secrets))
        verify_agreement(secrets)
        node.secrets = secrets

    def process_dataloader(self, dataloader: object) -> object:
        loader = super().process_dataloader(dataloader)
        node = self.privacy
        if isinstance(node, DecorNode) and node.calibration is not None:
            c = node.calibration
            options = ", ".join(
                f"({a.sigma_cdp:.3g}, {a.sigma_cor:.3g})" for a in c.alternatives if a.feasible and a.sigma_cor is not None
            )
            rank_zero_info(
                f"Decor calibration for epsilon={c.target_epsilon} (delta={c.delta}, {c.steps} steps, "
                f"adversary={c.adversary}): chosen sigma_cdp={node.sigma_cdp:.4g}, sigma_cor={node.sigma_cor:.4g}"
                f"{' (baseline ' + self.baseline + ')' if self.baseline else ''}; LDP level {c.sigma_ldp:.4g}, "
                f"CDP level {c.sigma_cdp_floor:.4g}; other feasible (sigma_cdp, sigma_cor): {options or 'none'}"
                f"{node.privacy_caveat}"
            )
        return loader
