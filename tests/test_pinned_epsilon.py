"""The epsilon every private strategy prints at the end of a fixed small run, pinned.

The values were measured before the package was restructured into one algorithm file per paper; moving code must not
change what any strategy prints, calibrates or enforces. Each run: one node, a fixed noise seed, 4 steps of a
3-class problem (64 examples, batch 16), once with a budget to calibrate to and once with given noise levels.
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.strategies import PRIVATE_STRATEGIES

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:CPGT's epsilon covers"),
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
]

#: (strategy, arguments) -> (printed epsilon, private steps, the node's epsilon() in full precision)
PINNED: dict[tuple[str, str], tuple[float, int, float]] = {
    ('cpgt', 'budget'): (50.0, 4, 50.0),
    ('cpgt', 'noise'): (153.6772, 4, 153.67724884627154),
    ('decor', 'budget'): (3.0, 4, 2.999999999992198),
    ('decor', 'noise'): (4.8706, 4, 4.870641742929558),
    ('dp2sgd', 'budget'): (2.994, 4, 2.993994139619158),
    ('dp2sgd', 'noise'): (3.1394, 4, 3.139354521534549),
    ('dp_csgp', 'budget'): (2.994, 4, 2.993994139619158),
    ('dp_csgp', 'noise'): (3.1394, 4, 3.139354521534549),
    ('dyn_d2p', 'budget'): (2.9998, 4, 2.9998206347941356),
    ('dyn_d2p', 'noise'): (1.0, 4, 0.9999848847502559),
    ('privsgp', 'budget'): (2.994, 4, 2.993994139619158),
    ('privsgp', 'noise'): (3.1394, 4, 3.139354521534549),
    ('privsgp_vr', 'budget'): (3.0, 4, 2.999999995451111),
    ('privsgp_vr', 'noise'): (12.82, 4, 12.81995115021643),
}

CONFIGURATIONS = {
    "budget": {
        "dp_csgp": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
        "privsgp": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
        "dp2sgd": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
        "privsgp_vr": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
        "dyn_d2p": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
        "decor": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
        "cpgt": dict(max_grad_norm=1.0, target_epsilon=50.0, noise_decay=0.9, lipschitz=0.1, accounting="finite"),
    },
    "noise": {
        "dp_csgp": dict(max_grad_norm=1.0, noise_multiplier=1.3),
        "privsgp": dict(max_grad_norm=1.0, noise_multiplier=1.3),
        "dp2sgd": dict(max_grad_norm=1.0, noise_multiplier=1.3),
        "privsgp_vr": dict(max_grad_norm=1.0, noise_multiplier=1.3),
        "dyn_d2p": dict(max_grad_norm=1.0, target_epsilon=1.0, target_delta=1e-5, variant="const"),
        "decor": dict(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0),
        "cpgt": dict(max_grad_norm=1.0, noise_x=0.1, noise_y=0.1, noise_decay=0.9, lipschitz=0.1, accounting="finite"),
    },
}


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def printed_epsilon(name: str, arguments: dict, tmp_path, caplog) -> tuple[float, int, float]:
    """Fit 4 steps on one node; the epsilon and step count of the end-of-fit summary line, and the node's own."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=16)
    strategy = PRIVATE_STRATEGIES[name](noise_seed=0, **arguments)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    with caplog.at_level("INFO"):
        trainer.fit(Classifier(), loader)
    summary = next(r.getMessage() for r in caplog.records if "final privacy per node" in r.getMessage())
    epsilon, steps = re.search(r"node 0: epsilon = ([0-9.]+|inf) after (\d+) private steps", summary).groups()
    return float(epsilon), int(steps), strategy.privacy.epsilon()


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
@pytest.mark.parametrize("name", sorted(PRIVATE_STRATEGIES))
def test_every_strategy_prints_the_pinned_epsilon(name: str, configuration: str, tmp_path, caplog) -> None:
    assert set(CONFIGURATIONS[configuration]) == set(PRIVATE_STRATEGIES)  # a new strategy joins this table
    measured = printed_epsilon(name, CONFIGURATIONS[configuration][name], tmp_path, caplog)
    assert measured == pytest.approx(PINNED[name, configuration], rel=1e-9), (name, configuration, measured)
