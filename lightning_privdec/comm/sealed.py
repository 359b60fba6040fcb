"""Sealed gossip: every message between two neighbours encrypted and authenticated with ChaCha20-Poly1305.

:class:`SealedExchange` wraps another :class:`~lightning_privdec.comm.base.Exchange`. Each directed edge i -> j has its
own 32-byte key, derived from the authenticated X25519 agreement of the signed setup
(:func:`lightning_privdec.comm.identity.seal_keys`), and counts its messages: message number k on that edge uses

* nonce ``0x00000000 || k`` (96 bits; k is never reused under one key, and the keys are new for every run),
* associated data ``tag || i || j || k`` (the direction and the message number are authenticated).

So a message altered in transit, replayed, delivered out of order, sent in the other direction or forged by anyone
but its sender fails to open, and the receiving node raises :class:`TamperedMessageError` naming the sender and the
round before any of it is used. A message is its packed tensors (:func:`~lightning_privdec.comm.distributed.pack`)
plus the 16-byte Poly1305 tag: exactly 16 bytes more per message, which the traffic counters count.

The cipher runs on the CPU: a message of tensors on a GPU is copied to the host to be sealed and opened; with a
roster the strategies carry the sealed bytes over :class:`~lightning_privdec.comm.framed.FramedExchange`, from and
into host memory, so each message crosses PCIe once each way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from torch import Tensor

from lightning_privdec.comm.base import (
    Exchange, Incoming, Outgoing, PendingRound, Received, WrappedExchange, check_finite,
)
from lightning_privdec.comm.base import TensorSpec
from lightning_privdec.comm.distributed import message_nbytes, pack, unpack

__all__ = ["SEAL_OVERHEAD", "SealedExchange", "TamperedMessageError"]

SEAL_OVERHEAD = 16  # bytes of the Poly1305 tag
_TAG = b"lightning_privdec/sealed-gossip/v1"


class TamperedMessageError(RuntimeError):
    """A gossip message did not authenticate: nothing of it was used, and the node stops."""


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


class SealedExchange(WrappedExchange):
    """``inner`` with every message sealed under the per-edge keys ``keys[peer] = (sending key, receiving key)``.

    Same interface and rounds as ``inner`` (``exchange`` and ``start``); shares its traffic counter, which counts the
    sealed bytes. ``device``: where opened messages are returned (``None``: where they arrived); an ``inner`` whose
    ``device`` is the CPU (:class:`~lightning_privdec.comm.framed.FramedExchange`) is handed host buffers.
    """

    def __init__(self, inner: Exchange, keys: Mapping[int, tuple[bytes, bytes]],
                 device: torch.device | None = None) -> None:
        super().__init__(inner)
        self.device = device
        self._host_wire = getattr(inner, "device", None) == torch.device("cpu")
        self._ciphers = {peer: (ChaCha20Poly1305(send), ChaCha20Poly1305(receive)) for peer, (send, receive) in keys.items()}
        self._sent: dict[int, int] = {}  # messages sealed so far to each peer
        self._opened: dict[int, int] = {}  # messages expected so far from each peer
        self._buffers: dict[tuple[str, int], Tensor] = {}
        self.rounds = 0

    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        """One round; sealed and opened in buffers kept per peer (the inner exchange is done with them on return;
        the tensors returned are views that the next round overwrites, as the :class:`Exchange` contract allows)."""
        sealed, expected = self._seal_round(outgoing, incoming, reuse=True)
        received = self.inner.exchange(sealed, {p: [s] for p, (s, _, _) in expected.items()})
        return self._open_round(received, expected, reuse=True)

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> PendingRound:
        sealed, expected = self._seal_round(outgoing, incoming, reuse=False)
        pending = self.inner.start(sealed, {p: [s] for p, (s, _, _) in expected.items()}, tag)
        return PendingRound(lambda: self._open_round(pending.wait(), expected, reuse=False))

    # ---- one round -----------------------------------------------------------------------------------------------------
    def _seal_round(
        self, outgoing: Outgoing, incoming: Incoming, reuse: bool
    ) -> tuple[dict[int, list[Tensor]], dict[int, tuple[TensorSpec, list[TensorSpec], tuple[int, int]]]]:
        self._check_peers(outgoing, incoming)
        round = self.traffic.rounds  # the gossip's round (the counter is the inner exchange's, kept in checkpoints)
        self.rounds += 1
        sealed = {peer: [self._seal(peer, tensors, reuse)] for peer, tensors in outgoing.items()}
        expected = {}
        for peer, specs in incoming.items():
            count = self._opened.get(peer, 0)
            self._opened[peer] = count + 1
            size = message_nbytes(specs) + SEAL_OVERHEAD
            expected[peer] = (TensorSpec((size,), torch.uint8), list(specs), (round, count))
        return sealed, expected

    def _open_round(self, received: Received, expected: Mapping, reuse: bool) -> Received:
        opened = {peer: self._open(peer, received[peer][0], specs, round, count, reuse)
                  for peer, (_, specs, (round, count)) in expected.items()}
        return check_finite(self.rank, opened, next((r for _, _, (r, _) in expected.values()), 0))

    def _cipher(self, peer: int, direction: int) -> ChaCha20Poly1305:
        ciphers = self._ciphers.get(peer)
        if ciphers is None:
            raise RuntimeError(f"node {self.rank}: no sealing key for node {peer}, which is not a neighbour in the graph")
        return ciphers[direction]

    def _associated(self, sender: int, receiver: int, count: int) -> bytes:
        return _TAG + _u64(sender) + _u64(receiver) + _u64(count)

    def _host_buffer(self, kind: str, peer: int, nbytes: int, reuse: bool) -> Tensor:
        """A CPU byte buffer: the one kept for (kind, peer) when ``reuse`` (fresh large buffers cost page faults)."""
        if not reuse:
            return torch.empty(nbytes, dtype=torch.uint8)
        buffer = self._buffers.get((kind, peer))
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[(kind, peer)] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer

    def _seal(self, peer: int, tensors: list[Tensor] | tuple[Tensor, ...], reuse: bool = False) -> Tensor:
        cipher = self._cipher(peer, 0)
        count = self._sent.get(peer, 0)
        self._sent[peer] = count + 1
        if len(tensors) > 1 and all(t.device.type == "cpu" for t in tensors):  # packed into a kept buffer too
            nbytes = message_nbytes([TensorSpec.of(t) for t in tensors])
            plain = pack(tensors, out=self._host_buffer("plain", peer, nbytes, reuse))
        else:
            plain = pack(tensors)
        device = plain.device
        host = plain.cpu() if device.type != "cpu" else plain
        out = self._host_buffer("sealed", peer, host.numel() + SEAL_OVERHEAD, reuse)
        cipher.encrypt_into(b"\0\0\0\0" + _u64(count), host.numpy(), self._associated(self.rank, peer, count), out.numpy())
        return out if device.type == "cpu" or self._host_wire else out.to(device)

    def _open(
        self, peer: int, buffer: Tensor, specs: list[TensorSpec], round: int, count: int, reuse: bool = False
    ) -> list[Tensor]:
        cipher = self._cipher(peer, 1)
        host = buffer.cpu() if buffer.device.type != "cpu" else buffer
        plain = self._host_buffer("opened", peer, host.numel() - SEAL_OVERHEAD, reuse)
        try:
            cipher.decrypt_into(b"\0\0\0\0" + _u64(count), host.numpy(), self._associated(peer, self.rank, count),
                                plain.numpy())
        except InvalidTag:
            raise TamperedMessageError(
                f"node {self.rank}: the gossip message from node {peer} in round {round} does not authenticate: it was "
                f"altered, replayed, reordered or forged on its way (only node {peer}, with its key from the signed "
                "setup, can seal a message to this node). Nothing of it was used and training stops here: check the "
                f"network path between the two nodes and node {peer} itself, then restart every node from the last "
                "checkpoint."
            ) from None
        target = self.device or buffer.device
        return unpack(plain if target.type == "cpu" else plain.to(target), specs)

    def __getstate__(self) -> object:
        raise TypeError("SealedExchange holds the edge keys and cannot be pickled")
