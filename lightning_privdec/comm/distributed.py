"""Point-to-point exchange over torch.distributed (gloo on CPU, NCCL on CUDA) on the default process group.

gloo on CUDA (several ranks sharing one GPU, which NCCL refuses) works too: gloo's send and receive read and write
host memory only, so a CUDA rank's messages travel through host buffers (:attr:`TorchDistributedExchange.wire_device`).

The wire format, used by every exchange: one round sends exactly one buffer per (sender, receiver) pair, the tensors
of its message (a compressor's payload, the push-sum weight, ...) packed into one flat byte buffer (:func:`pack`); the
receiver knows their shapes and dtypes in advance (:class:`~.base.TensorSpec`) because every node knows the schedule
and the compressor, so no header travels.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_privdec.comm.base import Exchange, Incoming, Outgoing, PendingRound, Received, TensorSpec, check_finite


def message_nbytes(specs: Sequence[TensorSpec]) -> int:
    """Exact size in bytes of a message with these tensors."""
    return sum(spec.nbytes for spec in specs)


def pack(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """Concatenate the raw bytes of ``tensors`` into one contiguous uint8 buffer (a view when there is one; else
    written into ``out`` when given)."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if len(views) == 1:
        return views[0]
    return torch.cat(views) if out is None else torch.cat(views, out=out)


def unpack(buffer: Tensor, specs: Sequence[TensorSpec]) -> list[Tensor]:
    """Split a uint8 buffer back into tensors of the given specs (views into ``buffer``; a misaligned piece is copied)."""
    expected = message_nbytes(specs)
    if buffer.numel() != expected:
        raise RuntimeError(f"received {buffer.numel()} bytes, expected {expected} for message {list(specs)}")
    tensors, offset = [], 0
    for spec in specs:
        chunk = buffer[offset : offset + spec.nbytes]
        if offset % spec.dtype.itemsize:  # a typed view needs an aligned offset: copy the few misaligned bytes
            chunk = chunk.clone()
        tensors.append(chunk.view(spec.dtype).reshape(spec.shape))
        offset += spec.nbytes
    return tensors


class PeerFailureError(RuntimeError):
    """A gossip round failed because a neighbour died or did not answer within the process group's timeout."""

    @classmethod
    def during_round(cls, rank: int, peers: Sequence[int], cause: BaseException) -> PeerFailureError:
        reason = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
        return cls(
            f"node {rank} lost contact with its gossip neighbours {list(peers)}: a neighbour process died or did not "
            f"answer within the timeout (the strategy's peer_timeout, else timeout). Backend error: {reason}. Look for "
            "the first error in the other nodes' logs, then restart all nodes and resume from the last checkpoint "
            "(trainer.fit(..., ckpt_path=...))."
        )


class _Guarded:
    """A torch.distributed work handle whose ``wait`` raises :class:`PeerFailureError` instead of a backend error."""

    def __init__(self, work: Any, rank: int, peers: Sequence[int], timeout: timedelta | None) -> None:
        self.work, self.rank, self.peers, self.timeout = work, rank, peers, timeout

    def wait(self) -> Any:
        try:  # gloo's point-to-point waits ignore the process group's timeout unless it is passed here
            return self.work.wait() if self.timeout is None else self.work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerFailureError.during_round(self.rank, self.peers, exc) from exc


class TorchDistributedExchange(Exchange):
    """One ``batch_isend_irecv`` per round: an isend per out-neighbour and an irecv per in-neighbour.

    ``exchange`` waits for the round; ``start`` returns at once with the work handles (SGP's overlap).
    ``exchange`` packs and receives into buffers kept per message slot and reused by the next ``exchange`` (fresh
    large buffers every round cost page faults on CPU); ``start`` keeps a set per tag, used by the tag's next round
    once this one was waited for (rounds in flight together have different tags, so each has its own buffers).

    Uses the default process group (no process group per edge, so no creation-order hangs). With NCCL the CUDA
    device of this rank must be set before the first round (Lightning's strategies do this at setup).

    ``timeout``: the longest wait for one round's messages before :class:`PeerFailureError` (``None``: no limit).

    ``wire_device``: where the bytes travel from and to: the rank's device, except on gloo with a CUDA device, whose
    send and receive take raw host pointers; there each message is copied to pinned host memory before its round
    and the received bytes back to the device after it.

    ``defer_posts``: ``start`` packs a round's messages at once but posts them at the next :meth:`post_deferred` (or
    when a round is waited for). The Lightning strategies post at the next batch's start, after Lightning's per-step
    broadcast from rank 0 (a collective of the same default group), which would otherwise queue behind the round's
    bytes on rank 0's link and hold every node for the whole transfer.
    """

    def __init__(
        self, device: torch.device, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None,
        defer_posts: bool = False,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedExchange needs an initialised torch.distributed process group")
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.device = device
        self.wire_device = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
        self.group = group
        self.timeout = timeout
        self._reused: dict[tuple[tuple[str, Hashable], int], Tensor] = {}  # (kind, k-th message) -> its last buffer
        self._tags_in_flight: set[int] = set()  # tags of started rounds not yet waited for, whose buffers are kept
        self.defer_posts = defer_posts
        self._deferred: list[Callable[[], None]] = []  # started rounds not yet posted, oldest first

    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        round = self.traffic.rounds
        self.post_deferred()
        send_buffers, recv_buffers = self._buffers(outgoing, incoming, kept="exchange", waited=True)
        for work in self._post(send_buffers, recv_buffers, tag=0):
            work.wait()
        self._record(send_buffers, recv_buffers)
        received = {peer: unpack(recv_buffers[peer].to(self.device), specs) for peer, specs in incoming.items()}
        return check_finite(self.rank, received, round)

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> PendingRound:
        """The same ``batch_isend_irecv`` without waiting: gloo's and NCCL's own threads move the bytes meanwhile
        (posted now, or at the next :meth:`post_deferred` with ``defer_posts``). The buffers are kept per ``tag`` and
        reused by its next round once this one has been waited for (fresh ones while it is still in flight), so the
        tensors ``wait()`` returns are valid until the next round started with the same tag."""
        round = self.traffic.rounds
        reuse = tag not in self._tags_in_flight
        send_buffers, recv_buffers = self._buffers(outgoing, incoming, kept=("start", tag) if reuse else None,
                                                   waited=False)
        if reuse:
            self._tags_in_flight.add(tag)
        self._record(send_buffers, recv_buffers)
        works: list[Any] = []
        failed: list[PeerFailureError] = []  # a post that failed fails the round's wait too (its buffers hold nothing)

        def post() -> None:
            try:
                works.extend(self._post(send_buffers, recv_buffers, tag=tag))
            except PeerFailureError as exc:
                failed.append(exc)
                raise

        self._deferred.append(post)
        if not self.defer_posts:
            self.post_deferred()

        def complete() -> Received:
            self.post_deferred()
            if failed:
                raise failed[0]
            for work in works:
                work.wait()
            if reuse:  # the sends have left and the receives arrived: the tag's next round may take the buffers
                self._tags_in_flight.discard(tag)  # (a round whose wait failed keeps its tag: fresh buffers, safely)
            received = {peer: unpack(recv_buffers[peer].to(self.device), s) for peer, s in incoming.items()}
            return check_finite(self.rank, received, round)

        return PendingRound(complete)

    def post_deferred(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def _buffers(
        self, outgoing: Outgoing, incoming: Incoming, *, kept: Hashable | None, waited: bool
    ) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """A round's packed send buffers and its receive buffers: those kept under ``kept`` per message slot, or
        fresh ones (``kept=None``: a round started while another with its tag is in flight). A round ``waited`` for
        before the caller goes on may send a one-tensor message from the tensor itself; any other send owns its
        bytes (the caller may change its tensors at once)."""
        self._check_peers(outgoing, incoming)
        staged = self.wire_device != self.device
        if kept is None:
            send_buffers = {
                peer: pack(tensors).to(self.wire_device) if staged else
                pack(tensors).clone() if len(tensors) == 1 else pack(tensors)
                for peer, tensors in outgoing.items()
            }  # fmt: skip
            recv_buffers = {
                peer: torch.empty(message_nbytes(specs), dtype=torch.uint8, device=self.wire_device)
                for peer, specs in incoming.items()
            }
        else:  # buffers kept by position in the round, so a time-varying graph reuses them whatever the peer
            send_buffers = {}
            for slot, (peer, tensors) in enumerate(outgoing.items()):
                nbytes = message_nbytes([TensorSpec.of(t) for t in tensors])
                if staged or (len(tensors) == 1 and not waited):
                    send_buffers[peer] = self._buffer(("send", kept), slot, nbytes).copy_(pack(tensors))
                else:
                    send_buffers[peer] = pack(tensors) if len(tensors) == 1 else pack(
                        tensors, out=self._buffer(("send", kept), slot, nbytes))
            recv_buffers = {
                peer: self._buffer(("recv", kept), slot, message_nbytes(specs))
                for slot, (peer, specs) in enumerate(incoming.items())
            }
        return send_buffers, recv_buffers

    def _post(self, send_buffers: Mapping[int, Tensor], recv_buffers: Mapping[int, Tensor], tag: int) -> list[Any]:
        """One ``batch_isend_irecv`` of a round's buffers; its work handles."""
        ops = [dist.P2POp(dist.isend, buf, peer, self.group, tag) for peer, buf in send_buffers.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group, tag) for peer, buf in recv_buffers.items()]
        peers = sorted({*send_buffers, *recv_buffers})
        try:
            return [_Guarded(w, self.rank, peers, self.timeout) for w in dist.batch_isend_irecv(ops)] if ops else []
        except RuntimeError as exc:  # a send to a peer whose connection is already closed fails at once
            raise PeerFailureError.during_round(self.rank, peers, exc) from exc

    def _buffer(self, kind: tuple[str, Hashable], slot: int, nbytes: int) -> Tensor:
        """The byte buffer kept for the ``slot``-th message of a round (``kind``: send or receive, and the rounds
        that share it), reallocated only when its size changes."""
        buffer = self._reused.get((kind, slot))
        if buffer is None or buffer.numel() != nbytes:
            pinned = self.wire_device != self.device and self.device.type == "cuda"  # fast copies to the GPU
            buffer = self._reused[(kind, slot)] = torch.empty(
                nbytes, dtype=torch.uint8, device=self.wire_device, pin_memory=pinned
            )
        return buffer

    def _record(self, send_buffers: Mapping[int, Tensor], recv_buffers: Mapping[int, Tensor]) -> None:
        self.traffic.record(
            {peer: buf.numel() for peer, buf in send_buffers.items()},
            {peer: buf.numel() for peer, buf in recv_buffers.items()},
        )
