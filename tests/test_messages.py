"""What a new user is told: every setting a strategy cannot honour is refused before training with why and what to do,
every setting it changes is said once in plain words, and nothing a user cannot act on is printed. One process each;
the one multi-process test checks that a refused setup prints one message per run, not one traceback per rank."""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_privdec import (
    CorrelatedNoiseStrategy,
    CPGTStrategy,
    DecentralizedPushSumStrategy,
    PrivacyConfigError,
    PrivSGPStrategy,
    RandK,
)
from lightning_privdec.privacy import check_private_model
from lightning_privdec.privacy.local_dp import check_sampler_is_replaceable
from lightning_privdec.strategies import NAME_ONLY_PRIVACY, PRIVATE_STRATEGIES, STRATEGIES
from lightning_privdec.strategies.checks import (
    NodeMismatchError,
    check_same_configuration,
    model_difference,
    raised_on_every_node,
)
from tests.small_classifier import Classifier, dataset
from tests.multiprocess import run_group

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:Total length of `DataLoader`"),
]


def fit(strategy: object, loader: DataLoader | None = None, **kwargs: object) -> pl.Trainer:
    options = dict(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, **{**options, **kwargs})
    trainer.fit(Classifier(), loader if loader is not None else DataLoader(dataset(), batch_size=16))
    return trainer


def private(**kwargs: object) -> PrivSGPStrategy:
    return PrivSGPStrategy(**{"max_grad_norm": 1.0, "noise_multiplier": 1.0, "noise_seed": 0, **kwargs})


def said(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.INFO) -> int:
    """How many records at ``level`` or above contain ``text``."""
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= level)


# ============================================================================ a custom sampler
def test_a_weighted_sampler_is_refused_with_why_and_what_to_do() -> None:
    data = dataset()
    weighted = WeightedRandomSampler(torch.ones(len(data)), num_samples=len(data))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=private(), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(PrivacyConfigError) as refused:
        trainer.fit(Classifier(), DataLoader(data, batch_size=16, sampler=weighted))
    message = str(refused.value)
    assert "WeightedRandomSampler" in message and "Poisson sampling" in message  # what and why
    assert "weight the loss" in message and "node_indices" in message  # what to do
    assert trainer.global_step == 0


def test_only_samplers_that_poisson_sampling_can_stand_for_are_kept() -> None:
    data = dataset(40)
    for kept in (SequentialSampler(data), RandomSampler(data), DistributedSampler(data, num_replicas=2, rank=1)):
        check_sampler_is_replaceable(kept, len(data))
    refused = [
        WeightedRandomSampler(torch.ones(40), num_samples=40),
        RandomSampler(data, replacement=True),
        RandomSampler(data, num_samples=10),
        SubsetRandomSampler(range(10)),
        DistributedSamplerWrapper(WeightedRandomSampler(torch.ones(40), num_samples=40), num_replicas=2, rank=0),
    ]
    for sampler in refused:  # Lightning wraps a user's sampler in DistributedSamplerWrapper on several devices
        with pytest.raises(PrivacyConfigError, match="private strategies cannot keep"):
            check_sampler_is_replaceable(sampler, len(data))


# ============================================================================ Lightning's gradient clipping
def test_lightnings_gradient_clipping_is_refused_beside_dp_clipping() -> None:
    with pytest.raises(PrivacyConfigError) as refused:
        fit(private(), gradient_clip_val=0.5)
    message = str(refused.value)
    assert "gradient_clip_val=0.5" in message and "after its noise is added" in message
    assert "Remove gradient_clip_val" in message and "max_grad_norm" in message
    fit(DecentralizedPushSumStrategy(), gradient_clip_val=0.5)  # without privacy it clips as Lightning does


# ============================================================================ one node
def test_one_node_is_said_plainly_once(caplog: pytest.LogCaptureFixture) -> None:
    strategy = DecentralizedPushSumStrategy(topology="exponential", compressor=RandK(0.5))
    with caplog.at_level(logging.INFO):
        trainer = fit(strategy)
        trainer.fit_loop.epoch_loop.max_steps = 6
        trainer.fit(trainer.lightning_module, DataLoader(dataset(), batch_size=16))  # a second fit: nothing new
    assert said(caplog, "runs on ONE node (devices x num_nodes = 1): there is no neighbour to gossip with") == 1
    assert said(caplog, "1 nodes") == 0


# ============================================================================ Decor has no compression
@pytest.mark.parametrize("compressor", [RandK(0.5), "randk:0.5"])
def test_decor_refuses_a_compressor(compressor: object) -> None:
    with pytest.raises(PrivacyConfigError, match=r"does not support compressor=RandK.*Use compressor=None"):
        CorrelatedNoiseStrategy(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0, compressor=compressor)
    assert CorrelatedNoiseStrategy(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0).compressor is None


# ============================================================================ every registered name works
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_name_works_as_a_string(name: str, caplog: pytest.LogCaptureFixture) -> None:
    if STRATEGIES[name] is CPGTStrategy:  # its epsilon rests on the user's L: refused with the call to write
        with pytest.raises(PrivacyConfigError, match=r"strategy='cpgt' needs .*lipschitz=.*CPGTStrategy\(lipschitz="):
            pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        return
    with caplog.at_level(logging.INFO):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert type(trainer.strategy) is STRATEGIES[name]
        assert type(pl.Trainer(accelerator="cpu", devices=2, strategy=f"{name}_spawn").strategy) is STRATEGIES[name]
    if name in PRIVATE_STRATEGIES:  # the name's privacy is stated, with how to choose it
        assert trainer.strategy.privacy_parameters.max_grad_norm == NAME_ONLY_PRIVACY["max_grad_norm"]
        assert trainer.strategy.privacy_parameters.target_epsilon == NAME_ONLY_PRIVACY["target_epsilon"]
        assert said(caplog, f"strategy={name!r} is {STRATEGIES[name].__name__} with max_grad_norm=1.0, "
                            "target_epsilon=3.0, target_delta=1e-05") == 2  # once per Trainer
        assert said(caplog, f"pass strategy={STRATEGIES[name].__name__}(max_grad_norm=...") == 2


@pytest.mark.parametrize("name", [
    name if name in ("push_sum", "dp_csgp") else pytest.param(name, marks=pytest.mark.slow)  # the rest: 2-9 s each
    for name in sorted(STRATEGIES) if STRATEGIES[name] is not CPGTStrategy
])
def test_a_strategy_given_by_name_trains(name: str) -> None:
    trainer = fit(name, max_steps=2)
    assert trainer.global_step == 2


# ============================================================================ one readable message
def test_a_refused_layer_list_names_the_first_few_and_counts_the_rest() -> None:
    model = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(4, 4), nn.BatchNorm1d(4))])
    with pytest.raises(PrivacyConfigError) as refused:
        check_private_model(model)
    lines = str(refused.value).splitlines()
    assert [line.split(" (")[0] for line in lines[1:4]] == ["  - 1", "  - 3", "  - 5"]
    assert lines[4] == "  - and 7 more BatchNorm1d layers alike (10 in all)"
    assert len(lines) == 6  # the heading, 3 layers, the count, the fix
    with pytest.warns(UserWarning, match=r"place: 1: BatchNorm1d.*; 5: BatchNorm1d\(4.*\) and 7 more\. The new"):
        check_private_model(model, fix=True)


def test_an_error_every_node_raises_is_printed_by_rank_0_only(capsys: pytest.CaptureFixture) -> None:
    previous = sys.excepthook
    try:
        quiet = raised_on_every_node(NodeMismatchError("rank 1's copy"), rank=1)
        sys.excepthook(type(quiet), quiet, None)
        other = ValueError("an error of this rank only")
        sys.excepthook(type(other), other, None)
        loud = raised_on_every_node(NodeMismatchError("rank 0's copy"), rank=0)
        sys.excepthook(type(loud), loud, None)
    finally:
        sys.excepthook = previous
    printed = capsys.readouterr().err
    assert "rank 1's copy" not in printed
    assert "an error of this rank only" in printed and "rank 0's copy" in printed


def test_different_models_are_told_apart_by_layer_name_and_shape() -> None:
    a = [("net.0.weight", "(16, 8) float32"), ("net.0.bias", "(16,) float32"), ("net.2.weight", "(3, 16) float32")]
    b = [("net.0.weight", "(16, 8) float32"), ("net.0.bias", "(16,) float32"), ("net.2.weight", "(3, 32) float32")]
    assert model_difference([a, a, b]) == (
        "different models; the first difference is trainable parameter 3: ranks 0, 1: net.2.weight (3, 16) float32; "
        "rank 2: net.2.weight (3, 32) float32"
    )
    assert model_difference([a, a[:2]]).endswith(
        "parameter 3: rank 0: net.2.weight (3, 16) float32; rank 1: no parameter; trainable parameters: rank 0: 3, "
        "rank 1: 2")
    with pytest.raises(NodeMismatchError) as mismatch:
        check_same_configuration([{"model": "sha256:aaaa"}, {"model": "sha256:bbbb"}], rank=0,
                                 details={"model": model_difference([a, b])})
    assert "model -> different models; the first difference is trainable parameter 3" in str(mismatch.value)
    assert "sha256" not in str(mismatch.value)


BAD_SETUP = Path(__file__).parent / "scripts" / "bad_setup.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("case", "message"), [
    ("batch_norm", "  - and 9 more BatchNorm1d layers alike (12 in all)"),
    ("model", "model -> different models; the first difference is trainable parameter 1: rank 0: net.0.weight "
              "(16, 8) float32; rank 1: net.0.weight (32, 8) float32"),
])
def test_a_refused_setup_prints_one_message_per_run_not_one_per_rank(case: str, message: str) -> None:
    run = run_group([sys.executable, str(BAD_SETUP), case], timeout=240)
    assert run.returncode != 0
    assert run.stderr.count(message) == 1, run.stderr[-4000:]
    assert run.stderr.count("Traceback") == 1
    assert "[rank1]" not in run.stderr


# ============================================================================ nothing a user cannot act on
def test_the_automatic_consensus_step_is_not_announced(caplog: pytest.LogCaptureFixture) -> None:
    strategy = DecentralizedPushSumStrategy(topology="exponential", compressor=RandK(0.5))
    with caplog.at_level(logging.DEBUG):
        fit(strategy)
    assert said(caplog, "consensus_step='auto' chose gamma") == 0
    assert said(caplog, "consensus_step='auto' chose gamma = 0.382 for RandK(ratio=0.5)", logging.DEBUG) == 1
    assert strategy.consensus_step == pytest.approx(0.382, abs=1e-3)  # chosen and used, and kept on the strategy


# ============================================================================ peer_timeout
@pytest.mark.parametrize("timeout", [-5, timedelta(seconds=-5), float("nan")])
def test_a_bad_peer_timeout_is_reported_in_seconds(timeout: object) -> None:
    with pytest.raises(ValueError) as refused:
        DecentralizedPushSumStrategy(peer_timeout=timeout)
    message = str(refused.value)
    assert message.startswith("peer_timeout must be a positive number of seconds, got ")
    assert ("got -5 s" in message or "got nan s" in message) and "timedelta(" not in message
    assert DecentralizedPushSumStrategy(peer_timeout=timedelta(minutes=2)).peer_timeout == timedelta(seconds=120)
