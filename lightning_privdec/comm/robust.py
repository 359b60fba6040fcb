"""Bounded influence of a misbehaving neighbour: self-centred clipping of the gossip (He, Karimireddy & Jaggi 2022,
"Byzantine-robust decentralized learning via ClippedGossip").

:class:`ClippedExchange` wraps the exchange of an exact, doubly-stochastic gossip (D-PSGD, DP²-SGD, Decor), whose
message is the sender's model x_j^{t+1/2} alone and is sent to the same neighbours it is received from. Each model
received is replaced by

    x_i + clip(x_j - x_i, tau),       clip(d, tau) = d min(1, tau / ||d||),

x_i being the model this node sends in the same round. The mixing x_i <- sum_j w_ij x_j (rows summing to one) then
becomes ClippedGossip's x_i + sum_j w_ij clip(x_j - x_i, tau): whatever neighbour j sends, it moves node i by at most
w_ij tau <= tau per round. Honest neighbours within tau of each other are mixed exactly as without clipping.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_privdec.comm.base import Exchange, Incoming, Outgoing, PendingRound, Received, WrappedExchange

__all__ = ["ClippedExchange"]


class ClippedExchange(WrappedExchange):
    """``inner`` with every received model clipped to within ``radius`` (L2) of this node's own; ``clipped[j]``
    counts the rounds in which neighbour j's message was clipped. Shares ``inner``'s traffic counter."""

    def __init__(self, inner: Exchange, radius: float) -> None:
        super().__init__(inner)
        if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not math.isfinite(radius) or radius <= 0:
            raise ValueError(f"the clipping radius must be a positive finite number, got {radius!r}")
        self.radius = float(radius)
        self.clipped: dict[int, int] = {}

    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        own = self._own_model(outgoing, incoming)
        return self._clip(self.inner.exchange(outgoing, incoming), own)

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> PendingRound:
        own = self._own_model(outgoing, incoming)
        if own is not None:
            own = own.detach().clone()  # the caller may change it while the round is in flight
        pending = self.inner.start(outgoing, incoming, tag)
        return PendingRound(lambda: self._clip(pending.wait(), own))

    def _own_model(self, outgoing: Outgoing, incoming: Incoming) -> Tensor | None:
        messages = list(outgoing.values())
        if not incoming:
            return None
        if set(outgoing) != set(incoming) or any(len(m) != 1 or m[0] is not messages[0][0] for m in messages):
            raise RuntimeError(
                f"node {self.rank}: robust='clip' needs a gossip whose one message is the node's model, sent to the "
                "neighbours it receives from (exact D-PSGD-style mixing on an undirected graph); this round sends "
                f"{[len(m) for m in messages]} tensors to {sorted(outgoing)} and receives from {sorted(incoming)}"
            )
        return messages[0][0]

    def _clip(self, received: Received, own: Tensor | None) -> Received:
        if own is None:
            return received
        for peer, tensors in received.items():
            difference = tensors[0].to(own.dtype) - own
            norm = float(torch.linalg.vector_norm(difference))
            if not math.isfinite(norm):  # squares of huge finite values overflowed float32
                norm = float(torch.linalg.vector_norm(difference.double()))
            if norm > self.radius:
                self.clipped[peer] = self.clipped.get(peer, 0) + 1
                received[peer] = [own + difference * (self.radius / norm)]
        return received
