"""Every private strategy fitted in turn on 2 nodes; each rank writes ``<out>/<strategy>/rank<r>.pt``: its final
parameters, its ledger and the bytes of every message it sent (tests/test_node_step.py compares them with the
simulator's). ``python tests/scripts/fit_every_strategy.py --out DIR --key-dir DIR``. The ranks of each fit are forked
from this process (Lightning's multiprocessing launcher, ``start_method="fork"``: the steps are what is compared, and
forking skips each rank's import of Lightning); each writes its outcome in :class:`WriteOutcome`, in its own process."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.node_step_cases

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_privdec.audit.observer import WireTap  # noqa: E402
from lightning_privdec.strategies import PRIVATE_STRATEGIES  # noqa: E402
from tests.node_step_cases import NODES, STEPS, NodeClassifier, outcome, strategy_arguments  # noqa: E402

warnings.filterwarnings("ignore", message=".*does not have many workers")


class WriteOutcome(Callback):
    """After the fit, in the rank's own process: its parameters, ledger and sent bytes to ``<out>/rank<r>.pt``."""

    def __init__(self, out: Path, taps: list[WireTap]) -> None:
        self.out, self.taps = out, taps

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (tap,) = self.taps
        self.out.mkdir(parents=True, exist_ok=True)
        result = outcome(pl_module, trainer.strategy.privacy.ledger, tap.sent)
        torch.save(result, self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--key-dir", type=Path, required=True)
    args = parser.parse_args()
    for name in sorted(PRIVATE_STRATEGIES):
        strategy = PRIVATE_STRATEGIES[name](**strategy_arguments(name, args.key_dir), start_method="fork")
        taps: list[WireTap] = []
        plain_exchange = strategy.make_exchange

        def tapped_exchange() -> WireTap:
            taps.append(WireTap(plain_exchange()))
            return taps[-1]

        strategy.make_exchange = tapped_exchange  # type: ignore[method-assign]
        model = NodeClassifier()
        trainer = L.Trainer(
            accelerator="cpu", devices=NODES, strategy=strategy, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False,  # each node trains on its own data (node_local_data=True)
            callbacks=[WriteOutcome(args.out / name, taps)],
        )
        trainer.fit(model)


if __name__ == "__main__":
    main()
