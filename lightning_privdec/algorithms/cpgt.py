"""CPGT: Compressed differentially Private Gradient Tracking (Xie, Yi, Wang, Cao, Ren), Algorithm 1, one agent i:

    init  x_i(0) given; replicas x_j^c(-1) = y_j^c(-1) = 0 for j = i and every neighbour; y_i(0) = grad f_i(x_i(0))
    5     eta_x ~ Lap_d(d_x q^k),  eta_y ~ Lap_d(d_y q^k)                        (this node's own generator)
    6     x_i^a = x_i(k) + eta_x,  y_i^a = y_i(k) + eta_y                                            (5)-(6)
    7     send C(x_i^a - x_i^c(k-1)) and C(y_i^a - y_i^c(k-1)) to every neighbour    (the only messages)
    8     receive C(x_j^a - x_j^c(k-1)), C(y_j^a - y_j^c(k-1)) from every neighbour j
    9     x_j^c(k) = x_j^c(k-1) + C(.),  y_j^c(k) = y_j^c(k-1) + C(.)   for j = i and every neighbour    (11)-(12)
    10    x_i(k+1) = x_i^a + gamma sum_j w_ij (x_j^c(k) - x_i^c(k)) - alpha y_i(k)                      (9)
          y_i(k+1) = y_i^a + gamma sum_j w_ij (y_j^c(k) - y_i^c(k)) + grad f_i(x_i(k+1)) - grad f_i(x_i(k))  (10)

W is doubly stochastic on a static undirected graph. With C = identity and gamma = 1 this is DiaDSP (Ding et al.
2021): x_i(k+1) = sum_j w_ij x_j^a - alpha y_i(k), eq. (7).

One gradient per round: :meth:`CPGTGossip.track` takes g_k = grad f_i(x_i(k)) and returns y_i(k) = u_i(k) + g_k,
where u_i(k+1) = y_i^a + gamma sum_j w_ij (y_j^c - y_i^c) - g_k is kept from the previous round (u_i(0) = 0 gives
y_i(0) = g_0). The descent x_i(k) - alpha y_i(k) is left to the caller (plain SGD with lr = alpha on p.grad = y(k)
in the Lightning strategy); :meth:`CPGTGossip.step` then adds the noise and the consensus term of line 10.

The compressor's randomness is keyed by public (seed, sender, channel, round) integers: independent of the data
and of the noise, so compression is post-processing (Theorem 2's proof shares it between the coupled runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_privdec.algorithms.consensus_step import ConsensusStep, choose_consensus_step
from lightning_privdec.algorithms.mixing import message_key
from lightning_privdec.comm import Exchange, TensorSpec
from lightning_privdec.compression import Compressor, Identity
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator
from lightning_privdec.topology import Topology, TopologyError

__all__ = ["CHANNEL_X", "CHANNEL_Y", "CPGTGossip", "laplace_noise"]

CHANNEL_X, CHANNEL_Y = 0, 1  # compressor keys of the two messages of a round
NOISE_STREAM = "cpgt-laplace"


def laplace_noise(
    numel: int, scale: float, generator: NoiseGenerator, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Lap_d(scale): d i.i.d. Laplace(scale) entries from this agent's secret ``generator`` (ChaCha20,
    :meth:`~lightning_privdec.privacy.noise.NoiseGenerator.laplace`), on the generator's device."""
    return generator.laplace(numel, scale, dtype)


class CPGTGossip:
    """One agent's CPGT state: x_i, u_i, the replicas x_j^c, y_j^c (j = i and neighbours) and a round counter.

    Args:
        x: x_i(0), flat (the gossip keeps its own copy).
        rank: this agent's id.
        topology: static, undirected; ``mixing_matrix(0)`` must be doubly stochastic (e.g. Metropolis weights).
        exchange: moves the messages (torch.distributed or loopback).
        compressor: C; ``None`` or :class:`Identity` sends the differences uncompressed.
        consensus_step: gamma > 0, or ``"auto"`` (:mod:`lightning_privdec.algorithms.consensus_step`: 1 without
            compression).
        noise_x, noise_y: d_x, d_y >= 0 (0: no noise on that variable, not private).
        noise_decay: q in (0, 1].
        noise_seed: ``None`` (default): the Laplace noise comes from OS entropy, unknown to everyone else; an int:
            reproducible noise derived from (seed, rank), for tests only.
        seed: shared by all agents; keys the compressor's randomness.
    """

    def __init__(
        self,
        x: Tensor,
        *,
        rank: int,
        topology: Topology,
        exchange: Exchange,
        compressor: Compressor | None = None,
        consensus_step: float | str = 1.0,
        noise_x: float,
        noise_y: float,
        noise_decay: float,
        noise_seed: int | None = None,
        seed: int = 0,
    ) -> None:
        if x.dim() != 1:
            raise ValueError(f"CPGT gossips one flat vector; got shape {tuple(x.shape)}")
        if not topology.is_static or not topology.is_symmetric:
            raise TopologyError(
                f"CPGT needs a static undirected graph (Assumption 2); topology {topology.name!r} is "
                f"{'time-varying' if not topology.is_static else 'directed'}. Use 'ring', 'torus', 'complete' or an "
                "nx.Graph"
            )
        self.consensus_step_choice: ConsensusStep | None = None  # how "auto" chose gamma (None when given)
        if consensus_step == "auto":
            self.consensus_step_choice = choose_consensus_step(compressor, topology, x.numel())
            consensus_step = self.consensus_step_choice.gamma
        if isinstance(consensus_step, bool) or not isinstance(consensus_step, (int, float)) or not consensus_step > 0:
            raise ValueError(f"consensus_step (gamma) must be 'auto' or a number > 0, got {consensus_step!r}")
        if not 0.0 < noise_decay <= 1.0:
            raise ValueError(f"noise_decay (q) must lie in (0, 1], got {noise_decay}")
        self.rank = rank
        self.topology = topology
        self.exchange = exchange
        self.compressor: Compressor = Identity() if compressor is None else compressor
        self.gamma = float(consensus_step)
        self.seed = seed
        self.noise_seed = noise_seed
        self.noise_decay = float(noise_decay)
        self.set_noise(noise_x, noise_y)
        self.generator = node_noise_generator(x.device, noise_seed, rank, stream=NOISE_STREAM)
        matrix = topology.mixing_matrix(0)
        self.neighbours = tuple(topology.in_peers(rank, 0))
        self.weights = {j: float(matrix[rank, j]) for j in self.neighbours}  # w_ij
        self.round = 0
        self.x = x.detach().clone()  # x_i(k), the clean state
        self.u = torch.zeros_like(self.x)  # u_i(k) = y_i(k) - grad f_i(x_i(k)); u_i(0) = 0
        self.y: Tensor | None = None  # y_i(k), set by track()
        self._grad: Tensor | None = None  # grad f_i(x_i(k)), set by track()
        zeros = torch.zeros_like(self.x)
        self.x_copies = {j: zeros.clone() for j in (rank, *self.neighbours)}  # x_j^c(k-1)
        self.y_copies = {j: zeros.clone() for j in (rank, *self.neighbours)}  # y_j^c(k-1)
        self.last_noise: tuple[Tensor, Tensor] | None = None  # (eta_x(k), eta_y(k)) of the last round, diagnostics

    def set_noise(self, noise_x: float, noise_y: float) -> None:
        """d_x and d_y (both >= 0); the strategy sets them once they are calibrated."""
        if not (noise_x >= 0 and noise_y >= 0):
            raise ValueError(f"noise scales must be >= 0, got noise_x={noise_x}, noise_y={noise_y}")
        self.noise_x, self.noise_y = float(noise_x), float(noise_y)

    # ----------------------------------------------------------------------------------------------------------------
    @property
    def dimension(self) -> int:
        return self.x.numel()

    def uncompressed_message_nbytes(self) -> int:
        """Bytes of one message without compression: the state and the tracker differences, d values each."""
        return 2 * self.x.numel() * self.x.element_size()

    @property
    def z(self) -> Tensor:
        """The model to evaluate gradients at: x_i(k) itself (no push-sum weight)."""
        return self.x.clone()

    def debias_into(self, out: Tensor) -> None:
        """Write x_i(k) into ``out`` (the module's parameters): gradients are taken at the clean state."""
        out.copy_(self.x)

    def track(self, grad: Tensor) -> Tensor:
        """y_i(k) = u_i(k) + grad f_i(x_i(k)) (line 10, second half, with y_i(0) = grad f_i(x_i(0))); returns y_i(k)."""
        self._grad = grad.detach().to(self.x.dtype).clone()
        self.y = self.u + self._grad
        return self.y

    # ----------------------------------------------------------------------------------------------------------------
    def step(self, x_half: Tensor) -> None:
        """One round, lines 5-10, given x_half = x_i(k) - alpha y_i(k) (the caller's descent step)."""
        if self.y is None or self._grad is None:
            raise RuntimeError("CPGTGossip.step needs track(grad f_i(x_i(k))) first, once per round")
        k, d, dtype = self.round, self.dimension, self.x.dtype
        decay = self.noise_decay**k
        # Lines 5-6: eta ~ Lap_d(d q^k); x^a = x + eta_x, y^a = y + eta_y
        eta_x = laplace_noise(d, self.noise_x * decay, self.generator, dtype).to(self.x.device)
        eta_y = laplace_noise(d, self.noise_y * decay, self.generator, dtype).to(self.x.device)
        x_a, y_a = self.x + eta_x, self.y + eta_y
        # Line 7: the compressed differences are the only messages
        payload_x = self._compress(x_a - self.x_copies[self.rank], CHANNEL_X)
        payload_y = self._compress(y_a - self.y_copies[self.rank], CHANNEL_Y)
        # Line 8: exchange with every neighbour (undirected: in-peers = out-peers)
        spec = [TensorSpec(tuple(s), dt) for s, dt in self.compressor.payload_spec(d, dtype)]
        received = self.exchange.exchange(
            {j: [*payload_x, *payload_y] for j in self.neighbours}, {j: spec + spec for j in self.neighbours}
        )
        # Line 9 (11)-(12): x_j^c(k) = x_j^c(k-1) + C(.), y_j^c(k) likewise, for j = i and every neighbour
        self._add_to_copies(self.rank, payload_x, payload_y)
        for j in self.neighbours:
            self._add_to_copies(j, received[j][: len(spec)], received[j][len(spec) :], sender=j)
        # Line 10 (9): x(k+1) = x^a + gamma sum_j w_ij (x_j^c - x_i^c) - alpha y(k), alpha y(k) = x(k) - x_half
        descent = self.x - x_half.to(dtype)
        x_next = x_a + self.gamma * self._consensus(self.x_copies) - descent
        # Line 10 (10), all but grad f_i(x(k+1)): u(k+1) = y^a + gamma sum_j w_ij (y_j^c - y_i^c) - grad f_i(x(k))
        self.u = y_a + self.gamma * self._consensus(self.y_copies) - self._grad
        self.x = x_next
        self.y = self._grad = None
        self.last_noise = (eta_x, eta_y)
        self.round += 1

    def _compress(self, difference: Tensor, channel: int) -> list[Tensor]:
        return self.compressor.encode(difference, message_key(self.seed, self.rank, channel, self.round))

    def _add_to_copies(
        self, j: int, payload_x: list[Tensor], payload_y: list[Tensor], sender: int | None = None
    ) -> None:
        sender = self.rank if sender is None else sender
        d, dtype = self.dimension, self.x.dtype
        for copies, payload, channel in ((self.x_copies, payload_x, CHANNEL_X), (self.y_copies, payload_y, CHANNEL_Y)):
            key = message_key(self.seed, sender, channel, self.round)
            copies[j].add_(self.compressor.decode(payload, d, key, dtype=dtype))

    def _consensus(self, copies: Mapping[int, Tensor]) -> Tensor:
        """sum_j w_ij (c_j - c_i) over the neighbours (the j = i term is zero)."""
        total = torch.zeros_like(self.x)
        for j in self.neighbours:
            total.add_(copies[j] - copies[self.rank], alpha=self.weights[j])
        return total

    # ---- checkpointing ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Round, x, u, every replica and the traffic; the noise generator's draw count only with a fixed
        ``noise_seed`` (a secure generator's key is never saved)."""
        state: dict[str, Any] = {
            "round": self.round,
            "x": self.x.detach().cpu().clone(),
            "u": self.u.detach().cpu().clone(),
            "x_copies": {j: t.detach().cpu().clone() for j, t in self.x_copies.items()},
            "y_copies": {j: t.detach().cpu().clone() for j, t in self.y_copies.items()},
            "noise": [self.noise_x, self.noise_y, self.noise_decay],
            "traffic": self.exchange.traffic.state_dict(),
        }
        if self.noise_seed is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        device = self.x.device
        self.round = int(state["round"])
        self.x = state["x"].to(device=device, dtype=self.x.dtype).clone()
        self.u = state["u"].to(device=device, dtype=self.x.dtype).clone()
        self.x_copies = {int(j): t.to(device).clone() for j, t in state["x_copies"].items()}
        self.y_copies = {int(j): t.to(device).clone() for j, t in state["y_copies"].items()}
        noise_x, noise_y, self.noise_decay = (float(v) for v in state["noise"])
        self.set_noise(noise_x, noise_y)
        self.y = self._grad = None
        self.exchange.traffic.load_state_dict(state["traffic"])
        if self.noise_seed is not None and "generator" in state:
            self.generator.set_state(state["generator"])
