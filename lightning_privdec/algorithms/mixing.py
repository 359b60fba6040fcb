"""Push-sum gossip of one flat vector, exact or compressed with error feedback.

Exact: Stochastic Gradient Push (Assran et al. 2019, Alg. 1): every node keeps a numerator x_i and a weight y_i,
mixes both with the round's column-stochastic matrix A(k), and evaluates gradients at the de-biased z_i = x_i / y_i:

    x_i <- sum_{j in N_in(i) + i} a_ij x_j        y_i <- sum_{j in N_in(i) + i} a_ij y_j

Compressed: DP-CSGP (Zhu et al.), Algorithm 1, lines 1-7 (CHOCO-style error feedback with public copies x_hat):

    1  q_i = Q(x_i - x_hat_i)                          (compress)
    2  send {q_i, y_i} to out-neighbours
    3  receive {q_j, y_j} from in-neighbours
    4  x_hat_j += q_j for j in N_in(i) + i
    5  w_i = x_i - x_hat_i + sum_j a_ij x_hat_j
    6  y_i = sum_j a_ij y_j
    7  z_i = w_i / y_i

Line 5 keeps the network sum of x exact whatever Q does, because the columns of A sum to one. On a time-varying
graph a node's out-neighbours change, so one shared x_hat_i would go stale at nodes that did not hear the last
update; there each directed edge (i -> k) keeps its own copy x_hat_ik, held identically by both ends and updated only
in the rounds the edge is active, and line 5 becomes

    5' w_i = a_ii x_i + sum_k a_ki (x_i - x_hat_ik) + sum_j a_ij x_hat_ji

which is line 5 exactly when all out-edges share one copy, and again conserves the sum. Written as a correction,
line 5 is w_i = x_i + gamma (sum_j a_ij x_hat_j - sum_k a_ki x_hat_ik): DP-CSGP fixes gamma = 1; CHOCO-SGD's
consensus step gamma < 1 (Koloskova et al. 2019) keeps aggressive compressors stable, and then y is mixed with the
same effective matrix I + gamma (A - I), so z = x / y stays unbiased. With
``push_sum_weight=False`` the weight is neither sent nor mixed (y = 1): plain D-PSGD for doubly-stochastic A.

Overlap (SGP's overlap variant, Assran et al. 2019, with bounded staleness tau >= 1): round k's messages are posted
without waiting and mixed in tau steps later, so their transfer runs during the next tau forward/backward passes.
At step k, with v_i = x_i^{k+1/2}:

    v_i += sum_j a_ij(r) x_j(r),  w_i = y_i + sum_j a_ij(r) y_j(r)   for the rounds r <= k - tau still in flight
    send {v_i, w_i} to out-neighbours (non-blocking)
    x_i = a_ii(k) v_i,  y_i = a_ii(k) w_i,  z_i = x_i / y_i = v_i / w_i

The network sum of x plus the messages in flight changes only by the local updates, and of y plus the weights in
flight stays n, so z_i still reaches the exact average; every round is mixed exactly tau steps late (the paper's
bound, always met), which keeps a run deterministic and resumable bit for bit. Overlap needs exact messages and the
push-sum weight: a delayed message leaves the sender with its share a_ii x_i, which only y de-biases.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_privdec.algorithms.consensus_step import ConsensusStep, check_consensus_step, choose_consensus_step
from lightning_privdec.algorithms.weighted_sum import weighted_sum_into
from lightning_privdec.comm import Exchange, PendingRound, TensorSpec
from lightning_privdec.compression import Compressor, Identity, Workspace
from lightning_privdec.topology import Topology

BROADCAST = -1  # channel id of the one public copy a node shares with all its out-neighbours on a static graph
_MASK64 = (1 << 64) - 1


def message_key(seed: int, sender: int, channel: int, round_: int) -> int:
    """A 63-bit key shared by sender and receiver of one message (splitmix64 over the identifying integers)."""
    h = seed & _MASK64
    for value in (sender, channel, round_):
        h = (h + 0x9E3779B97F4A7C15 + (value & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


@dataclass(frozen=True)
class RoundPlan:
    """Who node i talks to in one round, and the mixing weights it needs (from row i and column i of A(k))."""

    in_peers: tuple[int, ...]
    out_peers: tuple[int, ...]
    self_weight: float  # a_ii
    in_weights: dict[int, float]  # a_ij: how much of sender j's message node i keeps
    out_weights: dict[int, float]  # a_ki: how much of node i's message receiver k keeps


def plan_round(topology: Topology, rank: int, round_: int) -> RoundPlan:
    """Read node ``rank``'s part of round ``round_`` from the topology."""
    matrix = topology.mixing_matrix(round_)
    in_peers = tuple(topology.in_peers(rank, round_))
    out_peers = tuple(topology.out_peers(rank, round_))
    return RoundPlan(
        in_peers=in_peers,
        out_peers=out_peers,
        self_weight=float(matrix[rank, rank]),
        in_weights={j: float(matrix[rank, j]) for j in in_peers},
        out_weights={k: float(matrix[k, rank]) for k in out_peers},
    )


@dataclass
class InFlight:
    """One round's messages posted but not yet mixed in (overlap)."""

    round: int
    messages: PendingRound


class PushSumGossip:
    """One node's push-sum state (x, y and, with compression, the public copies x_hat) and its gossip round.

    Args:
        x: this node's initial numerator x_i (flat, 1-D); the gossip keeps its own copy.
        rank: this node's id.
        topology: the communication schedule; ``mixing_matrix(k)`` must be column-stochastic (push-sum) or doubly
            stochastic (``push_sum_weight=False``).
        exchange: moves the messages (torch.distributed or loopback).
        compressor: ``None`` or ``Identity()`` for exact gossip, else the compressor of line 1.
        push_sum_weight: send and mix the weight y (push-sum); False gives D-PSGD.
        reference: the common starting value of every public copy x_hat. It must be identical at every node: the
            shared public initial parameters (keeps X - X_hat = 0 at t = 1), or zeros (the paper's choice) when the
            nodes start from different points.
        seed: shared by all nodes; keys the compressor's randomness per (sender, channel, round).
        consensus_step: gamma in (0, 1] of line 5 (1 = DP-CSGP exactly), or ``"auto"``: chosen from the compressor's
            omega^2 and the graph (:mod:`lightning_privdec.algorithms.consensus_step`); only used with a compressor.
        staleness: 0 (default) mixes every round's messages in the round itself; tau >= 1 overlaps each round with
            the next tau steps and mixes its messages tau steps late (exact push-sum only).
    """

    def __init__(
        self,
        x: Tensor,
        *,
        rank: int,
        topology: Topology,
        exchange: Exchange,
        compressor: Compressor | None = None,
        push_sum_weight: bool = True,
        reference: Tensor | None = None,
        seed: int = 0,
        consensus_step: float | str = 1.0,
        staleness: int = 0,
    ) -> None:
        if x.dim() != 1:
            raise ValueError(f"push-sum gossips one flat vector; got shape {tuple(x.shape)}")
        self.rank = rank
        self.topology = topology
        self.exchange = exchange
        self.compressor = None if compressor is None or isinstance(compressor, Identity) else compressor
        self.push_sum_weight = push_sum_weight
        consensus_step = check_consensus_step(consensus_step)
        self.seed = seed
        #: how "auto" chose gamma (None when gamma was given)
        self.consensus_step_choice: ConsensusStep | None = None
        if consensus_step == "auto":
            self.consensus_step_choice = choose_consensus_step(self.compressor, topology, x.numel())
            consensus_step = self.consensus_step_choice.gamma
        self.gamma = float(consensus_step) if self.compressor is not None else 1.0
        self.round = 0
        self.x = x.detach().clone()
        self.y = torch.ones(1, dtype=torch.float64, device=x.device)
        self.own_copies: dict[int, Tensor] = {}  # x_hat_i per channel (BROADCAST, or receiver id on time-varying graphs)
        self.neighbour_copies: dict[int, Tensor] = {}  # x_hat_j (or x_hat_ji) per in-neighbour j
        # what the public copies start at, until they are made (at the first round, after the first backward pass
        # and its one-off checks, or when a checkpoint is loaded): x itself in the usual case (no second vector)
        self._copies_start: Tensor | None = None
        self._copies_made = self.compressor is None
        if reference is not None and not torch.equal(reference, self.x):
            self._copies_start = reference.detach().clone()
        elif reference is not None:
            self._copies_start = self.x  # x is first written by the first round, after the copies are made
        self.workspace = Workspace()  # the compressor's scratch (with overlap, the mixed numerator), reused every round
        self._plans: dict[int, RoundPlan] = {}
        self.staleness = self._check_staleness(staleness)
        self.in_flight: deque[InFlight] = deque()  # overlap: posted rounds, oldest first

    def _check_staleness(self, staleness: int) -> int:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0 (0: no overlap); got {staleness!r}")
        if staleness == 0:
            return 0
        if self.compressor is not None:
            raise ValueError(
                "overlap (staleness > 0) needs exact messages: compressed gossip's error-feedback copies x_hat assume "
                "every message is mixed in the round it was sent. Use compressor=None, or no overlap."
            )
        if not self.push_sum_weight:
            raise ValueError(
                "overlap (staleness > 0) needs the push-sum weight y: while its messages are in flight a node holds "
                "only its share a_ii x_i, which y de-biases. Use column-stochastic mixing with push_sum_weight=True."
            )
        for k in range(self.topology.period):
            if self.plan(k).self_weight <= 0.0:
                raise ValueError(
                    f"overlap (staleness > 0) needs every node to keep a share of its own mass, but a_ii = 0 for node "
                    f"{self.rank} in round {k}: while the messages are in flight it would hold nothing (z = 0 / 0). "
                    "Use mixing weights with a positive diagonal (e.g. weights='push-sum')."
                )
        return staleness

    # ----------------------------------------------------------------------------------------------------------------
    @property
    def z(self) -> Tensor:
        """The de-biased model z_i = x_i / y_i (a new tensor)."""
        return self.x / self.y.to(self.x.dtype)

    def debias_into(self, out: Tensor) -> None:
        """Write z_i = x_i / y_i into ``out`` (the module's parameter buffer) without allocating."""
        if self.debias_is_identity():
            out.copy_(self.x)  # x / 1, bit for bit, at the cost of a copy
        else:
            torch.div(self.x, self.y.to(self.x.dtype), out=out)

    def debias_is_identity(self) -> bool:
        """Whether :meth:`debias_into` writes x itself, bit for bit: y = 1.0 exactly (x / 1 is exact), which holds
        where the mixing weights' float64 sums are exactly 1 (the one-peer exponential graph on 2^k nodes, rings,
        D-PSGD without the weight); checked on the host only (no device sync)."""
        return self.x.device.type == "cpu" and float(self.y) == 1.0

    @property
    def dimension(self) -> int:
        return self.x.numel()

    def uncompressed_message_nbytes(self) -> int:
        """Bytes of one message of this gossip without compression: the numerator and, with push-sum, the weight."""
        return self.x.numel() * self.x.element_size() + (self.y.element_size() if self.push_sum_weight else 0)

    def plan(self, round_: int) -> RoundPlan:
        key = round_ % self.topology.period
        if key not in self._plans:
            self._plans[key] = plan_round(self.topology, self.rank, round_)
        return self._plans[key]

    # ----------------------------------------------------------------------------------------------------------------
    def step(self, x_half: Tensor) -> None:
        """One gossip round on x_i^{t+1/2} (the numerator after the local update); updates x, y and the copies."""
        plan = self.plan(self.round)
        if self.compressor is not None:
            self._compressed_round(x_half, plan)
        elif self.staleness:
            self._overlap_round(x_half, plan)
        else:
            self._exact_round(x_half, plan)
        self.round += 1

    def _weight_message(self) -> list[Tensor]:
        return [self.y] if self.push_sum_weight else []

    def _weight_specs(self) -> list[TensorSpec]:
        return [TensorSpec((1,), torch.float64)] if self.push_sum_weight else []

    def _mix_weights(self, plan: RoundPlan, received: Mapping[int, list[Tensor]]) -> None:
        """y_i <- y_i + gamma (sum_j a_ij y_j - y_i), i.e. y = A y when gamma = 1 (line 6)."""
        if not self.push_sum_weight:
            return
        mixed = self.y * plan.self_weight
        for j in plan.in_peers:
            mixed = mixed + plan.in_weights[j] * received[j][-1]
        self.y = self.y + self.gamma * (mixed - self.y)

    def _exact_round(self, x_half: Tensor, plan: RoundPlan) -> None:
        """SGP: send (x, y) to out-neighbours, then x_i = sum_j a_ij x_j and y_i = sum_j a_ij y_j."""
        message_specs = [TensorSpec.of(x_half), *self._weight_specs()]
        outgoing = {k: [x_half, *self._weight_message()] for k in plan.out_peers}
        received = self.exchange.exchange(outgoing, {j: message_specs for j in plan.in_peers})
        incoming = [(received[j][0], plan.in_weights[j]) for j in plan.in_peers]
        weighted_sum_into(self.x, [(x_half, plan.self_weight), *incoming])
        self._mix_weights(plan, received)

    # ---- overlap: SGP with non-blocking messages mixed tau steps late ----------------------------------------------
    def _overlap_round(self, x_half: Tensor, plan: RoundPlan) -> None:
        """Mix the rounds r <= k - tau into (v, w), post {v, w} without waiting, keep x = a_ii v and y = a_ii w."""
        v, w = self._mix_in_flight(x_half, self.y, through_round=self.round - self.staleness)
        message_specs = [TensorSpec.of(v), *self._weight_specs()]
        messages = self.exchange.start(
            {k: [v, w] for k in plan.out_peers},
            {j: message_specs for j in plan.in_peers},
            tag=self.round % (self.staleness + 1),  # the rounds in flight together never share a tag
        )
        self.in_flight.append(InFlight(self.round, messages))
        torch.mul(v, plan.self_weight, out=self.x)
        self.y = w * plan.self_weight

    def _mix_in_flight(self, x: Tensor, y: Tensor, through_round: int) -> tuple[Tensor, Tensor]:
        """x + sum_j a_ij(r) x_j(r) and y + sum_j a_ij(r) y_j(r) over the rounds r <= through_round in flight (waits
        for them, oldest first), the numerator in a vector kept for it (``x`` itself when no round is due); ``x`` is
        left unchanged."""
        mixed = x
        while self.in_flight and self.in_flight[0].round <= through_round:
            flight = self.in_flight.popleft()
            plan = self.plan(flight.round)
            received = flight.messages.wait()
            into = self.workspace.get("mixed", x.numel(), x.dtype, x.device).view_as(x) if mixed is x else mixed
            terms = [(received[j][0], plan.in_weights[j]) for j in plan.in_peers]
            mixed = weighted_sum_into(into, [(mixed, 1.0), *terms])  # as x.clone().add_(x_j, alpha=a_ij)... rounds
            for j in plan.in_peers:
                y = y + plan.in_weights[j] * received[j][-1]
        return mixed, y

    def flush(self) -> None:
        """Wait for every round still in flight and mix it in now (end of training): x and y then hold all the mass."""
        mixed, self.y = self._mix_in_flight(self.x, self.y, through_round=self.round)
        if mixed is not self.x:
            self.x.copy_(mixed)

    # ---- compressed: DP-CSGP Algorithm 1, lines 1-7 -----------------------------------------------------------------
    def _channel(self, receiver: int) -> int:
        """Which public copy of the sender an edge uses: one shared copy on a static graph, one per edge otherwise."""
        return BROADCAST if self.topology.is_static else receiver

    def _make_copies(self) -> None:
        """Every public copy this node will ever use, at the reference (or zeros): one per channel it sends on and
        one per node it hears from over the topology's period (docs/compression.md, "Memory per neighbour")."""
        if self._copies_made:
            return
        union = self.topology.union_graph()
        receivers = [k for k in union.successors(self.rank) if k != self.rank]
        senders = [j for j in union.predecessors(self.rank) if j != self.rank]
        start = self._copies_start
        for table, keys in ((self.own_copies, {self._channel(k) for k in receivers}), (self.neighbour_copies, senders)):
            for key in sorted(keys):
                table[key] = torch.zeros_like(self.x) if start is None else start.clone()
        self._copies_start, self._copies_made = None, True

    def _compressed_round(self, x_half: Tensor, plan: RoundPlan) -> None:
        """Lines 1-6 with no model-sized temporary: the compressor works in :attr:`workspace` and adds its decoded
        messages into the copies in place (a sparsifier touches only the kept coordinates)."""
        assert self.compressor is not None
        d, k = x_half.numel(), self.round
        compressor, workspace = self.compressor, self.workspace
        self._make_copies()
        # x is free until line 5 writes it (the strategy took x^{t+1/2} from it): the compressor's difference buffer
        workspace.lend("difference", self.x if self.x.data_ptr() != x_half.data_ptr() else None)
        # Lines 1 and 4 (j = i): q_i = Q(x_i - x_hat_i); x_hat_i += q_i. One payload per channel.
        payloads: dict[int, list[Tensor]] = {}
        for channel in {self._channel(receiver) for receiver in plan.out_peers}:
            key = message_key(self.seed, self.rank, channel, k)
            payloads[channel] = compressor.encode_feedback_(x_half, self.own_copies[channel], key, workspace)
        # Lines 2-3: send {q_i, y_i}; receive {q_j, y_j}.
        payload_specs = [TensorSpec(tuple(s), dt) for s, dt in compressor.payload_spec(d, x_half.dtype)]
        message_specs = payload_specs + self._weight_specs()
        outgoing = {r: [*payloads[self._channel(r)], *self._weight_message()] for r in plan.out_peers}
        received = self.exchange.exchange(outgoing, {j: message_specs for j in plan.in_peers})
        # Line 4: x_hat_j += q_j for every in-neighbour.
        for j in plan.in_peers:
            key = message_key(self.seed, j, self._channel(self.rank), k)
            payload = received[j][: len(payload_specs)]
            compressor.decode_add_(payload, self.neighbour_copies[j], key, workspace)
        # Line 5 (5' on time-varying graphs): w_i = x_i + gamma (sum_j a_ij x_hat_j - sum_k a_ki x_hat_ik),
        # where the first sum runs over in-neighbours and the second over the copies this node sent from: one
        # pass over all of them, straight into x.
        terms = [(x_half, 1.0)] + [(self.neighbour_copies[j], self.gamma * plan.in_weights[j]) for j in plan.in_peers]
        for channel in payloads:
            sent_weight = sum(a for r, a in plan.out_weights.items() if self._channel(r) == channel)
            terms.append((self.own_copies[channel], -self.gamma * sent_weight))
        weighted_sum_into(self.x, terms)
        # Line 6: y_i = sum_j a_ij y_j (the weight travels uncompressed).
        self._mix_weights(plan, received)

    # ---- checkpointing ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The node's state; with overlap it waits for the rounds in flight and keeps their messages, unmixed, so a
        resumed run mixes them at the same step as an uninterrupted one."""
        self._make_copies()
        state = {
            "round": self.round,
            "x": self.x.detach().cpu().clone(),
            "y": self.y.detach().cpu().clone(),
            "own_copies": {c: t.detach().cpu().clone() for c, t in self.own_copies.items()},
            "neighbour_copies": {j: t.detach().cpu().clone() for j, t in self.neighbour_copies.items()},
            "traffic": self.exchange.traffic.state_dict(),
        }
        if self.in_flight:
            state["in_flight"] = [
                {
                    "round": flight.round,
                    "received": {j: [t.detach().cpu().clone() for t in m] for j, m in flight.messages.wait().items()},
                }
                for flight in self.in_flight
            ]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        device = self.x.device
        self._make_copies()  # before x changes: a copy the checkpoint lacks was never used, so it is at the start
        self.round = int(state["round"])
        self.x.copy_(state["x"].to(device))
        self.y = state["y"].to(device=device, dtype=torch.float64).clone()
        for table, saved in ((self.own_copies, state["own_copies"]), (self.neighbour_copies, state["neighbour_copies"])):
            for key, t in saved.items():
                if int(key) in table:
                    table[int(key)].copy_(t)
                else:
                    table[int(key)] = t.to(device).clone()
        self.exchange.traffic.load_state_dict(state["traffic"])
        self.in_flight = deque(
            InFlight(
                int(flight["round"]),
                PendingRound.arrived({int(j): [t.to(device) for t in m] for j, m in flight["received"].items()}),
            )
            for flight in state.get("in_flight", [])
        )
        if not self.staleness:  # resumed without overlap: mix what the overlapping run left in flight now
            self.flush()
