"""Resuming from a checkpoint, in one process: each paper's node state, the gossip's state (messages in flight
included), the pairwise secrets, and the strategies' resume policy for the noise (keep, re-plan, refuse).

The resume after a crash between a release and its checkpoint is in tests/test_write_ahead_ledger.py; real
multi-process runs that resume are in the tests/test_*_multiprocess.py files (each with the run it resumes)."""

from __future__ import annotations

import io
import os
import re
import stat
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_privdec import DPCSGPStrategy, PrivacyConfigError
from lightning_privdec.algorithms import PushSumGossip
from lightning_privdec.algorithms.dyn_d2p import DynD2PNode, DynD2POptions
from lightning_privdec.algorithms.privsgp_vr import PrivSGPVRNode
from lightning_privdec.comm.loopback import LoopbackNetwork
from lightning_privdec.compression import RandK
from lightning_privdec.privacy.pairwise import CorrelatedNoise, simulate_key_agreement
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.privacy.accounting import GaussianRelease
from lightning_privdec.strategies import PrivSGPVRStrategy
from lightning_privdec.topology import build_topology
from tests.small_classifier import Classifier
from tests.test_dp_csgp import attached_node, loader, one_step
from tests.test_overlap import LR, in_flight_mass, run
from tests.test_pairwise import _run_with_key_files, edges, ring
from tests.test_dyn_d2p import node_loader, planned_node, take_step
from tests.test_privsgp_vr import (
    DELTA,
    STATE,
    attach_with_data,
    clip,
    fill,
    make_node,
    node_data,
    per_example_gradient,
    tensors_in,
    train,
)
from tests.test_push_sum_gossip import D, run_gossip, start_points
from tests.test_reliability import data, private, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:Total length of `DataLoader`"),
]


def tensors(obj: object, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested checkpoint, with its path of keys (dict keys, list positions, attributes)."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in tensors(v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in tensors(v, f"{path}/{i}")]
    if hasattr(obj, "__dict__"):
        return tensors(vars(obj), f"{path}.{type(obj).__name__}")
    return []


def per_sample_data(obj: object, num_params: int) -> list[str]:
    """Paths that look like per-sample gradients: a name saying so, or a float tensor larger than the model (every
    legitimate float tensor is at most one copy of the flat parameters: weights, optimizer state, gossip state)."""
    found = []
    for path, t in tensors(obj):
        lowered = path.lower()
        if "grad_sample" in lowered or "per_sample" in lowered or "table" in lowered:
            found.append(path)
        elif t.is_floating_point() and t.numel() > num_params:
            found.append(f"{path} {tuple(t.shape)}")
    return found


class KeepPerSampleGradients(pl.Callback):
    """Captures the live per-sample gradients (hooks) or SAGA table of one step, to prove the check can see them."""

    def __init__(self) -> None:
        self.live: object = None

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dp = trainer.strategy.privacy
        if trainer.global_step == 2 and self.live is None:
            table = getattr(dp, "table", None)
            self.live = {"table": table.rows.clone()} if table is not None else {
                "grads": [g.clone() for g in dp.clipping.per_sample.per_sample_grads()]}


BUDGET = dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, noise_seed=0)


@pytest.fixture(scope="module")
def end_of_a_two_epoch_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """DP-CSGP at epsilon 3 planned for 2 epochs, checkpointed at its end: (the checkpoint, its sigma)."""
    tmp_path = tmp_path_factory.mktemp("two_epochs")
    strategy = DPCSGPStrategy(**BUDGET)
    trainer(tmp_path, strategy, checkpoints=True, max_steps=-1, max_epochs=2).fit(Classifier(), data())
    checkpoint = sorted((tmp_path / "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)[-1]
    return checkpoint, strategy.privacy.noise_multiplier


def _resume_with_max_epochs_4(tmp_path: Path, checkpoint: Path, **kwargs: object) -> tuple[pl.Trainer, DPCSGPStrategy]:
    strategy = DPCSGPStrategy(**BUDGET, **kwargs)
    resumed = trainer(tmp_path, strategy, checkpoints=False, max_steps=-1, max_epochs=4)
    resumed.fit(Classifier(), data(), ckpt_path=checkpoint)
    return resumed, strategy


@pytest.mark.slow  # three Lightning fits
def test_resume_continues_the_ledger_keeps_sigma_and_never_rolls_back():
    e, model = attached_node(target_epsilon=2.0, target_delta=1e-5, seed=5)
    e.private_dataloader(loader(), planned_steps=20, world_size=4)
    sigma = e.noise_multiplier
    for _ in range(3):
        one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    buffer = io.BytesIO()
    torch.save(e.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed, _ = attached_node(target_epsilon=2.0, target_delta=1e-5, seed=5)
    resumed.load_state_dict(saved)
    resumed.private_dataloader(loader(), planned_steps=20, world_size=4)
    assert resumed.ledger.steps == 3 and resumed.noise_multiplier == sigma  # same plan: same sigma
    assert resumed.epsilon() == pytest.approx(e.epsilon())

    longer, _ = attached_node(target_epsilon=2.0, target_delta=1e-5, seed=5)
    longer.load_state_dict(saved)
    longer.private_dataloader(loader(), planned_steps=40, world_size=4)  # a longer plan: more noise per step
    assert longer.noise_multiplier > sigma
    assert longer.ledger.epsilon_after(37, GaussianRelease(longer.noise_multiplier, longer.sample_rate)) <= 2.0

    for _ in range(2):
        one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(PrivacyConfigError, match="forget spent privacy"):
        e.load_state_dict(saved)  # 3 < 5 steps already spent


@pytest.mark.filterwarnings("ignore:noise_multiplier=0 adds no noise")  # a bare node: CPGT's noise is Laplace
def test_a_resumed_run_keeps_its_q_when_auto_would_now_choose_another_and_refuses_an_explicit_other_q():
    """q is planned state: resumed in the strategy's order (gossip and node built, q re-chosen at setup from the new
    lr, then the checkpoint's gossip, node and optimizer states), the run goes on with the q, alpha, noise and epsilon
    it started with (Algorithm 1, line 5: d q^k; Theorem 2's bound holds for one q)."""
    import io
    import re

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_privdec.algorithms.cpgt import CPGTNode, CPGTOptions
    from lightning_privdec.comm.loopback import LoopbackExchange
    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.privacy.accounting.cpgt import auto_noise_decay

    data = DataLoader(TensorDataset(torch.randn(50, 3), torch.randn(50)), batch_size=50)  # full batches
    topology = build_topology("complete", 2, weights="metropolis")

    def setup(lr: float, **options):  # noqa: ANN202
        node = CPGTNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=0.0), rank=0, device=torch.device("cpu"),
                        options=CPGTOptions(**{"noise_decay": "auto", "lipschitz": 1.0, "target_epsilon": 3.0,
                                               **options}))
        node.build_gossip(torch.zeros(3, dtype=torch.float64), rank=0, topology=topology, compressor=None, seed=0,
                          exchange=LoopbackExchange(LoopbackNetwork(2), 0), consensus_step=1.0)
        optimizer = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=lr)
        node.configure_optimizer(optimizer, 3)
        return node, optimizer

    def saved(state: dict) -> dict:  # through torch.save, as in a checkpoint file
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    def resume(lr: float, node_state: dict, **options):  # noqa: ANN202
        node, optimizer = setup(lr, **options)
        node.gossip.load_state_dict(states["gossip"])
        node.load_state_dict(node_state)
        optimizer.load_state_dict(states["optimizer"])  # Lightning restores the optimizer (its lr) after the model
        node.private_dataloader(data, planned_steps=10)
        return node

    first, optimizer = setup(0.1)
    first.private_dataloader(data, planned_steps=10)
    for _ in range(3):
        first.ledger.record(first.next_release())
    q0 = auto_noise_decay(0.1, 1.0)
    assert first.noise_decay == pytest.approx(q0)
    states = saved({"node": first.state_dict(), "gossip": first.gossip.state_dict(),
                    "optimizer": optimizer.state_dict()})
    assert states["node"]["noise_decay"] == first.noise_decay

    q1 = auto_noise_decay(0.2, 1.0)
    assert setup(0.2)[0].noise_decay == pytest.approx(q1) and abs(q1 - q0) > 0.05  # what a fresh run would choose
    resumed = resume(0.2, states["node"])
    assert resumed.noise_decay == resumed.gossip.noise_decay == resumed.ledger.terms["q"] == first.noise_decay
    assert resumed.alpha == 0.1 and (resumed.noise_x, resumed.noise_y) == (first.noise_x, first.noise_y)
    assert resumed.steps == 3 and resumed.epsilon() == first.epsilon() == pytest.approx(3.0)
    # an explicit q: the checkpoint's is accepted, another is refused with both values
    assert resume(0.1, states["node"], noise_decay=first.noise_decay).noise_decay == first.noise_decay
    with pytest.raises(PrivacyConfigError, match=re.escape(f"q = {first.noise_decay!r} per round, this run passes "
                                                           f"noise_decay=0.8;") + ".*Resume with noise_decay="):
        resume(0.1, states["node"], noise_decay=0.8)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0 adds no noise")  # a bare node: CPGT's noise is Laplace
@pytest.mark.parametrize("accounting", ["sound", "finite"])
def test_the_resume_warning_prints_the_epsilon_the_ledger_holds_before_the_noise_is_planned(tmp_path, accounting):
    """The strategy reads the checkpoint and the write-ahead ledger before it plans the noise (the checkpoint is
    restored with the model, the plan comes with the dataloader). The warning printed "epsilon spent so far is 0.0000"
    there, as the bound's terms came only with the plan; the ledger's state now keeps them."""
    import io
    import re
    import warnings

    from lightning_privdec.privacy.write_ahead import WriteAheadLedger
    from tests.test_write_ahead_ledger import cpgt_node, make_cpgt_node

    ledger = WriteAheadLedger(tmp_path, "run", rank=0)
    crashed = cpgt_node(accounting)  # noise_x = noise_y = 1, alpha = 0.1, q = 0.9, planned for 10 rounds
    crashed.ledger.record(crashed.next_release())
    ledger.write(crashed)
    buffer = io.BytesIO()
    torch.save(crashed.state_dict(), buffer)  # the checkpoint, after round 1
    for _ in range(5):  # rounds 2..6 released, then the crash
        crashed.ledger.record(crashed.next_release())
        ledger.write(crashed)

    def resume(checkpoint: dict) -> tuple[str, object]:
        node = make_cpgt_node(accounting=accounting, noise_x=1.0, noise_y=1.0)  # built, no plan yet
        node.load_state_dict(checkpoint)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            assert ledger.recover(node) == 5
        (message,) = [str(w.message) for w in warned]
        data = torch.utils.data.TensorDataset(torch.randn(50, 3), torch.randn(50))
        batch_size = 5 if accounting == "finite" else 50
        node.private_dataloader(torch.utils.data.DataLoader(data, batch_size=batch_size), planned_steps=10)
        return message, node

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    message, resumed = resume(checkpoint)
    printed = float(re.search(r"epsilon spent so far is ([0-9.]+) \(delta=0.0\)", message).group(1))
    # the trajectory goes on from round 1; rounds 1..5 are charged again as they are sent again
    assert resumed.steps == 6 and resumed.ledger.rounds == 1 and resumed.epsilon() >= crashed.epsilon() > 0
    assert printed == pytest.approx(resumed.epsilon(), abs=5e-5)  # the ledger's epsilon, before and after the plan


def test_checkpoints_hold_no_table_and_a_resumed_node_rebuilds_it_at_the_resumed_parameters():
    J = 8
    x, y = node_data(0, J)
    module = nn.Linear(3, 2)
    dp = make_node(0, 1.0, 1.5)
    loader = attach_with_data(dp, module, x, y, batch_size=2, steps=8)
    fill(dp, module)
    train(dp, module, loader, lr=0.5)
    state = dp.state_dict()
    assert "table" not in state and not any(t.is_floating_point() for t in tensors_in(state))

    dp.clipping.detach()
    resumed = make_node(0, 1.0, 1.5)
    resumed.load_state_dict(state)
    assert resumed.steps == dp.steps == 4 and resumed.epsilon() == pytest.approx(dp.epsilon(), rel=1e-12)
    attach_with_data(resumed, module, x, y, batch_size=2, steps=8)
    assert not resumed.table_ready
    fill(resumed, module)
    z = torch.nn.utils.parameters_to_vector(module.parameters()).detach().double()
    expected = torch.stack([clip(per_example_gradient(z, x[j].double(), y[j].double()), 1.0) for j in range(J)])
    assert torch.allclose(resumed.table.rows.double(), expected, atol=1e-5)
    other = make_node(0, 1.0, 1.5, accounting="no_amplification")
    with pytest.raises(PrivacyConfigError, match="same accounting"):
        other.load_state_dict(state)




def test_state_dict_resume_continues_the_same_trajectory():
    n = 5
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    x0 = start_points(n)
    straight, _ = run_gossip(n, topology, rounds=20, compressor=RandK(0.5), gamma=0.5, x0=x0)
    first_half, _ = run_gossip(n, topology, rounds=10, compressor=RandK(0.5), gamma=0.5, x0=x0)
    states = [g.state_dict() for g in first_half]

    network = LoopbackNetwork(n)

    def resumed(rank, exchange):
        gossip = PushSumGossip(
            torch.zeros(D), rank=rank, topology=topology, exchange=exchange, compressor=RandK(0.5), consensus_step=0.5
        )
        gossip.load_state_dict(states[rank])
        for _ in range(10):
            gossip.step(gossip.x)
        return gossip

    for a, b in zip(straight, network.run(resumed)):
        assert a.round == b.round == 20
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


def test_resuming_from_a_state_with_messages_in_flight_continues_the_same_trajectory():
    n = 5
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    straight = run(n, topology, range(20), staleness=2, lr=LR)
    first = run(n, topology, range(9), staleness=2, lr=LR)
    states = [g.state_dict() for g in first]
    assert all(len(s["in_flight"]) == 2 for s in states)
    resumed = run(n, topology, range(9, 20), staleness=2, lr=LR, state=states)
    for a, b in zip(straight, resumed):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and a.round == b.round
    # resumed without overlap, the messages left in flight are mixed in at once: nothing is lost
    synchronous = run(n, topology, range(9, 9), staleness=0, state=states)
    total = sum(g.x for g in first) + sum(in_flight_mass(g)[0] for g in first)
    assert torch.allclose(sum(g.x for g in synchronous), total, rtol=0, atol=1e-12)
    assert sum(float(g.y) for g in synchronous) == pytest.approx(n, abs=1e-12)


def test_key_file_resume_rederives_the_same_secrets_and_streams(tmp_path):
    graph = ring(4)
    first = _run_with_key_files(graph, tmp_path)
    for i in graph:
        assert stat.S_IMODE(os.stat(tmp_path / f"node{i}.key").st_mode) == 0o600
    checkpoint = {i: s.state_dict() for i, s in first.items()}
    before = CorrelatedNoise(first[0], 0.5).sum_for_round(7, 1000)

    resumed = _run_with_key_files(graph, tmp_path)  # loads the same files: same keys, same secrets
    for i, j in edges(graph):
        assert resumed[i].secret(j) == first[i].secret(j)
    assert all(resumed[i].load_state_dict(checkpoint[i], require_same_secrets=True) for i in graph)
    assert torch.equal(CorrelatedNoise(resumed[0], 0.5).sum_for_round(7, 1000), before)

    other_context = _run_with_key_files(graph, tmp_path, context=b"run-B")  # context is bound into the secrets
    assert other_context[0].secret(1) != first[0].secret(1)

    fresh = simulate_key_agreement(graph)  # resume without key files: a new, equally valid agreement
    assert fresh[0].secret(1) != first[0].secret(1)
    assert fresh[0].load_state_dict(checkpoint[0]) is False
    with pytest.raises(PrivacyConfigError, match="differ from the checkpoint"):
        fresh[0].load_state_dict(checkpoint[0], require_same_secrets=True)
    with pytest.raises(PrivacyConfigError, match="checkpoint is for node 1"):
        fresh[0].load_state_dict(checkpoint[1])

    first[0].delete_key_file()
    assert not (tmp_path / "node0.key").exists()


@pytest.mark.parametrize("strategy", [lambda: private(grad_sample_mode="hooks"),
                                      lambda: PrivSGPVRStrategy(max_grad_norm=1.0, noise_multiplier=1.0)],
                         ids=["per-sample gradients", "PrivSGP-VR table"])
def test_checkpoints_of_private_runs_hold_no_per_sample_gradients(strategy, tmp_path: Path) -> None:
    keep = KeepPerSampleGradients()
    model = Classifier()
    fit = trainer(tmp_path, strategy(), max_steps=4)
    fit.callbacks.append(keep)
    fit.fit(model, data(n=64))
    num_params = sum(p.numel() for p in model.parameters())
    assert per_sample_data(keep.live, num_params), "the check must recognise the run's own per-sample data"
    checkpoints = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(checkpoints) == 4
    for path in checkpoints:
        checkpoint = torch.load(path, weights_only=False)
        assert "lightning_privdec" in checkpoint  # the node's gossip, optimizer and privacy state are there ...
        assert per_sample_data(checkpoint, num_params) == []  # ... but nothing per-sample


def test_a_resume_that_would_drown_the_model_in_noise_is_refused_with_the_choices(end_of_a_two_epoch_plan, tmp_path) -> None:
    checkpoint, old_sigma = end_of_a_two_epoch_plan
    with pytest.raises(PrivacyConfigError) as refused:
        _resume_with_max_epochs_4(tmp_path, checkpoint)
    message = str(refused.value)
    assert "32 steps have spent epsilon = 2.9" in message and "of target_epsilon = 3.0" in message
    assert "instead of" in message and "raise target_epsilon" in message and "start a new run" in message
    assert "resume_noise='keep'" in message and "resume_noise='recalibrate'" in message
    new, old = (float(x) for x in re.search(r"need sigma = ([\d.e+]+) instead of ([\d.e+]+)", message).groups())
    assert old == pytest.approx(old_sigma, rel=1e-3) and new > 2 * old


def test_a_resume_may_keep_its_noise_and_stop_at_the_budget_or_recalibrate_knowingly(end_of_a_two_epoch_plan,
                                                                                     tmp_path) -> None:
    checkpoint, old_sigma = end_of_a_two_epoch_plan
    kept, strategy = _resume_with_max_epochs_4(tmp_path / "keep", checkpoint, resume_noise="keep")
    assert strategy.privacy.noise_multiplier == old_sigma and strategy.privacy.epsilon() <= 3.0
    assert kept.global_step < 4 * 16  # stopped when the budget was spent
    _, strategy = _resume_with_max_epochs_4(tmp_path / "again", checkpoint, resume_noise="recalibrate")
    assert strategy.privacy.noise_multiplier > 2 * old_sigma and strategy.privacy.epsilon() <= 3.0


def test_a_resume_that_replans_sigma_says_so_once_and_the_summary_shows_both(end_of_a_two_epoch_plan, tmp_path,
                                                                              caplog) -> None:
    checkpoint, old_sigma = end_of_a_two_epoch_plan
    with caplog.at_level("INFO"):
        _, strategy = _resume_with_max_epochs_4(tmp_path, checkpoint, resume_noise="recalibrate")
    new_sigma = strategy.privacy.noise_multiplier
    change = f"sigma = {old_sigma:.4g} up to step 32, {new_sigma:.4g} from step 33"
    messages = [r.getMessage() for r in caplog.records]
    announced = [m for m in messages if "this resumed run plans 64 steps in all" in m]
    assert len(announced) == 1 and change in announced[0]
    (summary,) = [m for m in messages if "final privacy per node" in m]
    assert f"Gaussian noise sigma = {new_sigma:.4g} x C" in summary and change in summary


def test_a_resume_with_a_noise_multiplier_given_by_hand_uses_it(end_of_a_two_epoch_plan, tmp_path) -> None:
    """resume_noise governs a calibrated sigma only: a sigma the user passes is never refused nor replaced."""
    checkpoint, old_sigma = end_of_a_two_epoch_plan
    for choice in ("auto", "keep"):
        strategy = DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=3 * old_sigma, noise_seed=0, resume_noise=choice)
        resumed = trainer(tmp_path / choice, strategy, checkpoints=False, max_steps=-1, max_epochs=3)
        resumed.fit(Classifier(), data(), ckpt_path=checkpoint)
        assert strategy.privacy.noise_multiplier == 3 * old_sigma and resumed.global_step == 3 * 16


def test_a_checkpoint_resumes_with_its_epsilon_and_plan_and_never_rolls_back():
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=3.0, target_delta=DELTA)
    node = PrivSGPVRNode(parameters, rank=0, device=torch.device("cpu"))
    node.load_state_dict(STATE)
    assert node.steps == 4 and node.epsilon() == pytest.approx(2.2140620521134196, rel=1e-12)
    assert (node.noise_multiplier, node.split) == (STATE["noise_multiplier"], STATE["split"])
    attach_with_data(node, nn.Linear(3, 2), *node_data(0, 8), batch_size=2, steps=8)
    assert node.noise_multiplier == STATE["noise_multiplier"]  # the plan it was calibrated for: kept
    assert node.ledger.state_dict()["steps"] == 4
    node.ledger.record(node.next_release())
    with pytest.raises(PrivacyConfigError, match="has 4 steps but 5"):
        node.load_state_dict(STATE)  # never rolls back


def test_node_epsilons_budget_and_resume():
    model = nn.Linear(3, 2)
    e = planned_node(model=model, planned_steps=8)
    assert e.certified_steps == 8 and 0.99 * 2.0 <= e.plan_epsilon <= 2.0
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    for _ in range(3):
        take_step(e, model, x, y, "hooks")
    assert e.epsilon() == pytest.approx(e.schedule.rigorous_epsilon(1e-5, steps=3), rel=1e-12)
    assert e.paper_epsilon() == pytest.approx(e.schedule.clt_epsilon(1e-5, steps=3), rel=1e-9)
    assert e.current_clip == e.schedule.clip(3) and e.noise_multiplier == e.schedule.noise_multiplier(3)
    buffer = io.BytesIO()
    torch.save(e.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    same = DynD2PNode(e.parameters, options=DynD2POptions(rho_c=4.0, rho_mu=2.0), rank=1, device=torch.device("cpu"), noise_seed=3)
    same.attach(nn.Linear(3, 2))
    same.load_state_dict(saved)
    same.private_dataloader(node_loader(), 8, 4)  # the same plan: the schedule continues at step 3
    assert same.schedule == e.schedule and same.steps == 3 and same.epsilon() == e.epsilon()
    assert same.current_clip == e.schedule.clip(3)

    longer = DynD2PNode(e.parameters, options=DynD2POptions(rho_c=4.0, rho_mu=2.0), rank=1, device=torch.device("cpu"), noise_seed=3)
    longer.attach(nn.Linear(3, 2))
    longer.load_state_dict(saved)
    with pytest.warns(UserWarning, match="re-planned"):
        longer.private_dataloader(node_loader(), 16, 4)  # a longer plan: re-calibrated over the remaining steps
    assert longer.schedule.steps == 16 and longer.steps == 3
    assert 0.99 * 2.0 <= longer.plan_epsilon <= 2.0 and longer.certified_steps == 16
    assert longer.schedule.noise_multiplier(3) > e.schedule.noise_multiplier(3)  # more steps: more noise each

    for _ in range(5):
        take_step(e, model, x, y, "hooks")
    assert e.next_step_exceeds_budget() and e.epsilon() <= 2.0
    with pytest.raises(PrivacyConfigError, match="forget spent privacy"):
        e.load_state_dict(saved)
