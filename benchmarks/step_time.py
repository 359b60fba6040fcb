"""Per-step wall time on N CPU processes: Lightning DDP, Opacus DP-SGD on DDP, push-sum and every private strategy.

What it measures
----------------
The same model (an MLP, 784-H-H/2-10, about 1.3M parameters with the default H=1024), the same synthetic data
(fixed seed, batch 64 per process) and the same optimizer (plain SGD, lr 0.01) are trained for ``--warmup + --steps``
steps under each configuration, each in its own fresh N-process Lightning run (gloo on CPU):

    non-private   ddp         Lightning's DDPStrategy (gradient all-reduce)
                  push_sum    DecentralizedPushSumStrategy("exponential-one-peer"), uncompressed
                  randk, topk, qsgd   ... with RandK(0.1), TopK(0.01), QSGD(8)
    private       opacus_ddp  Opacus's own distributed DP-SGD inside Lightning's DDPStrategy: opacus.GradSampleModule
                              hooks, opacus.distributed.DPDDP instead of torch DDP, opacus.optimizers.
                              DistributedDPOptimizer (per-rank flat clipping, noise on rank 0 only, all-reduce of the
                              clipped sums), Opacus's RDP accountant stepped by the optimizer, Poisson batches from
                              opacus.data_loader.DPDataLoader(distributed=True). The central-DP reference.
                  dp_csgp     DPCSGPStrategy, RandK(0.5), consensus step 0.5
                  privsgp     PrivSGPStrategy (DP-CSGP without compression)
                  dyn_d2p     DynD2PStrategy (target epsilon 3, delta 1e-5: its clip/noise schedule needs a budget)
                  privsgp_vr  PrivSGPVRStrategy, SAGA table initialised to zeros, on a smaller shard (see below)
                  cpgt        CPGTStrategy, ring, Laplace noise_x = noise_y = 0.01, q = 0.9, L = 1,
                              accounting="finite" (the default accounting needs full batches)
                  decor       CorrelatedNoiseStrategy, ring, sigma_cdp = sigma_cor = 1 (X25519 + ChaCha20 noise)

Every private run clips per-sample gradients at C = 1 with noise multiplier sigma = 1 (given, so no calibration runs
before training; Dyn-D2P derives its schedule from its budget, CPGT adds Laplace noise in the gossip instead) and
Poisson-samples each node's shard of J = 2048 examples at q = 64 / 2048, as the Opacus run does (its distributed
Poisson sampler gives every rank the same J and q). Each private step still records itself in the node's ledger,
and Dyn-D2P checks its budget after every step (a one-bit all-reduce): that is part of the cost being measured.
PrivSGP-VR keeps a J x d gradient table per node (10.9 GB at J = 2048), so it trains on J = ``--vr-examples`` (128:
683 MB per node) at q = 64 / J; its step does the same per-sample work plus the table update. The directed
strategies use push-sum's topology (one peer per round); CPGT and Decor need an undirected graph (ring: 2 peers).
The private strategies use the library's default per-sample mode unless ``--grad-sample-mode`` says otherwise.

For every rank a callback takes ``time.perf_counter()`` at ``on_train_batch_start`` and ``on_train_batch_end``
(forward + backward + clipping and noise + optimizer step + gossip; data loading excluded), drops the first
``--warmup`` steps and keeps the median of the rest. The table shows rank 0's median, the maximum of the ranks'
medians, and both as ratios to the DDP run and to the Opacus-on-DDP run of the same invocation. For gossip runs it
also reports the median time inside ``strategy.gossip.step`` and inside the exchange itself, and the bytes each node
sent per step (measured by the exchange; for push-sum runs compared with the stated size
``out_degree x (compressor.encoded_nbytes(d) + 8)``).

Per-sample modes (``--modes``, on by default): one process, the same MLP and a batch of 64, the median CPU time of
forward + backward + clipping + noise for each ``grad_sample_mode`` of the library's privacy engine
(``bookkeeping``, ``hooks``, ``functorch``, ``ghost``), next to a non-private forward + backward and to Opacus's own
single-process DP-SGD (GradSampleModule hooks or expanded weights + DPOptimizer's clip, noise and scale); it also
checks that every engine mode produces the same clipped sum as ``hooks`` (noise off).

Noise generation (``--noise``, on by default): one process, the Gaussian noise of one private step of ResNet-18
(the GroupNorm ResNet-18 of ``examples/cifar_resnet.py``, d = 11.2M parameters): milliseconds per step for the
generator the library used before (``torch.randn`` with a ``torch.Generator``, 32 effective seed bits on CPU), for
its ChaCha20 ``NoiseGenerator`` (256-bit key) and for the same with ``secure_mode=True``; next to the CPU time of
one whole private step of that model (forward, backward, book-keeping clipping, noise; batch ``--noise-batch-size``
of 32x32 images), so the noise's share of a step is printed (target: at most 10%).

Targets (from the issue): uncompressed push-sum <= 1.2x DDP; each private strategy <= 1.1x Opacus-on-DDP; bytes on
the wire within 5% of the stated size.

How to run
----------
    python benchmarks/step_time.py                      # everything: 12 configs on 4 processes + per-sample modes
    python benchmarks/step_time.py --repeats 3          # interleaved repeats, medians over runs (less noise)
    python benchmarks/step_time.py --configs ddp,opacus_ddp,privsgp --steps 100
    python benchmarks/step_time.py --modes-only         # only the single-process per-sample mode comparison
    python benchmarks/step_time.py --noise-only --no-record   # only the noise generation cost (ResNet-18)
    python benchmarks/step_time.py --grad-sample-mode hooks   # the private strategies with Opacus's hooks

It prints the tables, writes ``benchmarks/step_time.png`` and appends the tables with this machine's description to
``benchmarks/RESULTS.md`` (``--no-record``: print only). The parent process never builds a Trainer: it re-runs this
file as a child with ``--config NAME --out FILE`` for each configuration; Lightning's subprocess launcher then starts
ranks 1..N-1 of that child. Every rank uses ``torch.set_num_threads(1)``. With 4 processes on a 2-core machine the
timings include CPU contention between ranks (each rank gets about half a core), and whatever else runs on the
machine shifts them further; compare ratios within one invocation only, and use ``--repeats`` when it is shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine_info import append_results, machine_line, software_line, usable_cores

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Config:
    label: str
    family: str  # "ddp", "opacus", "gossip" (non-private push-sum) or "private" (ours)
    compressor: str | None = None
    topology: str | None = None


TOPOLOGY = "exponential-one-peer"
CONFIGS: dict[str, Config] = {
    "ddp": Config("DDP", "ddp"),
    "push_sum": Config("push-sum (uncompressed)", "gossip", None, TOPOLOGY),
    "randk": Config("push-sum + RandK(0.1)", "gossip", "randk:0.1", TOPOLOGY),
    "topk": Config("push-sum + TopK(0.01)", "gossip", "topk:0.01", TOPOLOGY),
    "qsgd": Config("push-sum + QSGD(8)", "gossip", "qsgd:8", TOPOLOGY),
    "opacus_ddp": Config("Opacus DP-SGD on DDP", "opacus"),
    "dp_csgp": Config("DP-CSGP + RandK(0.5)", "private", "randk:0.5", TOPOLOGY),
    "privsgp": Config("PrivSGP", "private", None, TOPOLOGY),
    "dyn_d2p": Config("Dyn-D2P", "private", None, TOPOLOGY),
    "privsgp_vr": Config("PrivSGP-VR", "private", None, TOPOLOGY),
    "cpgt": Config("CPGT (ring)", "private", None, "ring"),
    "decor": Config("Decor (ring)", "private", None, "ring"),
}
INPUT_DIM, NUM_CLASSES, LR = 784, 10, 0.01
CLIP, SIGMA = 1.0, 1.0  # C and sigma of every Gaussian-noise run (ours and Opacus's)
WEIGHT_BYTES = 8  # the push-sum weight y travels as one float64
PUSH_SUM_TARGET, OPACUS_TARGET, BYTES_TOLERANCE = 1.2, 1.1, 0.05
BATCHES_PER_EPOCH = 32  # J = batch x 32 examples per node: q = 1/32


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped before timing")
    parser.add_argument("--devices", type=int, default=4, help="CPU processes per run")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list out of {','.join(CONFIGS)}")
    parser.add_argument("--hidden", type=int, default=1024, help="first hidden width H of the MLP 784-H-H/2-10")
    parser.add_argument("--batch-size", type=int, default=64, help="per process (expected size for Poisson runs)")
    parser.add_argument("--vr-examples", type=int, default=128, help="PrivSGP-VR's shard J per node (table J x d)")
    parser.add_argument("--grad-sample-mode", default=None, help="per-sample mode of our private strategies "
                        "(bookkeeping, hooks, functorch, ghost); default: the library's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per config, interleaved; medians are reported")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one configuration")
    parser.add_argument("--modes", action=argparse.BooleanOptionalAction, default=True,
                        help="also compare the per-sample modes in one process (default: on)")
    parser.add_argument("--modes-only", action="store_true", help="only the per-sample mode comparison")
    parser.add_argument("--noise", action=argparse.BooleanOptionalAction, default=True,
                        help="noise generation per step for ResNet-18 (11.2M parameters): old vs new generator")
    parser.add_argument("--noise-only", action="store_true", help="only the noise generation comparison")
    parser.add_argument("--noise-batch-size", type=int, default=32, help="batch of the ResNet-18 private step")
    parser.add_argument("--mode-steps", type=int, default=10, help="timed steps per per-sample mode")
    parser.add_argument("--modes-model", default="mlp",
                        choices=("mlp", "resnet18", "resnet18_torchvision", "gpt2", "lstm", "gru", "lstm_demo", "vit",
                                 "transformer_demo", "bert"),
                        help="the model of the per-sample mode comparison: resnet18 is examples/cifar_resnet.py's "
                        "out-of-place ResNet-18, resnet18_torchvision torchvision's unchanged one (GroupNorm)")
    parser.add_argument("--engine-modes", type=lambda v: [m.strip() for m in v.split(",") if m.strip()], default=None,
                        help="comma list of the library's per-sample modes to time (default: all four)")
    parser.add_argument("--json", type=Path, default=None, help="also write all results to this file")
    parser.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "step_time.png")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument("--no-record", action="store_true", help="print only: no plot, nothing appended")
    # internal: one configuration in one Lightning run, or the mode comparison (set by the parent)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--modes-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    only = args.modes_only or args.noise_only
    args.config_list = [] if only else [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_list + ([args.config] if args.config else []) if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if args.steps < 1 or args.warmup < 0 or args.devices < 2 or args.repeats < 1 or args.mode_steps < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --devices >= 2, --repeats >= 1 and --mode-steps >= 1")
    if not 0 < args.batch_size <= args.vr_examples:
        parser.error(f"--vr-examples ({args.vr_examples}) must be at least --batch-size ({args.batch_size})")
    modes = ("bookkeeping", "hooks", "functorch", "ghost")
    if args.grad_sample_mode is not None and args.grad_sample_mode not in modes:
        parser.error(f"--grad-sample-mode must be one of {modes}")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# child: one configuration, one N-process Lightning run (this code runs on every rank)
# ---------------------------------------------------------------------------------------------------------------------
def build_model(hidden: int, per_sample_loss: bool = False):  # noqa: ANN201
    import lightning as L
    import torch
    from torch import nn

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(INPUT_DIM, hidden),
                nn.ReLU(),
                nn.Linear(hidden, hidden // 2),
                nn.ReLU(),
                nn.Linear(hidden // 2, NUM_CLASSES),
            )

        def forward(self, inputs):  # noqa: ANN001, ANN201
            return self.net(inputs)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            inputs, targets = batch  # nothing logged: no extra collectives
            return nn.functional.cross_entropy(self(inputs), targets, reduction="none" if per_sample_loss else "mean")

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=LR)

    return MLP()


def build_loader(batch_size: int, devices: int, batches_per_epoch: int, seed: int):  # noqa: ANN201
    """Synthetic, learnable data: random inputs labelled by a fixed random linear map (identical on every rank)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(seed)
    n = batch_size * devices * batches_per_epoch
    inputs = torch.randn(n, INPUT_DIM, generator=gen)
    targets = (inputs @ torch.randn(INPUT_DIM, NUM_CLASSES, generator=gen)).argmax(dim=1)
    # Lightning adds a DistributedSampler: each rank sees batches_per_epoch distinct batches per epoch.
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size, shuffle=True, drop_last=True)


def build_opacus_strategy(batch_size: int):  # noqa: ANN201
    """Opacus's distributed DP-SGD (``PrivacyEngine.make_private`` on a DPDDP model, done by hand) in Lightning DDP."""
    from lightning.pytorch.strategies import DDPStrategy
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.data_loader import DPDataLoader
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.optimizers import DistributedDPOptimizer

    class OpacusDDPStrategy(DDPStrategy):
        def _setup_model(self, model):  # noqa: ANN001, ANN202
            # DPDDP broadcasts rank 0's parameters once and adds no gradient hooks: the optimizer all-reduces
            return DPDDP(GradSampleModule(model))

        def setup_optimizers(self, trainer) -> None:  # noqa: ANN001
            super().setup_optimizers(trainer)
            self.accountant = RDPAccountant()
            self.optimizers = [
                DistributedDPOptimizer(
                    optimizer, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=batch_size,
                    loss_reduction="mean",
                )
                for optimizer in self.optimizers
            ]

        def process_dataloader(self, dataloader):  # noqa: ANN001, ANN202
            trainer = self.lightning_module.trainer
            if not trainer.training:
                return dataloader
            # as make_private(poisson_sampling=True) on a distributed model: q = 1 / len(loader) on every rank
            loader = DPDataLoader.from_data_loader(dataloader, distributed=True)
            for optimizer in self.optimizers:
                optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=1 / len(dataloader)))
            return loader

    return OpacusDDPStrategy()


def build_strategy(config: str, args: argparse.Namespace):  # noqa: ANN201
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_privdec.strategies import STRATEGIES

    spec = CONFIGS[config]
    if spec.family == "ddp":
        return DDPStrategy()
    if spec.family == "opacus":
        return build_opacus_strategy(args.batch_size)
    if spec.family == "gossip":
        return STRATEGIES["push_sum"](topology=spec.topology, compressor=spec.compressor, seed=0)
    common: dict[str, Any] = dict(topology=spec.topology, compressor=spec.compressor, seed=0, max_grad_norm=CLIP)
    if args.grad_sample_mode is not None and config != "decor":  # Decor's engine always uses hooks
        common["grad_sample_mode"] = args.grad_sample_mode
    extra: dict[str, Any] = {
        "dp_csgp": dict(noise_multiplier=SIGMA, consensus_step=0.5),
        "privsgp": dict(noise_multiplier=SIGMA),
        "dyn_d2p": dict(target_epsilon=3.0, target_delta=1e-5),
        "privsgp_vr": dict(noise_multiplier=SIGMA, table_init="zeros"),
        "cpgt": dict(noise_x=0.01, noise_y=0.01, noise_decay=0.9, lipschitz=1.0, accounting="finite"),
        "decor": dict(sigma_cdp=SIGMA * CLIP, sigma_cor=SIGMA * CLIP),
    }[config]
    return STRATEGIES[config](**common, **extra)


def _timed(fn, record: list[float]):  # noqa: ANN001, ANN202
    """Wrap ``fn`` so that every call appends its wall time (seconds) to ``record``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)

    return wrapper


def make_step_timer(warmup: int):  # noqa: ANN201
    """A Callback timing every training batch on this rank, plus the gossip round and the exchange inside it."""
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.gossip: list[float] = []
            self.exchange: list[float] = []
            self.batch_sizes: list[int] = []
            # batch start -> next batch start: the step plus data loading and Lightning's per-step SIGTERM broadcast
            self.iterations: list[float] = []
            self._start: float | None = None

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            gossip = getattr(trainer.strategy, "gossip", None)
            if gossip is not None:  # instance attributes shadow the methods; the library is untouched
                gossip.step = _timed(gossip.step, self.gossip)
                gossip.exchange.exchange = _timed(gossip.exchange.exchange, self.exchange)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            now = time.perf_counter()
            if self._start is not None:
                self.iterations.append(now - self._start)
            self._start = now
            self.batch_sizes.append(int(batch[0].shape[0]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.steps.append(time.perf_counter() - self._start)

        def summary(self) -> dict[str, Any]:
            def median_ms(values: list[float]) -> float | None:
                kept = values[warmup:]
                return 1e3 * statistics.median(kept) if kept else None

            return {
                "median_step_ms": median_ms(self.steps),
                "median_gossip_ms": median_ms(self.gossip),
                "median_exchange_ms": median_ms(self.exchange),
                "median_iteration_ms": median_ms(self.iterations),
                "mean_batch": statistics.mean(self.batch_sizes[warmup:] or [0]),
                "timed_steps": max(0, len(self.steps) - warmup),
            }

    return StepTimer()


def expected_push_sum_bytes(strategy: Any, rank: int, d: int) -> float:
    """Stated bytes per node per round: mean out-degree over one period x (payload + push-sum weight)."""
    topology = strategy.topology
    out_degree = statistics.mean(len(topology.out_peers(rank, k)) for k in range(topology.period))
    dtype = strategy.flat.buffer.dtype
    itemsize = strategy.flat.buffer.element_size()
    payload = itemsize * d if strategy.compressor is None else strategy.compressor.encoded_nbytes(d, dtype)
    return out_degree * (payload + WEIGHT_BYTES)


def rank_result(trainer: Any, timer: Any, d: int, config: str) -> dict[str, Any]:
    """Everything this rank measured."""
    result = {"rank": trainer.global_rank, "global_step": trainer.global_step, **timer.summary()}
    gossip = getattr(trainer.strategy, "gossip", None)
    if gossip is not None:
        traffic = gossip.exchange.traffic
        result.update(bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received, rounds=traffic.rounds)
        if config not in ("cpgt", "decor"):  # push-sum messages: (payload, y)
            result["expected_bytes_per_step"] = expected_push_sum_bytes(trainer.strategy, trainer.global_rank, d)
    return result


def run_child(args: argparse.Namespace) -> None:
    """One configuration on args.devices processes; rank 0 writes every rank's results to args.out."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # num_workers, logger and sampler hints would bury the numbers
    import lightning as L
    import torch.distributed as dist

    L.seed_everything(args.seed, verbose=False)
    model = build_model(args.hidden, per_sample_loss=args.grad_sample_mode == "ghost" and args.config != "decor"
                        and CONFIGS[args.config].family == "private")
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    timer = make_step_timer(args.warmup)
    total_steps = args.warmup + args.steps
    batches = args.vr_examples // args.batch_size if args.config == "privsgp_vr" else BATCHES_PER_EPOCH
    loader = build_loader(args.batch_size, args.devices, batches, args.seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=build_strategy(args.config, args),
        max_steps=total_steps,
        max_epochs=-1,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=loader)

    mine = rank_result(trainer, timer, d, args.config)
    ranks: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(ranks, mine)  # after training: not part of any timed step
    if trainer.global_rank == 0:
        out = {"config": args.config, "devices": trainer.world_size, "num_params": d, "ranks": ranks}
        args.out.write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------------------------------------------------------------
# child: the per-sample modes in one process
# ---------------------------------------------------------------------------------------------------------------------
def modes_problem(args: argparse.Namespace):  # noqa: ANN201
    """:func:`build_problem` for ``--modes-model``, ``--batch-size`` and ``--seed``."""
    return build_problem(args.modes_model, args.batch_size, args.seed, hidden=args.hidden)


def build_problem(  # noqa: ANN201
    name: str, batch: int, seed: int, *, hidden: int = 1024, tokens: int = 32, image_size: int = 32
):
    """(a fresh model, its inputs, targets, a loss of (outputs, targets) with ``reduction``), on the CPU, for:

    * ``mlp``: the MLP above (784-``hidden``-``hidden/2``-10);
    * ``resnet18``: the GroupNorm ResNet-18 of examples/cifar_resnet.py (out-of-place throughout), images of
      ``image_size`` (32) pixels square;
    * ``resnet18_torchvision``: torchvision's ResNet-18 unchanged (in-place ReLU, ``out += identity``) with
      GroupNorm(8, c), the same images;
    * ``efficientnet_b0``: torchvision's EfficientNet-B0 with GroupNorm(8, c) (its channels are multiples of 8) and
      its in-place activations made out-of-place (so that Opacus's hooks can see their inputs), the same images;
    * ``gpt2``: a GPT-2 from a config (2 layers, width 128, vocabulary 512), sequences of ``tokens`` tokens;
    * ``gpt2_small``: GPT-2 small from its config (12 layers, width 768, vocabulary 50257; 124M parameters, no
      download), sequences of ``tokens`` tokens;
    * ``vit``: torchvision's VisionTransformer at docs/models.md's size (patch 8, 2 layers, width 32), the same
      images: a class token and a position embedding used once for the whole batch;
    * ``transformer_demo``: Lightning's Transformer demo (``lightning.pytorch.demos.Transformer``: nn.Transformer,
      2 + 2 layers, width 200, dropout 0.2) at docs/models.md's vocabulary (64), ``tokens`` // 2 source and target
      tokens per example, stacked as the input (B, 2, T); the privacy unit is a sequence (its mean token loss);
    * ``bert``: Hugging Face's BertForSequenceClassification at docs/models.md's config (2 layers, width 32,
      vocabulary 64) with a padding mask, ``tokens`` // 2 tokens per example, 2 classes;
    * ``relative_bias``: self-attention with a relative-position bias table looked up with a (T, T) index buffer
      (width 64, 4 heads), ``tokens`` random 64-dimensional inputs per example, a 10-class head;
    * ``lstm``, ``gru``: docs/models.md's recurrent rows (benchmarks/compatibility.py): Lightning's SimpleLSTM demo
      class (2 layers of 32, vocabulary 64) with a fresh state per batch predicting each next token, and an
      nn.GRU(16, 24) classifier on its last step; 16 tokens;
    * ``lstm_demo``: Lightning's LSTM demo at its own size (SimpleLSTM: 4 layers of 512, dropout 0.2; vocabulary
      64) with a fresh state per batch (the demo carries it, which per-example privacy refuses), 16 tokens.

    The GPT-2s predict each next token; the privacy unit is a sequence (its mean token loss)."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)

    def cross_entropy(outputs, y, reduction="mean"):  # noqa: ANN001, ANN202
        return nn.functional.cross_entropy(outputs, y, reduction=reduction)

    loss = cross_entropy
    if name == "mlp":
        inputs = torch.randn(batch, INPUT_DIM, generator=gen)
        targets = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
        build = lambda: build_model(hidden)  # noqa: E731
    elif name in ("resnet18", "resnet18_torchvision", "efficientnet_b0"):
        inputs = torch.randn(batch, 3, image_size, image_size, generator=gen)
        targets = torch.randint(0, 10, (batch,), generator=gen)
        if name == "resnet18":
            sys.path.insert(0, str(ROOT / "examples"))
            from cifar_resnet import resnet18_groupnorm as build
        else:  # torchvision's own, unchanged but for the normalisation
            import torchvision

            factory = getattr(torchvision.models, name.removesuffix("_torchvision"))

            def build():  # noqa: ANN202
                model = factory(num_classes=10, norm_layer=lambda c: nn.GroupNorm(8, c))
                if name == "efficientnet_b0":
                    for module in model.modules():
                        if getattr(module, "inplace", False):
                            module.inplace = False
                return model
    elif name in ("gpt2", "gpt2_small"):
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4) if name == "gpt2" else \
            GPT2Config()  # GPT-2 small: the defaults of the config are its hyper-parameters
        inputs = torch.randint(0, config.vocab_size, (batch, tokens), generator=gen)
        targets = inputs

        class GPT2(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lm = GPT2LMHeadModel(config)

            def forward(self, ids):  # noqa: ANN001, ANN202
                return self.lm(ids).logits

        build = GPT2

        def loss(logits, ids, reduction="mean"):  # noqa: ANN001, ANN202
            per_token = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view(ids.shape[0], -1)
            per_sequence = per_token.mean(1)  # the privacy unit is a sequence
            return per_sequence if reduction == "none" else per_sequence.mean()
    elif name == "vit":
        from torchvision.models import VisionTransformer

        inputs = torch.randn(batch, 3, image_size, image_size, generator=gen)
        targets = torch.randint(0, 10, (batch,), generator=gen)

        def build():  # noqa: ANN202
            return VisionTransformer(image_size=image_size, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                     mlp_dim=64, num_classes=10)  # fmt: skip
    elif name == "transformer_demo":
        from lightning.pytorch.demos.transformer import Transformer

        steps = tokens // 2
        inputs = torch.randint(0, 64, (batch, 2, steps), generator=gen)  # source and target tokens
        targets = torch.randint(0, 64, (batch, steps), generator=gen)

        class Demo(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.demo = Transformer(vocab_size=64)

            def forward(self, pair):  # noqa: ANN001, ANN202
                return self.demo(pair[:, 0], pair[:, 1]).view(pair.shape[0], pair.shape[2], -1)

        build = Demo

        def loss(log_probs, y, reduction="mean"):  # noqa: ANN001, ANN202
            per_sequence = nn.functional.nll_loss(log_probs.transpose(1, 2), y, reduction="none").mean(1)
            return per_sequence if reduction == "none" else per_sequence.mean()
    elif name == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        inputs = torch.randint(1, 64, (batch, tokens // 2), generator=gen)
        inputs[: batch // 2, -3:] = 0  # padding
        targets = torch.randint(0, 2, (batch,), generator=gen)
        config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32, num_labels=2)  # fmt: skip

        class Bert(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bert = BertForSequenceClassification(config)

            def forward(self, ids):  # noqa: ANN001, ANN202
                return self.bert(input_ids=ids, attention_mask=(ids != 0).long()).logits

        build = Bert
    elif name == "relative_bias":
        inputs = torch.randn(batch, tokens, 64, generator=gen)
        targets = torch.randint(0, 10, (batch,), generator=gen)

        class RelativeBiasAttention(nn.Module):
            """Self-attention with a relative-position bias table looked up with a (T, T) index buffer (Swin's
            attention without windows), a residual MLP, then a classifier over the mean token."""

            def __init__(self, dim: int = 64, heads: int = 4) -> None:
                super().__init__()
                self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
                self.table = nn.Parameter(0.02 * torch.randn(2 * tokens - 1, heads))
                # a plain tensor, not a buffer: the library before broadcast capture refused a trainable layer
                # with buffers, and replays this one
                self.index = torch.arange(tokens)[:, None] - torch.arange(tokens) + tokens - 1
                self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                self.head = nn.Linear(dim, 10)

            def forward(self, x):  # noqa: ANN001, ANN202
                b, t, d = x.shape
                q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
                bias = self.table[self.index].permute(2, 0, 1).unsqueeze(0)
                h = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                                  .transpose(1, 2).reshape(b, t, d))  # fmt: skip
                return self.head((h + self.mlp(h)).mean(dim=1))

        build = RelativeBiasAttention
    elif name in ("lstm", "lstm_demo"):
        from lightning.pytorch.demos.lstm import SimpleLSTM

        inputs = torch.randint(1, 64, (batch, 16), generator=gen)
        targets = torch.randint(1, 64, (batch, 16), generator=gen)
        sizes = {"ninp": 32, "nhid": 32, "nlayers": 2} if name == "lstm" else {}

        class DemoLSTM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm = SimpleLSTM(vocab_size=64, **sizes)

            def forward(self, ids):  # noqa: ANN001, ANN202
                log_probs, _ = self.lstm(ids, self.lstm.init_hidden(ids.shape[0]))
                return log_probs.view(ids.shape[0], ids.shape[1], -1)

        build = DemoLSTM

        def loss(log_probs, y, reduction="mean"):  # noqa: ANN001, ANN202
            per_sequence = nn.functional.nll_loss(log_probs.transpose(1, 2), y, reduction="none").mean(1)
            return per_sequence if reduction == "none" else per_sequence.mean()
    elif name == "gru":
        inputs = torch.randint(1, 64, (batch, 16), generator=gen)
        targets = torch.randint(0, 2, (batch,), generator=gen)

        class GRUClassifier(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed, self.rnn, self.out = nn.Embedding(64, 16), nn.GRU(16, 24, batch_first=True), nn.Linear(24, 2)

            def forward(self, ids):  # noqa: ANN001, ANN202
                return self.out(self.rnn(self.embed(ids))[0][:, -1])

        build = GRUClassifier
    else:
        raise ValueError(f"unknown model {name!r}")

    def fresh_model():  # noqa: ANN202
        torch.manual_seed(seed)
        return build()

    return fresh_model, inputs, targets, loss


def run_modes_child(args: argparse.Namespace) -> None:
    """Median forward + backward + clip + noise per per-sample mode (one process, one thread); writes JSON. A mode
    that fails on the model is a row with its error (Opacus's hooks refuse some layers)."""
    import torch
    from opacus import PrivacyEngine
    from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights
    from opacus.optimizers import DPOptimizer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.algorithms.node import private_step as node_private_step
    from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE, GRAD_SAMPLE_MODES

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    fresh_model, inputs, targets, loss_fn = modes_problem(args)

    def opacus_model() -> torch.nn.Module:
        """The model as Opacus trains it: nn.LSTM/nn.GRU swapped for its DPLSTM/DPGRU (ModuleValidator.fix)."""
        from opacus.validators import ModuleValidator

        model = fresh_model()
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.RNNBase):  # (fix() of the whole model would deep-copy a local class)
                    setattr(parent, name, ModuleValidator.fix(child))
        return model

    def timed(step) -> float:  # noqa: ANN001
        for _ in range(2):
            step()
        times = []
        for _ in range(args.mode_steps):  # CPU time of this one-thread process: robust to load from other processes
            start = time.process_time()
            step()
            times.append(time.process_time() - start)
        return 1e3 * statistics.median(times)

    def row(label: str, build_step) -> dict[str, Any]:  # noqa: ANN001
        try:
            return {"mode": label, "ms": timed(build_step()), "max_abs_diff": None}
        except Exception as error:  # noqa: BLE001 - a mode that cannot run this model is a result
            return {"mode": label, "ms": None, "max_abs_diff": None, "error": f"{type(error).__name__}: {error}"[:160]}

    rows: list[dict[str, Any]] = []

    def plain_step():  # noqa: ANN202
        model = fresh_model()

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(inputs), targets).backward()
        return step

    rows.append(row("non-private forward + backward", plain_step))

    clipped: dict[str, list[torch.Tensor]] = {}
    for mode in args.engine_modes or GRAD_SAMPLE_MODES:
        def engine_step(mode=mode):  # noqa: ANN001, ANN202
            model = fresh_model()
            engine = DPCSGPNode(PrivacyParameters(max_grad_norm=CLIP, noise_multiplier=SIGMA), rank=0,
                                       device=torch.device("cpu"), grad_sample_mode=mode, noise_seed=0)
            engine.attach(model)
            engine.noise_multiplier, engine.sample_rate = SIGMA, args.batch_size / 2048
            engine.expected_batch_size = float(args.batch_size)

            def backward() -> None:
                model.zero_grad(set_to_none=True)
                if mode == "ghost":
                    engine.clipping.ghost_backward(loss_fn(model(inputs), targets, reduction="none"))
                else:
                    loss_fn(model(inputs), targets).backward()

            def step() -> None:
                backward()
                node_private_step(engine)

            backward()  # the clipped sum alone (noise off), for the equality check
            engine.noise_multiplier = 0.0
            node_private_step(engine)
            clipped[mode] = [p.grad.detach().clone() for p in model.parameters()]
            engine.noise_multiplier = SIGMA
            return step

        label = f"engine {mode!r}" + (" (default)" if mode == DEFAULT_GRAD_SAMPLE_MODE else "")
        rows.append({**row(label, engine_step), "engine_mode": mode})
    reference = clipped.get("hooks") or next(iter(clipped.values()), None)
    for r in rows:
        if r.get("engine_mode") in clipped and reference is not None:
            diffs = [(a - b).abs().max().item() for a, b in zip(clipped[r["engine_mode"]], reference)]
            r["max_abs_diff"] = max(diffs)

    for name, wrap in (("Opacus GradSampleModule (hooks) + DPOptimizer", GradSampleModule),
                       ("Opacus expanded weights (ew) + DPOptimizer", GradSampleModuleExpandedWeights)):
        def opacus_step(wrap=wrap):  # noqa: ANN001, ANN202
            model = opacus_model()
            wrapped = wrap(model, batch_first=True, loss_reduction="mean")
            optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=SIGMA,
                                    max_grad_norm=CLIP, expected_batch_size=args.batch_size)

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                loss_fn(wrapped(inputs), targets).backward()
                optimizer.pre_step()  # clip, accumulate, noise, scale (the step itself is left out, as above)
            return step

        rows.append(row(name, opacus_step))

    def opacus_ghost_step():  # noqa: ANN202
        model = opacus_model()
        loader = DataLoader(TensorDataset(inputs, targets), batch_size=args.batch_size)

        class Criterion(torch.nn.Module):
            reduction = "mean"

            def forward(self, outputs, y):  # noqa: ANN001, ANN202
                return loss_fn(outputs, y, reduction=self.reduction)

        wrapped, optimizer, criterion, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
            criterion=Criterion(), noise_multiplier=SIGMA, max_grad_norm=CLIP, grad_sample_mode="ghost",
            poisson_sampling=False,
        )

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(wrapped(inputs), targets).backward()  # Opacus's two backward passes
            optimizer.pre_step()
        return step

    rows.append(row("Opacus ghost clipping (make_private, grad_sample_mode='ghost')", opacus_ghost_step))
    args.out.write_text(json.dumps(rows, indent=1))


# ---------------------------------------------------------------------------------------------------------------------
# parent: run every configuration, then summarise
# ---------------------------------------------------------------------------------------------------------------------
def _child_command(args: argparse.Namespace, *extra: str) -> list[str]:
    cmd = [
        sys.executable, os.path.abspath(__file__), *extra,
        "--devices", str(args.devices), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--hidden", str(args.hidden), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
        "--vr-examples", str(args.vr_examples), "--mode-steps", str(args.mode_steps),
        "--modes-model", args.modes_model,
    ]  # fmt: skip
    if args.grad_sample_mode is not None:
        cmd += ["--grad-sample-mode", args.grad_sample_mode]
    if args.engine_modes:
        cmd += ["--engine-modes", ",".join(args.engine_modes)]
    return cmd


def _run_child(cmd: list[str], out: Path, what: str, timeout: float) -> tuple[Any, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    start = time.perf_counter()
    proc = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, timeout=timeout, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text()), elapsed


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch one child run (fresh processes) and return its JSON results."""
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        result, elapsed = _run_child(_child_command(args, "--config", config), Path(tmp) / "out.json",
                                     f"config {config!r}", args.timeout)
    result["wall_s"] = elapsed
    return result


def run_modes(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="step_time_modes_") as tmp:
        rows, _ = _run_child(_child_command(args, "--modes-child"), Path(tmp) / "out.json", "per-sample modes",
                             args.timeout)
    return rows


def summarise_run(result: dict[str, Any]) -> dict[str, Any]:
    """Reduce the per-rank numbers of one run to the table's columns."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    n, d = result["devices"], result["num_params"]
    summary = {
        "config": result["config"],
        "rank0_ms": ranks[0]["median_step_ms"],
        "max_rank_ms": max(r["median_step_ms"] for r in ranks),
        "per_rank_ms": [r["median_step_ms"] for r in ranks],
        "gossip_ms": ranks[0].get("median_gossip_ms"),
        "exchange_ms": ranks[0].get("median_exchange_ms"),
        "iteration_ms": ranks[0].get("median_iteration_ms"),
        "mean_batch": statistics.mean(r["mean_batch"] for r in ranks),
        "wall_s": result["wall_s"],
        "measured_bytes": None,
        "expected_bytes": None,
    }
    if result["config"] in ("ddp", "opacus_ddp"):
        summary["expected_bytes"] = 2 * (n - 1) / n * 4 * d  # ring all-reduce estimate (not measured)
    elif "rounds" in ranks[0]:
        summary["measured_bytes"] = statistics.mean(r["bytes_sent"] / max(1, r["rounds"]) for r in ranks)
        if "expected_bytes_per_step" in ranks[0]:
            summary["expected_bytes"] = statistics.mean(r["expected_bytes_per_step"] for r in ranks)
    return summary


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per configuration: the median over repeats of each run's numbers (bytes do not vary)."""
    per_run = [summarise_run(r) for r in runs]
    summary = dict(per_run[0])
    for key in ("rank0_ms", "max_rank_ms", "gossip_ms", "exchange_ms", "iteration_ms"):
        summary[key] = _median_or_none([s[key] for s in per_run])
    summary["per_rank_ms"] = [statistics.median(column) for column in zip(*(s["per_rank_ms"] for s in per_run))]
    summary["wall_s"] = sum(s["wall_s"] for s in per_run)
    summary["runs_rank0_ms"] = [s["rank0_ms"] for s in per_run]
    return summary


def machine_description(args: argparse.Namespace) -> list[str]:
    mode = args.grad_sample_mode or "library default"
    return [
        machine_line(),
        software_line(opacus=True),
        f"setup: {args.devices} CPU processes (gloo), torch.set_num_threads(1) per rank, MLP 784-{args.hidden}-"
        f"{args.hidden // 2}-10, batch {args.batch_size}/process, SGD, {args.warmup} warm-up + {args.steps} timed "
        f"steps; private runs: C = {CLIP}, sigma = {SIGMA}, Poisson q = 1/{BATCHES_PER_EPOCH} (PrivSGP-VR: "
        f"q = {args.batch_size}/{args.vr_examples}), per-sample mode: {mode}",
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(s: dict[str, Any], ref: dict[str, Any] | None) -> str:
    if ref is None:
        return "n/a"
    return f"{s['rank0_ms'] / ref['rank0_ms']:.2f}x / {s['max_rank_ms'] / ref['max_rank_ms']:.2f}x"


def _bytes_cells(s: dict[str, Any]) -> tuple[str, str, str]:
    measured, expected = s["measured_bytes"], s["expected_bytes"]
    if measured is None:
        return "not measured", ("n/a" if expected is None else f"{expected:,.0f} (ring estimate)"), "n/a"
    if expected is None:
        return f"{measured:,.0f}", "n/a", "n/a"
    diff = (measured - expected) / expected
    verdict = "PASS" if abs(diff) <= BYTES_TOLERANCE else "FAIL"
    return f"{measured:,.0f}", f"{expected:,.0f}", f"{100 * diff:+.2f}% {verdict}"


def format_report(summaries: list[dict[str, Any]], num_params: int, devices: int) -> list[str]:
    by_name = {s["config"]: s for s in summaries}
    ddp, opacus = by_name.get("ddp"), by_name.get("opacus_ddp")
    lines = [
        f"model parameters d = {num_params:,}; ratios: rank 0's median / the slowest rank's median",
        "",
        "| config | median step ms (rank0) | max-over-ranks median ms | vs DDP | vs Opacus-on-DDP | mean batch "
        "| bytes/node/step measured | stated | diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        measured, expected, diff = _bytes_cells(s)
        vs_opacus = _ratio(s, opacus) if CONFIGS[s["config"]].family in ("private", "opacus") else "-"
        lines.append(
            f"| {CONFIGS[s['config']].label} | {s['rank0_ms']:.1f} | {s['max_rank_ms']:.1f} | {_ratio(s, ddp)} "
            f"| {vs_opacus} | {s['mean_batch']:.1f} | {measured} | {expected} | {diff} |"
        )
    lines += [
        "",
        "Details. Step = on_train_batch_start -> on_train_batch_end. Iteration = batch start -> next batch start, i.e."
        " the step plus data loading and Lightning's per-step SIGTERM broadcast (a global collective).",
        "",
        "| config | per-rank median step ms | rank0 iteration ms | rank0 gossip.step ms | of which exchange ms "
        "| run wall s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in summaries:
        per_rank = ", ".join(f"{v:.1f}" for v in s["per_rank_ms"])
        family = CONFIGS[s["config"]].family
        gossip = _fmt(s["gossip_ms"], ".1f") if family in ("gossip", "private") else "n/a (all-reduce)"
        lines.append(
            f"| {s['config']} | {per_rank} | {_fmt(s['iteration_ms'], '.1f')} | {gossip} "
            f"| {_fmt(s['exchange_ms'], '.1f')} | {s['wall_s']:.1f} |"
        )
    lines += ["", *target_lines(summaries, ddp, opacus)]
    lines.append(
        f"note: {devices} processes share {usable_cores()} cores here, so ranks pre-empt each other; "
        "step times carry CPU contention, and load from other work on the machine can move a run by tens of percent. "
        "Compare ratios within one invocation; --repeats N interleaves N runs per config and reports medians."
    )
    return lines


def target_lines(summaries: list[dict[str, Any]], ddp: dict[str, Any] | None, opacus: dict[str, Any] | None) -> list[str]:
    def verdict(s: dict[str, Any], ref: dict[str, Any], target: float, what: str) -> list[str]:
        ratio, worst = s["rank0_ms"] / ref["rank0_ms"], s["max_rank_ms"] / ref["max_rank_ms"]
        out = [
            f"{CONFIGS[s['config']].label} / {what} = {ratio:.2f}x (target <= {target}x): "
            f"{'MET' if ratio <= target else 'NOT MET'}   [max-over-ranks medians: {worst:.2f}x]"
        ]
        if len(s["runs_rank0_ms"]) > 1:
            ratios = ", ".join(f"{p / q:.2f}x" for p, q in zip(s["runs_rank0_ms"], ref["runs_rank0_ms"]))
            out.append(f"  per repeat (rank0): {ratios}")
        return out

    lines: list[str] = []
    for s in summaries:
        family = CONFIGS[s["config"]].family
        if s["config"] == "push_sum" and ddp is not None:
            lines += verdict(s, ddp, PUSH_SUM_TARGET, "DDP")
        if family == "private" and opacus is not None:
            lines += verdict(s, opacus, OPACUS_TARGET, "Opacus-on-DDP")
    for s in summaries:
        if s["measured_bytes"] is not None and s["expected_bytes"] is not None:
            diff = (s["measured_bytes"] - s["expected_bytes"]) / s["expected_bytes"]
            lines.append(
                f"{CONFIGS[s['config']].label}: measured bytes within {100 * BYTES_TOLERANCE:.0f}% of stated size "
                f"({100 * diff:+.2f}%): {'MET' if abs(diff) <= BYTES_TOLERANCE else 'NOT MET'}"
            )
    return lines


def run_noise(args: argparse.Namespace) -> dict[str, Any]:
    """Noise generation for ResNet-18's d parameters, old vs new generator, and one private step of that model."""
    import torch

    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.algorithms.node import private_step as node_private_step
    from lightning_privdec.privacy.noise import node_noise_generator

    sys.path.insert(0, str(ROOT / "examples"))
    from cifar_resnet import resnet18_groupnorm

    warnings.filterwarnings("ignore")
    torch.manual_seed(args.seed)
    model = resnet18_groupnorm()
    d = sum(p.numel() for p in model.parameters())

    def median_ms(fn, repeats: int = 7) -> float:  # noqa: ANN001
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    old = torch.Generator().manual_seed(args.seed)
    new, secure = node_noise_generator("cpu", None, 0), node_noise_generator("cpu", None, 0, secure_mode=True)
    row: dict[str, Any] = {
        "d": d,
        "threads": torch.get_num_threads(),
        "old_ms": median_ms(lambda: torch.randn(d, generator=old).mul_(SIGMA)),
        "new_ms": median_ms(lambda: new.normal(d, SIGMA)),
        "secure_ms": median_ms(lambda: secure.normal(d, SIGMA), repeats=3),
    }
    engine = DPCSGPNode(PrivacyParameters(max_grad_norm=CLIP, noise_multiplier=SIGMA), rank=0,
                               device=torch.device("cpu"))
    engine.attach(model)
    engine.noise_multiplier, engine.sample_rate = SIGMA, args.noise_batch_size / 50_000
    engine.expected_batch_size = float(args.noise_batch_size)
    gen = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.noise_batch_size, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (args.noise_batch_size,), generator=gen)

    def private_step() -> None:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        node_private_step(engine)

    row["step_ms"] = median_ms(private_step, repeats=3)
    row["batch_size"] = args.noise_batch_size
    engine.clipping.detach()
    return row


def format_noise(row: dict[str, Any]) -> list[str]:
    step = row["step_ms"]
    return [
        f"Noise generation for one private step of ResNet-18 (GroupNorm, examples/cifar_resnet.py), d = {row['d']:,} "
        f"parameters, one process, {row['threads']} threads; median wall ms per step. Whole private step (forward, "
        f"backward, book-keeping clipping, noise; batch {row['batch_size']} of 32x32 images): {step:.0f} ms.",
        "",
        "| generator | noise ms per step | share of the private step |",
        "|---|---:|---:|",
        f"| old: torch.randn, torch.Generator (32 effective seed bits) | {row['old_ms']:.1f} | "
        f"{row['old_ms'] / step:.1%} |",
        f"| new: ChaCha20 NoiseGenerator, 256-bit key (default) | {row['new_ms']:.1f} | {row['new_ms'] / step:.1%} |",
        f"| new, secure_mode=True (4 draws per coordinate) | {row['secure_ms']:.1f} | {row['secure_ms'] / step:.1%} |",
    ]


MODES_MODELS = {
    "mlp": lambda args: f"MLP 784-{args.hidden}-{args.hidden // 2}-10",
    "resnet18": lambda args: "ResNet-18 (GroupNorm, examples/cifar_resnet.py), 32x32 images",
    "resnet18_torchvision": lambda args: "torchvision's ResNet-18 unchanged (GroupNorm(8, c)), 32x32 images",
    "gpt2": lambda args: "GPT-2 from a config (2 layers, width 128, vocabulary 512), sequences of 32 tokens",
    "vit": lambda args: "torchvision's VisionTransformer (image 32, patch 8, 2 layers, width 32)",
    "transformer_demo": lambda args: "Lightning's Transformer demo (nn.Transformer 2 + 2 layers, width 200, "
    "vocabulary 64), 16 + 16 tokens",
    "bert": lambda args: "BERT from a config (2 layers, width 32, vocabulary 64), 16 tokens with padding",
    "lstm": lambda args: "Lightning's SimpleLSTM (2 layers of 32, vocabulary 64, fresh state), sequences of 16 tokens",
    "gru": lambda args: "nn.GRU(16, 24) classifier on an Embedding(64, 16), sequences of 16 tokens",
    "lstm_demo": lambda args: "Lightning's LSTM demo's SimpleLSTM (4 layers of 512, vocabulary 64, fresh state), "
    "sequences of 16 tokens",
}


def format_modes(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    base = rows[0]["ms"]
    lines = [
        f"Per-sample modes: one process, one thread, {MODES_MODELS[args.modes_model](args)}, batch "
        f"{args.batch_size}, C = {CLIP}, sigma = {SIGMA}; median CPU time (user + system, page faults included) of "
        f"{args.mode_steps} steps of forward + backward + clip + noise + scale (no optimizer step). 'max abs diff': "
        "largest difference of the clipped sum (noise off) from mode 'hooks' on the same batch"
        + (" (here: from the first mode timed)" if args.engine_modes and "hooks" not in args.engine_modes else "") + ".",
        "",
        "| mode | median CPU ms | vs non-private | max abs diff vs hooks |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        diff = "-" if row.get("max_abs_diff") is None else f"{row['max_abs_diff']:.1e}"
        if row["ms"] is None:
            lines.append(f"| {row['mode']} | fails: {row['error']} | - | - |")
            continue
        ratio = f"{row['ms'] / base:.2f}x" if base else "-"
        lines.append(f"| {row['mode']} | {row['ms']:.1f} | {ratio} | {diff} |")
    return lines + ["", *modes_verdict(rows)]


def modes_verdict(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's two targets: the best engine mode at most 2x the non-private step, and never slower than Opacus's
    fastest mode (ghost clipping) on the same model and batch."""
    base = rows[0]["ms"]
    ours = [r for r in rows if r.get("engine_mode") and r["ms"] is not None]
    if not base or not ours:
        return ["no engine mode ran"]
    best = min(ours, key=lambda r: r["ms"])
    lines = [f"- best engine mode {best['engine_mode']!r}: {best['ms']:.1f} ms = {best['ms'] / base:.2f}x the non-private "
             f"step (target <= 2x: {'met' if best['ms'] <= 2 * base else 'missed'})"]
    ghost = next((r for r in rows if r["mode"].startswith("Opacus ghost")), None)
    if ghost is None or ghost["ms"] is None:
        lines.append(f"- Opacus ghost clipping cannot run this model: {ghost['error'] if ghost else 'not measured'}")
    else:
        lines.append(f"- against Opacus ghost clipping ({ghost['ms']:.1f} ms): {best['ms'] / ghost['ms']:.2f}x "
                     f"(target <= 1x: {'met' if best['ms'] <= ghost['ms'] else 'missed'})")
    return lines


def write_plot(path: Path, summaries: list[dict[str, Any]], modes: list[dict[str, Any]] | None) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'lightning-privdec[examples]'): no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = int(bool(summaries)) + int(bool(modes))
    fig, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 5), squeeze=False)
    colors = {"ddp": "tab:gray", "gossip": "tab:blue", "opacus": "tab:red", "private": "tab:green"}
    k = 0
    if summaries:
        ax = axes[0][k]
        k += 1
        names = [s["config"] for s in summaries]
        ax.bar(range(len(names)), [s["rank0_ms"] for s in summaries],
               color=[colors[CONFIGS[n].family] for n in names])
        ax.scatter(range(len(names)), [s["max_rank_ms"] for s in summaries], color="k", marker="_", s=200,
                   label="slowest rank's median", zorder=3)
        by_name = {s["config"]: s for s in summaries}
        if "ddp" in by_name:
            ax.axhline(PUSH_SUM_TARGET * by_name["ddp"]["rank0_ms"], color="tab:blue", linestyle=":",
                       label=f"{PUSH_SUM_TARGET}x DDP (push-sum target)")
        if "opacus_ddp" in by_name:
            ax.axhline(OPACUS_TARGET * by_name["opacus_ddp"]["rank0_ms"], color="tab:red", linestyle="--",
                       label=f"{OPACUS_TARGET}x Opacus-on-DDP (private target)")
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("median step time, rank 0 (ms)")
        ax.set_title("4 CPU processes: DDP (gray), push-sum (blue), Opacus (red), ours private (green)", fontsize=9)
        ax.legend(fontsize=8)
    if modes:
        ax = axes[0][k]
        ax.barh(range(len(modes)), [r["ms"] for r in modes], color="tab:purple")
        ax.set_yticks(range(len(modes)), [r["mode"] for r in modes], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("median CPU ms per step (one process, one thread)")
        ax.set_title("per-sample gradient modes: forward + backward + clip + noise", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def command_line(argv: list[str]) -> str:
    return "python benchmarks/step_time.py" + "".join(f" {a}" for a in argv)


def run_parent(args: argparse.Namespace, argv: list[str]) -> None:
    started = time.perf_counter()
    machine = machine_description(args)
    for line in machine:
        print(line, flush=True)
    results: dict[str, list[dict[str, Any]]] = {config: [] for config in args.config_list}
    for repeat in range(args.repeats):  # interleaved, so slow drifts in machine load hit every config alike
        for config in args.config_list:
            label = config if args.repeats == 1 else f"{config} (repeat {repeat + 1}/{args.repeats})"
            print(f"running {label} ...", end=" ", flush=True)
            results[config].append(run_config(config, args))
            print(f"{results[config][-1]['wall_s']:.1f}s", flush=True)
    noise = None
    if (args.noise and not args.modes_only) or args.noise_only:
        print("running the noise generation comparison (ResNet-18) ...", end=" ", flush=True)
        start = time.perf_counter()
        noise = run_noise(args)
        print(f"{time.perf_counter() - start:.1f}s", flush=True)
    modes = None
    if (args.modes and not args.noise_only) or args.modes_only:
        print("running the per-sample mode comparison ...", end=" ", flush=True)
        start = time.perf_counter()
        modes = run_modes(args)
        print(f"{time.perf_counter() - start:.1f}s", flush=True)
    summaries = [summarise(runs) for runs in results.values()]
    report: list[str] = []
    if summaries:
        num_params = results[args.config_list[0]][0]["num_params"]
        report += format_report(summaries, num_params, args.devices)
    if modes:
        report += ["", *format_modes(modes, args)]
    if noise:
        report += ["", *format_noise(noise)]
    total = time.perf_counter() - started
    print()
    print("\n".join(report))
    print(f"total wall time: {total:.1f}s")
    if args.json is not None:
        payload = {"machine": machine, "summaries": summaries, "modes": modes, "noise": noise, "raw": results,
                   "total_s": total}
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")
    if args.no_record:
        return
    write_plot(args.plot, summaries, modes)
    header = [
        "",
        f"## step_time.py — {datetime.date.today().isoformat()}",
        "",
        f"Command: `{command_line(argv)}` (total {total:.0f} s). The machine was shared with other work while this "
        "ran unless stated otherwise.",
        "",
        *(f"- {line}" for line in machine),
        "",
    ]
    append_results("\n".join(header + report) + "\n", args.results)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.modes_child:
        run_modes_child(args)
    elif args.config is not None:
        if args.out is None:
            raise SystemExit("--config needs --out")
        run_child(args)
    else:
        run_parent(args, argv)


if __name__ == "__main__":
    main()
