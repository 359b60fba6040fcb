"""The write-ahead privacy ledger: steps released after the last checkpoint stay counted after a crash and a resume."""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
from torch import nn

from lightning_privdec.privacy import PrivacyConfigError, epsilon_for
from lightning_privdec.privacy.accounting import GaussianRelease
from lightning_privdec.privacy.write_ahead import GENERATOR_KEYS, WriteAheadLedger
from tests.multiprocess import fit_digits_in_one_launch
from tests.test_dyn_d2p import planned_node, take_step
from tests.test_dp_csgp import attached_node, loader, one_step


def checkpoint(dp) -> dict:
    buffer = io.BytesIO()
    torch.save(dp.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def steps_until_budget(dp) -> int:
    taken = 0
    while not dp.next_step_exceeds_budget():
        dp.ledger.record(dp.next_release())  # what privatize() records
        taken += 1
    return taken


def test_a_resumed_node_counts_the_steps_released_after_its_checkpoint(tmp_path):
    ledger = WriteAheadLedger(tmp_path, "run", rank=1)
    e, model = attached_node(target_epsilon=2.0, target_delta=1e-5)  # secure: OS entropy
    e.private_dataloader(loader(), planned_steps=20, world_size=4)
    sigma, q = e.noise_multiplier, e.sample_rate
    saved = None
    for k in range(1, 13):
        one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
        ledger.write(e)  # before the step's message would leave the node
        if k == 5:
            saved = checkpoint(e)  # the last checkpoint; steps 6..12 are released, then the run crashes

    resumed, _ = attached_node(target_epsilon=2.0, target_delta=1e-5)
    resumed.load_state_dict(saved)
    assert resumed.steps == 5
    with pytest.warns(UserWarning, match=r"node 1: 7 private steps were released after the checkpoint") as warned:
        assert WriteAheadLedger(tmp_path, "run", rank=1).recover(resumed) == 7
    assert resumed.steps == 12 and resumed.ledger.history == [(sigma, q, 12)]
    assert resumed.epsilon() == pytest.approx(epsilon_for(sigma, q, 12, 1e-5), rel=1e-12)
    assert f"epsilon spent so far is {resumed.epsilon():.4f}" in str(warned[0].message)

    # the budget now includes the lost steps: the resumed run stops 7 steps earlier than one that forgot them
    resumed.private_dataloader(loader(), planned_steps=20, world_size=4)
    assert resumed.noise_multiplier == sigma  # the same plan keeps its sigma
    forgetful, _ = attached_node(target_epsilon=2.0, target_delta=1e-5)
    forgetful.load_state_dict(saved)
    forgetful.private_dataloader(loader(), planned_steps=20, world_size=4)
    assert steps_until_budget(resumed) == steps_until_budget(forgetful) - 7
    assert resumed.epsilon() <= 2.0 < resumed.ledger.epsilon_after(1, GaussianRelease(sigma, q))

    # a file that is not as far as the checkpoint changes nothing; the checkpoint's own count never rolls back
    again, _ = attached_node(target_epsilon=2.0, target_delta=1e-5)
    again.load_state_dict(resumed.state_dict())
    assert WriteAheadLedger(tmp_path, "run", rank=1).recover(again) == 0 and again.steps == resumed.steps


def test_the_file_holds_accounting_only_never_generator_states_and_is_replaced_atomically(tmp_path):
    e, model = attached_node(noise_multiplier=1.0, seed=1234)  # even a seeded node writes no generator state
    e.private_dataloader(loader(), planned_steps=10, world_size=4)
    assert "noise_generator" in e.state_dict()
    ledger = WriteAheadLedger(tmp_path, "abc", rank=1)
    one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    ledger.write(e)
    assert sorted(p.name for p in (tmp_path / "abc").iterdir()) == ["node_1.pt"]  # no temporary file left behind
    record = torch.load(ledger.path, weights_only=True)  # plain types only
    assert record["steps"] == 1 and set(record["accounting"]) == {"steps", "ledger", "noise_multiplier", "plan"}
    assert not set(GENERATOR_KEYS) & set(record["accounting"])
    for generator in (e.gaussian.generator, e.sampler.generator):
        assert generator._key not in ledger.path.read_bytes()
    # a crash while writing leaves the previous complete file: the new state only appears by os.replace
    inode = os.stat(ledger.path).st_ino
    one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    ledger.write(e)
    assert os.stat(ledger.path).st_ino != inode and torch.load(ledger.path, weights_only=True)["steps"] == 2
    # another run's or node's file is refused, not merged
    (tmp_path / "other").mkdir()
    os.replace(ledger.path, tmp_path / "other" / "node_1.pt")
    with pytest.raises(PrivacyConfigError, match="not node 1's write-ahead privacy ledger of run other"):
        WriteAheadLedger(tmp_path, "other", rank=1).read()


def test_dyn_d2p_resumes_its_schedule_at_the_released_step(tmp_path):
    model = nn.Linear(3, 2)
    e = planned_node(model=model, planned_steps=8, seed=None)
    ledger = WriteAheadLedger(tmp_path, "run", rank=1)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    take_step(e, model, x, y, "hooks")
    saved = checkpoint(e)
    for _ in range(4):
        take_step(e, model, x, y, "hooks")
        ledger.write(e)
    resumed = planned_node(model=nn.Linear(3, 2), planned_steps=8, seed=None)
    resumed.load_state_dict(saved)
    with pytest.warns(UserWarning, match="4 private steps were released"):
        ledger.recover(resumed)
    assert resumed.steps == 5 and resumed.epsilon() == pytest.approx(e.schedule.rigorous_epsilon(1e-5, steps=5))
    assert resumed.noise_multiplier == e.schedule.noise_multiplier(5)  # the schedule goes on at step 5, not 1


def make_cpgt_node(**options):  # noqa: ANN201
    """A CPGT node with alpha = 0.1 and d = 3, q = 0.9, L = 1 unless ``options`` say otherwise."""
    from lightning_privdec.algorithms.cpgt import CPGTNode, CPGTOptions
    from lightning_privdec.privacy import PrivacyParameters

    e = CPGTNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=0.0), rank=0, device=torch.device("cpu"),
                 options=CPGTOptions(**{"noise_decay": 0.9, "lipschitz": 1.0, **options}))
    e.configure_optimizer(torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1), 3)
    return e


def cpgt_node(accounting: str = "finite", target_epsilon: float | None = None):
    noise = dict(noise_x=1.0, noise_y=1.0) if target_epsilon is None else dict(noise_x=None, noise_y=None)
    e = make_cpgt_node(accounting=accounting, target_epsilon=target_epsilon, **noise)
    data = torch.utils.data.TensorDataset(torch.randn(50, 3), torch.randn(50))
    batch_size = 5 if accounting == "finite" else 50  # whole-run accountings need full batches
    e.private_dataloader(torch.utils.data.DataLoader(data, batch_size=batch_size), planned_steps=10)
    return e


def _cpgt_round_terms(e, rounds: int) -> list[float]:
    """The coupling's per-round epsilon terms of Theorem 2's proof, one per round, computed independently of the
    node from its parameters (Assumption 4 unless accounting='finite')."""
    from lightning_privdec.privacy.accounting.cpgt import cpgt_epsilon_after

    common = dict(alpha=e.alpha, lipschitz=e.lipschitz, q=e.noise_decay, noise_x=e.noise_x, noise_y=e.noise_y,
                  sensitivity=e.sensitivity, norm_factor=e.norm_factor, linear_difference=e.accounting != "finite")
    partial = [cpgt_epsilon_after(k, **common) for k in range(rounds + 1)]
    return [b - a for a, b in zip(partial, partial[1:])]


@pytest.mark.parametrize("accounting", ["sound", "finite"])
def test_cpgt_charges_every_round_a_resume_sends_again(tmp_path, accounting):
    """Checkpoint after round 1, crash after round 6, resume: rounds 1..5 go out twice (fresh Laplace noise, same
    scales); the printed epsilon is the composition, every released round's term counted once per release. A second
    crash (after round 3 of the resumed run, resumed from a checkpoint at round 2) adds round 2 once more."""
    from lightning_privdec.privacy.accounting.cpgt import cpgt_epsilon

    ledger = WriteAheadLedger(tmp_path, "run", rank=0)

    def advance(dp, rounds):
        for _ in range(rounds):
            dp.ledger.record(dp.next_release())  # what privatize() records, then the write before the message leaves
            ledger.write(dp)

    e = cpgt_node(accounting)
    advance(e, 1)
    at_round_1 = checkpoint(e)
    advance(e, 5)
    uninterrupted = e.epsilon()
    resumed = cpgt_node(accounting)
    resumed.load_state_dict(at_round_1)
    with pytest.warns(UserWarning, match="5 private steps were released"):
        ledger.recover(resumed)
    assert resumed.steps == 6 and resumed.ledger.rounds == 1  # 6 rounds released; the trajectory goes on from round 1
    terms = _cpgt_round_terms(e, 12)
    whole = cpgt_epsilon(alpha=0.1, lipschitz=1.0, q=0.9, noise_x=1.0, noise_y=1.0, sensitivity=e.sensitivity,
                         norm_factor=e.norm_factor)

    def composed(trajectory_rounds: int, replayed: list[int]) -> float:
        mine = whole if accounting == "sound" else sum(terms[:trajectory_rounds])
        return mine + sum(terms[k] for k in replayed)

    assert resumed.epsilon() == pytest.approx(composed(1, [1, 2, 3, 4, 5]), rel=1e-12)
    # before the fix the resumed run printed the uninterrupted value (and, finite, forgot rounds 1..5 once it passed 6)
    assert resumed.epsilon() > uninterrupted if accounting == "sound" else resumed.epsilon() == uninterrupted
    advance(resumed, 1)
    at_round_2 = checkpoint(resumed)
    advance(resumed, 1)  # round 3 released, then a second crash
    again = cpgt_node(accounting)
    again.load_state_dict(at_round_2)
    with pytest.warns(UserWarning, match="1 private steps were released"):
        ledger.recover(again)
    advance(again, 4)
    assert again.steps == 6 + 2 + 4 and again.ledger.rounds == 6
    assert again.epsilon() == pytest.approx(composed(6, [1, 2, 3, 4, 5, 2]), rel=1e-12)


def test_cpgt_refuses_to_resume_past_its_target_once_replays_are_charged(tmp_path):
    """A calibrated whole-run bound spends exactly the target: any replayed round takes the node past it."""
    ledger = WriteAheadLedger(tmp_path, "run", rank=0)
    e = cpgt_node("sound", target_epsilon=2.0)
    assert e.epsilon() == 0.0 and not e.next_step_exceeds_budget()
    e.ledger.rounds = 1
    ledger.write(e)
    saved = checkpoint(e)
    e.ledger.rounds = 4
    ledger.write(e)
    assert e.epsilon() == pytest.approx(2.0) and not e.next_step_exceeds_budget()
    resumed = cpgt_node("sound", target_epsilon=2.0)
    resumed.load_state_dict(saved)
    with pytest.warns(UserWarning, match="3 private steps were released"):
        ledger.recover(resumed)
    assert resumed.epsilon() > 2.0 and resumed.next_step_exceeds_budget()


def decor_node():
    import networkx as nx

    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.algorithms.decor import DecorNode, DecorOptions

    e = DecorNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), graph=nx.cycle_graph(4),
                  options=DecorOptions(sigma_cdp=1.0, sigma_cor=0.5, clipping="user"), rank=0,
                  device=torch.device("cpu"))
    e.plan_noise(10)
    return e


@pytest.mark.parametrize("make", [cpgt_node, decor_node])
def test_nodes_that_count_steps_resume_at_the_released_count(tmp_path, make):
    """CPGT (accounting='finite') and Decor (SecLDP) price the number of steps taken: the lost ones count too."""
    e = make()
    saved = checkpoint(e)  # after 0 steps
    for _ in range(6):  # six released steps (what privatize() records)
        e.ledger.record(e.next_release())
    WriteAheadLedger(tmp_path, "run", rank=0).write(e)
    resumed = make()
    resumed.load_state_dict(saved)
    assert resumed.steps == 0 and resumed.epsilon() == 0.0
    with pytest.warns(UserWarning, match="6 private steps were released"):
        WriteAheadLedger(tmp_path, "run", rank=0).recover(resumed)
    assert resumed.steps == 6 and resumed.epsilon() == e.epsilon() > 0


def test_the_write_costs_little_per_step(tmp_path):
    e, model = attached_node(noise_multiplier=1.0)
    e.private_dataloader(loader(), planned_steps=100, world_size=4)
    one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    ledger = WriteAheadLedger(tmp_path, "run", rank=1)
    start = time.perf_counter()
    for _ in range(50):
        ledger.write(e)
    per_write = (time.perf_counter() - start) / 50
    assert ledger.path.stat().st_size < 2048
    assert per_write < 0.05  # measured: about 0.5 ms with fsync on a local ext4 disk


@pytest.mark.multiprocess
def test_a_lightning_resume_after_a_crash_counts_the_released_steps(tmp_path):
    """Run A checkpoints epoch 0 (11 steps) and releases 33 steps in all; resuming epoch 0's checkpoint (as after a
    crash right after it) replays epochs 1-2 with fresh noise: 11 + 22 + 22 = 55 steps are counted, not 33."""
    common = ["--strategy", "dp_csgp", "--noise-multiplier", "1.0", "--max-epochs", "3", "--lr", "0.3"]
    first, resumed = fit_digits_in_one_launch(
        (tmp_path / "first", [*common, "--ckpt-dir", str(tmp_path / "ckpt")]),
        (tmp_path / "resumed", [*common, "--resume", str(tmp_path / "ckpt" / "epoch=0-*.ckpt")]), devices=2)
    files = sorted((tmp_path / "ckpt" / "privacy_ledger").glob("*/node_*.pt"))
    assert [f.name for f in files] == ["node_0.pt", "node_1.pt"] and files[0].parent == files[1].parent
    for a, b in zip(first, resumed):
        steps_per_epoch = a["global_step"] // 3
        assert a["ledger_steps"] == 3 * steps_per_epoch
        assert b["ledger_steps"] == 5 * steps_per_epoch  # epoch 0, the 2 lost epochs, and their replay
        assert b["epsilon"] == pytest.approx(epsilon_for(1.0, b["sample_rate"], b["ledger_steps"], 1e-5), rel=1e-9)
        assert b["epsilon"] > a["epsilon"]


def test_a_calibrated_finite_cpgt_plan_takes_every_planned_round():
    """The calibrated scale spends the target exactly (to float rounding): the last planned round must not be
    refused for a few ulp."""
    data = torch.utils.data.TensorDataset(torch.randn(50, 3), torch.randn(50))
    early = []
    for planned in range(2, 40, 3):
        for target in (0.5, 3.0, 7.3):
            e = make_cpgt_node(accounting="finite", target_epsilon=target)
            e.private_dataloader(torch.utils.data.DataLoader(data, batch_size=5), planned_steps=planned)
            e.ledger.rounds = planned - 1
            if e.next_step_exceeds_budget():
                early.append((planned, target))
            e.ledger.rounds = planned
            assert e.next_step_exceeds_budget() and e.epsilon() == pytest.approx(target, rel=1e-9)
    assert early == []
