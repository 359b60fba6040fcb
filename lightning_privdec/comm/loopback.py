"""A loopback exchange: n simulated nodes in one process, one thread per node.

The algorithm code is the same as in a multi-process run: every node calls ``exchange`` once per round and blocks
until its in-neighbours' messages arrive (or ``start``, then ``wait`` later). Messages are packed into byte buffers
exactly as on the wire (and copied), so byte counts match the distributed exchange. Deterministic: each node's
arithmetic does not depend on thread timing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from torch import Tensor

from lightning_privdec.comm.base import Exchange, Incoming, Outgoing, PendingRound, Received, check_finite
from lightning_privdec.comm.distributed import message_nbytes, pack, unpack

T = TypeVar("T")


class LoopbackExchange(Exchange):
    """One simulated node's endpoint of a :class:`LoopbackNetwork`."""

    def __init__(self, network: LoopbackNetwork, rank: int) -> None:
        super().__init__(rank, network.world_size)
        self._network = network

    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        return self.start(outgoing, incoming).wait()

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> PendingRound:
        """Post the messages now and collect them on ``wait()``. Each (sender, receiver) mailbox is first in, first
        out, so rounds waited for in the order they were started need no tag."""
        self._check_peers(outgoing, incoming)
        round = self.traffic.rounds
        sent = self._send(outgoing)
        self.traffic.record(sent, {peer: message_nbytes(specs) for peer, specs in incoming.items()})
        return PendingRound(lambda: check_finite(self.rank, self._receive(incoming), round))

    def _send(self, outgoing: Outgoing) -> dict[int, int]:
        sent = {}
        for peer, tensors in outgoing.items():
            buffer = pack(tensors).clone()
            sent[peer] = buffer.numel()
            self._network._mailbox(self.rank, peer).put(buffer)
        return sent

    def _receive(self, incoming: Incoming) -> Received:
        received = {}
        for peer, specs in incoming.items():
            try:
                buffer = self._network._mailbox(peer, self.rank).get(timeout=self._network.timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"node {self.rank} waited {self._network.timeout}s for node {peer}'s message: "
                    "the simulated nodes disagree on the schedule, or another node failed"
                ) from None
            received[peer] = unpack(buffer, specs)
        return received


class LoopbackNetwork:
    """n nodes in one process. ``run(fn)`` calls ``fn(rank, exchange)`` on every node concurrently."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int], queue.Queue[Tensor]] = {}
        self.exchanges = [LoopbackExchange(self, rank) for rank in range(world_size)]

    def _mailbox(self, sender: int, receiver: int) -> queue.Queue[Tensor]:
        with self._lock:
            return self._queues.setdefault((sender, receiver), queue.Queue())

    def run(self, fn: Callable[[int, Exchange], T]) -> list[T]:
        """Run ``fn`` for every node in its own thread; return the results by rank, re-raising the first error."""
        results: list[T | None] = [None] * self.world_size
        errors: list[BaseException] = []

        def node(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.exchanges[rank])
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=node, args=(r,), name=f"loopback-node-{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]
