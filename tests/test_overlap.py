"""SGP's overlap (non-blocking gossip mixed tau steps late): mass conservation, exact delay, resume, real processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_privdec.algorithms import PushSumGossip
from lightning_privdec.comm import LoopbackNetwork, TorchDistributedExchange
from lightning_privdec.comm.base import TensorSpec
from lightning_privdec.comm.distributed import PeerFailureError, pack, unpack
from lightning_privdec.strategies import (
    CorrelatedNoiseStrategy,
    CPGTStrategy,
    DecentralizedPushSumStrategy,
    DecentralizedSGDStrategy,
    DPCSGPStrategy,
    DynD2PStrategy,
    PrivSGPStrategy,
    PrivSGPVRStrategy,
)
from lightning_privdec.topology import build_topology
from tests.multiprocess import die_with_parent, fit_digits_in_one_launch, relative_consensus_distance

D, LR = 41, 0.05


def start_points(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(D, generator=g, dtype=torch.float64) * (i + 1) for i in range(n)]


def update(rank: int, step: int) -> torch.Tensor:
    """A stand-in gradient, fixed per (node, step), so every run of the same schedule sees the same updates."""
    return torch.randn(D, generator=torch.Generator().manual_seed(1000 * rank + step), dtype=torch.float64)


def train(gossip: PushSumGossip, steps: range, lr: float) -> None:
    for k in steps:
        gossip.step(gossip.x - lr * update(gossip.rank, k))


def in_flight_mass(gossip: PushSumGossip) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j a_ij x_j and sum_j a_ij y_j over the messages the checkpoint state holds in flight for this node."""
    x, y = torch.zeros(D, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for flight in gossip.state_dict().get("in_flight", []):
        plan = gossip.plan(flight["round"])
        for j, (xj, yj) in flight["received"].items():
            x, y = x + plan.in_weights[j] * xj.cpu(), y + plan.in_weights[j] * yj.cpu()
    return x, y


def run(n, topology, steps, *, staleness, lr=0.0, state=None, x0=None):
    x0 = start_points(n) if x0 is None else x0

    def node(rank, exchange):
        gossip = PushSumGossip(x0[rank], rank=rank, topology=topology, exchange=exchange, staleness=staleness)
        if state is not None:
            gossip.load_state_dict(state[rank])
        train(gossip, steps, lr)
        return gossip

    return LoopbackNetwork(n).run(node)


@pytest.mark.parametrize("staleness", [1, 3])
def test_the_network_sum_changes_only_by_the_updates_and_nodes_reach_the_exact_average(staleness):
    n, steps = 6, 40
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    x0 = start_points(n)
    nodes = run(n, topology, range(steps), staleness=staleness, lr=LR, x0=x0)
    expected = sum(x0) - LR * sum(update(i, k) for i in range(n) for k in range(steps))
    held = [in_flight_mass(g) for g in nodes]
    assert all(float(y.sum()) > 0 for _, y in held)  # messages really are in flight at the end
    assert torch.allclose(sum(g.x for g in nodes) + sum(x for x, _ in held), expected, rtol=0, atol=1e-12)
    assert sum(float(g.y) + float(y) for g, (_, y) in zip(nodes, held)) == pytest.approx(n, abs=1e-12)
    for g in nodes:  # flush mixes them in: no mass lost
        g.flush()
    assert torch.allclose(sum(g.x for g in nodes), expected, rtol=0, atol=1e-12)
    # consensus on the exact average once the updates stop (lr = 0)
    average = sum(x0) / n
    for g in run(n, topology, range(300), staleness=staleness, x0=x0):
        assert torch.allclose(g.z, average, rtol=0, atol=1e-9)


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_every_round_is_mixed_exactly_tau_steps_late(staleness):
    """Dense reference: v(k) = D(k-1) v(k-1) + O(k-tau) v(k-tau), A(k) = D(k) + O(k) (diagonal + off-diagonal)."""
    n, steps = 5, 12
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    x0 = start_points(n)
    v, w = [torch.stack(x0)], [torch.ones(n, 1, dtype=torch.float64)]
    for k in range(1, steps):
        a = torch.as_tensor(topology.mixing_matrix(k - 1), dtype=torch.float64)
        v.append(torch.diag(a).unsqueeze(1) * v[k - 1])
        w.append(torch.diag(a).unsqueeze(1) * w[k - 1])
        if k - staleness >= 0:
            a_late = torch.as_tensor(topology.mixing_matrix(k - staleness), dtype=torch.float64)
            off = a_late - torch.diag(torch.diag(a_late))
            v[k], w[k] = v[k] + off @ v[k - staleness], w[k] + off @ w[k - staleness]
    nodes = run(n, topology, range(steps), staleness=staleness, x0=x0)
    for i, g in enumerate(nodes):
        assert torch.allclose(g.z, v[-1][i] / w[-1][i], rtol=1e-12, atol=0)
        assert g.round == steps and len(g.in_flight) == staleness


def test_overlap_with_tau_1_is_synchronous_push_sum_one_step_behind():
    n = 6
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    overlap = run(n, topology, range(30), staleness=1)
    synchronous = run(n, topology, range(29), staleness=0)
    for a, b in zip(overlap, synchronous):
        assert torch.allclose(a.z, b.z, rtol=1e-13, atol=0)


def test_overlap_is_refused_where_delayed_mixing_is_not_sound():
    private = dict(max_grad_norm=1.0, noise_multiplier=1.0)
    assert DecentralizedPushSumStrategy().staleness == 0  # the default gossips synchronously
    assert DecentralizedPushSumStrategy(overlap=True, staleness=2).staleness == 2
    # noise is added before anything is sent: when a message is mixed is post-processing
    assert PrivSGPStrategy(overlap=True, **private).staleness == 1
    assert PrivSGPVRStrategy(overlap=True, **private).staleness == 1
    assert DynD2PStrategy(overlap=True, max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5).staleness == 1
    for make, message in [
        (lambda: DecentralizedSGDStrategy(overlap=True), "push-sum weight"),
        (lambda: DecentralizedPushSumStrategy(compressor="randk:0.1", overlap=True), "error-feedback"),
        (lambda: DPCSGPStrategy(overlap=True, **private), "PrivSGPStrategy"),
        (lambda: CorrelatedNoiseStrategy(overlap=True, max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0), "weight"),
        (lambda: CPGTStrategy(overlap=True, noise_decay=0.5, lipschitz=0.1, max_grad_norm=1.0, noise_x=0.1,
                              noise_y=0.1), "weight"),
        (lambda: DecentralizedPushSumStrategy(staleness=2), "only applies with overlap=True"),
        (lambda: DecentralizedPushSumStrategy(overlap=True, staleness=0), "int >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            make()
    no_self_weight = build_topology("directed-ring", 3, weights="push-sum")
    no_self_weight.mixing_matrix = lambda k: torch.tensor([[0.0, 0, 1], [1, 0, 0], [0, 1, 0]])  # a_ii = 0
    with pytest.raises(ValueError, match="a_ii = 0"):
        LoopbackNetwork(3).run(
            lambda r, ex: PushSumGossip(torch.zeros(2), rank=r, topology=no_self_weight, exchange=ex, staleness=1)
        )


# ---- real processes -------------------------------------------------------------------------------------------------
def _gloo_node(rank: int, world: int, init: str, out: str, device: str = "cpu") -> None:
    die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    topology = build_topology("exponential-one-peer", world, weights="push-sum")
    results = {}
    # 0: blocking rounds through the exchange's reused per-peer buffers; (tau, "deferred"): each round posted only
    # after the next step's collective, as the strategies post it after Lightning's per-step broadcast
    for staleness in (0, 1, 2, (1, "deferred"), (2, "deferred")):
        tau, deferred = staleness if isinstance(staleness, tuple) else (staleness, None)
        exchange = TorchDistributedExchange(torch.device(device), defer_posts=deferred is not None)
        gossip = PushSumGossip(start_points(world)[rank].to(device), rank=rank, topology=topology,
                               exchange=exchange, staleness=tau)
        for k in range(25):
            gossip.step(gossip.x - LR * update(rank, k).to(device))
            assert bool(exchange._deferred) == (deferred is not None)  # the round is posted now or after the collective
            dist.all_reduce(torch.ones(1))  # a collective while messages are in flight, as Lightning does per step
            exchange.post_deferred()
        assert gossip.x.device.type == torch.device(device).type and exchange.wire_device == torch.device("cpu")
        assert (exchange.wire_device != exchange.device) == (device != "cpu")  # staged through host buffers
        results[staleness] = (gossip.x.cpu(), gossip.y.cpu(), in_flight_mass(gossip))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", ["cpu", "cpu:0", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_gloo_processes_mix_exactly_like_the_loopback_simulation(device: str, tmp_path):
    """On CPU bit for bit; "cpu:0" is not gloo's wire device ("cpu"), so its messages take the host-staging path of
    CUDA ranks on gloo (copied to host buffers and back), bit for bit too; with CUDA tensors (several gloo ranks
    sharing one GPU) to float rounding."""
    world = 3
    # fork: the children start with this process's imports instead of loading torch and Lightning again (CUDA
    # cannot be used in a forked child once this process has used it: spawn then)
    mp.start_processes(_gloo_node, args=(world, f"file://{tmp_path}/rendezvous", str(tmp_path), device), nprocs=world,
                       start_method="spawn" if device == "cuda" else "fork")
    topology = build_topology("exponential-one-peer", world, weights="push-sum")

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6) if device == "cuda" else torch.equal(a, b)

    for staleness in (0, 1, 2, (1, "deferred"), (2, "deferred")):
        tau = staleness[0] if isinstance(staleness, tuple) else staleness
        simulated = run(world, topology, range(25), staleness=tau, lr=LR)
        for rank, g in enumerate(simulated):
            x, y, (in_x, in_y) = torch.load(tmp_path / f"rank{rank}.pt")[staleness]
            assert same(x, g.x) and same(y, g.y)
            assert same(in_x, in_flight_mass(g)[0]) and same(in_y, in_flight_mass(g)[1])


@pytest.mark.multiprocess
def test_lightning_overlap_trains_and_resumes_with_messages_in_flight_exactly(tmp_path):
    common = ["--strategy-kwargs", '{"overlap": true}', "--max-epochs", "3", "--lr", "0.2"]
    straight, resumed = fit_digits_in_one_launch(
        (tmp_path / "straight", [*common, "--ckpt-dir", str(tmp_path / "ckpt")]),
        (tmp_path / "resumed", [*common, "--resume", str(tmp_path / "ckpt" / "epoch=0-*.ckpt")]), devices=2)
    d = straight[0]["params"].numel()
    for a, b in zip(straight, resumed):
        assert a["test_acc"] > 0.85 and a["rounds"] == a["global_step"] > 0
        assert a["bytes_sent"] == a["rounds"] * (4 * d + 8)  # one dense message (x and y) per round
        assert torch.equal(a["params"], b["params"]), f"node {a['rank']} diverged after resume"
    assert relative_consensus_distance(straight) < 0.02


def test_an_overlapping_strategy_posts_each_round_at_the_next_batch_start(tmp_path):
    """With overlap the strategy's exchange defers a step's round until the next batch starts: after Lightning's
    per-step broadcast from rank 0, so that the broadcast never waits behind the round's bytes on a busy link."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    overlapping, blocking = DecentralizedPushSumStrategy(overlap=True), DecentralizedPushSumStrategy()
    for strategy in (overlapping, blocking):
        strategy.parallel_devices = [torch.device("cpu")]
    exchange = overlapping.make_exchange()
    assert exchange.defer_posts and not blocking.make_exchange().defer_posts
    posted = []
    exchange.post_deferred = lambda: posted.append(True)
    overlapping.gossip = SimpleNamespace(exchange=exchange)
    overlapping.on_train_batch_start(batch=None, batch_idx=0)
    assert posted == [True]


def test_a_deferred_round_whose_post_failed_fails_its_wait_too(tmp_path, monkeypatch):
    """A round whose deferred post raised (a neighbour already gone) never hands back its empty receive buffers as
    messages: its wait raises the same error."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    exchange = TorchDistributedExchange(torch.device("cpu"), defer_posts=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise PeerFailureError.during_round(0, [1], RuntimeError("Connection closed by peer"))

    monkeypatch.setattr(exchange, "_post", refuse)
    pending = exchange.start({}, {})
    with pytest.raises(PeerFailureError, match="lost contact"):
        exchange.post_deferred()
    with pytest.raises(PeerFailureError, match="lost contact"):
        pending.wait()


def test_a_started_round_reuses_its_tags_buffers_once_the_last_round_of_that_tag_was_waited(tmp_path, monkeypatch):
    """Started rounds keep one set of send and receive buffers per tag (no fresh model-sized buffers, and their page
    faults, every round); a tag's set is taken again only after its last round was waited for, and what a round
    sends is copied at once, whatever the caller then does to its tensors."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    exchange = TorchDistributedExchange(torch.device("cpu"))
    exchange.world_size = 3  # peers 1 and 2 exist for the buffers' sake only: nothing is posted
    posted = []
    monkeypatch.setattr(exchange, "_post", lambda send, recv, tag: posted.append((send, recv)) or [])
    x, y = torch.arange(6.0), torch.ones(1, dtype=torch.float64)
    specs = {2: [TensorSpec.of(x), TensorSpec.of(y)]}
    first = exchange.start({1: [x, y]}, specs, tag=0)
    second = exchange.start({1: [x, y]}, specs, tag=1)  # in flight beside the first: buffers of its own
    x.add_(1.0)
    assert torch.equal(unpack(posted[0][0][1], specs[2])[0], torch.arange(6.0))  # sent as it was at the start
    assert posted[1][0][1].data_ptr() != posted[0][0][1].data_ptr()
    posted[0][1][2].copy_(pack([torch.full((6,), 7.0), y]))  # round 0's message arrives
    assert torch.equal(first.wait()[2][0], torch.full((6,), 7.0))
    exchange.start({1: [x, y]}, specs, tag=0)  # tag 0 is free again: its buffers
    assert [b.data_ptr() for b in (posted[2][0][1], posted[2][1][2])] == [
        b.data_ptr() for b in (posted[0][0][1], posted[0][1][2])]
    exchange.start({1: [x, y]}, specs, tag=1)  # tag 1's round is still in flight: fresh buffers
    assert posted[3][0][1].data_ptr() != posted[1][0][1].data_ptr()
    assert posted[3][1][2].data_ptr() != posted[1][1][2].data_ptr()
    posted[1][1][2].copy_(pack([torch.full((6,), 5.0), y]))  # round 1's message arrives (its buffer is uninitialised)
    assert torch.equal(second.wait()[2][0], torch.full((6,), 5.0))
    exchange.start({1: [x]}, {2: specs[2][:1]}, tag=1)  # one tensor: copied into the kept buffer, not sent from x
    assert posted[4][0][1].data_ptr() != x.data_ptr() and torch.equal(posted[4][0][1].view(torch.float32), x)


class _ClonedMixing(PushSumGossip):
    """The overlap's mixing as it was written before its kept vector: ``x.clone()``, then one ``add_`` per message."""

    def _mix_in_flight(self, x, y, through_round):  # noqa: ANN001, ANN202
        mixed = x
        while self.in_flight and self.in_flight[0].round <= through_round:
            flight = self.in_flight.popleft()
            plan = self.plan(flight.round)
            received = flight.messages.wait()
            if mixed is x:
                mixed = x.clone()
            for j in plan.in_peers:
                mixed.add_(received[j][0], alpha=plan.in_weights[j])
                y = y + plan.in_weights[j] * received[j][-1]
        return mixed, y

    def flush(self) -> None:
        self.x, self.y = self._mix_in_flight(self.x, self.y, through_round=self.round)


@pytest.mark.parametrize("staleness", [1, 2])
def test_the_overlaps_kept_mixing_vector_gives_the_bits_of_clone_and_add(staleness):
    """float32 (the compiled weighted sum where it builds): the mixed numerator written into a kept vector gives
    ``clone`` + ``add_``'s bits where torch's adds fuse their multiply-add (else within float32 rounding), and the
    vector is reused, not re-allocated, every round."""
    from lightning_privdec.algorithms.weighted_sum import _torch_weighted_sum, weighted_sum_into

    a, b = torch.randn(3001), torch.randn(3001)
    exact = torch.equal(weighted_sum_into(torch.empty(3001), [(a, 1.0), (b, 0.3)]),
                        _torch_weighted_sum(torch.empty(3001), [(a, 1.0), (b, 0.3)]))
    topology = build_topology("exponential-one-peer", 4, weights="push-sum")
    kept = {}

    def run(gossip_class):  # noqa: ANN001, ANN202
        def node(rank, exchange):  # noqa: ANN001, ANN202
            generator = torch.Generator().manual_seed(rank)
            gossip = gossip_class(torch.randn(3001, generator=generator), rank=rank, topology=topology,
                                  exchange=exchange, staleness=staleness)
            for k in range(9):
                gossip.step(gossip.x - 0.01 * torch.randn(3001, generator=generator))
                if gossip_class is PushSumGossip and k >= staleness:
                    kept.setdefault(rank, []).append(gossip.workspace._tensors["mixed"])  # held: no id reused
            gossip.flush()
            return gossip.x, gossip.y

        return LoopbackNetwork(4).run(node)

    for (x, y), (x_ref, y_ref) in zip(run(PushSumGossip), run(_ClonedMixing)):
        assert torch.equal(y, y_ref)
        assert torch.equal(x, x_ref) if exact else torch.allclose(x, x_ref, rtol=1e-5, atol=1e-6)
    assert len(kept) == 4 and all(all(v is vectors[0] for v in vectors) for vectors in kept.values())
