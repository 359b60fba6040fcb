"""Checks that every node runs the same training, made before the first step (the non-finite guard of a step is
:mod:`lightning_privdec.algorithms.node`'s, re-exported here).

Gossip only works if all nodes take the same number of steps with the same algorithm: a node that disagrees would
leave its neighbours waiting for messages that never come. So at setup the nodes exchange a description of their
configuration (:func:`gather_from_nodes`) and every node raises the same :class:`NodeMismatchError` naming the fields
and ranks that differ; at the start of training they do the same for the number of training batches per epoch.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_privdec.algorithms.node import NonFiniteStepError, nonfinite_parameters
from lightning_privdec.comm.objects import all_gather_objects

__all__ = [
    "NodeMismatchError",
    "batches_per_epoch",
    "common_steps_per_epoch",
    "gather_tensors",
    "NonFiniteStepError",
    "check_overlap",
    "check_peer_timeout",
    "check_robust",
    "check_same_configuration",
    "describe",
    "differing_fields",
    "gather_from_nodes",
    "model_difference",
    "nonfinite_parameters",
    "raised_on_every_node",
]

#: longest value shown as text; longer ones (graphs, model shapes) travel as a SHA-256 digest
_MAX_TEXT = 80


class NodeMismatchError(ValueError):
    """The nodes were started with configurations or data that cannot train together (raised on every node)."""


def raised_on_every_node(error: BaseException, rank: int) -> BaseException:
    """``error``, which every node raises alike at setup, marked so that only rank 0 prints it: one message per run
    instead of one traceback per process. The other ranks exit with status 1 and print nothing (an uncaught
    exception's hook, installed here, skips the marked error; any other error prints as usual)."""
    if rank != 0:
        error.printed_by_rank_0 = True  # type: ignore[attr-defined]
        if not getattr(sys.excepthook, "skips_errors_rank_0_prints", False):
            sys.excepthook = _skip_errors_rank_0_prints(sys.excepthook)
    return error


def _skip_errors_rank_0_prints(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if not getattr(error, "printed_by_rank_0", False):
            previous(kind, error, traceback)

    excepthook.skips_errors_rank_0_prints = True  # type: ignore[attr-defined]
    return excepthook


def check_peer_timeout(peer_timeout: timedelta | float | None) -> timedelta | None:
    """``peer_timeout`` as a positive timedelta (None stays None); the error states the value in seconds."""
    if peer_timeout is None:
        return None
    if isinstance(peer_timeout, timedelta):
        seconds = peer_timeout.total_seconds()
    elif isinstance(peer_timeout, (int, float)) and not isinstance(peer_timeout, bool):
        seconds = float(peer_timeout)
    else:
        raise ValueError(f"peer_timeout must be a number of seconds or a timedelta, got {peer_timeout!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"peer_timeout must be a positive number of seconds, got {seconds:g} s: it is how long a node waits for "
            "another node before it stops with an error (e.g. peer_timeout=600 for ten minutes)"
        )
    return timedelta(seconds=seconds)


def _canonical(value: Any) -> str:
    """A text that is the same in every process for equal values (no memory addresses, no elided arrays)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return f"array{value.shape}:{value.dtype}:" + hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
    if isinstance(value, (list, tuple)):
        inner = ", ".join(map(_canonical, value))
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"  # a function: its name, not its address
    return repr(value)


def describe(value: Any) -> str:
    """A short, deterministic text for one configuration value: its repr, or a digest of a long one."""
    text = _canonical(value)
    if len(text) <= _MAX_TEXT:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def gather_from_nodes(value: Any, what: str = "a setup check") -> list[Any]:
    """Every node's ``value`` by rank (one all-gather in the typed encoding of :mod:`lightning_privdec.comm.objects`,
    never pickled: plain types only); just ``[value]`` without a process group."""
    return all_gather_objects(value, what)


def gather_tensors(value: torch.Tensor) -> torch.Tensor:
    """Every node's (small) tensor stacked by rank, shape ``(world_size, *value.shape)``: one ``dist.all_gather``
    (Lightning's ``strategy.all_gather`` goes through a deprecated autograd collective); ``value[None]`` alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value.unsqueeze(0)
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    return torch.stack(gathered)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def differing_fields(configurations: Sequence[Mapping[str, str]]) -> list[str]:
    """The fields on which some node's description differs from another's."""
    fields = sorted(set().union(*configurations))
    return [f for f in fields if len({c.get(f, "<missing>") for c in configurations}) > 1]


def model_difference(layouts: Sequence[Sequence[Sequence[str]]]) -> str:
    """Where the nodes' models first differ, in words: ``layouts[r]`` is node r's ``[(name, "shape dtype"), ...]``
    of trainable parameters, in order."""
    counts = [len(layout) for layout in layouts]
    for i in range(max(counts)):
        by_entry: dict[str, list[int]] = {}
        for r, layout in enumerate(layouts):
            entry = f"{layout[i][0]} {layout[i][1]}" if i < len(layout) else "no parameter"
            by_entry.setdefault(entry, []).append(r)
        if len(by_entry) > 1:
            parts = "; ".join(f"{_ranks(ranks)}: {entry}" for entry, ranks in by_entry.items())
            total = "" if len(set(counts)) == 1 else (
                "; trainable parameters: " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)))
            return f"different models; the first difference is trainable parameter {i + 1}: {parts}{total}"
    return "different models"  # the same layouts: the configuration's digest saw the same shapes (cannot happen)


def check_same_configuration(
    configurations: Sequence[Mapping[str, str]], rank: int, details: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`NodeMismatchError` unless every node described the same configuration.

    ``configurations[r]`` is node r's ``{field: describe(value)}``; the message lists each differing field with the
    ranks holding each value (or ``details[field]``, a fuller account of a long value: which layer differs), so
    every node prints the same diagnosis.
    """
    problems = []
    for field in differing_fields(configurations):
        if details is not None and field in details:
            problems.append(f"  {field} -> {details[field]}")
            continue
        by_value: dict[str, list[int]] = {}
        for r, configuration in enumerate(configurations):
            by_value.setdefault(configuration.get(field, "<missing>"), []).append(r)
        parts = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in by_value.items())
        problems.append(f"  {field} -> {parts}")
    if problems:
        raise raised_on_every_node(NodeMismatchError(
            f"node {rank}: the {len(configurations)} nodes were started with different configurations:\n"
            + "\n".join(problems)
            + "\nEvery node must run the same strategy arguments, Trainer limits and model (only the data shard, "
            "devices, timeouts and per-node paths may differ): start all processes from the same script and command "
            "line, then restart them together."
        ), rank)


def batches_per_epoch(dataloader: object) -> int | None:
    """Training batches in this node's loader per epoch (Lightning applies ``limit_train_batches`` to the common
    count afterwards, alike on every node); None without a length."""
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        return None


def common_steps_per_epoch(batches: Sequence[int | None], rank: int, max_steps: int) -> tuple[int, str | None]:
    """The number of steps every node takes per epoch (each step is one gossip round, so it must be common), and a
    note to print when the nodes' own loaders differ.

    ``batches[r]`` is node r's number of training batches per epoch (``None``: its loader has no length, e.g. an
    IterableDataset). Equal counts: that count. Different counts (nodes holding different amounts of data): node
    0's epoch, every node cycling (or Poisson-sampling) its own data. A loader without a length: ``max_steps`` steps
    in one epoch. Raises :class:`NodeMismatchError` if a node has no data, or lengths are unknown without max_steps.
    """
    known = {r: b for r, b in enumerate(batches) if b is not None}
    empty = [r for r, b in known.items() if b == 0]
    if empty:
        raise raised_on_every_node(NodeMismatchError(
            f"node {rank}: the training data of {_ranks(empty)} is empty (0 batches per epoch): an empty shard, or "
            "drop_last=True with fewer examples than batch_size. Give every node at least one batch of data (a "
            "larger dataset or fewer devices; with node_local_data, a non-empty dataset in every process)."
        ), rank)
    if len(known) < len(batches):
        if max_steps is None or max_steps < 0:
            unknown = [r for r in range(len(batches)) if r not in known]
            raise raised_on_every_node(NodeMismatchError(
                f"node {rank}: the training data of {_ranks(unknown)} has no length (an IterableDataset), so the "
                "nodes cannot agree on an epoch, and every step is one gossip round. Set Trainer(max_steps=...): "
                "every node then takes that many steps, cycling its own data."
            ), rank)
        return max_steps, f"every node takes max_steps = {max_steps} steps, cycling its own training data"
    if len(set(known.values())) > 1:
        counts = ", ".join(f"rank {r}: {b}" for r, b in known.items())
        return known[0], (
            f"the nodes hold different amounts of training data ({counts} batches per epoch): an epoch is node 0's "
            f"{known[0]} steps on every node (one gossip round each), each node drawing from its own data; set "
            "max_steps to choose the length of the run"
        )
    return known[0], None




def check_overlap(name: str, overlap: bool, staleness: int, *, push_sum: bool, compressed: str | None) -> int:
    """SGP's overlap only where delayed mixing is sound: exact push-sum messages (``push_sum``: the strategy mixes
    with the push-sum weight; ``compressed``: its compressor, if any). Returns tau (0: no overlap)."""
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False; got {overlap!r}")
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
        raise ValueError(f"staleness (SGP's tau: steps a message is late) must be an int >= 1; got {staleness!r}")
    if not overlap:
        if staleness != 1:
            raise ValueError(f"staleness={staleness} only applies with overlap=True: add overlap=True or drop it")
        return 0
    if not push_sum:
        raise ValueError(
            f"{name} does not support overlap=True: it mixes without the push-sum weight, and while a node's "
            "messages are in flight it holds only its own share a_ii x_i, which only that weight de-biases. Use a "
            "push-sum strategy (DecentralizedPushSumStrategy, PrivSGPStrategy), or overlap=False."
        )
    if compressed is not None:
        raise ValueError(
            f"{name} with compressor={compressed} does not support overlap=True: the error-feedback copies "
            "of compressed gossip assume every message is mixed in the round it was sent. Use compressor=None "
            "(DP-CSGP without compression is PrivSGPStrategy), or overlap=False."
        )
    return staleness


def check_robust(
    name: str, robust: str | None, radius: float | None, *, supported: bool, compressed: bool, overlap: bool
) -> tuple[str | None, float | None]:
    """``robust="clip"`` with its radius tau, for a strategy whose gossip message is the model itself (``supported``)
    without compression or overlap; returns (robust, radius)."""
    if robust is None:
        if radius is not None:
            raise ValueError(f"robust_radius={radius!r} only applies with robust='clip': add it or drop the radius")
        return None, None
    if robust != "clip":
        raise ValueError(f"robust must be None or 'clip' (self-centred clipping), got {robust!r}")
    if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not math.isfinite(radius) or radius <= 0:
        raise ValueError(
            f"robust='clip' needs robust_radius=tau > 0 (L2, parameter units): how far one neighbour may pull a "
            f"node per round; got {radius!r}"
        )
    if not supported or compressed or overlap:
        raise ValueError(
            f"{name}{' with a compressor' if compressed else ''}{' with overlap=True' if overlap else ''} does not "
            "support robust='clip': it clips the neighbours' models, so it needs exact gossip whose message is the "
            "model itself (D-PSGD: DecentralizedSGDStrategy; DP2SGDStrategy; CorrelatedNoiseStrategy) without "
            "compression or overlap."
        )
    return robust, float(radius)
