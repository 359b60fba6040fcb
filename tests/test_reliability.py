"""Bad input is refused before the first step on every node, non-finite steps stop the node that produced them, and
checkpoints hold no per-sample gradients. One process each (the multi-process faults: test_reliability_multiprocess).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec import (
    CorrelatedNoiseStrategy,
    DecentralizedPushSumStrategy,
    DPCSGPStrategy,
    PrivacyConfigError,
    PrivSGPStrategy,
    PrivSGPVRStrategy,
)
from lightning_privdec.compression import DRAW_FORMAT
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.strategies import STRATEGIES, DecentralizedStrategy
from tests.small_classifier import Classifier, dataset
from lightning_privdec.strategies.process_group import ProcessGroupStrategy
from tests.strategy_arguments import STRATEGY_ARGUMENTS
from lightning_privdec.strategies.checks import (
    NodeMismatchError,
    NonFiniteStepError,
    check_same_configuration,
    common_steps_per_epoch,
    describe,
    nonfinite_parameters,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:Total length of `DataLoader`"),
]


def data(n: int = 256, batch_size: int = 16) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size)


def trainer(tmp_path: Path, strategy: object, checkpoints: bool = True, **kwargs: object) -> pl.Trainer:
    """A one-node Trainer that logs every step to CSV under tmp_path and (by default) checkpoints every step."""
    options = dict(max_steps=6, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False)
    every_step = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=CSVLogger(tmp_path, name="log"),
        callbacks=[every_step] if checkpoints else [], enable_checkpointing=checkpoints, **{**options, **kwargs},
    )


def written(tmp_path: Path) -> list[str]:
    """Checkpoints and metric files a run left behind (hparams.yaml, written at setup, holds no training result)."""
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.suffix in (".ckpt", ".csv"))


def private(**kwargs: object) -> PrivSGPStrategy:
    return PrivSGPStrategy(**{"max_grad_norm": 1.0, "noise_multiplier": 1.0, "noise_seed": 0, **kwargs})


# ============================================================================ the same configuration on every node
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_argument_is_compared_across_nodes_or_declared_local(name: str) -> None:
    cls = STRATEGIES[name]
    arguments = {
        p.name
        for klass in cls.__mro__ if isinstance(klass, type) and issubclass(klass, ProcessGroupStrategy)
        for p in inspect.signature(klass.__init__).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    }
    strategy = cls(**STRATEGY_ARGUMENTS[name])
    local = {n for klass in cls.__mro__ for n in vars(klass).get("local_options", ())}
    compared = set(strategy.configuration())
    assert arguments - compared - local == set(), f"{cls.__name__}: add these to shared_options or local_options"
    assert not compared & local


def configuration(strategy: DecentralizedStrategy) -> dict[str, str]:
    return {name: describe(value) for name, value in strategy.configuration().items()}


def test_nodes_with_different_configurations_are_named_on_every_node() -> None:
    base = configuration(DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=1))
    other = configuration(DPCSGPStrategy(max_grad_norm=2.0, noise_multiplier=1.0, noise_seed=2, compressor="topk:0.1"))
    check_same_configuration([base, base], rank=0)  # agreement passes
    for rank in (0, 1, 2):
        with pytest.raises(NodeMismatchError) as error:
            check_same_configuration([base, other, base], rank=rank)
        message = str(error.value)
        assert message.startswith(f"node {rank}: the 3 nodes were started with different configurations")
        assert "max_grad_norm -> ranks 0, 2: 1.0; rank 1: 2.0" in message
        assert (f"compressor -> ranks 0, 2: RandK(ratio=0.5) (draw format {DRAW_FORMAT}); rank 1: TopK(ratio=0.1) "
                f"(draw format {DRAW_FORMAT})") in message.replace("'", "")
        assert "noise_seed" not in message  # a per-node seed may differ; seeded vs OS entropy may not
        assert "same script and command line" in message
    older = dict(base, compressor="'RandK(ratio=0.5)'")  # a version that drew the kept positions differently
    with pytest.raises(NodeMismatchError, match=r"compressor -> rank 0: 'RandK\(ratio=0.5\) \(draw format"):
        check_same_configuration([base, older], rank=0)
    secure = configuration(DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0))
    with pytest.raises(NodeMismatchError, match="noise_seed -> rank 0: 'fixed seed'; rank 1: 'OS entropy'"):
        check_same_configuration([base, secure], rank=0)
    # long values (graphs, model shapes) travel as digests, still compared
    assert describe(list(range(100))).startswith("sha256:") and describe(list(range(100))) != describe(list(range(99)))
    assert describe(1e-5) == "1e-05"


def test_decor_key_files_may_live_in_a_different_directory_on_each_node() -> None:
    a = configuration(CorrelatedNoiseStrategy(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0, key_file_dir="/a"))
    b = configuration(CorrelatedNoiseStrategy(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0, key_file_dir="/b"))
    check_same_configuration([a, b], rank=0)
    c = configuration(CorrelatedNoiseStrategy(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=2.0))
    with pytest.raises(NodeMismatchError, match="sigma_cor -> rank 0: 1.0; rank 1: 2.0"):
        check_same_configuration([a, c], rank=0)


def test_nodes_must_have_data_and_take_a_common_number_of_steps() -> None:
    assert common_steps_per_epoch([5, 5, 5], rank=0, max_steps=-1) == (5, None)
    with pytest.raises(NodeMismatchError, match=r"node 1: the training data of rank 2 is empty .*Give every node"):
        common_steps_per_epoch([5, 5, 0, 5], rank=1, max_steps=-1)
    steps, note = common_steps_per_epoch([5, 60], rank=1, max_steps=-1)  # unequal shards: node 0's epoch
    assert steps == 5 and "rank 0: 5, rank 1: 60" in note and "node 0's 5 steps" in note
    with pytest.raises(NodeMismatchError, match=r"rank 1 has no length .*Set Trainer\(max_steps=...\)"):
        common_steps_per_epoch([5, None], rank=0, max_steps=-1)  # an IterableDataset
    assert common_steps_per_epoch([None, None], rank=0, max_steps=40)[0] == 40


# ============================================================================ bad input: refused before the first step
def empty_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)), batch_size=4)


SETUP_ERRORS = {
    "empty shard": (lambda: DecentralizedPushSumStrategy(), {}, {}, empty_loader, NodeMismatchError,
                    "training data of rank 0 is empty"),
    "empty private shard": (lambda: private(node_local_data=True), {}, {}, empty_loader, NodeMismatchError,
                            "training data of rank 0 is empty"),
    "delta >= 1/J": (lambda: private(target_delta=0.01), {}, {},
                     lambda: data(n=256), PrivacyConfigError,
                     r"target_delta=0.01 is not below 1/J = 0.00391 for node 0's shard of J=256 examples.*Use "
                     r"target_delta <= 0.0004"),
    "unreachable epsilon": (lambda: private(noise_multiplier=None, target_epsilon=1e-3, target_delta=1e-5),
                            {}, {"max_steps": 500}, data, PrivacyConfigError, "cannot reach target_epsilon=0.001"),
    "BatchNorm": (private, {"batch_norm": True}, {}, data, PrivacyConfigError, "net.1.*BatchNorm1d"),
    "manual optimization": (private, {"manual": True}, {}, data, PrivacyConfigError,
                            "automatic optimization only.*Remove `self.automatic_optimization = False`"),
    "gradient accumulation in PrivSGP-VR": (
        lambda: PrivSGPVRStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0), {},
        {"accumulate_grad_batches": 2}, data, PrivacyConfigError, "needs the whole Poisson batch at once"),
    "no planned end": (private, {}, {"max_steps": -1, "max_epochs": -1}, data, PrivacyConfigError,
                       "set max_steps or max_epochs"),
    "sync_batchnorm": (lambda: DecentralizedPushSumStrategy(), {"batch_norm": True}, {"sync_batchnorm": True},
                       data, ValueError, "does not support sync_batchnorm.*Use GroupNorm"),
}


@pytest.mark.parametrize("case", list(SETUP_ERRORS))
def test_bad_input_is_refused_before_the_first_step_and_nothing_is_written(case: str, tmp_path: Path) -> None:
    make_strategy, model_kwargs, trainer_kwargs, loader, error, message = SETUP_ERRORS[case]
    model = Classifier(**model_kwargs)
    fit = trainer(tmp_path, make_strategy(), **trainer_kwargs)
    with pytest.raises(error, match=message):
        fit.fit(model, loader())
    assert fit.global_step == 0
    assert written(tmp_path) == []


def test_delta_is_checked_against_the_shard_size() -> None:
    params = PrivacyParameters(max_grad_norm=1.0, target_epsilon=1.0, target_delta=1e-3)
    params.check_delta(999)
    with pytest.raises(PrivacyConfigError, match="not below 1/J = 0.001 for node 3's shard of J=1000"):
        params.check_delta(1000, rank=3)
    with pytest.warns(UserWarning, match="default delta=1e-05, which is not below 1/J .* J=200000"):
        PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0).check_delta(200_000)


def test_peer_timeout_is_validated() -> None:
    assert DecentralizedPushSumStrategy(peer_timeout=20).peer_timeout.total_seconds() == 20
    with pytest.raises(ValueError, match="peer_timeout must be a positive"):
        DecentralizedPushSumStrategy(peer_timeout=0)


# ============================================================================ non-finite steps
def test_a_nan_loss_stops_the_node_naming_node_and_step_before_anything_leaves_it(tmp_path: Path) -> None:
    strategy = DecentralizedPushSumStrategy()
    model = Classifier(nan_at_step=3)
    fit = trainer(tmp_path, strategy, checkpoints=False)
    with pytest.raises(NonFiniteStepError, match=r"node 0, step 3: non-finite loss \(nan\) and gradient of "
                       r"net.0.weight, net.0.bias, net.2.weight and 1 more\. .*learning rate too large.*resume every"):
        fit.fit(model, data())
    assert strategy.gossip.round == 3  # steps 0, 1, 2 gossiped; step 3 neither updated nor gossiped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(strategy.gossip.x).all()


def test_the_gradient_check_names_exactly_the_non_finite_parameters() -> None:
    grads = {"a": torch.ones(5), "b": torch.ones(3), "c": torch.full((4,), 3e38), "d": torch.ones(2)}
    params = [(name, nn.Parameter(torch.zeros_like(g))) for name, g in grads.items()]
    for (name, p) in params:
        p.grad = grads[name].clone()
    assert nonfinite_parameters(params) == []  # c's sum overflows to inf, yet every entry is finite
    params[1][1].grad[2] = float("nan")
    params[3][1].grad[0] = float("-inf")
    assert nonfinite_parameters(params) == ["b", "d"]


def test_a_nan_gradient_stops_a_private_node_and_its_sampled_step_stays_in_the_ledger(tmp_path: Path) -> None:
    strategy = private()
    model = Classifier(nan_at_step=3)
    fit = trainer(tmp_path, strategy, checkpoints=False)
    with pytest.raises(NonFiniteStepError, match=r"node 0, step 3: non-finite gradient of net.0.weight"):
        fit.fit(model, data())
    assert strategy.gossip.round == 3 and all(torch.isfinite(p).all() for p in model.parameters())
    assert strategy.privacy.ledger.steps == 4  # the failed step's batch was sampled: it is counted


# ============================================================================ the write-ahead ledger, streams, max_time
def test_the_write_ahead_ledger_lives_with_the_checkpoints_or_logs_never_in_the_working_directory(tmp_path: Path) -> None:
    budget = dict(max_grad_norm=1.0, noise_multiplier=1.0)
    bare = pl.Trainer(accelerator="cpu", devices=1, strategy=DPCSGPStrategy(**budget), max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path / "bare")
    bare.fit(Classifier(), data())
    assert not list((tmp_path / "bare").rglob("node_*.pt"))  # nothing can resume it: no file
    bare.save_checkpoint(tmp_path / "bare" / "by_hand.ckpt")  # now a resume is possible: later steps are written
    assert bare.strategy._write_ahead_ledger().directory == (tmp_path / "bare" / "privacy_ledger").absolute()
    logged = trainer(tmp_path / "logged", DPCSGPStrategy(**budget), checkpoints=False)
    logged.fit(Classifier(), data())
    assert [p.parent.parent for p in (tmp_path / "logged").rglob("node_0.pt")] == [Path(logged.log_dir) / "privacy_ledger"]
    checkpointed = trainer(tmp_path / "ckpt", DPCSGPStrategy(**budget))
    checkpointed.fit(Classifier(), data())
    assert [p.parent.parent for p in tmp_path.joinpath("ckpt").rglob("node_0.pt")] == [
        tmp_path / "ckpt" / "ckpt" / "privacy_ledger"
    ]


def test_a_private_strategy_refuses_a_stream_and_says_why_and_how(tmp_path: Path) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(TensorDataset(torch.randn(32, 8), torch.zeros(32, dtype=torch.long)))

    run = trainer(tmp_path, private(), checkpoints=False)
    with pytest.raises(PrivacyConfigError, match="IterableDataset: Poisson sampling.*needs a finite shard.*map-style"):
        run.fit(Classifier(), DataLoader(Stream(), batch_size=8))
    assert run.global_step == 0


class SlowClassifier(Classifier):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(0.05)  # a step of known length, so max_time allows far fewer steps than max_epochs plans
        return super().training_step(batch, batch_idx)


@pytest.mark.slow  # runs until its wall-clock limit
def test_max_time_replans_sigma_so_the_budget_is_spent_by_the_time_limit(tmp_path: Path, caplog) -> None:
    strategy = DPCSGPStrategy(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, noise_seed=0)
    # 5 s: the Trainer's set-up and the re-plan's 5 warm-up steps fit in it on a loaded machine (3 s did not at load 9)
    run = trainer(tmp_path, strategy, checkpoints=False, max_steps=-1, max_epochs=100, max_time={"seconds": 5})
    with caplog.at_level("INFO"):
        run.fit(SlowClassifier(), data())
    dp = strategy.privacy
    planned_by_epochs = 100 * 16
    replanned = next(r.getMessage() for r in caplog.records if "max_time allows about" in r.getMessage())
    assert f"not the {planned_by_epochs} planned" in replanned
    assert dp.planned_steps < planned_by_epochs / 5  # at most 5 s / 0.05 s = 100 steps, not 1600
    assert dp.noise_multiplier < dp.ledger.history[0][0]  # less noise after the re-plan
    assert dp.ledger.history[-1][0] in (dp.ledger.history[0][0], dp.noise_multiplier)  # (a loaded machine
    # may reach max_time before a step at the new sigma)
    assert run.global_step < planned_by_epochs and dp.epsilon() <= 3.0
    assert not any("default of max_epochs=1000" in r.getMessage() for r in caplog.records)
