"""The write-ahead privacy ledger: every released step is on disk before its message leaves the node.

A checkpoint holds the ledger as of the checkpoint. A run that crashes later has already sent the messages of the
steps in between; a resumed secure run draws fresh noise (generator states are never checkpointed) and sends NEW
messages about the same data for those steps. So each node writes its accounting state (ledger history,
step count, plan, noise levels: never generator states, secrets or gradients) to ``<dir>/<run>/node_<rank>.pt``
after the private step and before the gossip, atomically (a temporary file, then ``os.replace``). On resume the
node reads the file of the checkpoint's run: when it records more steps than the checkpoint, the node takes the
file's accounting state, so epsilon and the budget checks count the lost steps too.

Files are keyed by a run id kept in the checkpoint: a fresh run gets a new id (and never merges with another run's
file); every run resumed from a checkpoint of that lineage continues the same file.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_privdec.privacy.errors import PrivacyConfigError

FORMAT = 1
#: privacy state keys that must never reach a write-ahead file (a generator's state reveals its seed)
GENERATOR_KEYS = ("noise_generator", "sampling_generator")


def new_run_id() -> str:
    """A fresh, unguessable run id (names a run's ledger directory, not a secret)."""
    return uuid.uuid4().hex


class WriteAheadLedger:
    """One node's write-ahead file ``<directory>/<run_id>/node_<rank>.pt``.

    Args:
        directory: the ledger directory (created on the first write).
        run_id: the run lineage the file belongs to (stored in the checkpoint).
        rank: this node's id.
    """

    def __init__(self, directory: str | os.PathLike, run_id: str, rank: int) -> None:
        self.directory = Path(directory).absolute()
        self.run_id, self.rank = run_id, rank
        self.path = self.directory / run_id / f"node_{rank}.pt"
        self._tmp = self.path.with_name(f".node_{rank}.pt.tmp")

    def write(self, node: Any) -> None:
        """Atomically replace the file by ``node``'s accounting state (call before the step's message leaves)."""
        state = node.accounting_state()
        if any(key in state for key in GENERATOR_KEYS):
            raise RuntimeError("accounting_state() returned generator states; they must never leave the checkpoint")
        record = {"format": FORMAT, "run": self.run_id, "rank": self.rank, "steps": int(node.steps),
                  "accounting": state}
        if not self._tmp.parent.is_dir():
            self._tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(self._tmp, "wb") as handle:
            torch.save(record, handle)
            handle.flush()
            os.fsync(handle.fileno())  # on disk before the message is sent, even if the machine fails
        os.replace(self._tmp, self.path)

    def read(self) -> dict[str, Any] | None:
        """The recorded state, or ``None`` without a file. Refuses a file of another run or node."""
        if not self.path.exists():
            return None
        record = torch.load(self.path, weights_only=True)
        if record.get("format") != FORMAT or record.get("run") != self.run_id or record.get("rank") != self.rank:
            raise PrivacyConfigError(
                f"{self.path} is not node {self.rank}'s write-ahead privacy ledger of run {self.run_id}; "
                "restore the file this run wrote, or remove it knowing that its released steps will not be counted"
            )
        return record

    def recover(self, node: Any) -> int:
        """After ``node`` loaded a checkpoint: adopt the file's accounting state if it records more steps.

        Returns the number of released steps past the checkpoint (0 if none) and warns on this node when positive.
        """
        record = self.read()
        checkpointed = int(node.steps)
        if record is None or int(record["steps"]) <= checkpointed:
            return 0
        node.load_accounting_state(record["accounting"])
        lost = int(node.steps) - checkpointed
        said = f"epsilon spent so far is {node.epsilon():.4f} (delta={node.delta})"
        warnings.warn(
            f"node {self.rank}: {lost} private steps were released after the checkpoint (its ledger has "
            f"{checkpointed} steps, the write-ahead ledger {self.path} has {node.steps}); they stay counted: "
            f"{said}, and the budget checks include them, so training may stop earlier than the uninterrupted run",
            UserWarning,
            stacklevel=2,
        )
        return lost


def strip_generators(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without generator states."""
    return {key: value for key, value in state.items() if key not in GENERATOR_KEYS}
