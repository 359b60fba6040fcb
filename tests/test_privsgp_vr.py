"""PrivSGP-VR: the SAGA step against a transcription of Algorithm 1, the table, the sound accounting, K*."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.algorithms.node import private_step
from lightning_privdec.algorithms import PushSumGossip
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.privacy import PrivacyConfigError, PrivacyParameters, epsilon_for, node_noise_generator
from lightning_privdec.privacy.accounting.saga import (
    c2_for_optimal_steps,
    optimal_split,
    optimal_steps,
    paper_noise_std,
    saga_epsilon,
    sound_split,
    theorem1_bound,
)
from lightning_privdec.privacy.accounting.saga_calibration import calibrate_saga_noise
from lightning_privdec.algorithms.privsgp_vr import (
    REFRESH_PASSES,
    PrivSGPVRNode,
    SagaTable,
    saga_step,
)
from lightning_privdec.privacy.dp_step import clip_rows_
from lightning_privdec.privacy.sampling import PoissonBatchSampler
from lightning_privdec.strategies import PRIVATE_STRATEGIES, PrivSGPVRStrategy
from lightning_privdec.topology import build_topology

DELTA = 1e-5


# ---- a tiny least-squares problem with per-example gradients in closed form ------------------------------------------
def node_data(rank: int, J: int = 6, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(J, 3, generator=g) * scale, torch.randn(J, 2, generator=g)


def per_example_gradient(z: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """grad of 0.5 ||W x + b - y||^2 for z = [W (2x3, row-major), b (2)], in float64."""
    W, b = z[:6].view(2, 3), z[6:]
    r = W @ x + b - y
    return torch.cat([torch.outer(r, x).reshape(-1), r])


def clip(v: torch.Tensor, C: float) -> torch.Tensor:
    return v * min(1.0, C / (float(v.norm()) + 1e-6))


def clip_rows(rows: torch.Tensor, C: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A clipped copy of ``rows`` by the library's per-row clipping (``clip_rows_``), and the norms before it."""
    clipped = rows.clone()
    return clipped, clip_rows_(clipped, C)


def saga_gradient_sum(
    table: SagaTable, indices: list[int] | torch.Tensor, fresh: torch.Tensor, q: float
) -> torch.Tensor:
    """Line 6 times qJ, reading the table only: sum_{xi in S} (c_xi - table[xi]) + q sum_j table[j]."""
    index = torch.as_tensor(indices, dtype=torch.long)
    correction = (fresh - table.rows[index].to(fresh.dtype)).sum(0) if index.numel() else fresh.new_zeros(table.dim)
    return correction + (q * table.total).to(fresh.dtype)


def squared_loss(module: nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
    x, y = batch[0], batch[1]
    return 0.5 * ((module(x) - y) ** 2).sum(1).mean()


def make_node(rank: int, C: float, noise: float, seed: int = 11, **options) -> PrivSGPVRNode:  # noqa: ANN003
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise 0 warns that it is not private
        parameters = PrivacyParameters(max_grad_norm=C, noise_multiplier=noise, target_delta=DELTA)
        return PrivSGPVRNode(parameters, rank=rank, device=torch.device("cpu"), noise_seed=seed, **options)


def attach_with_data(dp: PrivSGPVRNode, module: nn.Module, x, y, batch_size: int, steps: int):  # noqa: ANN001, ANN201
    dp.attach(module)
    dataset = TensorDataset(x, y, torch.arange(len(y)))
    return dp.private_dataloader(DataLoader(dataset, batch_size=batch_size), planned_steps=steps)


def fill(dp: PrivSGPVRNode, module: nn.Module) -> None:
    def backward(batch) -> bool:  # noqa: ANN001
        squared_loss(module, batch).backward()
        return True

    dp.fill_table(backward)


def train(dp: PrivSGPVRNode, module: nn.Module, loader, lr: float) -> None:  # noqa: ANN001
    """One pass over ``loader``: the private step, then plain SGD on the released gradient."""
    for batch in loader:
        squared_loss(module, batch).backward()
        private_step(dp)
        with torch.no_grad():
            for p in module.parameters():
                p -= lr * p.grad


def common_start() -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, 8)


def set_flat(module: nn.Module, z: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(z.to(torch.float32), module.parameters())


# ---- Algorithm 1 ---------------------------------------------------------------------------------------------------
def test_the_private_step_and_push_sum_follow_a_transcription_of_algorithm_1_on_several_nodes():
    n, J, B, C, noise, lr, steps = 3, 6, 2, 1.5, 0.6, 0.3, 9
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    x0 = common_start()

    def node(rank, exchange):  # noqa: ANN001, ANN202
        module = nn.Linear(3, 2)
        set_flat(module, x0)
        dp = make_node(rank, C, noise)
        loader = attach_with_data(dp, module, *node_data(rank, J), batch_size=B, steps=steps)
        fill(dp, module)
        gossip = PushSumGossip(x0.clone(), rank=rank, topology=topology, exchange=exchange)
        record = []
        for batch in (b for _ in range(steps) for b in loader):
            if len(record) == steps:
                break
            module.zero_grad(set_to_none=True)
            squared_loss(module, batch).backward()
            private_step(dp)
            released = torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone()
            mean_ok = torch.allclose(dp.table.mean, dp.table.rows.double().mean(0), atol=1e-6)
            record.append((batch[2].tolist(), released, mean_ok))
            gossip.step(gossip.x - lr * released)  # line 9, then lines 10-13
            set_flat(module, gossip.z)  # line 14
        return record, gossip.z.clone(), dp

    results = LoopbackNetwork(n).run(node)

    # the transcription, in float64 with dense mixing matrices, on the batches the nodes drew
    data = [tuple(t.double() for t in node_data(rank, J)) for rank in range(n)]
    q = B / J
    z = [x0.double().clone() for _ in range(n)]
    x = [x0.double().clone() for _ in range(n)]
    w = [1.0] * n
    tables = [[clip(per_example_gradient(z[i], data[i][0][j], data[i][1][j]), C) for j in range(J)] for i in range(n)]
    g_bar = [sum(t) / J for t in tables]
    generators = [node_noise_generator("cpu", 11, rank) for rank in range(n)]
    for k in range(steps):
        x_half = []
        for i in range(n):
            batch, released, mean_ok = results[i][0][k]
            fresh = {j: clip(per_example_gradient(z[i], data[i][0][j], data[i][1][j]), C) for j in batch}
            g = sum((fresh[j] - tables[i][j] for j in batch), torch.zeros(8, dtype=torch.float64)) / (q * J) + g_bar[i]  # 6
            for j in batch:  # line 7
                g_bar[i] = g_bar[i] + (fresh[j] - tables[i][j]) / J
                tables[i][j] = fresh[j]
            N = generators[i].normal(8, noise * C, torch.float32).double()  # line 8
            g_tilde = g + N / (q * J)
            assert torch.allclose(released.double(), g_tilde, atol=1e-6), (k, i)
            assert mean_ok
            x_half.append(x[i] - lr * g_tilde)  # line 9
        P = torch.as_tensor(topology.mixing_matrix(k), dtype=torch.float64)
        x = [sum(P[i, j] * x_half[j] for j in range(n)) for i in range(n)]  # line 12
        w = [sum(float(P[i, j]) * w[j] for j in range(n)) for i in range(n)]  # line 13
        z = [x[i] / w[i] for i in range(n)]  # line 14
    for i in range(n):
        assert torch.allclose(results[i][1].double(), z[i], atol=1e-5)
        assert results[i][2].steps == steps
    assert sum(len(b) for r in results for b, _, _ in r[0]) > 0


def test_the_first_step_after_the_full_pass_releases_the_full_clipped_gradient_at_z0():
    """Lines 1-3 store c_j(z^0) for all j, so at k = 0 the sampled correction vanishes: g = g_bar = the full gradient."""
    J, C = 8, 0.5
    x, y = node_data(0, J, scale=3.0)
    module = nn.Linear(3, 2)
    set_flat(module, common_start())
    dp = make_node(0, C, 0.0)
    loader = attach_with_data(dp, module, x, y, batch_size=3, steps=5)
    fill(dp, module)
    z0 = common_start().double()
    full = sum(clip(per_example_gradient(z0, x[j].double(), y[j].double()), C) for j in range(J)) / J
    assert torch.allclose(dp.table.mean, full, atol=1e-6)
    batch = next(iter(loader))  # whichever examples it holds, c = table for them at z^0
    squared_loss(module, batch).backward()
    private_step(dp)
    released = torch.cat([p.grad.reshape(-1) for p in module.parameters()]).double()
    assert torch.allclose(released, full, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_table_entry_is_clipped_to_C_also_in_reduced_precision(dtype):
    J, C = 12, 0.25
    x, y = node_data(1, J, scale=50.0)  # per-example gradients far above C
    module = nn.Linear(3, 2)
    dp = make_node(0, C, 1.0, table_dtype=dtype)
    loader = attach_with_data(dp, module, x, y, batch_size=4, steps=9)
    raw = [per_example_gradient(common_start().double(), x[j].double(), y[j].double()).norm() for j in range(J)]
    assert min(raw) > 10 * C  # every example's gradient is far above the bound
    set_flat(module, common_start())
    fill(dp, module)
    train(dp, module, loader, lr=0.1)
    norms = torch.linalg.vector_norm(dp.table.rows.float(), dim=1)
    assert float(norms.max()) <= C
    assert float(norms.min()) > 0.9 * C  # clipped, not zeroed
    assert torch.allclose(dp.table.total, dp.table.rows.double().sum(0), atol=1e-4)


def test_the_saga_gradient_is_unbiased_for_any_table():
    """E over Poisson batches of line 6 equals the mean of the fresh clipped gradients, whatever the table holds."""
    g = torch.Generator().manual_seed(0)
    J, d, C, q, draws = 10, 5, 1.0, 0.3, 4000
    table = SagaTable(J, d, max_norm=C)
    table.store(list(range(J)), clip_rows(torch.randn(J, d, generator=g) * 3, C)[0])
    fresh, _ = clip_rows(torch.randn(J, d, generator=g) * 3, C)
    samples = []
    for _ in range(draws):
        batch = (torch.rand(J, generator=g) < q).nonzero().reshape(-1)
        samples.append(saga_gradient_sum(table, batch, fresh[batch], q) / (q * J))
    samples = torch.stack(samples).double()
    stderr = samples.std(0) / math.sqrt(draws)
    assert ((samples.mean(0) - fresh.double().mean(0)).abs() < 4 * stderr + 1e-6).all()


def test_the_in_place_saga_step_releases_line_6_plus_noise_and_replaces_the_sampled_rows():
    g = torch.Generator().manual_seed(2)
    J, d, C, q = 9, 6, 1.0, 0.4
    table = SagaTable(J, d, max_norm=C)
    table.store(range(J), clip_rows(torch.randn(J, d, generator=g) * 3, C)[0])
    rows, total = table.rows.clone(), table.total.clone()
    batch, fresh, noise = [7, 2, 4], clip_rows(torch.randn(3, d, generator=g) * 3, C)[0], torch.randn(d, generator=g)
    expected = (saga_gradient_sum(table, batch, fresh, q) + noise) / (q * J)
    assert torch.equal(table.rows, rows) and torch.equal(table.total, total)  # line 6 alone reads the table only
    torch.testing.assert_close(saga_step(table, batch, fresh.clone(), q, noise), expected)
    rows[batch] = fresh
    torch.testing.assert_close(table.rows, rows)
    torch.testing.assert_close(table.total, rows.double().sum(0))
    with pytest.raises(RuntimeError, match="sampled twice"):
        table.store([1, 1], fresh[:2])
    with pytest.raises(RuntimeError, match="3 per-sample gradients for 2"):
        table.store([1, 2], fresh)
    # J + 3 rows stored so far; the float64 sum is recomputed from the rows once 32 passes' worth (32 J) are stored
    for step in range((REFRESH_PASSES * J - (J + 3)) // 3):
        table.store([step % J, (step + 3) % J, (step + 5) % J], clip_rows(torch.randn(3, d, generator=g), C)[0])
    torch.testing.assert_close(table.total, table.rows.double().sum(0), rtol=1e-12, atol=1e-12)
    buffer = table.workspace(4)  # one reused buffer, grown only for a larger batch
    assert table.workspace(3).data_ptr() == buffer.data_ptr() and table.workspace(4).shape == (4, d)
    assert table.workspace(6).shape == (6, d) and table.workspace(7).data_ptr() == table.workspace(6).data_ptr()


def test_late_in_training_the_saga_gradient_varies_far_less_than_the_plain_minibatch_gradient():
    """Least squares: after a few epochs of SAGA (noise-free: the DP noise is additive and independent of the
    estimator), the sampling variance of the SAGA gradient at the current point is much smaller than that of the plain
    Poisson mini-batch gradient (sum_S c / qJ) at the same point."""
    g = torch.Generator().manual_seed(1)
    J, d, C, q, lr = 60, 4, 10.0, 0.1, 0.05
    A = torch.randn(J, d, generator=g)
    b = A @ torch.randn(d, generator=g) + 0.5 * torch.randn(J, generator=g)

    def clipped(z):  # noqa: ANN001, ANN202
        return clip_rows((A @ z - b).unsqueeze(1) * A, C)[0]

    z = torch.zeros(d)
    table = SagaTable(J, d, max_norm=C)
    table.store(list(range(J)), clipped(z))
    for _ in range(40 * int(1 / q)):
        batch = (torch.rand(J, generator=g) < q).nonzero().reshape(-1)
        z = z - lr * saga_step(table, batch, clipped(z)[batch], q, torch.zeros(d))
    current = clipped(z)
    vr, plain = [], []
    for _ in range(2000):
        batch = (torch.rand(J, generator=g) < q).nonzero().reshape(-1)
        vr.append(saga_gradient_sum(table, batch, current[batch], q) / (q * J))
        plain.append(current[batch].sum(0) / (q * J))
    full = current.mean(0)
    var_vr = (torch.stack(vr) - full).pow(2).sum(1).mean()
    var_plain = (torch.stack(plain) - full).pow(2).sum(1).mean()
    assert float(var_plain) > 0.1  # the plain estimator is genuinely noisy here
    assert float(var_vr) < 0.05 * float(var_plain)


# ---- which examples: the sampler's FIFO ------------------------------------------------------------------------------
class OneHotExamples(pl.LightningModule):
    """Example j is the one-hot e_j and its loss w . e_j: its gradient is e_j at every z, so a table row that holds
    another example's gradient is visible. training_step logs, as users' steps do."""

    def __init__(self, J: int) -> None:
        super().__init__()
        self.net = nn.Linear(J, 1, bias=False)
        self.seen: set[int] = set()

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        (x,) = batch
        loss = self.net(x).sum(1).mean()
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.seen.update(batch[0].argmax(1).tolist())

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("table_init", ["full", "zeros"])
def test_a_lightning_fit_stores_each_examples_gradient_in_its_own_row(table_init):
    J = 24
    model = OneHotExamples(J)
    strategy = PrivSGPVRStrategy(max_grad_norm=2.0, noise_multiplier=1.0, noise_seed=3, table_init=table_init)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # a worker process: the loader draws batches from the sampler ahead of the training step
    trainer.fit(model, DataLoader(TensorDataset(torch.eye(J)), batch_size=3, num_workers=1))
    dp = strategy.privacy
    assert trainer.global_step == dp.steps == 3 * 8
    expected = torch.zeros(J, J)
    rows = range(J) if table_init == "full" else sorted(model.seen)
    expected[list(rows), list(rows)] = 1.0
    assert 0 < len(model.seen) < J or table_init == "full"
    assert torch.allclose(dp.table.rows, expected, atol=1e-5)
    assert torch.allclose(dp.table.total.float(), expected.sum(0), atol=1e-5)


def test_the_sampler_records_its_batches_in_order_and_a_new_epoch_drops_prefetched_ones():
    sampler = PoissonBatchSampler(20, 0.3, steps_per_epoch=5, generator=node_noise_generator("cpu", 0, 0, "sampling"))
    fifo = sampler.record_batches()
    epoch = iter(sampler)
    first, second = next(epoch), next(epoch)  # a loader prefetching one batch ahead
    assert fifo.popleft() == first and list(fifo) == [second]
    new_epoch = iter(sampler)
    third = next(new_epoch)  # the prefetched `second` was never trained on
    assert list(fifo) == [third]


def test_the_node_refuses_a_step_whose_gradients_do_not_match_the_sampled_examples():
    module = nn.Linear(3, 2)
    dp = make_node(0, 1.0, 1.0)
    loader = attach_with_data(dp, module, *node_data(0, 8), batch_size=6, steps=4)
    fill(dp, module)
    batch = next(iter(loader))
    assert len(batch[2]) > 0
    squared_loss(module, (torch.cat([batch[0], batch[0][:1]]), torch.cat([batch[1], batch[1][:1]]))).backward()
    with pytest.raises(RuntimeError, match="do not match"):
        private_step(dp)


# ---- accounting ----------------------------------------------------------------------------------------------------
def test_the_node_epsilon_is_the_opacus_composition_of_its_two_mechanisms():
    J, B, steps, noise = 8, 2, 6, 2.5
    module = nn.Linear(3, 2)
    dp = make_node(0, 1.0, noise)
    loader = attach_with_data(dp, module, *node_data(0, J), batch_size=B, steps=steps)
    fill(dp, module)
    done = 0
    while done < steps:
        for batch in loader:
            squared_loss(module, batch).backward()
            private_step(dp)
            done += 1
            if done == steps:
                break
    q, rho = B / J, dp.split
    assert rho is not None and 0 < rho < 1  # at q = 1/4 the split analysis is the tighter one
    hand = RDPAccountant()
    hand.history = [(noise * math.sqrt(rho) / 2, q, steps), (noise * math.sqrt(1 - rho) / q, 1.0, steps)]
    assert dp.epsilon() == pytest.approx(hand.get_epsilon(DELTA), rel=1e-12)
    assert dp.steps == steps and len(dp.ledger.history) == 2
    assert saga_epsilon(noise, q, steps, DELTA, split=rho) == pytest.approx(dp.epsilon(), rel=1e-12)
    assert rho == pytest.approx(optimal_split(noise, q, steps, DELTA), abs=1e-9)
    joint = RDPAccountant()
    joint.history = [(noise / (2 - q), 1.0, steps)]
    assert dp.epsilon() < joint.get_epsilon(DELTA)
    report = dp.report()
    assert report["epsilon"] == dp.epsilon() == report["epsilon_sound_formula"]
    assert report["epsilon_paper_formula"] == pytest.approx(epsilon_for(noise / 3, q, steps, DELTA), rel=1e-12)


def test_the_prv_option_composes_the_same_two_mechanisms_and_is_tighter():
    m, q, steps, rho = 6.0, 0.05, 400, 0.68
    prv = saga_epsilon(m, q, steps, DELTA, split=rho, accountant="prv")
    hand = PRVAccountant()
    hand.history = [(m * math.sqrt(rho) / 2, q, steps), (m * math.sqrt(1 - rho) / q, 1.0, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert prv == pytest.approx(hand.get_epsilon(DELTA), rel=1e-9)
    assert prv <= saga_epsilon(m, q, steps, DELTA, split=rho)


@pytest.mark.parametrize("q,steps", [(32 / 337, 330), (0.01, 2000), (1.0, 40)])
def test_the_optimal_split_is_no_worse_than_any_other_split(q, steps):
    m = 6.0
    rho = optimal_split(m, q, steps, DELTA)
    best = saga_epsilon(m, q, steps, DELTA, split=rho)
    for other in (1e-3, 0.1, 0.3, 0.5, 2 / 3, 0.8, 0.95, 1 - 1e-3):
        assert best <= saga_epsilon(m, q, steps, DELTA, split=other) * (1 + 1e-6)  # up to the search tolerance
    # the two extremes put (almost) no noise on one part: epsilon explodes there
    assert saga_epsilon(m, q, steps, DELTA, split=1e-4) > 10 * best
    assert saga_epsilon(m, q, steps, DELTA, split=1 - 1e-6) > 2 * best


@pytest.mark.slow  # a sweep of RDP accountings
def test_the_sound_accounting_versus_the_paper_formula():
    """q = 1: the split with its best rho = 2/3 ((2C)^2/s1^2 + C^2/s2^2 = 9C^2/s^2) is exactly the paper's sensitivity 3C,
    while the joint analysis sees that every example is in every batch (c - t + t = c: sensitivity C). With
    subsampling the sound bound (the better of the two) is not above the paper's number in these regimes: the paper
    over-charges the sampled part and under-charges the table mean. Each part alone, with all the noise, is a floor."""
    m = 5.0
    rho = optimal_split(m, 1.0, 50, DELTA)
    assert rho == pytest.approx(2 / 3, abs=2e-3)
    assert saga_epsilon(m, 1.0, 50, DELTA, split=rho) == pytest.approx(epsilon_for(m / 3, 1.0, 50, DELTA), rel=1e-4)
    assert saga_epsilon(m, 1.0, 50, DELTA) == pytest.approx(epsilon_for(m, 1.0, 50, DELTA), rel=1e-12)
    regimes = [(1 / 3125, 3120, 2.0), (32 / 337, 330, 2.0), (32 / 337, 330, 8.0), (0.5, 100, 4.0), (0.9, 50, 4.0)]
    for q, steps, m in regimes:
        rho = optimal_split(m, q, steps, DELTA)
        split = saga_epsilon(m, q, steps, DELTA, split=rho)
        joint = saga_epsilon(m, q, steps, DELTA, split=None)
        assert joint == pytest.approx(epsilon_for(m / (2 - q), 1.0, steps, DELTA), rel=1e-12)
        paper = saga_epsilon(m, q, steps, DELTA, accounting="paper")
        assert paper == pytest.approx(epsilon_for(m / 3, q, steps, DELTA), rel=1e-12)
        assert min(split, joint) <= paper * (1 + 1e-9)
        assert split >= epsilon_for(m / 2, q, steps, DELTA)  # the sampled part alone, all the noise on it
        assert split >= epsilon_for(m / q, 1.0, steps, DELTA)  # the table mean alone, all the noise on it
        no_amp = saga_epsilon(m, q, steps, DELTA, accounting="no_amplification")
        assert no_amp == joint
    # the split wins for small q (the digits run: q = 32/337), the joint analysis for large q
    assert sound_split(8.0, 32 / 337, 330, DELTA) is not None
    assert sound_split(8.0, 0.9, 50, DELTA) is None


@pytest.mark.parametrize(
    "accounting,accountant,q,steps,target",
    [("sound", "rdp", 32 / 337, 330, 3.0), ("sound", "rdp", 0.01, 2000, 1.0), ("paper", "rdp", 32 / 337, 330, 3.0),
     ("no_amplification", "rdp", 0.05, 100, 8.0), ("sound", "prv", 32 / 337, 330, 3.0)],
)
def test_calibration_spends_the_target_within_one_percent(accounting, accountant, q, steps, target):
    noise = calibrate_saga_noise(target, DELTA, q, steps, accounting=accounting, accountant=accountant)
    spent = saga_epsilon(noise.noise_multiplier, q, steps, DELTA, accounting=accounting, accountant=accountant,
                         split=noise.split)
    assert 0.99 * target <= spent <= target


def test_calibration_with_a_history_spends_the_rest_of_the_budget():
    q, first = 0.1, 100
    start = calibrate_saga_noise(3.0, DELTA, q, 300)
    history = [(s, r, first) for s, r in start.entries(q)]
    rest = calibrate_saga_noise(3.0, DELTA, q, 400, history=history)
    total = saga_epsilon(rest.noise_multiplier, q, 400, DELTA, split=rest.split, history=history)
    assert 0.99 * 3.0 <= total <= 3.0
    assert rest.noise_multiplier > start.noise_multiplier  # more steps left than planned: more noise


def test_the_paper_accounting_warns_that_it_is_not_a_guarantee():
    with pytest.warns(UserWarning, match="not a guarantee"):
        dp = make_node(0, 1.0, 2.0, accounting="paper")
        attach_with_data(dp, nn.Linear(3, 2), *node_data(0, 8), batch_size=2, steps=4)


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_a_table_above_the_memory_budget_is_refused_before_training_with_its_size_and_the_fix():
    dp = make_node(0, 1.0, 1.0, max_table_bytes=100)
    with pytest.raises(PrivacyConfigError) as err:
        attach_with_data(dp, nn.Linear(3, 2), *node_data(0, 8), batch_size=2, steps=4)
    message = str(err.value)
    assert "8 x 8 x 4" in message and "256 bytes" in message and "max_table_bytes" in message
    assert "bfloat16" in message and "PrivSGPStrategy" in message
    assert SagaTable.nbytes_for(50_000 // 16, 11_173_962) / 1024**3 > 100  # ResNet-18 on a CIFAR-10 shard


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(grad_sample_mode="ghost"), "ghost clipping"), (dict(accounting="moments"), "unknown accounting"),
     (dict(accountant="gdp"), "gdp"), (dict(max_table_bytes=0), "max_table_bytes"),
     (dict(table_init="random"), "table_init"), (dict(table_dtype=torch.int8), "table_dtype")],
)
def test_bad_options_are_refused_when_the_strategy_is_built(kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match):
        PrivSGPVRStrategy(max_grad_norm=1.0, target_epsilon=3.0, target_delta=DELTA, **kwargs)


def test_the_strategy_is_registered_and_defaults_to_the_papers_graph():
    strategy = PRIVATE_STRATEGIES["privsgp_vr"](max_grad_norm=1.0, target_epsilon=3.0, target_delta=DELTA)
    assert isinstance(strategy, PrivSGPVRStrategy)
    assert strategy.topology_spec == "exponential-one-peer" and strategy.compressor is None
    assert strategy.accounting == "sound" and strategy.required_mixing == "column"


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def tensors_in(obj):  # noqa: ANN001, ANN201
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


#: a node's checkpointed state after 4 steps at q = 1/4 of a plan of 8 (target 3)
STATE = {
    "ledger": {"accountant": "rdp", "delta": 1e-05,
               "history": [[1.7537816414746124, 0.25, 4], [7.45024875172985, 1.0, 4]], "steps": 4},
    "noise_multiplier": 3.971415124084777, "plan": [8, 0.25], "steps": 4, "split": 0.7800464410974725,
    "accounting": "sound",
}




def test_a_checkpoint_round_trips():
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=3.0, target_delta=DELTA)
    node = PrivSGPVRNode(parameters, rank=0, device=torch.device("cpu"))
    node.load_state_dict(STATE)
    assert node.state_dict() == STATE
    node.load_state_dict(node.state_dict())
    assert node.steps == 4 and node.epsilon() == pytest.approx(2.2140620521134196, rel=1e-12)


# ---- Corollary 1 ---------------------------------------------------------------------------------------------------
RESNET18 = dict(L=25.0, G=10.0, F0=2.8, b_sq=500_000.0, x0_norm_sq=780_000.0)  # Sec. 5.1, G^2 = 100
CIFAR = dict(J=50_000 // 16, n=16, d=11_173_962, epsilon=3.0, delta=1e-5)  # d: ResNet-18 for CIFAR-10 (not stated)


def test_optimal_steps_reproduces_the_papers_k_star_only_with_an_unstated_c2():
    c2 = c2_for_optimal_steps(3120, **RESNET18, **CIFAR)
    assert optimal_steps(**RESNET18, **CIFAR, c2=c2) == pytest.approx(3120, rel=1e-12)
    assert 0.3 < c2 < 0.45  # K* ~ 3120 needs c2 ~ 0.37 with d = 11.2M parameters; c2 = 1 would give ~430 steps
    assert optimal_steps(**RESNET18, **CIFAR, c2=1.0) == pytest.approx(3120 * c2**2, rel=1e-12)
    # at K*, eq. (11)'s sigma^2 equals a / (24 L d) (Theorem 1's noise term equals the rest) ...
    sigma = paper_noise_std(3120, CIFAR["J"], RESNET18["G"], 3.0, 1e-5, c2)
    a = 13 * 2.8 + 6 * 25 * 780_000 + 18 * 25 * 500_000
    assert sigma**2 == pytest.approx(a / (24 * 25 * CIFAR["d"]), rel=1e-9)

    # ... and K* minimises Theorem 1's bound with that noise
    def bound(K: float) -> float:
        s = paper_noise_std(K, CIFAR["J"], RESNET18["G"], 3.0, 1e-5, c2)
        return theorem1_bound(K, n=16, d=CIFAR["d"], L=25.0, F0=2.8, x0_norm_sq=780_000.0, b_sq=500_000.0,
                              sigmas=[s] * 16)

    assert bound(3120) < min(bound(3120 * 0.8), bound(3120 * 1.25))
    # per-node budgets: one node with a smaller epsilon lowers K*
    budgets = [3.0] * 15 + [1.0]
    assert optimal_steps(**RESNET18, **{**CIFAR, "epsilon": budgets}, c2=c2) < 3120


# ---- privdec-account privsgp-vr ------------------------------------------------------------------------------------
def test_the_account_command_prints_the_accountants_noise_and_both_epsilons(capsys):
    import json

    from lightning_privdec.cli.account import main

    q = 32 / 337
    common = ["--sample-rate", str(q), "--steps", "330", "--delta", "1e-5", "--json"]
    assert main(["privsgp-vr", "--target-epsilon", "3", *common]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = calibrate_saga_noise(3.0, DELTA, q, 330)
    assert result["noise_multiplier"] == expected.noise_multiplier and result["split"] == expected.split
    assert result["epsilon"] == result["epsilon_sound"] == saga_epsilon(
        expected.noise_multiplier, q, 330, DELTA, split=expected.split
    )
    assert result["epsilon_paper"] == pytest.approx(epsilon_for(expected.noise_multiplier / 3, q, 330, DELTA))
    with pytest.raises(SystemExit) as exit_:  # gdp cannot compose the two mechanisms: argparse refuses it
        main(["privsgp-vr", "--noise-multiplier", "8", "--accountant", "gdp", *common])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
