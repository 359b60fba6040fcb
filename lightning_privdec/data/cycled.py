"""A node's own training data, cycled to the number of steps every node takes per epoch.

Every training step is one gossip round, so all nodes must take the same number of steps, while real nodes hold
different amounts of data (a hospital of 300 patients next to one of 30,000) or stream it (an IterableDataset).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["CycledLoader"]


class CycledLoader:
    """Exactly ``steps`` batches of ``loader`` per epoch: a node with less data starts its loader over, a node with
    more goes on where the last epoch stopped, so every example is still visited in turn.

    Args:
        loader: the node's own training loader (any iterable; a new ``iter()`` per pass, e.g. a reshuffled
            DataLoader).
        steps: batches per epoch, the same on every node.
    """

    def __init__(self, loader: Iterable[Any], steps: int) -> None:
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        self.loader, self.steps = loader, steps
        self._iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.steps):
            yield self._next()

    def _next(self) -> Any:
        if self._iterator is not None:
            try:
                return next(self._iterator)
            except StopIteration:
                pass
        self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError("this node's training loader yields no batch: every node needs data") from None

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, ... as the wrapped loader has them
        if name in ("loader", "steps", "_iterator"):
            raise AttributeError(name)
        return getattr(self.loader, name)
