"""Checks that every node runs the same training, made before the first step (the non-finite guard of a step is
:mod:`lightning_privdec.algorithms.node`'s, re-exported here).

Gossip only works if all nodes take the same number of steps with the same algorithm: a node that disagrees would
leave its neighbours waiting for messages that never come. So at setup the nodes exchange a description of their
configuration (:func:`gather_from_nodes`) and every node raises the same :class:`NodeMismatchError` naming the fields
and ranks that differ; at the start of training they do the same for the number of training batches per epoch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_privdec.algorithms.node import NonFiniteStepError, nonfinite_parameters
from lightning_privdec.comm.objects import all_gather_objects

__all__ = [
    "NodeMismatchError",
    "common_steps_per_epoch",
    "gather_tensors",
    "NonFiniteStepError",
    "check_same_configuration",
    "describe",
    "gather_from_nodes",
    "nonfinite_parameters",
]

#: longest value shown as text; longer ones (graphs, model shapes) travel as a SHA-256 digest
_MAX_TEXT = 80


class NodeMismatchError(ValueError):
    """The nodes were started with configurations or data that cannot train together (raised on every node)."""


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


def check_same_configuration(configurations: Sequence[Mapping[str, str]], rank: int) -> None:
    """Raise :class:`NodeMismatchError` unless every node described the same configuration.

    ``configurations[r]`` is node r's ``{field: describe(value)}``; the message lists each differing field with the
    ranks holding each value, so every node prints the same diagnosis.
    """
    fields = sorted(set().union(*configurations))
    problems = []
    for field in fields:
        by_value: dict[str, list[int]] = {}
        for r, configuration in enumerate(configurations):
            by_value.setdefault(configuration.get(field, "<missing>"), []).append(r)
        if len(by_value) > 1:
            parts = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in by_value.items())
            problems.append(f"  {field} -> {parts}")
    if problems:
        raise NodeMismatchError(
            f"node {rank}: the {len(configurations)} nodes were started with different configurations:\n"
            + "\n".join(problems)
            + "\nEvery node must run the same strategy arguments, Trainer limits and model (only the data shard, "
            "devices, timeouts and per-node paths may differ): start all processes from the same script and command "
            "line, then restart them together."
        )


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
        raise NodeMismatchError(
            f"node {rank}: the training data of {_ranks(empty)} is empty (0 batches per epoch): an empty shard, or "
            "drop_last=True with fewer examples than batch_size. Give every node at least one batch of data (a "
            "larger dataset or fewer devices; with node_local_data, a non-empty dataset in every process)."
        )
    if len(known) < len(batches):
        if max_steps is None or max_steps < 0:
            unknown = [r for r in range(len(batches)) if r not in known]
            raise NodeMismatchError(
                f"node {rank}: the training data of {_ranks(unknown)} has no length (an IterableDataset), so the "
                "nodes cannot agree on an epoch, and every step is one gossip round. Set Trainer(max_steps=...): "
                "every node then takes that many steps, cycling its own data."
            )
        return max_steps, f"every node takes max_steps = {max_steps} steps, cycling its own training data"
    if len(set(known.values())) > 1:
        counts = ", ".join(f"rank {r}: {b}" for r, b in known.items())
        return known[0], (
            f"the nodes hold different amounts of training data ({counts} batches per epoch): an epoch is node 0's "
            f"{known[0]} steps on every node (one gossip round each), each node drawing from its own data; set "
            "max_steps to choose the length of the run"
        )
    return known[0], None


