"""A node's own state in a Lightning checkpoint: every node's gossip state, buffers, optimizer state and random
generators, gathered to rank 0 under :data:`CHECKPOINT_KEY` in plain tensors and values (loadable with
``weights_only=True``); each node resumes its own trajectory from its entry."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_privdec.tensors import split_like
from lightning_privdec.topology import TopologyError

CHECKPOINT_KEY = "lightning_privdec"


def node_entry(checkpoint: Mapping[str, Any], world_size: int, rank: int) -> Mapping[str, Any] | None:
    """Node ``rank``'s entry of a checkpoint of ``world_size`` nodes (None: a checkpoint without node states)."""
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        return None
    if saved["world_size"] != world_size:
        raise TopologyError(
            f"the checkpoint holds the state of {saved['world_size']} nodes but this run has {world_size}; "
            "resume with the same devices x num_nodes, or load only the weights (state_dict) into a new run"
        )
    return saved["nodes"][rank]


def load_debiased_parameters(module: torch.nn.Module, gossip: Mapping[str, Any]) -> None:
    """The de-biased model z = x / y of a node's saved gossip state into ``module``'s trainable parameters."""
    z = gossip["x"] / gossip["y"].to(gossip["x"].dtype)
    parameters = [p for p in module.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, value in zip(parameters, split_like(z, parameters)):
            p.copy_(value)


def rng_state() -> dict[str, Any]:
    """This process's random generators as tensors and plain values (loadable with ``weights_only=True``)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    version, python_state, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)],
        "python": [version, torch.tensor(python_state, dtype=torch.int64), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in python_state.tolist()), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_cpu(obj: Any) -> Any:
    """Tensors in ``obj`` (nested dicts, lists, tuples) detached, copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
