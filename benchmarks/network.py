"""DDP vs gossip vs compressed private gossip on an emulated bandwidth-limited network (Linux namespaces + tc).

What it builds
--------------
One network namespace per node (``pdn0`` .. ``pdn{N-1}``) and one more (``pdnbr``) holding a Linux bridge; each node
is joined to the bridge by a veth pair, gets a private test address 10.217.0.(i+1)/24 on its end (``pdnn{i}``) and a
token-bucket limit on that end's egress (``tc qdisc ... root tbf rate R mbit``): every node sends at most R Mbit/s,
as a site behind an R Mbit/s uplink would. Nothing is added to the host's own namespace and nothing outside these
namespaces is contacted. Stale namespaces of an interrupted run (names starting with ``pdn``) are removed at start;
everything is removed at exit, also on an error, SIGTERM or Ctrl-C. Needs root and ``ip netns``.

What it measures
----------------
Each rank runs in its own namespace (``ip netns exec``) with ``GLOO_SOCKET_IFNAME`` set to its veth, so every byte
between ranks crosses the rate limit. The N processes are started once; they initialise one gloo process group and
then train every configuration in turn (a fresh Trainer, model and seed each), so Python's start-up is paid once:

    ddp                Lightning's DDPStrategy (ring all-reduce of the gradients)
    push_sum           DecentralizedPushSumStrategy, exponential-one-peer graph (one message per node per step)
    push_sum_overlap   the same with overlap=True (the message travels during the next forward/backward)
    push_sum_overlap2  overlap=True, staleness=2 (two rounds in flight, each mixed two steps late)
    push_sum_sealed    push_sum with a roster (roster=, identity_key=): signed setup, every message sealed with
                       ChaCha20-Poly1305 and sent length-framed over TCP (+16 + 8 bytes); keys made for the run in its
                       temporary directory
    privsgp            PrivSGPStrategy (DP push-sum, uncompressed), C = 1, sigma = 1
    dp_csgp_randk0.1   DPCSGPStrategy with RandK(0.1), consensus step 0.05 (the value docs/compression.md found
                       stable for RandK(0.1) on this graph), C = 1, sigma = 1
    dp_csgp_qsgd8      DPCSGPStrategy with QSGD(8), consensus step 0.5, C = 1, sigma = 1
    decor              CorrelatedNoiseStrategy on a ring (two messages per node per step), sigma_cdp = sigma_cor = 1

Models (``--model``): ``mlp``, the digits MLP 64-64-10 (4,810 parameters, 19 KB messages: compute and latency dominate); ``wide``,
an MLP 64-3072-3072-10 of 9.67M parameters (38.7 MB messages, little compute per parameter: the network dominates);
``resnet18``, the GroupNorm ResNet-18 of examples/cifar_resnet.py (11.2M parameters) on synthetic CIFAR-shaped data.
``mlp`` and ``wide`` train on scikit-learn's bundled digits (real labels, no download; Lightning shards the training
set over the nodes), so their runs also give a test accuracy; ``resnet18`` gives step time only.

Per configuration and rank: the median step time, as batch start -> next batch start (forward, backward, privacy,
optimizer, exchange, and Lightning's own per-step work), over ``--steps`` steps after ``--warmup``; the bytes this
node's interface sent per timed step (``tx_bytes`` of its veth: payload, TCP/IP headers and Lightning's control
collectives, i.e. what the rate limit sees), and the payload bytes the library's exchange counted; the seconds per
step spent blocked in the exchange (the gossip configs: time inside ``exchange`` and waiting on ``start``'s rounds)
the seconds between one batch's end and the next one's start (Lightning's per-step SIGTERM broadcast from rank 0, a
global collective that waits for the slowest rank, and fetching the batch); and the compute (the rest of the step).
For DDP, whose all-reduce runs inside backward, the compute is measured instead: before its run every rank times the
same forward + backward + SGD steps on a local copy of the model, all ranks at once (so with the same CPU
contention), and exchange = step - compute - between steps. A row reports the slowest rank's
median (``step_seconds``) and the medians over ranks of the other numbers. The physical limit of a step is
``bytes_per_node_step * 8 / R`` (its bytes through its own link) plus its compute.

With ``--eval-every K`` (mlp and wide), every K steps all ranks evaluate their own model on the digits test set
(450 images) and wait for each other; the evaluation and the wait are excluded from the clock. The row then holds
the accuracy curve (training seconds, mean accuracy over nodes) and the training seconds until the mean accuracy
first reaches ``--target-accuracy``.

How to run (as root)
--------------------
    python benchmarks/network.py --nodes 4 --mbit 100 --model wide --steps 10 --json OUT.json
    python benchmarks/network.py --nodes 8 --mbit 10,100,1000 --model wide --steps 6 --json wide8.json
    python benchmarks/network.py --nodes 8 --mbit 100 --model mlp --steps 60 --eval-every 5 --json acc.json
    python benchmarks/network.py --report wide8.json acc.json     # tables + plots, appended to RESULTS.md
    python benchmarks/network.py --nodes 8 --mbit 100 --configs push_sum_overlap --sigterm-every 0   # ablation

``--sigterm-every K`` runs Lightning's per-step SIGTERM broadcast (a global collective from rank 0 before every step)
only every K steps (0: never), in this benchmark only, to measure what that synchronisation costs; the default, 1,
leaves Lightning as it is.

``--json`` writes ``{"rows": [{"config", "nodes", "mbit", "step_seconds", "bytes_per_node_step",
"compute_seconds", "exchange_seconds", ...}], ...}``. ``--report`` reads such files, prints the tables, writes
``benchmarks/network_step_time.png`` and ``benchmarks/network_accuracy.png`` and appends to RESULTS.md.
Every rank uses one intra-op thread (``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1``, unless set); with more
ranks than cores, the compute column carries CPU contention.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from machine_info import append_results, machine_line, software_line, usable_cores

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "pdn"  # every namespace, interface and bridge this benchmark creates starts with it
SUBNET = "10.217.0"
MASTER_PORT = 29517
TOPOLOGY = "exponential-one-peer"
CLIP, SIGMA, LR = 1.0, 1.0, 0.05
CONFIGS = ("ddp", "push_sum", "push_sum_overlap", "push_sum_overlap2", "push_sum_sealed", "privsgp", "dp_csgp_randk0.1",
           "dp_csgp_qsgd8", "decor")
BATCH = {"mlp": 32, "wide": 32, "resnet18": 4}  # per node; ResNet-18's is small so the CPUs keep up with the network
WIDE_HIDDEN = 3072
PUSH_SUM_TARGET, RANDK_TARGET, LIMIT_TARGET, ACCURACY_SPEEDUP = 0.6, 0.15, 1.3, 2.0  # issue 17's targets


class SetupError(RuntimeError):
    """The machine cannot build the emulated network (not root, no ``ip netns``, no tbf)."""


# ---------------------------------------------------------------------------------------------------------------------
# the emulated network
# ---------------------------------------------------------------------------------------------------------------------
def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def tbf_args(mbit: float) -> list[str]:
    """tbf at ``mbit``: a bucket of 2.5 ms of traffic (at least 32 KiB, the issue's 256 kbit at 100 Mbit/s)."""
    burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.0025))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "500ms"]


def check_privileges() -> None:
    """Raise SetupError with what is missing, before anything is created."""
    if os.geteuid() != 0:
        raise SetupError("this benchmark builds network namespaces and needs root (run it with sudo, as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SetupError(f"`{tool}` is not installed (package iproute2)")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        raise SetupError("`ip netns` does not work on this machine (no network namespace support)")


class Network:
    """N node namespaces ``{prefix}0..`` joined by a bridge in namespace ``{prefix}br``; node i has the veth
    ``{prefix}n{i}`` with address 10.217.0.(i+1)/24 and a tbf limit on its egress. Every name starts with ``prefix``,
    so concurrent runs with different prefixes do not meet, and a rerun removes what an interrupted one left."""

    def __init__(self, nodes: int, prefix: str = PREFIX) -> None:
        self.nodes, self.prefix = nodes, prefix

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def interface(self, rank: int) -> str:
        return f"{self.prefix}n{rank}"

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def _existing(self) -> list[str]:
        proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
        rest = [name[len(self.prefix):] for name in names if name.startswith(self.prefix)]
        return [self.prefix + r for r in rest if r == "br" or r.isdigit()]

    def remove(self) -> None:
        """Delete every namespace with this prefix (their veths and the bridge go with them)."""
        for name in self._existing():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def build(self) -> None:
        self.remove()
        bridge_ns, bridge = f"{self.prefix}br", f"{self.prefix}bridge"
        _ip("netns", "add", bridge_ns)
        _ip("-n", bridge_ns, "link", "add", bridge, "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", bridge, "up")
        for rank in range(self.nodes):
            ns, port, interface = self.namespace(rank), f"{self.prefix}b{rank}", self.interface(rank)
            _ip("netns", "add", ns)
            _ip("-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", interface, "netns", ns)
            _ip("-n", bridge_ns, "link", "set", port, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", interface)
            _ip("-n", ns, "link", "set", interface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def set_rate(self, mbit: float) -> None:
        """(Re)place the egress limit of every node's interface."""
        for rank in range(self.nodes):
            proc = subprocess.run(["ip", "netns", "exec", self.namespace(rank), "tc", "qdisc", "replace", "dev",
                                   self.interface(rank), "root", *tbf_args(mbit)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SetupError(f"tc tbf on {self.interface(rank)} failed: {proc.stderr.strip()}")

    def install_cleanup(self) -> None:
        """Remove the namespaces at interpreter exit; SIGTERM / SIGHUP become an exit (so ``finally`` runs)."""
        atexit.register(self.remove)

        def _exit(signum: int, frame: Any) -> None:  # noqa: ARG001
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit)


# ---------------------------------------------------------------------------------------------------------------------
# child: one rank, in its namespace, training every configuration in turn
# ---------------------------------------------------------------------------------------------------------------------
def build_net(model: str, width: int = WIDE_HIDDEN):  # noqa: ANN201
    """The model's network; ``width``: the hidden width of ``wide`` (the test uses a narrow one)."""
    from torch import nn

    if model == "mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))  # DigitsClassifier's network
    if model == "wide":
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    sys.path.insert(0, str(ROOT / "examples"))
    from cifar_resnet import resnet18_groupnorm

    return resnet18_groupnorm()


def build_module(net: Any):  # noqa: ANN001, ANN201
    import lightning as L
    import torch
    import torch.nn.functional as F

    class Classifier(L.LightningModule):
        """Cross-entropy, plain SGD, nothing logged (no collectives besides the strategy's own)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.net(x)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN202
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):  # noqa: ANN202
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Classifier()


def build_data(model: str, nodes: int, seed: int):  # noqa: ANN201
    """(train loader, test tensors or None): digits for mlp and wide, CIFAR-shaped noise for resnet18."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    if model == "resnet18":
        gen = torch.Generator().manual_seed(seed)
        n = BATCH[model] * nodes * 16
        train = TensorDataset(torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen))
        test = None
    else:
        from lightning_privdec.data.digits import load_digits_tensors

        tensors = load_digits_tensors(seed)
        train, test = TensorDataset(*tensors["train"]), tensors["test"]
    return DataLoader(train, batch_size=BATCH[model], shuffle=True, drop_last=True), test


def make_identities(directory: Path, nodes: int) -> None:
    """``directory/node<rank>.key`` for every rank and their ``directory/roster`` (push_sum_sealed)."""
    from lightning_privdec.comm.identity import write_identity_key

    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{rank} {base64.b64encode(write_identity_key(directory / f'node{rank}.key')).decode()}"
             for rank in range(nodes)]
    (directory / "roster").write_text("\n".join(lines) + "\n")


def build_strategy(config: str, peer_timeout: float, identities: Path | None = None, rank: int = 0):  # noqa: ANN201
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_privdec import (
        QSGD,
        CorrelatedNoiseStrategy,
        DecentralizedPushSumStrategy,
        DPCSGPStrategy,
        PrivSGPStrategy,
        RandK,
    )

    private = dict(max_grad_norm=CLIP, seed=0, peer_timeout=peer_timeout)
    if config == "ddp":
        return DDPStrategy()
    if config in ("push_sum", "push_sum_overlap", "push_sum_overlap2"):
        return DecentralizedPushSumStrategy(topology=TOPOLOGY, seed=0, overlap=config != "push_sum",
                                            staleness=2 if config == "push_sum_overlap2" else 1,
                                            peer_timeout=peer_timeout)  # fmt: skip
    if config == "push_sum_sealed":
        assert identities is not None
        return DecentralizedPushSumStrategy(topology=TOPOLOGY, seed=0, peer_timeout=peer_timeout,
                                            roster=identities / "roster", identity_key=identities / f"node{rank}.key")
    if config == "privsgp":
        return PrivSGPStrategy(topology=TOPOLOGY, noise_multiplier=SIGMA, **private)
    if config == "dp_csgp_randk0.1":
        return DPCSGPStrategy(topology=TOPOLOGY, compressor=RandK(0.1), consensus_step=0.05, noise_multiplier=SIGMA,
                              **private)  # fmt: skip
    if config == "dp_csgp_qsgd8":
        return DPCSGPStrategy(topology=TOPOLOGY, compressor=QSGD(8), consensus_step=0.5, noise_multiplier=SIGMA,
                              **private)  # fmt: skip
    if config == "decor":
        return CorrelatedNoiseStrategy(topology="ring", sigma_cdp=SIGMA * CLIP, sigma_cor=SIGMA * CLIP, **private)
    raise ValueError(f"unknown config {config!r}; choose from {CONFIGS}")


def tx_bytes(interface: str) -> int:
    """Bytes this namespace's interface has sent (``ip netns exec`` mounts the namespace's own /sys)."""
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def make_probe(warmup: int, interface: str, test: Any, eval_every: int):  # noqa: ANN001, ANN201
    """A Callback timing every step on this rank, the time blocked in the exchange, the interface's bytes and
    (every ``eval_every`` steps) the test accuracy of this node's model, with evaluation excluded from the clock."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.paused: list[float] = []  # per step: seconds of evaluation (and the barrier after it)
            self.blocked: list[float] = []  # per step: seconds blocked in the exchange
            self.curve: list[tuple[int, float, float]] = []  # (step, training seconds so far, accuracy)
            self._blocked = 0.0
            self._tx: int | None = None
            self._payload: int | None = None
            self.bytes_per_step: float | None = None
            self.payload_per_step: float | None = None

        def _blocking(self, fn):  # noqa: ANN001, ANN202
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._blocked += time.perf_counter() - start

            return wrapper

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            gossip = getattr(trainer.strategy, "gossip", None)
            self.exchange = None if gossip is None else gossip.exchange
            if self.exchange is None:
                return
            blocking_start = self._blocking(self.exchange.start)

            def start(*args: Any, **kwargs: Any) -> Any:  # the wait for an overlapped round counts where it happens
                pending = blocking_start(*args, **kwargs)
                pending.wait = self._blocking(pending.wait)
                return pending

            # instance attributes shadow the methods; the library is untouched
            self.exchange.exchange = self._blocking(self.exchange.exchange)
            self.exchange.start = start

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if len(self.starts) == warmup:
                self._tx = tx_bytes(interface)
                self._payload = None if self.exchange is None else self.exchange.traffic.bytes_sent
            self._blocked = 0.0
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.ends.append(time.perf_counter())
            self.blocked.append(self._blocked)
            paused = 0.0
            if eval_every and test is not None and len(self.ends) % eval_every == 0:
                start = time.perf_counter()
                was_training = pl_module.training
                pl_module.eval()
                with torch.no_grad():
                    accuracy = (pl_module(test[0]).argmax(-1) == test[1]).float().mean().item()
                pl_module.train(was_training)
                dist.barrier()  # everyone resumes together: no rank's evaluation shows up as another's exchange
                paused = time.perf_counter() - start
                self.curve.append((len(self.ends), self.training_seconds(), accuracy))
            self.paused.append(paused)

        def training_seconds(self) -> float:
            """Wall-clock seconds of training so far: batch start to batch end, and the gaps between batches."""
            total = self.ends[-1] - self.starts[0]
            return total - sum(self.paused)

        def on_train_end(self, trainer, pl_module) -> None:
            timed = len(self.starts) - warmup
            if self._tx is not None and timed > 0:
                self.bytes_per_step = (tx_bytes(interface) - self._tx) / timed
                if self._payload is not None:
                    self.payload_per_step = (self.exchange.traffic.bytes_sent - self._payload) / timed

        def steps(self) -> list[float]:
            """Batch start -> next batch start (evaluation excluded); the last step ends at its batch end."""
            bounds = self.starts[1:] + [self.ends[-1]]
            return [b - a - p for a, b, p in zip(self.starts, bounds, self.paused)]

        def gaps(self) -> list[float]:
            """Batch end -> next batch start (evaluation excluded): Lightning's per-step SIGTERM broadcast from rank 0
            (a global collective: it waits for the slowest rank) and fetching the next batch; 0 after the last."""
            return [b - a - p for a, b, p in zip(self.ends, self.starts[1:], self.paused)] + [0.0]

        def summary(self) -> dict[str, Any]:
            """Medians over the timed steps; compute is taken step by step (step - exchange - between steps)."""
            steps, blocked, gaps = self.steps()[warmup:], self.blocked[warmup:], self.gaps()[warmup:]
            gossip = self.exchange is not None
            return {
                "step_seconds": statistics.median(steps),
                "between_steps_seconds": statistics.median(gaps),
                "exchange_seconds": statistics.median(blocked) if gossip else None,
                "compute_seconds": statistics.median(s - b - g for s, b, g in zip(steps, blocked, gaps)) if gossip
                else None,
                "bytes_per_node_step": self.bytes_per_step,
                "payload_bytes_per_node_step": self.payload_per_step,
                "curve": self.curve,
            }

    return Probe()


def local_compute_seconds(model: str, width: int, loader: Any, steps: int, warmup: int) -> float:
    """Median seconds of forward + backward + SGD step on a local copy of the model (no communication)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = build_net(model, width)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    times: list[float] = []
    batches = iter(loader)
    for _ in range(warmup + steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def thin_sigterm_broadcast(trainer: Any, every: int) -> None:
    """Ablation: Lightning's per-step SIGTERM broadcast from rank 0 (a global collective before every step) only
    every ``every`` steps (0: never), to measure what the per-step global synchronisation costs."""
    loop = trainer.fit_loop.epoch_loop
    original, calls = loop._broadcast_sigterm_tensor, [0]

    def broadcast() -> None:
        calls[0] += 1
        if every and calls[0] % every == 0:
            original()

    loop._broadcast_sigterm_tensor = broadcast


def run_child(args: argparse.Namespace) -> None:
    """This rank: one gloo process group, then every configuration; writes ``{out_dir}/{config}.{rank}.json``."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # sampler, worker and logger hints would bury the numbers
    import lightning as L
    import torch.distributed as dist

    interface = os.environ["GLOO_SOCKET_IFNAME"]
    rank, nodes = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=nodes)  # Lightning reuses it for every Trainer
    import lightning_privdec

    for config in args.configs:
        L.seed_everything(args.seed, verbose=False)
        loader, test = build_data(args.model, nodes, args.seed)
        row: dict[str, Any] = {"rank": rank, "package": lightning_privdec.__file__}
        if config == "ddp":
            dist.barrier()
            local = local_compute_seconds(args.model, args.width, loader, args.steps, args.warmup)
        L.seed_everything(args.seed, verbose=False)
        module = build_module(build_net(args.model, args.width))
        probe = make_probe(args.warmup, interface, test, args.eval_every)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, num_nodes=nodes, strategy=build_strategy(config, args.peer_timeout, args.out_dir / "keys", rank),
            max_steps=args.warmup + args.steps, max_epochs=-1, callbacks=[probe], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        if args.sigterm_every != 1:
            thin_sigterm_broadcast(trainer, args.sigterm_every)
        dist.barrier()
        trainer.fit(module, train_dataloaders=loader)
        row.update(probe.summary())
        row["num_params"] = sum(p.numel() for p in module.parameters())
        if config == "ddp":  # the all-reduce runs inside backward: the exchange is what the local compute leaves
            row["compute_seconds"] = local
            row["exchange_seconds"] = max(0.0, row["step_seconds"] - local - row["between_steps_seconds"])
        (args.out_dir / f"{config}.{rank}.json").write_text(json.dumps(row))
        dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# parent: build the network, launch the ranks, summarise
# ---------------------------------------------------------------------------------------------------------------------
def launch(args: argparse.Namespace, network: Network, mbit: float, out_dir: Path) -> None:
    """Start one rank per namespace, wait for all (bounded by --timeout), raise with the failing rank's output."""
    env_base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env_base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # one intra-op thread per rank: Lightning's launcher otherwise sets torch's threads to the machine's core count in
    # every rank (each rank is one node of its own), and eight ranks' OpenMP threads then spin against each other
    env_base.setdefault("OMP_NUM_THREADS", "1")
    procs: list[tuple[subprocess.Popen, Any]] = []
    try:
        for rank in range(args.nodes):
            env = dict(env_base, MASTER_ADDR=network.address(0), MASTER_PORT=str(MASTER_PORT),
                       WORLD_SIZE=str(args.nodes), NODE_RANK=str(rank), LOCAL_RANK="0",
                       GLOO_SOCKET_IFNAME=network.interface(rank))  # fmt: skip
            cmd = ["ip", "netns", "exec", network.namespace(rank), sys.executable, os.path.abspath(__file__),
                   "--child", "--model", args.model, "--width", str(args.width), "--steps", str(args.steps),
                   "--warmup", str(args.warmup),
                   "--configs", ",".join(args.configs), "--seed", str(args.seed), "--eval-every", str(args.eval_every),
                   "--peer-timeout", str(args.peer_timeout), "--sigterm-every", str(args.sigterm_every),
                   "--out-dir", str(out_dir)]  # fmt: skip
            log = (out_dir / f"rank{rank}.log").open("w")
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + args.timeout
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the ranks did not finish within --timeout {args.timeout:.0f} s at {mbit} Mbit/s") from exc
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    failed = [rank for rank, (proc, _) in enumerate(procs) if proc.returncode != 0]
    if failed:
        tail = "\n".join((out_dir / f"rank{failed[0]}.log").read_text().splitlines()[-30:])
        raise RuntimeError(f"rank {failed[0]} exited with {procs[failed[0]][0].returncode} at {mbit} Mbit/s:\n{tail}")


def limit_seconds(row: dict[str, Any]) -> float:
    """The physical limit of a step: its bytes through the node's link, ``bytes * 8 / R``. With overlap a round is
    still in flight when the window closes, so the interface's count over a few steps can miss part of the last one:
    the larger of that count and the exchange's exact payload count is used."""
    limit_bytes = max(row["bytes_per_node_step"], row["payload_bytes_per_node_step"] or 0.0)
    return limit_bytes * 8 / (row["mbit"] * 1e6)


def summarise(config: str, ranks: list[dict[str, Any]], args: argparse.Namespace, mbit: float) -> dict[str, Any]:
    """One JSON row: the slowest rank's median step, the medians over ranks of the rest, the accuracy curve."""

    def median(key: str) -> float | None:
        values = [r[key] for r in ranks if r.get(key) is not None]
        return statistics.median(values) if values else None

    row: dict[str, Any] = {
        "config": config, "nodes": args.nodes, "mbit": mbit, "model": args.model,
        "step_seconds": max(r["step_seconds"] for r in ranks),
        "bytes_per_node_step": median("bytes_per_node_step"),
        "compute_seconds": median("compute_seconds"),
        "exchange_seconds": median("exchange_seconds"),
        "between_steps_seconds": median("between_steps_seconds"),
        "payload_bytes_per_node_step": median("payload_bytes_per_node_step"),
        "per_rank_step_seconds": [r["step_seconds"] for r in ranks],
        "num_params": ranks[0]["num_params"], "steps": args.steps, "warmup": args.warmup,
        "sigterm_every": args.sigterm_every,
    }  # fmt: skip
    row["limit_seconds"] = limit_seconds(row)
    if args.eval_every and ranks[0]["curve"]:
        curve = [(step, max(c[1] for c in points), statistics.mean(c[2] for c in points))
                 for step, *_ in ranks[0]["curve"]
                 for points in [[next(c for c in r["curve"] if c[0] == step) for r in ranks]]]  # fmt: skip
        row["accuracy_curve"] = curve  # (step, training seconds of the slowest rank, mean accuracy over nodes)
        row["target_accuracy"] = args.target_accuracy
        reached = [seconds for _, seconds, accuracy in curve if accuracy >= args.target_accuracy]
        row["time_to_accuracy_seconds"] = reached[0] if reached else None
        row["final_accuracy"] = curve[-1][2]
    return row


def run_parent(args: argparse.Namespace, argv: list[str]) -> None:
    check_privileges()
    network = Network(args.nodes, args.prefix)
    network.install_cleanup()
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    print(machine_line(), flush=True)
    try:
        network.build()
        for mbit in args.rates:
            network.set_rate(mbit)
            with tempfile.TemporaryDirectory(prefix="pdn_network_") as tmp:
                out_dir = Path(tmp)
                print(f"{args.nodes} nodes at {mbit:g} Mbit/s, model {args.model}: {', '.join(args.configs)} ...",
                      flush=True)  # fmt: skip
                start = time.perf_counter()
                if "push_sum_sealed" in args.configs:
                    make_identities(out_dir / "keys", args.nodes)
                launch(args, network, mbit, out_dir)
                print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
                for config in args.configs:
                    ranks = [json.loads((out_dir / f"{config}.{rank}.json").read_text()) for rank in range(args.nodes)]
                    if not all(r["package"].startswith(str(ROOT)) for r in ranks):
                        raise RuntimeError(f"the ranks imported lightning_privdec from {ranks[0]['package']}, "
                                           f"not from this checkout ({ROOT})")  # fmt: skip
                    rows.append(summarise(config, ranks, args, mbit))
    finally:
        network.remove()
    payload = {
        "rows": rows, "command": "python benchmarks/network.py " + " ".join(argv),
        "machine": [machine_line(), software_line(opacus=True)], "total_seconds": time.perf_counter() - started,
        "date": datetime.date.today().isoformat(),
    }  # fmt: skip
    print("\n".join(step_table(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")


# ---------------------------------------------------------------------------------------------------------------------
# report: tables and plots from one or more --json files
# ---------------------------------------------------------------------------------------------------------------------
def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def step_table(rows: list[dict[str, Any]]) -> list[str]:
    """One markdown table per (model, N, R), with each row's ratio to DDP and to its physical limit."""
    lines: list[str] = []
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["nodes"], row["mbit"]), []).append(row)
    for row in rows:
        row["limit_seconds"] = limit_seconds(row)
    for (model, nodes, mbit), group in groups.items():
        ddp = next((r for r in group if r["config"] == "ddp"), None)
        lines += [
            "",
            f"**{model}** ({group[0]['num_params']:,} parameters), {nodes} nodes, {mbit:g} Mbit/s per node "
            f"({group[0]['steps']} timed steps after {group[0]['warmup']} warm-up)",
            "",
            "| config | step s (slowest rank) | vs DDP | MB/node/step on the wire | of which payload | compute s "
            "| exchange s | between steps s | dominated by | limit s (bytes/R) | limit + compute s "
            "| step / (limit + compute) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in group:
            floor = r["limit_seconds"] + r["compute_seconds"]
            vs_ddp = "n/a" if ddp is None else f"{r['step_seconds'] / ddp['step_seconds']:.2f}x"
            dominated = "network" if r["exchange_seconds"] > r["compute_seconds"] else "compute"
            lines.append(
                f"| {r['config']} | {r['step_seconds']:.3f} | {vs_ddp} | {_mb(r['bytes_per_node_step'])} "
                f"| {_mb(r['payload_bytes_per_node_step'])} | {r['compute_seconds']:.3f} | {r['exchange_seconds']:.3f} "
                f"| {_seconds(r.get('between_steps_seconds'))} | {dominated} | {r['limit_seconds']:.3f} | {floor:.3f} "
                f"| {r['step_seconds'] / floor:.2f} |"
            )
    return lines


def accuracy_table(rows: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in rows if "accuracy_curve" in r]
    if not rows:
        return []
    lines = [
        "",
        "| model | nodes | Mbit/s | config | target | training s to target | vs DDP | final mean accuracy | steps |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ddp = next((d for d in rows if d["config"] == "ddp" and (d["model"], d["nodes"], d["mbit"]) ==
                    (r["model"], r["nodes"], r["mbit"])), None)  # fmt: skip
        tta = r["time_to_accuracy_seconds"]
        ratio = "n/a" if tta is None or ddp is None or ddp["time_to_accuracy_seconds"] is None else \
            f"{tta / ddp['time_to_accuracy_seconds']:.2f}x"  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['mbit']:g} | {r['config']} | {r['target_accuracy']:.2f} "
            f"| {'not reached' if tta is None else f'{tta:.1f}'} | {ratio} | {r['final_accuracy']:.3f} "
            f"| {r['warmup'] + r['steps']} |"
        )
    return lines


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 17's targets, where the rows hold the needed runs (8 nodes, 100 Mbit/s, wide / resnet18; digits)."""
    lines: list[str] = []
    for r in rows:
        if r["nodes"] != 8 or r["mbit"] != 100 or r["model"] not in ("wide", "resnet18"):
            continue
        ddp = next((d for d in rows if d["config"] == "ddp" and (d["model"], d["nodes"], d["mbit"]) ==
                    (r["model"], r["nodes"], r["mbit"])), None)  # fmt: skip
        target = {"push_sum": PUSH_SUM_TARGET, "dp_csgp_randk0.1": RANDK_TARGET}.get(r["config"])
        if ddp is None or target is None:
            continue
        ratio = r["step_seconds"] / ddp["step_seconds"]
        floor = r["step_seconds"] / (r["limit_seconds"] + r["compute_seconds"])
        lines.append(
            f"- {r['model']}, {r['config']}: {ratio:.2f}x DDP (target <= {target}x): "
            f"{'MET' if ratio <= target else 'NOT MET'}; {floor:.2f}x its limit + compute (target <= "
            f"{LIMIT_TARGET}x): {'MET' if floor <= LIMIT_TARGET else 'NOT MET'}"
        )
    for r in rows:
        if r.get("time_to_accuracy_seconds") is None or r["config"] not in ("push_sum", "dp_csgp_randk0.1"):
            continue
        ddp = next((d for d in rows if d["config"] == "ddp" and (d["model"], d["nodes"], d["mbit"]) ==
                    (r["model"], r["nodes"], r["mbit"])), None)  # fmt: skip
        if ddp is None or ddp.get("time_to_accuracy_seconds") is None:
            continue
        ratio = r["time_to_accuracy_seconds"] / ddp["time_to_accuracy_seconds"]
        lines.append(
            f"- digits ({r['model']}, {r['nodes']} nodes, {r['mbit']:g} Mbit/s), {r['config']}: reaches "
            f"{r['target_accuracy']:.2f} in {ratio:.2f}x DDP's time (target <= {1 / ACCURACY_SPEEDUP:.2f}x): "
            f"{'MET' if ratio <= 1 / ACCURACY_SPEEDUP else 'NOT MET'}"
        )
    return lines


def write_plots(rows: list[dict[str, Any]], step_plot: Path, accuracy_plot: Path) -> None:
    """Step time vs bandwidth per config (one panel per model and N); accuracy vs training time per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["nodes"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (model, nodes) in zip(axes[0], panels):
        for config in CONFIGS:
            points = sorted((r["mbit"], r["step_seconds"]) for r in rows
                            if (r["model"], r["nodes"], r["config"]) == (model, nodes, config))  # fmt: skip
            if points:
                ax.plot(*zip(*points), marker="o", label=config)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("egress rate per node (Mbit/s)")
        ax.set_ylabel("median step time, slowest rank (s)")
        ax.set_title(f"{model}, {nodes} nodes", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(step_plot, dpi=110)
    print(f"plot: {step_plot}")
    curves = [r for r in rows if "accuracy_curve" in r]
    if not curves:
        return
    groups = sorted({(r["model"], r["nodes"], r["mbit"]) for r in curves})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, key in zip(axes[0], groups):
        for r in curves:
            if (r["model"], r["nodes"], r["mbit"]) == key:
                _, seconds, accuracy = zip(*r["accuracy_curve"])
                ax.plot(seconds, accuracy, marker=".", label=r["config"])
        ax.axhline(curves[0]["target_accuracy"], color="k", linestyle=":", linewidth=1)
        ax.set_xlabel("training wall-clock (s, evaluation excluded)")
        ax.set_ylabel("digits test accuracy (mean over nodes)")
        ax.set_title(f"{key[0]}, {key[1]} nodes, {key[2]:g} Mbit/s", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(accuracy_plot, dpi=110)
    print(f"plot: {accuracy_plot}")


def run_report(args: argparse.Namespace) -> None:
    payloads = [json.loads(Path(p).read_text()) for p in args.report]
    rows = [row for payload in payloads for row in payload["rows"]]
    report = [*step_table(rows), *accuracy_table(rows)]
    targets = target_lines(rows)
    if targets:
        report += ["", "Targets (issue 17):", "", *targets]
    print("\n".join(report))
    if args.no_record:
        return
    write_plots(rows, ROOT / "benchmarks" / "network_step_time.png", ROOT / "benchmarks" / "network_accuracy.png")
    header = ["", f"## network.py — {datetime.date.today().isoformat()}", "", "Commands:", ""]
    header += [f"- `{p['command']}` ({p['total_seconds']:.0f} s, {p['date']})" for p in payloads]
    header += ["", *(f"- {line}" for line in payloads[0]["machine"]),
               f"- {usable_cores()} usable cores shared by all ranks; the machine was shared with other work",
               "", "Plots: `benchmarks/network_step_time.png`, `benchmarks/network_accuracy.png`."]  # fmt: skip
    append_results("\n".join(header + report) + "\n", args.results)


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--nodes", type=int, default=4, help="namespaces, one rank each")
    parser.add_argument("--mbit", default="100", help="egress rate per node in Mbit/s; a comma list runs each")
    parser.add_argument("--model", choices=("mlp", "wide", "resnet18"), default="wide")
    parser.add_argument("--width", type=int, default=WIDE_HIDDEN, help="hidden width of the wide MLP")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing starts")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list out of {','.join(CONFIGS)}")
    parser.add_argument("--eval-every", type=int, default=0, help="test accuracy every K steps (mlp, wide); 0: off")
    parser.add_argument("--target-accuracy", type=float, default=0.85, help="for the time to accuracy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-timeout", type=float, default=300.0, help="seconds a gossip rank waits for a peer")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for all configs at one rate")
    parser.add_argument("--sigterm-every", type=int, default=1,
                        help="ablation: Lightning's per-step SIGTERM broadcast only every K steps (0: never; 1: as is)")
    parser.add_argument("--prefix", default=PREFIX, help="name prefix of the namespaces and interfaces (<= 8 chars)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    parser.add_argument("--report", nargs="+", default=None, help="JSON files of earlier runs: tables and plots")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument("--no-record", action="store_true", help="with --report: print only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    try:
        args.rates = [float(r) for r in args.mbit.split(",")]
    except ValueError:
        parser.error(f"--mbit takes Mbit/s numbers separated by commas, got {args.mbit!r}")
    if not (args.prefix.isalpha() and len(args.prefix) <= 8):
        parser.error("--prefix must be at most 8 letters (interface names are limited to 15 characters)")
    if args.nodes < 2 or args.nodes > 250 or args.steps < 1 or args.warmup < 0 or min(args.rates) <= 0:
        parser.error("need 2 <= --nodes <= 250, --steps >= 1, --warmup >= 0 and positive --mbit")
    return args


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.child:
        run_child(args)
    elif args.report:
        run_report(args)
    else:
        try:
            run_parent(args, argv)
        except SetupError as exc:
            raise SystemExit(f"network.py: cannot build the emulated network: {exc}") from None
        except KeyboardInterrupt:
            raise SystemExit("network.py: interrupted; the namespaces were removed") from None


if __name__ == "__main__":
    main()
