"""The exchange interface: one gossip round of point-to-point messages between graph neighbours."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


#: what a node sends in one round: peer -> the tensors of its message
Outgoing = Mapping[int, Sequence[Tensor]]
#: what a node expects in one round: peer -> the shapes and dtypes of its message
Incoming = Mapping[int, Sequence[TensorSpec]]
#: what arrived in one round: peer -> the tensors of its message
Received = dict[int, list[Tensor]]


@dataclass
class TrafficCounter:
    """Bytes that really went over the wire, per node: the last round and the running totals."""

    bytes_sent: int = 0
    bytes_received: int = 0
    last_bytes_sent: int = 0
    last_bytes_received: int = 0
    rounds: int = 0
    per_peer_sent: dict[int, int] = field(default_factory=dict)

    def record(self, sent: Mapping[int, int], received: Mapping[int, int]) -> None:
        self.last_bytes_sent = sum(sent.values())
        self.last_bytes_received = sum(received.values())
        self.bytes_sent += self.last_bytes_sent
        self.bytes_received += self.last_bytes_received
        self.rounds += 1
        for peer, n in sent.items():
            self.per_peer_sent[peer] = self.per_peer_sent.get(peer, 0) + n

    def state_dict(self) -> dict:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rounds": self.rounds,
            "per_peer_sent": dict(self.per_peer_sent),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_received = int(state["bytes_received"])
        self.rounds = int(state["rounds"])
        self.per_peer_sent = {int(k): int(v) for k, v in state["per_peer_sent"].items()}


class Exchange(abc.ABC):
    """Sends one message to each out-neighbour and receives one from each in-neighbour, per round.

    ``outgoing`` maps a peer to the tensors sent to it; ``incoming`` maps a peer to the specs of the tensors expected
    from it. Each message travels as one packed byte buffer (:func:`~lightning_privdec.comm.distributed.pack`; no
    header: the receiver knows the specs). Returns the received tensors per peer. Every call is one round; both ends
    must agree on who talks to whom in it.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.traffic = TrafficCounter()

    @abc.abstractmethod
    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        """Run one round of point-to-point messages and return what arrived, by sender.

        The returned tensors may be views into receive buffers that the next round reuses: use or copy them first.
        """

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> PendingRound:
        """Post one round without waiting for it (non-blocking send and receive); ``wait()`` on the result.

        The tensors of ``outgoing`` are copied before this returns, so the caller may change them at once. Rounds
        posted with different ``tag`` may be in flight together. What ``wait()`` returns may be overwritten by the
        next round started with the same tag (an exchange may reuse its buffers). This default runs the round at
        once (blocking); the distributed and loopback exchanges really overlap it with whatever the caller does next.
        """
        received = {peer: [t.clone() for t in tensors] for peer, tensors in self.exchange(outgoing, incoming).items()}
        return PendingRound(lambda: received)

    def post_deferred(self) -> None:
        """Post the rounds :meth:`start` has left unposted, oldest first (an exchange that defers them; nothing by
        default)."""

    def close(self) -> None:
        """Release the connections this exchange holds (nothing by default); no round may follow."""

    def _check_peers(self, outgoing: Mapping[int, Sequence[Tensor]], incoming: Mapping[int, object]) -> None:
        for peer in list(outgoing) + list(incoming):
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise ValueError(f"node {self.rank}: invalid peer {peer} (world size {self.world_size})")


class WrappedExchange(Exchange):
    """An exchange around ``inner`` (sealing, clipping, recording): the same node and rounds, ``inner``'s traffic
    counter, and the rounds ``inner`` defers and the connections it holds handed to it."""

    def __init__(self, inner: Exchange) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.traffic = inner.traffic

    def post_deferred(self) -> None:
        self.inner.post_deferred()

    def close(self) -> None:
        self.inner.close()


class NonFiniteMessageError(FloatingPointError):
    """A neighbour's gossip message holds NaN or infinite values: refused before anything of it is mixed."""


def check_finite(rank: int, received: Received, round: int) -> Received:
    """``received`` unchanged if every floating-point value in it is finite; else :class:`NonFiniteMessageError`
    naming the first sender at fault. An honest node never sends a non-finite value (the strategies stop at a
    non-finite loss or gradient), so one comes from a faulty or malicious neighbour. A NaN or infinity makes its
    tensor's sum non-finite, so finite sums (one fast reduction each, one host synchronisation) clear the round;
    only then, or when huge finite values overflowed a sum, is every entry checked."""
    floats = [(peer, t) for peer, tensors in received.items() for t in tensors if t.is_floating_point() and t.numel()]
    sums = [t.sum(dtype=torch.float32 if t.element_size() < 4 else None).to(torch.float64) for _, t in floats]
    if not floats or bool(torch.isfinite(torch.stack(sums)).all()):
        return received
    bad = [peer for peer, t in floats if not bool(torch.isfinite(t).all())]
    if not bad:
        return received
    peer = bad[0]
    raise NonFiniteMessageError(
        f"node {rank}: the gossip message from node {peer} in round {round} holds NaN or infinite values; nothing of "
        f"it was mixed and training stops here. Node {peer} is faulty or misbehaving (an honest node stops at its own "
        "first non-finite loss or gradient before sending anything): look at its log, then restart every node from "
        "the last checkpoint."
    )


class PendingRound:
    """One round's messages in flight. ``wait()`` blocks until this node's sends have left and its receives have
    arrived, and returns what arrived, by sender; later calls return the same tensors."""

    def __init__(self, complete: Callable[[], dict[int, list[Tensor]]]) -> None:
        self._complete: Callable[[], dict[int, list[Tensor]]] | None = complete
        self._received: dict[int, list[Tensor]] | None = None

    @classmethod
    def arrived(cls, received: dict[int, list[Tensor]]) -> PendingRound:
        """A round whose messages are already here (restored from a checkpoint)."""
        pending = cls(lambda: received)
        pending.wait()
        return pending

    def wait(self) -> dict[int, list[Tensor]]:
        if self._complete is not None:
            self._received, self._complete = self._complete(), None
        assert self._received is not None
        return self._received
