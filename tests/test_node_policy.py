"""The privacy policy around a node's steps, without Lightning (algorithms/node.py: the planned steps, where the
write-ahead ledger goes), and the Lightning base class the strategies derive from (strategies/process_group.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, StrategyRegistry

from lightning_privdec.algorithms.node import WriteAheadPlace, planned_steps
from lightning_privdec.privacy import PrivacyConfigError
from lightning_privdec.strategies import STRATEGIES, DPCSGPStrategy


def test_the_planned_steps_are_the_first_limit_reached() -> None:
    assert planned_steps(10, limit_batches=1.0, max_epochs=3, max_steps=-1) == 30
    assert planned_steps(10, limit_batches=1.0, max_epochs=3, max_steps=7) == 7
    assert planned_steps(10, limit_batches=4, max_epochs=3, max_steps=None) == 12  # a count of batches
    assert planned_steps(10, limit_batches=0.25, max_epochs=2, max_steps=None) == 4  # a fraction: int(2.5) = 2
    assert planned_steps(10, limit_batches=0.01, max_epochs=2, max_steps=None) == 2  # at least one batch
    assert planned_steps(10, limit_batches=1.0, max_epochs=-1, max_steps=50) == 50


@pytest.mark.parametrize("time_limited", [False, True])
def test_a_run_without_an_end_is_refused_with_what_to_set(time_limited: bool) -> None:
    with pytest.raises(PrivacyConfigError, match="set max_steps or max_epochs") as error:
        planned_steps(10, limit_batches=1.0, max_epochs=-1, max_steps=-1, time_limited=time_limited)
    assert ("with max_time, sigma is re-planned" in str(error.value)) == time_limited


def test_the_write_ahead_ledger_goes_to_the_first_directory_given_and_is_looked_up_once(tmp_path: Path) -> None:
    place = WriteAheadPlace(True, rank=1, seeded=False)
    assert place.open(lambda: [tmp_path / "ckpt"]) is None  # no run id yet: nothing is written
    place.run = "run0"
    calls: list[int] = []

    def directories() -> list[Path | None]:
        calls.append(1)
        return [None, tmp_path / "logs", tmp_path / "root"]

    ledger = place.open(directories)
    assert ledger is not None and ledger.path == (tmp_path / "logs" / "privacy_ledger" / "run0" / "node_1.pt")
    assert place.open(directories) is ledger and len(calls) == 1  # opened once (the log directory is broadcast)
    assert place.checkpoint_entry() == {"run": "run0", "dir": str((tmp_path / "logs" / "privacy_ledger"))}


def test_without_a_directory_or_with_seeded_noise_no_ledger_is_written(tmp_path: Path) -> None:
    place = WriteAheadPlace(True, rank=0, seeded=False)
    place.run = "run0"
    assert place.open(lambda: [None, None, None]) is None and place.checkpoint_entry() is None
    given = WriteAheadPlace(tmp_path / "given", rank=0, seeded=False)
    given.run = "run0"
    assert given.open(lambda: pytest.fail("a given path needs no lookup")).directory == tmp_path / "given"
    for setting in (False, None):
        off = WriteAheadPlace(setting, rank=0, seeded=False)
        off.run = "run0"
        assert off.open(lambda: [tmp_path]) is None
    seeded = WriteAheadPlace(True, rank=0, seeded=True)
    seeded.run = "run0"
    assert seeded.open(lambda: [tmp_path]) is None


def test_every_strategy_is_a_parallel_strategy_without_ddp() -> None:
    """The strategies derive from Lightning's ParallelStrategy (not DDPStrategy, disabled); Lightning treats them
    as distributed (DistributedSampler per node, sync_dist logging), and every registered name builds one."""
    strategy = DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0)
    assert isinstance(strategy, ParallelStrategy) and not isinstance(strategy, DDPStrategy)
    assert strategy.is_distributed
    for name in STRATEGIES:
        if name != "cpgt":  # refused by name alone (its constant L): tests/test_messages.py
            for registered in (name, name + "_spawn"):
                built = StrategyRegistry.get(registered)
                assert isinstance(built, STRATEGIES[name]) and isinstance(built, ParallelStrategy)
