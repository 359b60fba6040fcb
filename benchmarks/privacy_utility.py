"""Privacy-utility on real data: test accuracy vs epsilon for the private strategies and a central DP-SGD baseline.

What it measures
----------------
scikit-learn's handwritten digits (1,797 real images; :func:`lightning_privdec.data.digits.load_digits_tensors` with
its fixed split: 449 test images, never used to choose anything). The training part is split once more: a held-out
validation set (``--val-fraction``, default 20%) for tuning and the rest for training. On ``--nodes`` processes
(default 8, gloo on CPU) every method trains the digits MLP (64-64-10, :class:`DigitsClassifier`) for ``--epochs``
epochs at per-node expected batch B = ``--batch-size`` (Poisson sampling, q = B / J), with per-node target epsilon in
``--epsilons`` and delta = 1e-5:

    dp_csgp   DP-CSGP, exponential graph, RandK(0.5), gamma auto    (examples/digits.py defaults)
    privsgp   PrivSGP, exponential graph, uncompressed
    dyn_d2p   Dyn-D2P, exponential-one-peer, rho_c = rho_mu = 2
    decor     Decor, ring, SecLDP against an eavesdropper
    ldp       Decor's LDP baseline on the ring (sigma_cor = 0: every message private on its own)
    central   central DP-SGD: ONE model on all the training data (Opacus, Poisson sampling at q = nB / N, the
              same number of steps, RDP accountant), i.e. a trusted curator

Tuning: for each method the SGD learning rate and clip bound C are chosen on the validation split from the grid
``--lrs`` x ``--clips`` at ``--tune-epsilon`` with seed 0 (headline metric, see below); every epsilon and seed then
uses the chosen pair. The epsilon reported covers training only: the tuning runs' own privacy cost is not accounted
(as in most of the literature; see Papernot & Steinke 2022).

Reported per method and epsilon: mean and sample standard deviation over ``--seeds`` of the test accuracy of each
node's own model averaged over the nodes (the headline: what a node holds after training), of the network-average
model (formed for evaluation only), and the largest epsilon any node actually spent, from its accountant.

Cost: one ``--nodes``-process launch runs every decentralized fit (Lightning's subprocess launcher re-runs this
script on each rank, all ranks walk the same job list and reuse the process group; each fit gets a fresh Trainer,
strategy, model and privacy engine). The central baseline runs in the parent process.

    python benchmarks/privacy_utility.py                  # the full table (40-50 min on 2 busy CPU cores)
    python benchmarks/privacy_utility.py --quick          # smoke check: 4 nodes, 2 epochs, no tuning, 2 epsilons
    python benchmarks/privacy_utility.py --records /tmp/pu.jsonl --resume   # continue an interrupted run

Prints the tables, writes ``benchmarks/privacy_utility.png`` and appends the tables with this machine's description
to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from machine_info import append_results, cpu_name, usable_cores  # noqa: E402  (benchmarks/machine_info.py)

METHODS: dict[str, dict[str, Any]] = {  # name -> label and examples/digits.py options (None: central baseline)
    "dp_csgp": {"label": "DP-CSGP (exponential, RandK(0.5))", "strategy": "dp_csgp", "baseline": None},
    "privsgp": {"label": "PrivSGP (exponential)", "strategy": "privsgp", "baseline": None},
    "dyn_d2p": {"label": "Dyn-D2P (exponential-one-peer)", "strategy": "dyn_d2p", "baseline": None},
    "decor": {"label": "Decor (ring, eavesdropper)", "strategy": "decor", "baseline": None},
    "ldp": {"label": "LDP (ring)", "strategy": "decor", "baseline": "ldp"},
    "central": {"label": "central DP-SGD (Opacus, 1 model)", "strategy": None, "baseline": None},
}
DELTA = 1e-5
DATA_SEED = 0  # the train/validation/test split is the same for every run; seeds vary init, sampling and noise


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list out of {','.join(METHODS)}")
    p.add_argument("--epsilons", default="0.5,1,2,4,8", help="per-node target epsilons (delta = 1e-5)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1 per method and epsilon")
    p.add_argument("--nodes", type=int, default=8, help="processes = nodes")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32, help="expected per-node batch B (central: nodes x B)")
    p.add_argument("--lrs", default="0.1,0.3,1.0", help="learning-rate grid")
    p.add_argument("--clips", default="0.5,2.0", help="clip-bound grid (Dyn-D2P: the initial clip C_0)")
    p.add_argument("--tune-epsilon", type=float, default=2.0, help="epsilon at which the grid is searched (seed 0)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="share of the training images held out to tune")
    p.add_argument("--quick", action="store_true", help="smoke check: 4 nodes, 2 epochs, eps 1,4, 1 seed, no grid")
    p.add_argument("--records", type=Path, default=None, help="JSON-lines file of every fit (default: a temp file)")
    p.add_argument("--resume", action="store_true", help="keep the fits already in --records and run the rest")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds allowed for the multi-process launch")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "privacy_utility.png")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    p.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # internal: the job plan
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.epochs, args.seeds = 4, 2, 1
        args.epsilons, args.lrs, args.clips, args.tune_epsilon = "1,4", "0.5", "1.0", 1.0
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    args.epsilon_list, args.lr_list, args.clip_list = _floats(args.epsilons), _floats(args.lrs), _floats(args.clips)
    if not args.epsilon_list or min(args.epsilon_list) <= 0 or args.tune_epsilon <= 0:
        p.error("epsilons must be positive numbers, e.g. --epsilons 0.5,1,2")
    if not args.lr_list or not args.clip_list or min(args.lr_list + args.clip_list) <= 0:
        p.error("--lrs and --clips need positive values, e.g. --lrs 0.1,0.3 --clips 1")
    if args.nodes < 2 or args.epochs < 1 or args.seeds < 1 or args.batch_size < 1:
        p.error("need --nodes >= 2, --epochs >= 1, --seeds >= 1 and --batch-size >= 1")
    if not 0.0 < args.val_fraction < 0.9:
        p.error("--val-fraction must lie in (0, 0.9)")
    if args.resume and args.records is None:
        p.error("--resume needs --records FILE (the file of an earlier run)")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# data and evaluation (shared by the workers and the central baseline)
# ---------------------------------------------------------------------------------------------------------------------
def splits(val_fraction: float) -> dict[str, Any]:
    """The fixed digits split, with the last ``val_fraction`` of the training images held out for tuning."""
    from lightning_privdec.data.digits import load_digits_tensors

    data = load_digits_tensors(DATA_SEED)
    x, y = data["train"]
    n_val = int(round(len(y) * val_fraction))
    return {"train": (x[:-n_val], y[:-n_val]), "val": (x[-n_val:], y[-n_val:]), "test": data["test"]}


def job_key(job: dict[str, Any]) -> tuple:
    return (job["method"], float(job["epsilon"]), int(job["seed"]), float(job["lr"]), float(job["clip"]))


def choose(records: list[dict[str, Any]], method: str, tune_epsilon: float) -> dict[str, Any] | None:
    """The grid point with the best validation accuracy (nodes' mean) at the tuning epsilon, seed 0; ties: first."""
    tried = [r for r in records if r["method"] == method and r["epsilon"] == tune_epsilon and r["seed"] == 0]
    if not tried:
        return None
    return max(tried, key=lambda r: (r["val_acc_nodes_mean"], -r["grid_index"]))


def resolve(job: dict[str, Any], records: list[dict[str, Any]], tune_epsilon: float) -> dict[str, Any] | None:
    """A final job gets its method's chosen (lr, C); None while the method's tuning is unfinished."""
    if job.get("lr") is not None:
        return job
    best = choose(records, job["method"], tune_epsilon)
    return None if best is None else {**job, "lr": best["lr"], "clip": best["clip"], "grid_index": best["grid_index"]}


def pending(jobs: list[dict[str, Any]], records: list[dict[str, Any]], tune_epsilon: float) -> list[dict[str, Any]]:
    """Jobs without a record yet (a final run whose pair equals a tuning run's reuses that run)."""
    done = {job_key(r) for r in records}
    resolved = [resolve(job, records, tune_epsilon) for job in jobs]
    return [job for job, r in zip(jobs, resolved) if r is None or job_key(r) not in done]


# ---------------------------------------------------------------------------------------------------------------------
# worker: every decentralized fit in one N-process launch (this code runs on every rank)
# ---------------------------------------------------------------------------------------------------------------------
def evaluate_decentralized(trainer: Any, model: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Each node's accuracy and the network-average model's, on the validation and test splits (all ranks agree)."""
    import torch

    from lightning_privdec.data.digits import accuracy

    strategy = trainer.strategy
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    average = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(strategy.all_gather(params).mean(0), average.parameters())
    out: dict[str, Any] = {}
    for split in ("val", "test"):
        own = torch.tensor([accuracy(model, *data[split])])
        nodes = strategy.all_gather(own).reshape(-1).tolist()
        out[f"{split}_acc_nodes"] = nodes
        out[f"{split}_acc_nodes_mean"] = statistics.mean(nodes)
        out[f"{split}_acc_average"] = accuracy(average, *data[split])
    eps = strategy.all_gather(torch.tensor([strategy.privacy.epsilon()], dtype=torch.float64)).reshape(-1).tolist()
    out["epsilon_spent_per_node"] = eps
    out["epsilon_spent"] = max(eps)
    out["noise_multiplier"] = strategy.privacy.noise_multiplier
    return out


def fit_decentralized(job: dict[str, Any], settings: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """One fit of one method with a fresh Trainer, strategy, model and privacy engine."""
    import lightning as L

    import digits as example  # examples/digits.py: the strategies with the quick start's defaults
    from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule

    method = METHODS[job["method"]]
    options = argparse.Namespace(
        strategy=method["strategy"], topology=None, compressor=None, gamma=None, epsilon=job["epsilon"], delta=DELTA,
        clip=job["clip"], accountant="rdp", adversary="eavesdropper", baseline=method["baseline"], seed=job["seed"],
        strategy_kwargs=json.dumps({"noise_seed": job["seed"]}),  # reproducible noise: a benchmark, not a deployment
    )
    L.seed_everything(job["seed"], verbose=False)
    model = DigitsClassifier(lr=job["lr"])
    datamodule = DigitsDataModule(batch_size=settings["batch_size"], seed=job["seed"])
    datamodule.tensors = {"train": data["train"], "test": data["test"]}  # setup() keeps tensors it is given
    trainer = L.Trainer(
        accelerator="cpu", devices=settings["nodes"], strategy=example.build_strategy(options),
        max_epochs=settings["epochs"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    seconds = time.perf_counter() - start
    result = {**job, "steps": trainer.global_step, "seconds": seconds, **evaluate_decentralized(trainer, model, data)}
    result["topology"] = trainer.strategy.topology.name
    result["compressor"] = str(trainer.strategy.compressor)
    del trainer, model, datamodule
    gc.collect()
    return result


def memoize_decor_accounting() -> None:
    """Compute each SecLDP calibration and accountant value once per process.

    Both are pure functions of their numbers, so results are identical; every fit calibrates Decor's noise pair and
    searches the rounds its budget allows, which on a few shared cores costs more than the training itself.
    """
    import functools

    from lightning_privdec.algorithms import decor
    from lightning_privdec.privacy.accounting import secldp

    calibrate, calibrations = decor.calibrate_secldp, {}

    def calibrate_once(target, delta, steps, graph, clip, adversary, **options):  # noqa: ANN001, ANN202
        edges = tuple(sorted(tuple(sorted(e)) for e in graph.edges()))
        key = (target, delta, steps, edges, clip, adversary, tuple(sorted(options.items())))
        if key not in calibrations:
            calibrations[key] = calibrate(target, delta, steps, graph, clip, adversary, **options)
        return calibrations[key]

    decor.calibrate_secldp = calibrate_once
    secldp.secldp_epsilon_example_level = functools.lru_cache(maxsize=None)(secldp.secldp_epsilon_example_level)


def run_worker(plan_path: Path) -> None:
    """Walk the plan's jobs on every rank; rank 0 appends one JSON line per fit to the plan's records file."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # sampler, worker and logger hints, once per fit and rank
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    memoize_decor_accounting()
    plan = json.loads(plan_path.read_text())
    settings, records = plan["settings"], list(plan["records"])
    data = splits(settings["val_fraction"])
    done = {job_key(r) for r in records}
    started = time.perf_counter()
    for planned in plan["jobs"]:
        job = resolve(planned, records, settings["tune_epsilon"])  # final runs: the pair chosen on validation
        if job is None:
            raise RuntimeError(f"no tuning result for {planned['method']}; the plan must tune it first")
        if job_key(job) in done:  # e.g. the tuning run at the tuning epsilon, seed 0, with the chosen pair
            continue
        result = {**fit_decentralized(job, settings, data), "settings": settings}
        records.append(result)
        done.add(job_key(result))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
            with open(plan["records_path"], "a") as f:
                f.write(json.dumps(result) + "\n")
            print(
                f"[{time.perf_counter() - started:7.1f}s] {job['phase']:5s} {job['method']:8s} eps={job['epsilon']:<4g} "
                f"seed={job['seed']} lr={job['lr']:<4g} C={job['clip']:<4g} steps={result['steps']} "
                f"val={result['val_acc_nodes_mean']:.3f} test(nodes)={result['test_acc_nodes_mean']:.3f} "
                f"test(avg)={result['test_acc_average']:.3f} eps_spent={result['epsilon_spent']:.3f} "
                f"({result['seconds']:.1f}s)",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------------------------------
# central DP-SGD baseline (Opacus, one process)
# ---------------------------------------------------------------------------------------------------------------------
def fit_central(job: dict[str, Any], settings: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """One model on all the training data: Opacus DP-SGD, Poisson sampling at q = nB / N, RDP accountant."""
    import lightning as L
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_privdec.data.digits import DigitsClassifier, accuracy

    L.seed_everything(job["seed"], verbose=False)
    model = DigitsClassifier(lr=job["lr"]).net  # the same MLP the nodes train
    batch = settings["nodes"] * settings["batch_size"]  # the network's expected batch per step
    loader = DataLoader(TensorDataset(*data["train"]), batch_size=batch, shuffle=True)
    engine = PrivacyEngine(accountant="rdp")
    module, optimizer, private_loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=job["lr"]), data_loader=loader,
        target_epsilon=job["epsilon"], target_delta=DELTA, epochs=settings["epochs"], max_grad_norm=job["clip"],
        poisson_sampling=True,
    )  # fmt: skip
    start, steps = time.perf_counter(), 0
    for _ in range(settings["epochs"]):
        module.train()
        for x, y in private_loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
            steps += 1
    seconds = time.perf_counter() - start
    out = {**job, "steps": steps, "seconds": seconds, "topology": "none", "compressor": "none"}
    for split in ("val", "test"):
        acc = accuracy(module, *data[split])
        out.update({f"{split}_acc_nodes": [acc], f"{split}_acc_nodes_mean": acc, f"{split}_acc_average": acc})
    out["epsilon_spent"] = engine.get_epsilon(DELTA)
    out["epsilon_spent_per_node"] = [out["epsilon_spent"]]
    out["noise_multiplier"] = optimizer.noise_multiplier
    return out


# ---------------------------------------------------------------------------------------------------------------------
# parent: plan, launch, summarise
# ---------------------------------------------------------------------------------------------------------------------
def grid(args: argparse.Namespace) -> list[tuple[float, float]]:
    return [(lr, clip) for lr in args.lr_list for clip in args.clip_list]


def plan_jobs(args: argparse.Namespace, methods: list[str]) -> list[dict[str, Any]]:
    """Tuning jobs (every grid point at the tuning epsilon, seed 0), then the final jobs (pair chosen later)."""
    jobs = []
    for method in methods:
        for index, (lr, clip) in enumerate(grid(args)):
            jobs.append(dict(method=method, phase="tune", epsilon=args.tune_epsilon, seed=0, lr=lr, clip=clip,
                             grid_index=index))  # fmt: skip
    for seed in range(args.seeds):  # seed-major: an interrupted run still has every method at every epsilon
        for epsilon in args.epsilon_list:
            for method in methods:
                jobs.append(dict(method=method, phase="final", epsilon=epsilon, seed=seed, lr=None, clip=None))
    return jobs


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return dict(nodes=args.nodes, epochs=args.epochs, batch_size=args.batch_size, val_fraction=args.val_fraction,
                tune_epsilon=args.tune_epsilon)  # fmt: skip


def read_records(path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The fits in ``path`` made with these settings (a resumed run never mixes in fits of another set-up)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("settings", settings) == settings]


def run_central(args: argparse.Namespace, records_path: Path, records: list[dict[str, Any]]) -> None:
    settings, data = settings_of(args), splits(args.val_fraction)
    done = {job_key(r) for r in records}
    for planned in plan_jobs(args, ["central"]):
        job = resolve(planned, records, args.tune_epsilon)
        if job_key(job) in done:
            continue
        result = {**fit_central(job, settings, data), "settings": settings}
        records.append(result)
        done.add(job_key(result))
        with records_path.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{job['phase']:5s} central  eps={job['epsilon']:<4g} seed={job['seed']} lr={job['lr']:<4g} "
              f"C={job['clip']:<4g} steps={result['steps']} val={result['val_acc_nodes_mean']:.3f} "
              f"test={result['test_acc_nodes_mean']:.3f} eps_spent={result['epsilon_spent']:.3f}", flush=True)  # fmt: skip


def run_decentralized(args: argparse.Namespace, methods: list[str], records_path: Path, records: list[dict]) -> None:
    """One N-process launch of this script in worker mode, for every decentralized fit."""
    jobs = pending(plan_jobs(args, methods), records, args.tune_epsilon)
    if not jobs:
        return
    with tempfile.TemporaryDirectory(prefix="privacy_utility_") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan = {"settings": settings_of(args), "records": [r for r in records if r["method"] in methods],
                "records_path": str(records_path), "jobs": jobs}  # fmt: skip
        plan_path.write_text(json.dumps(plan))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(plan_path)]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)  # the worker prints one line per fit
        if proc.returncode != 0:
            raise SystemExit(
                f"the {args.nodes}-process run failed (exit {proc.returncode}); finished fits are in {records_path}: "
                f"rerun with --records {records_path} --resume"
            )
    records[:] = read_records(records_path, settings_of(args))


def summarise(args: argparse.Namespace, records: list[dict[str, Any]]) -> tuple[dict, dict]:
    """Per method: the chosen pair; per (method, epsilon): the final runs' statistics."""
    chosen, table = {}, {}
    for method in args.method_list:
        best = choose(records, method, args.tune_epsilon)
        chosen[method] = best
        for epsilon in args.epsilon_list:
            runs = [r for r in records if best is not None and job_key(r) in
                    {(method, epsilon, s, best["lr"], best["clip"]) for s in range(args.seeds)}]  # fmt: skip
            if not runs:
                continue

            def stats(key: str) -> tuple[float, float]:
                values = [r[key] for r in runs]
                return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

            table[(method, epsilon)] = {
                "nodes": stats("test_acc_nodes_mean"), "average": stats("test_acc_average"),
                "epsilon_spent": max(r["epsilon_spent"] for r in runs), "seeds": len(runs),
                "steps": statistics.median(r["steps"] for r in runs),
                "noise_multiplier": statistics.mean(r["noise_multiplier"] for r in runs),
                "seconds": statistics.mean(r["seconds"] for r in runs),
            }  # fmt: skip
    return chosen, table


def machine_description() -> str:
    import torch

    return (f"{cpu_name()}, {usable_cores()} usable cores, {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, no GPU used")  # fmt: skip


def grid_table(args: argparse.Namespace, records: list[dict[str, Any]]) -> str:
    """Validation accuracy (nodes' mean) of every grid point at the tuning epsilon, seed 0; * marks the choice."""
    points = grid(args)
    lines = ["| method | " + " | ".join(f"lr={lr:g}, C={c:g}" for lr, c in points) + " |",
             "|---|" + "---:|" * len(points)]  # fmt: skip
    for method in args.method_list:
        best = choose(records, method, args.tune_epsilon)
        tried = {(r["lr"], r["clip"]): r for r in records if r["method"] == method and r["phase"] == "tune"
                 and r["epsilon"] == args.tune_epsilon and r["seed"] == 0}  # fmt: skip
        cells = [
            "n/a" if p not in tried else f"{tried[p]['val_acc_nodes_mean']:.3f}" + ("*" if tried[p] is best else "")
            for p in points
        ]
        lines.append(f"| {METHODS[method]['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_report(
    args: argparse.Namespace, chosen: dict, table: dict, total_s: float, sizes: dict, grid_text: str = ""
) -> str:
    eps = args.epsilon_list
    pm = "±"
    head = "| method | " + " | ".join(f"eps={e:g}" for e in eps) + " |\n|---|" + "---:|" * len(eps) + "\n"

    def cells(method: str, render: Any) -> str:
        return " | ".join(render(table[(method, e)]) if (method, e) in table else "n/a" for e in eps)

    def acc(key: str) -> Any:
        return lambda s: f"{s[key][0]:.3f} {pm} {s[key][1]:.3f}" if s["seeds"] > 1 else f"{s[key][0]:.3f} (1 seed)"

    lines = [
        f"\n## privacy_utility.py — {datetime.date.today().isoformat()}, {args.nodes} nodes, machine: "
        f"{machine_description()}\n",
        f"Command: `{' '.join(['python benchmarks/privacy_utility.py', *sys.argv[1:]])}` (total wall time "
        f"{total_s / 60:.1f} min). Digits (real data): {sizes['train']} training images split over the nodes "
        f"(Lightning's IID shards), {sizes['val']} held out for tuning, {sizes['test']} test images (fixed split, "
        f"never used for tuning). Digits MLP 64-64-10, plain SGD, {args.epochs} epochs, per-node expected batch "
        f"{args.batch_size} (Poisson, q = B/J); central baseline: one model, expected batch {args.nodes}x"
        f"{args.batch_size} over all {sizes['train']} images (same q, same number of steps). delta = {DELTA:g}. "
        f"{args.seeds} seed(s) (0..{args.seeds - 1}: model init, sampling and noise; the data split is fixed).\n",
        f"Tuning grid: lr in {{{', '.join(f'{v:g}' for v in args.lr_list)}}} x clip C in "
        f"{{{', '.join(f'{v:g}' for v in args.clip_list)}}}, at epsilon = {args.tune_epsilon:g}, seed 0, scored by the "
        "validation accuracy of the nodes' own models (mean over nodes); the chosen pair is used at every epsilon. "
        "The privacy cost of tuning is not included in the epsilons below.\n",
        "| method | chosen lr | chosen C | validation acc at tuning |\n|---|---:|---:|---:|\n"
        + "".join(
            f"| {METHODS[m]['label']} | {c['lr']:g} | {c['clip']:g} | {c['val_acc_nodes_mean']:.3f} |\n"
            for m, c in chosen.items() if c is not None
        ),
        f"Validation accuracy over the grid (each node's model, mean over nodes; * = chosen):\n\n{grid_text}",
        f"**Headline: test accuracy of each node's own model, mean over the nodes; mean {pm} sd over seeds.**\n",
        head + "".join(f"| {METHODS[m]['label']} | {cells(m, acc('nodes'))} |\n" for m in args.method_list),
        f"Test accuracy of the network-average model (average of the nodes' parameters, formed for evaluation only; "
        f"central: the one model); mean {pm} sd over seeds.\n",
        head + "".join(f"| {METHODS[m]['label']} | {cells(m, acc('average'))} |\n" for m in args.method_list),
        "Epsilon actually spent (largest over nodes and seeds, from each node's accountant: RDP for DP-CSGP, "
        "PrivSGP, Dyn-D2P and central; SecLDP for Decor and LDP) / noise multiplier sigma (Decor, LDP: sigma_cdp / "
        "C; Dyn-D2P: after the last step) / steps.\n",
        head + "".join(
            f"| {METHODS[m]['label']} | "
            + cells(m, lambda s: f"{s['epsilon_spent']:.3f} / {s['noise_multiplier']:.2f} / {s['steps']:.0f}")
            + " |\n"
            for m in args.method_list
        ),
        "Guarantees differ: DP-CSGP, PrivSGP, Dyn-D2P and LDP protect every message a node sends (per-node "
        "example-level DP against anyone who sees its messages); Decor's SecLDP holds against an eavesdropper that "
        "knows no pairwise secret (weaker than against the neighbours themselves); central DP-SGD assumes a trusted "
        "curator holding all the data. Noise is seeded per (seed, rank) for reproducibility (a deployment draws it "
        "from OS entropy).\n",
    ]
    return "\n".join(lines)


def plot(args: argparse.Namespace, table: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    titles = {"nodes": "each node's model (mean over nodes) — headline", "average": "network-average model"}
    for ax, key in zip(axes, ("nodes", "average")):
        for method in args.method_list:
            points = [(e, table[(method, e)][key]) for e in args.epsilon_list if (method, e) in table]
            if not points:
                continue
            style = "--" if method == "central" else "-"
            ax.errorbar([e for e, _ in points], [m for _, (m, _) in points], yerr=[s for _, (_, s) in points],
                        linestyle=style, marker="o", capsize=3, label=METHODS[method]["label"])  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.epsilon_list, [f"{e:g}" for e in args.epsilon_list])
        ax.set_xlabel(f"target epsilon, delta = {DELTA:g} (per node; central: of the one model)")
        ax.set_title(titles[key], fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Digits, {args.nodes} nodes, {args.epochs} epochs: mean ± sd over {args.seeds} seed(s)")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        run_worker(args.worker)
        return
    started = time.perf_counter()
    records_path = args.records or Path(tempfile.mkdtemp(prefix="privacy_utility_")) / "records.jsonl"
    if records_path.exists() and not args.resume:
        records_path.unlink()
    records = read_records(records_path, settings_of(args))
    print(f"machine: {machine_description()}\nrecords: {records_path}", flush=True)
    if "central" in args.method_list:
        run_central(args, records_path, records)
    run_decentralized(args, [m for m in args.method_list if m != "central"], records_path, records)
    chosen, table = summarise(args, records)
    data = splits(args.val_fraction)
    sizes = {k: len(v[1]) for k, v in data.items()}
    report = format_report(args, chosen, table, time.perf_counter() - started, sizes, grid_table(args, records))
    print(report)
    plot(args, table)
    print(f"plot: {args.plot}")
    if not args.no_append:
        append_results(report, args.results)
    missing = [(m, e) for m in args.method_list for e in args.epsilon_list if (m, e) not in table]
    if missing or any(s["seeds"] < args.seeds for s in table.values()):
        print(f"warning: incomplete results (missing {missing}); rerun with --records {records_path} --resume")


if __name__ == "__main__":
    main()
