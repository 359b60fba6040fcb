"""One process per node over ``torch.distributed``, launched like Lightning's DDP, without DistributedDataParallel.

:class:`ProcessGroupStrategy` is the part of Lightning's ``DDPStrategy`` that decentralized training uses: the
launchers (``start_method="popen"``: Lightning's subprocess script launcher, which also serves torchrun and SLURM
through the cluster environment; ``"spawn"``/``"fork"``/``"forkserver"``: its multiprocessing launcher), the
process group (backend from the device: gloo on CPU, NCCL on CUDA), ranks, the device of each process and the
collectives Lightning itself calls (``barrier`` for checkpoints, ``reduce`` for ``log(..., sync_dist=True)`` and stop
decisions, ``all_gather``, and ``broadcast`` in a typed encoding instead of pickle). It never wraps the model and
never all-reduces gradients: what a step sends is the subclass's business.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_privdec.comm.objects import broadcast_object
from lightning_privdec.strategies.checks import gather_from_nodes

log = logging.getLogger(__name__)


def destroy_process_group_at_exit() -> None:
    """Destroy the process group while the interpreter is alive (Lightning does so for NCCL only): a gloo group left
    to finalization can abort a finished run ("terminate called without an active exception", exit code -6)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupStrategy(ParallelStrategy):
    """Multi-process training, one device per process, on one or several machines, with no gradient all-reduce.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every Lightning
            strategy (the Trainer fills in those not given).
        process_group_backend: ``None``: gloo on CPU, NCCL on CUDA.
        timeout: how long the start-up rendezvous and every collective may wait (Lightning's default 30 minutes).
        start_method: ``"popen"`` (default: the script is run once per process; torchrun and SLURM start the
            processes themselves), or ``"spawn"``, ``"fork"``, ``"forkserver"`` (multiprocessing).
    """

    #: Lightning then gives every training loader a DistributedSampler (each node its own shard) and lets
    #: ``log(..., sync_dist=True)`` reduce over the nodes
    is_distributed = True

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.num_nodes = 1  # the Trainer's num_nodes (set by its accelerator connector)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method != "popen" and self.cluster_environment.creates_processes_externally:
            raise ValueError(
                f"start_method={self._start_method!r} starts this machine's processes itself, but "
                f"{type(self.cluster_environment).__name__} (torchrun, SLURM, ...) has already started them: every "
                "process would start its own world again and wait forever. Use start_method='popen' (the default) "
                "under such a launcher"
            )
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        """The accelerator, then the process group (every process waits here for the others, up to ``timeout``)."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if _TORCH_GREATER_EQUAL_2_3:
            kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        atexit.unregister(destroy_process_group_at_exit)  # one entry however many fits this process runs
        atexit.register(destroy_process_group_at_exit)

    def setup(self, trainer: pl.Trainer) -> None:
        """DDP's setup without its wrapper, nor rank 0's weights broadcast when only evaluating (every process keeps
        and evaluates its own model); when fitting, :meth:`configure_node` before the optimizers are set up and
        :meth:`_check_optimization` after."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.configure_node()
            self.setup_optimizers(trainer)
            self._check_optimization(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def configure_node(self) -> None:
        """When fitting, in place of DDP's wrapping, before the optimizers are set up: nothing here."""

    def _check_optimization(self, trainer: pl.Trainer) -> None:
        """When fitting, once the optimizers are set up: refuse what the strategy cannot train (nothing here)."""

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast (checkpoint paths, log dirs, stop decisions) in the typed encoding of
        :mod:`lightning_privdec.comm.objects` instead of pickle: plain values only (str, int, float, bool, None,
        bytes, lists, tuples, dicts, paths, CPU tensors); anything else raises before it is sent."""
        return broadcast_object(obj, src, what=f"{type(self).__name__}.broadcast")

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """A tensor reduced over every process (``"mean"`` by default, or ``"sum"``, or a ``ReduceOp``); anything
        else is returned as it is."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


def sync_module_states(module: torch.nn.Module) -> bool:
    """Give every node rank 0's parameters and buffers, as DDP's start-up broadcast does, but compare a SHA-256
    digest of them first (one small all-gather): the broadcast, (N - 1) model copies through rank 0's link, runs only
    if some node's digest differs from rank 0's. Nodes that seeded their models alike start at once. Returns whether
    the broadcast ran (the same answer on every node)."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    digest = hashlib.sha256()
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if name in ignore:
            continue
        data = tensor.detach().reshape(-1).cpu()
        digest.update(f"{name}:{data.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy())
    digests = gather_from_nodes(digest.hexdigest())
    if all(d == digests[0] for d in digests):
        return False
    _sync_module_states(module)
    return True
