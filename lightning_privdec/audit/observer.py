"""The auditor's view: every message on the wire, and what a node released, recovered from those messages alone.

Threat model of the audit: an observer who reads every message of every node (a curious neighbour sees a subset of
this; Decor's eavesdropper sees exactly this) and knows the algorithm and its public parameters (graph, mixing
weights, step size, consensus step, compressor and its public seed, initial model), but no node's noise, sampling
or secrets. :class:`WireTap` records what a node puts on the wire; the decoders below turn the transcripts into the
released noisy gradients, using nothing else.

Push-sum family (SGP / PrivSGP / Dyn-D2P / PrivSGP-VR exact, DP-CSGP compressed on a static graph, D-PSGD / Decor):
node i's numerator after its local step is x_i^{t+1/2} = P_i(t) - eta G_i(t), with G_i(t) the sum of its released
gradients up to round t and P_i(t) = x^0 + gamma sum_{s<t} (sum_j a_ij xhat_j(s+1) - sum_k a_ki xhat_i(s+1)) its
public part (the mixing corrections, DP-CSGP Algorithm 1 line 5; with exact messages xhat = the message and gamma =
1, line 5 is the push-sum mix). The public copy xhat_i is everything node i ever sent, decoded, so the auditor
computes G_i(t) = (P_i(t) - xhat_i(t+1)) / eta on the coordinates node i's round-t message carried: all of them
for exact messages; for a sparsifier (RandK, TopK) the kept ones, each coordinate then known up to the last round it
travelled (for a quantizer, QSGD or Sign, the value is only approximate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_privdec.algorithms.cpgt import CHANNEL_X, CHANNEL_Y
from lightning_privdec.algorithms.mixing import BROADCAST, message_key, plan_round
from lightning_privdec.comm import Exchange
from lightning_privdec.comm.base import Incoming, Outgoing, Received, WrappedExchange
from lightning_privdec.compression import Compressor, Identity
from lightning_privdec.topology import Topology

__all__ = ["WireTap", "cpgt_observations", "push_sum_released"]


class WireTap(WrappedExchange):
    """An :class:`Exchange` that records every message its node sends (one dict ``peer -> tensors`` per round)."""

    def __init__(self, inner: Exchange) -> None:
        super().__init__(inner)
        self.sent: list[dict[int, list[Tensor]]] = []

    def _record(self, outgoing: Outgoing) -> None:
        self.sent.append({peer: [t.detach().clone() for t in tensors] for peer, tensors in outgoing.items()})

    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        self._record(outgoing)
        return self.inner.exchange(outgoing, incoming)

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> Any:
        """A round posted without waiting (overlapping gossip) is recorded like any other."""
        self._record(outgoing)
        return self.inner.start(outgoing, incoming, tag)


def _compressor(compressor: Compressor | None) -> Compressor | None:
    return None if compressor is None or isinstance(compressor, Identity) else compressor


def _one_message(sent: Mapping[int, list[Tensor]], node: int, round_: int) -> list[Tensor]:
    if not sent:
        raise ValueError(f"node {node} sent nothing in round {round_}: the auditor cannot follow its state")
    return next(iter(sent.values()))


@torch.no_grad()
def push_sum_released(
    transcripts: Sequence[Sequence[Mapping[int, list[Tensor]]]],
    topology: Topology,
    *,
    x0: Tensor,
    lr: float,
    compressor: Compressor | None = None,
    consensus_step: float = 1.0,
    seed: int = 0,
) -> Tensor:
    """Every node's released gradient per round, ``(nodes, rounds, d)``, from the push-sum transcripts alone.

    ``transcripts[k][t]`` is what node k sent in round t (:attr:`WireTap.sent`). Messages start with the numerator
    (exact) or the compressed payload; a trailing push-sum weight is ignored. Compressed gossip is decoded with the
    public per-message keys, which needs one public copy per sender (a static graph).
    """
    compressor = _compressor(compressor)
    if compressor is not None and not topology.is_static:
        raise ValueError("the auditor decodes compressed gossip on static graphs only (one public copy per sender)")
    n, rounds, d = len(transcripts), len(transcripts[0]), x0.numel()
    gamma = consensus_step if compressor is not None else 1.0
    x0 = x0.detach().to(torch.float64)
    copies = [x0.clone() for _ in range(n)]  # xhat_k (exact messages: the last message)
    public = [x0.clone() for _ in range(n)]  # P_k(t)
    cumulative = torch.zeros(n, rounds + 1, d, dtype=torch.float64)  # G_k(t - 1), G_k(-1) = 0
    spec_length = len(compressor.payload_spec(d)) if compressor is not None else 1
    for t in range(rounds):
        fresh = []  # the coordinates each node's message of round t carried
        for k in range(n):
            message = _one_message(transcripts[k][t], k, t)[:spec_length]
            if compressor is None:
                copies[k] = message[0].to(torch.float64)
                fresh.append(slice(None))
            else:
                key = message_key(seed, k, BROADCAST, t)
                update = compressor.decode(message, d, key, dtype=message[0].dtype).to(torch.float64)
                copies[k] += update
                fresh.append(update != 0)
        for k in range(n):
            cumulative[k, t + 1] = cumulative[k, t]
            cumulative[k, t + 1, fresh[k]] = ((public[k] - copies[k]) / lr)[fresh[k]]
        for k in range(n):
            plan = plan_round(topology, k, t)
            correction = -sum(plan.out_weights.values()) * copies[k]
            for j in plan.in_peers:
                correction += plan.in_weights[j] * copies[j]
            public[k] += gamma * correction
    return cumulative.diff(dim=1)


@torch.no_grad()
def cpgt_observations(
    transcripts: Sequence[Sequence[Mapping[int, list[Tensor]]]],
    topology: Topology,
    node: int,
    *,
    dimension: int,
    alpha: float,
    compressor: Compressor | None = None,
    consensus_step: float = 1.0,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """What CPGT's messages (Algorithm 1) tell about node ``node``'s clipped gradients g_k.

    Returns ``(o_y, o_x, innovations)``:

    * ``o_y = y^a(0) = g_0 + eta_y(0)``, the first tracker message;
    * ``o_x = g_0 - eta_x(1) / alpha``, from the state messages: ``x^a(1) - x^a(0) - gamma sum_j w_ij (x^c_j(0) -
      x^c_i(0)) + alpha y^a(0) = alpha eta_y(0) + eta_x(1)``, independent of ``o_y``;
    * ``innovations[k] = y^a(k) - y^a(k-1) - gamma sum_j w_ij (y^c_j(k-1) - y^c_i(k-1)) = g_k - g_(k-1) +
      eta_y(k)`` for k >= 1 (row 0 is ``o_y``), each with Laplace noise of scale d_y q^k.

    When one example changes the gradient by a constant (Assumption 4: full batches of a linear-in-the-example loss)
    the innovations carry no signal and ``(o_y, o_x)`` hold everything; with Poisson mini-batches g_k - g_(k-1)
    moves with each sampling of the example, seen under ever smaller noise. Exact for uncompressed messages; with a
    compressor the replicas x^c, y^c stand in for x^a, y^a.
    """
    compressor = compressor if compressor is not None else Identity()
    spec_length = len(compressor.payload_spec(dimension))
    rounds = len(transcripts[node])
    replicas: dict[tuple[int, int], Tensor] = {}
    history: list[dict[tuple[int, int], Tensor]] = []
    for t in range(rounds):
        for k in range(len(transcripts)):
            message = _one_message(transcripts[k][t], k, t)
            for channel, payload in ((CHANNEL_X, message[:spec_length]), (CHANNEL_Y, message[spec_length:])):
                key = message_key(seed, k, channel, t)
                decoded = compressor.decode(payload, dimension, key, dtype=payload[0].dtype).to(torch.float64)
                replicas[(k, channel)] = replicas.get((k, channel), torch.zeros_like(decoded)) + decoded
        history.append(dict(replicas))
    matrix = topology.mixing_matrix(0)

    def consensus(t: int, channel: int) -> Tensor:
        total = torch.zeros(dimension, dtype=torch.float64)
        for j in topology.in_peers(node, 0):
            total += float(matrix[node, j]) * (history[t][(j, channel)] - history[t][(node, channel)])
        return total

    o_y = history[0][(node, CHANNEL_Y)]
    innovations = torch.stack([o_y] + [
        history[t][(node, CHANNEL_Y)] - history[t - 1][(node, CHANNEL_Y)] - consensus_step * consensus(t - 1, CHANNEL_Y)
        for t in range(1, rounds)
    ])
    residual = (history[1][(node, CHANNEL_X)] - history[0][(node, CHANNEL_X)]
                - consensus_step * consensus(0, CHANNEL_X) + alpha * o_y)
    return o_y, o_y - residual / alpha, innovations
