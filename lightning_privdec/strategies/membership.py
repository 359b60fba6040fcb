"""A strategy's roster at setup, and the exchange its gossip travels over.

With a roster and an identity key, every node proves its membership for this run and signs its configuration
digest and ephemeral X25519 key (:mod:`lightning_privdec.comm.identity`); the gossip is then sealed per edge and
carried length-framed over TCP (:mod:`lightning_privdec.comm.sealed`, :mod:`lightning_privdec.comm.framed`). An
identity key inside a directory the run writes (checkpoints, logs, the write-ahead ledger) is refused on every node.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from lightning_privdec.comm import Exchange, TorchDistributedExchange
from lightning_privdec.comm.framed import FramedExchange
from lightning_privdec.comm.identity import (
    AuthenticatedSetup, Identity, MembershipError, Roster, authenticate_members, check_key_outside, identity_path,
    seal_keys,
)
from lightning_privdec.comm.objects import encode
from lightning_privdec.comm.robust import ClippedExchange
from lightning_privdec.comm.sealed import SealedExchange
from lightning_privdec.strategies.checks import gather_from_nodes

SealKeys = dict[int, tuple[bytes, bytes]]


def output_directories(trainer: pl.Trainer | None) -> list[tuple[str, str | os.PathLike[str]]]:
    """The directories a run writes checkpoints and logs to, as ``(what, path)``: the Trainer's
    ``default_root_dir`` (when it is the working directory, Lightning's default, only the ``checkpoints`` and
    ``lightning_logs`` folders it writes there), every ModelCheckpoint's ``dirpath`` and every logger's directory."""
    if trainer is None:
        return []
    root = Path(trainer.default_root_dir)
    if root.resolve() == Path.cwd().resolve():
        directories: list[tuple[str, str | os.PathLike[str]]] = [
            ("the Trainer's default checkpoint directory", root / "checkpoints"),
            ("the Trainer's default log directory", root / "lightning_logs"),
        ]
    else:
        directories = [("the Trainer's default_root_dir", root)]
    directories += [("a ModelCheckpoint's dirpath", c.dirpath) for c in trainer.checkpoint_callbacks if c.dirpath]
    for logger in trainer.loggers:
        folder = getattr(logger, "root_dir", None) or logger.save_dir
        if folder:
            directories.append((f"the {type(logger).__name__}'s directory", folder))
    return directories


def authenticate(
    roster: Roster, identity_key: str | os.PathLike[str], *, rank: int, local_rank: int, node_rank: int,
    world_size: int, directories: list[tuple[str, str | os.PathLike[str]]], configuration: Mapping[str, str],
    agreement_key: Callable[[], X25519PrivateKey], neighbours: Iterable[int],
) -> tuple[AuthenticatedSetup, X25519PrivateKey, SealKeys]:
    """The signed setup of every node (each calls it alike): this node's identity key (``{rank}``, ``{local_rank}``,
    ``{node_rank}`` filled in) checked outside ``directories`` on every node first, then the roster's proof of
    membership over ``configuration``'s digest and the X25519 key; returns the setup, the key and the sealing keys
    of this node's edges to ``neighbours``. Raises :class:`MembershipError` naming the node at fault."""
    problem, identity = None, identity_key
    try:
        identity = identity_path(roster, identity_key, rank=rank, local_rank=local_rank, node_rank=node_rank)
        check_key_outside(identity, directories)
    except MembershipError as error:
        problem = error
    failed = [(r, m) for r, m in enumerate(gather_from_nodes(problem and str(problem))) if m is not None]
    if problem is not None:
        raise problem
    if failed:
        raise MembershipError(f"node {failed[0][0]} cannot use its identity key, so no node starts: {failed[0][1]}")
    key = agreement_key()
    setup = authenticate_members(
        Identity(identity), roster, rank=rank, world_size=world_size,
        agreement_key=key.public_key().public_bytes_raw(),
        configuration_digest=hashlib.sha256(encode(dict(configuration))).digest(),
    )
    return setup, key, seal_keys(key, setup, rank, neighbours)


def make_exchange(
    device: torch.device, timeout: timedelta | None, sealing: SealKeys | None = None,
    robust_radius: float | None = None, defer_posts: bool = False,
) -> Exchange:
    """The gossip's point-to-point exchange: over torch.distributed (overlapped rounds posted at
    ``post_deferred`` with ``defer_posts``); with ``sealing`` keys sealed per edge and carried length-framed over TCP
    (so that no message size can abort the receiver; sealed and sent from the host); with ``robust_radius`` clipped
    around the node's own model (:mod:`lightning_privdec.comm.robust`)."""
    exchange: Exchange
    if sealing is not None:
        exchange = SealedExchange(FramedExchange(torch.device("cpu"), sealing, timeout), sealing, device=device)
    else:
        exchange = TorchDistributedExchange(device, timeout=timeout, defer_posts=defer_posts)
    return exchange if robust_radius is None else ClippedExchange(exchange, robust_radius)


__all__ = ["authenticate", "make_exchange", "output_directories"]
