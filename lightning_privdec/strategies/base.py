"""The Lightning glue shared by every decentralized strategy.

A :class:`DecentralizedStrategy` is a :class:`~lightning_privdec.strategies.process_group.ProcessGroupStrategy`: it
launches like DDP (Lightning's launchers and cluster environments: subprocess, spawn, torchrun, SLURM) but never
wraps the model in ``DistributedDataParallel`` and never all-reduces gradients. Per optimizer step it runs the node's
step of :mod:`lightning_privdec.algorithms.node` (the one the simulator and the audit run too): forward and backward
at the de-biased parameters z held by the module (Lightning's closure); private strategies' clipping, noise,
accounting and write-ahead; the finite check; the user's optimizer on the push-sum numerator x (through Lightning's
precision plugin); the gossip round and z = x / y back into the module.

Global collectives (``reduce``, ``barrier``, ``broadcast``, ``all_gather``) keep working for logging, metrics and
checkpointing; training itself only talks to graph neighbours. No object a node receives from another is unpickled:
``broadcast``, the setup checks and the checkpoint gathering use the typed encoding of
:mod:`lightning_privdec.comm.objects`. Beside this class: the setup checks (:mod:`.checks`), the roster and the
exchange (:mod:`.membership`), the divergence guard (:mod:`.divergence`) and the checkpoint's node states
(:mod:`.node_state`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import networkx as nx
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_privdec.algorithms.base import Gossip, NodeAlgorithm, PrivateNodeAlgorithm
from lightning_privdec.algorithms.consensus_step import check_consensus_step, choose_consensus_step
from lightning_privdec.algorithms.flat_parameters import FlatParameters
from lightning_privdec.algorithms.node import NodeRunner
from lightning_privdec.algorithms.sgp import SGPNode
from lightning_privdec.comm import Exchange
from lightning_privdec.comm.identity import AuthenticatedSetup, Roster, check_membership
from lightning_privdec.comm.objects import gather_objects
from lightning_privdec.compression import DRAW_FORMAT, Compressor, build_compressor
from lightning_privdec.data.cycled import CycledLoader
from lightning_privdec.strategies.checks import (
    batches_per_epoch, check_overlap, check_peer_timeout, check_robust, check_same_configuration,
    common_steps_per_epoch, describe, differing_fields, gather_from_nodes, model_difference,
)
from lightning_privdec.strategies.divergence import DivergenceGuard, likely_cause
from lightning_privdec.strategies.membership import authenticate, make_exchange, output_directories
from lightning_privdec.strategies.node_state import (
    CHECKPOINT_KEY, load_debiased_parameters, node_entry, restore_rng_state, rng_state, to_cpu,
)
from lightning_privdec.strategies.process_group import ProcessGroupStrategy, sync_module_states
from lightning_privdec.topology import Topology, build_topology

# Lightning's CombinedLoader (every fit) calls a torch pytree API that this torch deprecates: nothing a user of these
# strategies can act on, so it is not shown.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"lightning\.pytorch\.utilities"
)

log = logging.getLogger(__name__)


class DecentralizedStrategy(ProcessGroupStrategy):
    """Base class: one process per node, gossip between graph neighbours instead of gradient all-reduce.

    Args:
        topology: a name (``"exponential"``, ``"exponential-one-peer"``, ``"ring"``, ``"directed-ring"``,
            ``"complete"``, ``"torus"``, ``"erdos-renyi"``), a networkx graph, or a :class:`Topology` object. Names
            are built for the world size (devices x num_nodes) at setup.
        compressor: ``None``, a :class:`Compressor`, or a spec string such as ``"randk:0.1"``.
        consensus_step: gamma of the compressed gossip (DP-CSGP Algorithm 1 line 5 uses 1). ``"auto"`` (default):
            chosen at setup from the compressor's omega^2 and the graph's mixing weights, calibrated on CHOCO-SGD's
            step (:mod:`lightning_privdec.algorithms.consensus_step`; 1 without compression) and logged at debug
            level. A number in (0, 1] is used as given.
        seed: shared by all nodes; keys compressor randomness and random graphs.
        overlap: SGP's overlap: each round's messages travel during the next ``staleness`` forward/backward passes
            (posted after Lightning's per-step broadcast, which would otherwise wait behind them) and are mixed in
            ``staleness`` steps late (exact push-sum only; see :mod:`lightning_privdec.algorithms.mixing`).
        staleness: tau >= 1, the steps a message is late with ``overlap=True``.
        divergence_guard: stop every node with :class:`~lightning_privdec.strategies.divergence.DivergenceError`
            when the gossip correction or the training loss grows without bound (checked every 10 steps with one
            small all-gather; :mod:`lightning_privdec.strategies.divergence`). ``False`` turns it off.
        robust: ``"clip"``: self-centred clipping of every received model to within ``robust_radius`` (L2) of this
            node's own (ClippedGossip, :mod:`lightning_privdec.comm.robust`): one neighbour moves a node by at most
            that radius per round, whatever it sends. For the exact doubly-stochastic strategies (D-PSGD, DP²-SGD,
            Decor) without compression or overlap. ``None`` (default): plain mixing.
        robust_radius: the clipping radius tau (required with ``robust="clip"``), in parameter units: larger than
            the honest nodes' distance to each other, or they are slowed down too.
        roster: a roster file (or :class:`~lightning_privdec.comm.identity.Roster`) listing every member's Ed25519
            public key, the same on every node; with ``identity_key``, the nodes authenticate each other at setup and
            seal their gossip, carried length-framed over TCP (:mod:`lightning_privdec.comm.identity`,
            :mod:`lightning_privdec.comm.sealed`, :mod:`lightning_privdec.comm.framed`; see docs/threat-model.md).
            ``None`` (default): members are trusted to follow the protocol.
        identity_key: this node's Ed25519 private key file (PEM, mode 0600; ``privdec-keygen`` creates one), refused
            at setup when it lies inside the run's checkpoint, log or ledger directories (:meth:`output_directories`).
            Given with ``roster`` only. ``{rank}``, ``{local_rank}`` and ``{node_rank}`` in the path are filled in per
            process (several nodes on one machine: ``"keys/site-a-{local_rank}.key"``).
        peer_timeout: how long a node waits for any other node (a gossip message, a collective) once training is set
            up, before it stops with an error: a ``timedelta`` or seconds, longer than the slowest checkpoint write
            or validation pass (the others wait that long). ``None`` keeps ``timeout`` (Lightning's, 30 minutes by
            default), which also bounds the start-up rendezvous; see the README, "Reliability".
        kwargs: :class:`~lightning_privdec.strategies.process_group.ProcessGroupStrategy`'s: ``start_method``,
            ``process_group_backend``, ``timeout`` and every Lightning strategy's (``accelerator``,
            ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``).
    """

    #: mixing-weight rule the algorithm needs by default, and the stochasticity it checks
    default_weights: str = "push-sum"
    required_mixing: Literal["column", "doubly", "row"] = "column"
    requires_symmetric_graph: bool = False
    #: constructor arguments (stored under the same attribute name) that every node must share, beyond those
    #: :meth:`configuration` lists itself; each class names its own, the check collects them over the MRO
    shared_options: tuple[str, ...] = (
        "weights", "consensus_step", "seed", "staleness", "divergence_guard", "roster", "robust", "robust_radius",
    )
    #: whether the gossip's one message is the node's model (exact doubly-stochastic mixing): ``robust="clip"``
    supports_robust_clip: bool = False
    #: constructor arguments that may differ from node to node (never compared)
    local_options: tuple[str, ...] = (
        "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
        "process_group_backend", "timeout", "peer_timeout", "start_method", "identity_key",
    )

    def __init__(
        self,
        topology: str | Topology | Any = "exponential-one-peer",
        compressor: Compressor | str | None = None,
        *,
        weights: str | Any | None = None,
        consensus_step: float | Literal["auto"] = "auto",
        seed: int = 0,
        overlap: bool = False,
        staleness: int = 1,
        divergence_guard: bool = True,
        robust: Literal["clip"] | None = None,
        robust_radius: float | None = None,
        roster: str | os.PathLike[str] | Roster | None = None,
        identity_key: str | os.PathLike[str] | None = None,
        peer_timeout: timedelta | float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.topology_spec = topology
        self.roster, self.identity_key = check_membership(roster, identity_key)
        self.membership: AuthenticatedSetup | None = None  # what the signed setup established (with a roster)
        self._agreement_key: X25519PrivateKey | None = None  # held from the signed setup until the gossip is built
        self._seal_keys: dict[int, tuple[bytes, bytes]] | None = None
        self.peer_timeout: timedelta | None = check_peer_timeout(peer_timeout)
        self.compressor = build_compressor(compressor)
        self.weights = weights if weights is not None else self.default_weights
        self._consensus_step = check_consensus_step(consensus_step)
        self._consensus_step_reported = False
        self._said: set[str] = set()  # what say_once has said
        if not isinstance(divergence_guard, bool):
            raise ValueError(f"divergence_guard must be True or False; got {divergence_guard!r}")
        self.divergence_guard = divergence_guard
        self._guard: DivergenceGuard | None = None
        self.seed = int(seed)
        name = type(self).__name__
        self.staleness = check_overlap(name, overlap, staleness, push_sum=self.required_mixing == "column",
                                       compressed=None if self.compressor is None else str(self.compressor))
        self.robust, self.robust_radius = check_robust(
            name, robust, robust_radius, supported=self.supports_robust_clip, compressed=self.compressor is not None,
            overlap=bool(self.staleness))
        self.topology: Topology | None = None
        self.flat: FlatParameters | None = None
        self.gossip: Gossip | None = None
        self.runner: NodeRunner | None = None  # the node's step (algorithms/node.py), built with the gossip
        self.steps_per_epoch: int | None = None  # common to every node, fixed when training starts
        if isinstance(topology, Topology):  # a user-built graph can be checked now, before any process starts
            self.make_topology(topology.num_nodes)

    def say_once(self, message: str) -> None:
        """Print ``message`` on rank 0, once per strategy (a setting chosen or changed for the user, in words)."""
        if message not in self._said:
            self._said.add(message)
            rank_zero_info(message)

    @property
    def consensus_step(self) -> float | str:
        """gamma in use once the gossip is built (given, or chosen by ``"auto"``); before, what was asked for."""
        gamma = getattr(self.gossip, "gamma", None)
        return self._consensus_step if gamma is None else gamma

    # ---- setup -------------------------------------------------------------------------------------------------------
    def make_topology(self, world_size: int) -> Topology:
        topology = build_topology(self.topology_spec, world_size, weights=self.weights, seed=self.seed)
        topology.validate(world_size, mixing=self.required_mixing, require_symmetric=self.requires_symmetric_graph)
        return topology

    def setup_environment(self) -> None:
        # Validate the graph before the process group exists: every rank fails alike, nobody waits on a rendezvous
        # that will never complete, and each prints its own error (none knows yet whether the others fail too).
        world_size = self.num_nodes * self.num_processes
        self.topology = self.make_topology(world_size)
        if world_size == 1:
            self.say_once(
                f"{type(self).__name__} runs on ONE node (devices x num_nodes = 1): there is no neighbour to gossip "
                "with, so every step is this process's own update and nothing is sent. For N nodes, set devices=N "
                "(one process per node) or num_nodes."
            )
        super().setup_environment()
        if self.peer_timeout is not None:  # the rendezvous above used `timeout`; from here on nodes wait this long
            set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch < 2.10
            set_timeout(self.peer_timeout)
        self.check_same_configuration()
        self.authenticate_members()

    def configuration(self) -> dict[str, Any]:
        """What every node must agree on (arguments, graph, model shapes, Trainer limits); compared at setup."""
        topology = self.topology
        graph = topology and [sorted(topology.graph(k).edges) for k in range(topology.period)]
        if topology is not None and topology.weight_rule == "custom":  # the user's own matrices, compared too
            graph = (graph, [topology.mixing_matrix(k) for k in range(topology.period)])
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        configuration: dict[str, Any] = {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "topology": (getattr(topology, "name", None), getattr(topology, "weight_rule", None), graph),
            "compressor": self.compressor and f"{self.compressor} (draw format {DRAW_FORMAT})",
            "overlap": self.staleness > 0,
            "model": module and [(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters() if p.requires_grad],
        }
        for name in ("max_epochs", "max_steps", "limit_train_batches", "accumulate_grad_batches", "gradient_clip_val",
                     "precision"):
            configuration[f"Trainer.{name}"] = getattr(trainer, name, None)
        for cls in type(self).__mro__:
            for name in vars(cls).get("shared_options", ()):
                value = getattr(self, name)  # an options dataclass is compared field by field
                configuration.update(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else {name: value})
        return configuration

    def check_same_configuration(self) -> None:
        """Exchange :meth:`configuration` (short values as text, long ones as a SHA-256 digest) and raise
        :class:`~lightning_privdec.strategies.checks.NodeMismatchError` on every node if any two nodes differ."""
        mine = {name: describe(value) for name, value in self.configuration().items()}
        gathered = gather_from_nodes(mine)
        details = {}
        if "model" in differing_fields(gathered):  # every node sees it: the layer lists travel only then
            module = self.lightning_module
            layout = [(n, f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}")
                      for n, p in module.named_parameters() if p.requires_grad] if module is not None else []
            details["model"] = model_difference(gather_from_nodes(layout))
        check_same_configuration(gathered, self.global_rank, details)

    def authenticate_members(self) -> None:
        """With a roster: the signed setup of :mod:`lightning_privdec.strategies.membership` and the sealing keys of
        this node's edges. Raises :class:`~lightning_privdec.comm.identity.MembershipError` naming the rank."""
        self.membership, self._agreement_key, self._seal_keys = None, None, None
        if self.roster is None or self.identity_key is None:
            return
        assert self.topology is not None
        self.membership, self._agreement_key, self._seal_keys = authenticate(
            self.roster, self.identity_key, rank=self.global_rank, local_rank=self.local_rank,
            node_rank=self.node_rank, world_size=self.world_size, directories=self.output_directories(),
            configuration={name: describe(value) for name, value in self.configuration().items()},
            agreement_key=self.agreement_private_key,
            neighbours=nx.Graph(self.topology.union_graph()).neighbors(self.global_rank),
        )

    def output_directories(self) -> list[tuple[str, str | os.PathLike[str]]]:
        """The directories this run writes checkpoints and logs to, as ``(what, path)``: an identity key must lie
        outside all of them (:func:`~lightning_privdec.strategies.membership.output_directories`)."""
        return output_directories(getattr(self.lightning_module, "_trainer", None))

    def agreement_private_key(self) -> X25519PrivateKey:
        """The X25519 key this node signs at setup (fresh for every run unless a subclass keeps one in a file)."""
        return X25519PrivateKey.generate()

    def make_exchange(self) -> Exchange:
        """The gossip's exchange (:func:`.membership.make_exchange`); overlapped rounds posted at the next batch."""
        return make_exchange(self.root_device, self.peer_timeout or self._timeout, self._seal_keys,
                             self.robust_radius if self.robust == "clip" else None, defer_posts=bool(self.staleness))

    def configure_node(self) -> None:
        """At setup, in place of DDP's wrapping: common public initialisation, flat parameters, exchange, gossip and
        the node's runner."""
        assert isinstance(self.model, pl.LightningModule)
        assert self.topology is not None
        sync_module_states(self.model)  # every node starts from rank 0's parameters (the public x^0)
        self.flat = FlatParameters(self.model)
        self.gossip = self.build_gossip(self.flat.buffer, self.make_exchange())
        node = self.node_algorithm()
        self.runner = NodeRunner(
            self.model, self.flat, self.gossip, node if isinstance(node, PrivateNodeAlgorithm) else None,
            rank=self.global_rank, check_loss=self.stop_on_nonfinite_loss,
        )
        self._agreement_key = self._seal_keys = None  # the exchange (and Decor's secrets) hold what they need
        if getattr(self.gossip, "staleness", 0) != self.staleness:
            raise RuntimeError(f"{type(self).__name__}'s gossip does not implement overlap=True; use overlap=False")
        self._guard = DivergenceGuard() if self.divergence_guard else None
        self._describe_compression()

    def node_algorithm(self) -> NodeAlgorithm:
        """This node's algorithm (:mod:`lightning_privdec.algorithms`): SGP here; private strategies return their
        paper's node."""
        return SGPNode()

    def build_gossip(self, x0: torch.Tensor, exchange: Exchange) -> Gossip:
        """The node's mixing, as its algorithm builds it, with this strategy's graph, compressor and options."""
        assert self.topology is not None
        return self.node_algorithm().build_gossip(
            x0, rank=self.global_rank, topology=self.topology, exchange=exchange, compressor=self.compressor,
            push_sum_weight=self.required_mixing == "column", seed=self.seed, consensus_step=self._consensus_step,
            staleness=self.staleness,
        )

    def _describe_compression(self) -> None:
        """Which gamma ``"auto"`` chose for a compressed gossip, and from what, once at debug level (a default with
        nothing to act on: a divergence error names the consensus step when it is the likely cause); a warning for a
        consensus step of 1 with an aggressive compressor."""
        choice = getattr(self.gossip, "consensus_step_choice", None)
        if self.compressor is None or self.topology is None or self.flat is None:
            return
        if choice is not None and not self._consensus_step_reported:
            log.debug(f"{type(self).__name__}: {choice.describe(self.compressor, self.topology)}")
            self._consensus_step_reported = True
        omega2 = self.compressor.omega2(self.flat.numel)
        if self._consensus_step == 1.0 and omega2 > 0.5:
            rank_zero_warn(
                f"{self.compressor} has omega^2 = {omega2:.3f} > 0.5 on this model and consensus_step=1 (DP-CSGP's "
                "implicit value): error-feedback gossip can diverge with aggressive compression (the divergence guard "
                "then stops training). Use consensus_step='auto' (the default; see docs/compression.md)."
            )

    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                f"{type(self).__name__} does not support sync_batchnorm: it all-reduces activations every step, "
                "which decentralized training must not do. Use GroupNorm (or LayerNorm) instead of BatchNorm."
            )
        super().setup(trainer)

    def _check_optimization(self, trainer: pl.Trainer) -> None:
        super()._check_optimization(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} gossips the model after each step of ONE optimizer; "
                f"configure_optimizers returned {len(self.optimizers)}. Use a single optimizer (param groups are fine)."
            )

    def process_dataloader(self, dataloader: object) -> object:
        """Every node takes node 0's steps per epoch (a gossip round each), or ``max_steps``: a node whose loader is
        shorter, longer or unsized (IterableDataset) cycles its own data (:class:`CycledLoader`); said once."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and trainer.training and trainer.limit_train_batches != 0:
            counts = gather_from_nodes(batches_per_epoch(dataloader))
            self.steps_per_epoch, note = common_steps_per_epoch(counts, self.global_rank, trainer.max_steps)
            if note is not None:
                rank_zero_info(f"{type(self).__name__}: {note}")
                dataloader = CycledLoader(dataloader, self.steps_per_epoch)  # type: ignore[arg-type]
        return super().process_dataloader(dataloader)

    # ---- the training step ---------------------------------------------------------------------------------------
    #: whether a non-finite loss stops training (private strategies check only the privatized gradient: the mean
    #: loss of an empty Poisson batch is NaN by construction)
    stop_on_nonfinite_loss: bool = True

    def closure_result(self, loss: Any) -> Any:
        """What the step's closure returns to the precision plugin and optimizer (the loss by default)."""
        return loss

    def step_options(self) -> dict[str, Any]:
        """What a strategy adds to :meth:`NodeRunner.step` (private ones: the write-ahead ledger, GradScaler)."""
        return {}

    def step_refused(self) -> bool:
        """Whether this step is refused before it touches any data (a private strategy past its budget)."""
        return False

    def after_step(self) -> None:
        """What the nodes decide together after each step (a private strategy: whether to stop at its budget)."""

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        runner = self.runner
        if runner is None:
            raise RuntimeError(f"{type(self).__name__}.optimizer_step called before setup")
        if self.step_refused():
            return None  # no data touched, nothing released

        def update(numerator_closure: Callable[[], Any]) -> Any:  # the user's optimizer, through the precision plugin
            return super(DecentralizedStrategy, self).optimizer_step(
                optimizer, lambda: self.closure_result(numerator_closure()), model, **kwargs
            )

        def look_for_divergence(output: Any) -> None:
            gossip, flat = runner.gossip, runner.flat
            if self._guard is not None and self._guard.due(gossip.round):
                self._guard.check(output, torch.dist(gossip.x, flat.buffer).item(), flat.buffer.norm().item(),
                                  step=gossip.round, device=self.root_device, cause=self.divergence_cause,
                                  skip_nonfinite_loss=not self.stop_on_nonfinite_loss)

        output = runner.step(optimizer, closure, step=self.lightning_module.trainer.global_step, update=update,
                             after_gossip=look_for_divergence, **self.step_options())
        self.after_step()
        return output

    def divergence_cause(self) -> str:
        """The settings most likely behind a divergence the guard found, for its error message."""
        lrs = [float(g["lr"]) for g in self.optimizers[0].param_groups] if self.optimizers else []
        auto = None
        if self.compressor is not None:
            assert self.topology is not None and self.flat is not None
            auto = choose_consensus_step(self.compressor, self.topology, self.flat.numel).gamma
        return likely_cause(lrs, self.compressor, float(self.consensus_step), auto)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Post the overlapped round the last step started, after Lightning's per-step broadcast from rank 0."""
        super().on_train_batch_start(batch, batch_idx)
        exchange = getattr(self.gossip, "exchange", None)
        if exchange is not None:
            exchange.post_deferred()

    def teardown(self) -> None:
        exchange = getattr(self.gossip, "exchange", None)
        if exchange is not None:
            exchange.close()  # a roster's gossip connections (nothing over torch.distributed)
        super().teardown()

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.staleness and self.gossip is not None and self.flat is not None:
            self.gossip.flush()  # overlap: mix the last rounds still in flight, so no node's final model misses them
            self.gossip.debias_into(self.flat.buffer)

    # ---- checkpoints: every node's own state ---------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # restore into the gossip state, which exists only after setup

    def node_state_dict(self) -> dict[str, Any]:
        """Everything this node needs to continue its own trajectory."""
        assert self.lightning_module is not None and self.gossip is not None
        return {
            "rank": self.global_rank,
            "gossip": self.gossip.state_dict(),
            "buffers": {k: v.detach().cpu().clone() for k, v in self.lightning_module.named_buffers()},
            "optimizers": [to_cpu(opt.state_dict()) for opt in self.optimizers],
            "rng": rng_state(),
        }

    def load_node_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None and self.gossip is not None and self.flat is not None
        self.gossip.load_state_dict(state["gossip"])
        self.gossip.debias_into(self.flat.buffer)
        buffers = dict(self.lightning_module.named_buffers())
        with torch.no_grad():
            for name, value in state["buffers"].items():
                buffers[name].copy_(value)
        restore_rng_state(state["rng"])

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.gossip is not None and dist.is_available() and dist.is_initialized():
            # checkpointing only, never training; typed encoding, never pickled (rank 0 runs no other node's code)
            gathered = gather_objects(self.node_state_dict(), dst=0, what="a node's checkpoint state")
            if self.is_global_zero:
                checkpoint[CHECKPOINT_KEY] = {
                    "world_size": self.world_size,
                    "topology": getattr(self.topology, "name", str(self.topology_spec)),
                    "nodes": gathered,
                }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _fitting(self) -> bool:
        module = self.lightning_module
        return module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        node = node_entry(checkpoint, self.world_size, self.global_rank)
        if node is None:
            return
        if self._fitting() and self.gossip is not None:  # resuming training: the node's whole state
            self.load_node_state_dict(node)
        else:  # evaluating a checkpoint: each node loads its own de-biased model and nothing else
            self._load_debiased_parameters(node)

    def _load_debiased_parameters(self, node: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        load_debiased_parameters(self.lightning_module, node["gossip"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        node = node_entry(checkpoint, self.world_size, self.global_rank) if self._fitting() else None
        if node is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, node["optimizers"]):
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)
