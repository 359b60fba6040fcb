"""The GPU check: every CUDA path of the library run and timed in one command, written to one JSON file and a table.

What it runs (each section in processes of its own, bounded in time, so one failure or hang costs only its own
section; a section that fails is recorded with its error and the others still run)
--------------------------------------------------------------------------------------------------------------------
``tests``       pytest on the CUDA-only tests (skipped without CUDA) and on the per-sample, noise and mixed-precision
                tests with their ``device`` fixture on the GPU (``PRIVDEC_TEST_DEVICE=cuda``, tests/conftest.py):
                passed / failed / skipped counts and the failing tests' names.
``attacks``     the crafted clipping attacks of lightning_privdec/audit/sensitivity.py on the device (``privdec-audit
                --clipping``'s, the batches moved there, so that D and D \\ x run at different batch sizes through
                the device's kernels): every attack, mode and precision, its largest ||S(D) - S(D \\ x)|| / C,
                which must stay within C (the quick run: two attacks).
``throughput``  one training step (forward, backward, clipping, noise, SGD step) on one device, samples/s and peak
                GPU memory, for torchvision's ResNet-18 (GroupNorm, batch 256, 32x32), EfficientNet-B0 (GroupNorm,
                out-of-place activations; batch 256, 32x32) and GPT-2 small from its config (batch 32, 128 tokens),
                each in fp32, bf16-mixed and 16-mixed (float16 autocast and a real GradScaler), plus in fp32 the CIFAR
                example's out-of-place ResNet-18 (the ResNet-18 that Opacus's ghost clipping can run; it refuses
                torchvision's in-place residual add and GPT-2's tied weights), as: the non-private step; the
                library's private step (``DPCSGPNode``, C = 1, sigma = 1) in ``bookkeeping`` and ``ghost`` mode, as
                the strategies run it (the GradScaler's scale told before backward, the privatized sum multiplied by
                it before ``scaler.step``); and Opacus's ghost clipping (``PrivacyEngine.make_private(grad_sample_mode=
                "ghost")``, its DPOptimizer's step). Models and data come from benchmarks/step_time.py's
                ``build_problem``. A configuration that cannot run is a row with its error.
``noise``       the ChaCha20 noise generator on the device (its keystream computed there, privacy/
                device_keystream.py, where that works): ns per coordinate for 11M (ResNet-18) and 124M (GPT-2
                small) float32 coordinates next to ``torch.randn`` on the same device, peak GPU memory, and the
                distribution checks of the 11M float32 draw (mean, standard deviation, Kolmogorov-Smirnov,
                2/3/4-sigma tail masses), its equality bit for bit with the same key's draw from the host's keystream,
                and float64 draws' equality (to 1e-12) with the CPU draws of the same key.
``ranks``       4 ranks sharing the one GPU over gloo (NCCL refuses two ranks on one GPU; the gossip's messages travel
                through host memory): ``examples/cifar_resnet.py --synthetic`` for 20 steps (batch 32, 512 images)
                with each private strategy, launched as 4 single-device processes (``--num-nodes 4 --devices 1``
                with the launch variables set per rank, as benchmarks/network.py does); each rank's epsilon, whether
                its parameters are finite, and its peak GPU memory.
``profile``     one fp32 private step of ResNet-18 (ghost) and GPT-2 small (book-keeping) under torch.profiler: wall
                time, the device's busy time, kernels launched, host synchronisations and the operators taking the
                most host time (what bounds the step on a GPU: launches or arithmetic).
Peak GPU memory (``torch.cuda.max_memory_allocated``) is part of every throughput, noise and ranks row; the
``memory`` section gathers them per configuration (on CPU nothing is measured: null).

Targets (checked and printed on a GPU): the best private mode's step <= 1.5x the non-private step on ResNet-18 and
GPT-2; its samples/s >= Opacus ghost's wherever Opacus runs; noise <= 0.1 ns per coordinate.

How to run
----------
On the GPU machine (python3 3.12 with torch, lightning, torchvision, transformers, pytest; no internet). opacus and
cryptography (with cffi and pycparser) travel as wheels: here, first ``bash benchmarks/gpu_wheels.sh`` fills the
ignored folder ``.gpu_wheels`` (5.7 MiB; the working tree itself is about 2.5 MB, far under the 64 MiB that may
travel). Then the device tool's ``run`` with ``carry: [".gpu_wheels"]``, ``timeout_s: 590`` and this command (the
project itself is put on PYTHONPATH, ahead of the wheels: opacus's wheel ships top-level ``benchmarks`` and
``examples`` packages)::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        --find-links .gpu_wheels opacus cryptography cffi pycparser && \
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 && \
    python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json --time-limit 530 2>&1 | tee $OUT/gpu_check.log

Time: ``--time-limit 530`` bounds the sections together (at most 30, 110, 35, 150, 155 and 40 s in the order noise,
tests, attacks, ranks, throughput, profile; the fifth GPU run's took 356 s in all; a section past its time is cut and
recorded as such, the tests with the outcomes pytest printed so far, a timed-out rank with its stacks). The ranks
section launches 3 strategies at once (``--concurrent-launches``), their ranks splitting the cores' intra-op threads
(``OMP_NUM_THREADS``): on the fourth GPU run one launch took 32-38 s, mostly imports and CUDA's start, and 7 one after
the other did not fit. The install takes seconds, so the command ends within 9 minutes; with the machine's start (1-2
minutes) that leaves 3-4 minutes of a 15-minute budget to re-run what failed alone on the still warm machine (it goes
back after 30 s idle), e.g. ``--sections ranks --strategies decor,cpgt --time-limit 150``. The JSON is rewritten after
every section, so a killed run still returns what it finished. Its table (stdout, also in the log) is what goes into
benchmarks/RESULTS.md.

The smoke run (CI: tests/test_gpu_check.py)::

    python benchmarks/gpu_check.py --accelerator cpu --quick --json /tmp/gpu_check.json

``--quick``: batches of 2 (8x8 images; the 2-layer GPT-2 of step_time.py with 16 tokens instead of GPT-2 small), every
precision on that GPT-2 only and fp32 on the others, 1 warm-up and 1 timed step, 100k and 1M noise coordinates, 2 ranks
for 1 step of DP-CSGP only, two clipping attacks, and two tests of tests/test_noise.py (its CUDA-only one skips on CPU).
Without ``--quick``, ``--accelerator cpu`` runs the full configuration on the CPU (slow: tens of minutes).
``--sections`` picks sections; ``--models``, ``--kinds`` and ``--precisions`` pick throughput rows; ``--library DIR``
runs the throughput and profile sections on another tree of the library (e.g. an older commit's ``lightning_privdec``
copied into an ignored folder that travels with ``carry``), for a comparison on one machine; ``--no-table`` prints only
the JSON's path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from gpu_throughput import EXTRA_KWARGS, device_name  # noqa: E402
from machine_info import machine_line, software_line  # noqa: E402

#: run in this order; "memory" is gathered from the others
SECTIONS = ("noise", "tests", "attacks", "ranks", "throughput", "profile")
#: the tests that skip without CUDA, and the files whose tests take the ``device`` fixture (tests/conftest.py)
CUDA_ONLY_TESTS = (
    "tests/test_compression.py::test_cuda_round_trip",
    "tests/test_noise.py::test_cuda_draws_equal_the_cpu_draws_of_the_same_key",
    "tests/test_overlap.py::test_gloo_processes_mix_exactly_like_the_loopback_simulation[cuda]",
    "tests/test_device_keystream.py::test_cuda_draws_from_the_device_keystream_equal_those_from_the_host_keystream",
)
DEVICE_TEST_FILES = ("tests/test_per_sample_modes.py", "tests/test_noise.py", "tests/test_laplace.py",
                     "tests/test_strategy_modes.py")
#: the quick run: one module's tests (its CUDA-only one skips on CPU), for the counting and the report
QUICK_TESTS = ("tests/test_noise.py::test_cuda_draws_equal_the_cpu_draws_of_the_same_key",
               "tests/test_noise.py::test_gaussian_noise_has_the_right_mean_std_and_tails")

PRECISIONS = ("fp32", "bf16-mixed", "16-mixed")
#: name -> benchmarks/step_time.py's build_problem arguments (full run, quick run) and the precisions measured (the
#: quick run: every precision on the small GPT-2 only). resnet18_cifar, the CIFAR example's out-of-place ResNet-18,
#: is one that Opacus's ghost clipping can hook (it refuses torchvision's in-place `out += identity`, and GPT-2's
#: shared position ids); the quick run leaves it out.
MODELS: dict[str, dict[str, Any]] = {
    "resnet18": dict(full=dict(name="resnet18_torchvision", batch=256),
                     quick=dict(name="resnet18_torchvision", batch=2), precisions=PRECISIONS, quick_precisions=("fp32",)),
    "efficientnet_b0": dict(full=dict(name="efficientnet_b0", batch=256), quick=dict(name="efficientnet_b0", batch=2),
                            precisions=PRECISIONS, quick_precisions=("fp32",)),
    "gpt2": dict(full=dict(name="gpt2_small", batch=32, tokens=128), quick=dict(name="gpt2", batch=2, tokens=16),
                 precisions=PRECISIONS, quick_precisions=PRECISIONS),
    "resnet18_cifar": dict(full=dict(name="resnet18", batch=256), quick=None, precisions=("fp32",),
                           quick_precisions=()),
}
QUICK_IMAGE_SIZE = 8  # pixels: the quick run's images (the full run's are 32x32)
KINDS = ("non-private", "bookkeeping", "ghost", "opacus-ghost")  # bookkeeping and ghost: the library's modes
CLIP, SIGMA, LR = 1.0, 1.0, 0.01
NOISE_SIZES = {False: (11_173_962, 124_439_808), True: (100_000, 1_000_000)}  # ResNet-18's d, GPT-2 small's d
PRIVATE_STRATEGIES = ("dp_csgp", "privsgp", "dp2sgd", "decor", "dyn_d2p", "privsgp_vr", "cpgt")
STEP_TARGET, OPACUS_TARGET, NOISE_TARGET_NS = 1.5, 1.0, 0.1
#: seconds each section may take at most (the overall --time-limit cuts them further)
#: the sections ``--library`` applies to (the others always run this checkout's library)
LIBRARY_SECTIONS = ("throughput", "profile")
SECTION_LIMITS = {"noise": 30.0, "tests": 110.0, "attacks": 35.0, "ranks": 150.0, "throughput": 155.0,
                  "profile": 40.0}  # 520 s, within the docstring command's --time-limit 530
#: the quick run's clipping attacks (the full run's: every one, 126 rows in 14 s on an H200)
QUICK_ATTACKS = ("gram_linear", "gram_conv_per_example")
#: strategies the ranks section launches at once (each its own gloo world of --ranks processes): most of a launch
#: is imports and CUDA's start, which a GPU machine's cores run side by side
CONCURRENT_LAUNCHES = 3
#: the profiled private steps (fp32): model -> per-sample mode (each model's faster mode in the third GPU run)
PROFILED = {"resnet18": "ghost", "gpt2": "bookkeeping"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"), help="gpu (default: CUDA) or cpu")
    p.add_argument("--quick", action="store_true", help="the smoke configuration (seconds; see above)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list out of " + ",".join(SECTIONS))
    p.add_argument("--json", type=Path, default=ROOT / "gpu_check.json", help="where the results go")
    p.add_argument("--time-limit", type=float, default=530.0, help="seconds for all sections together")
    p.add_argument("--concurrent-launches", type=int, default=None,
                   help=f"strategies the ranks section runs at once (default {CONCURRENT_LAUNCHES}; quick 1)")
    p.add_argument("--ranks", type=int, default=None, help="processes of the ranks section (default 4; quick 2)")
    p.add_argument("--strategies", default=None,
                   help="comma list of the ranks section's strategies (default: every private one; quick: dp_csgp)")
    p.add_argument("--models", default=None, help="throughput: comma list out of " + ",".join(MODELS))
    p.add_argument("--kinds", default=None, help="throughput: comma list out of " + ",".join(KINDS))
    p.add_argument("--precisions", default=None, help="throughput: comma list out of " + ",".join(PRECISIONS))
    p.add_argument("--library", type=Path, default=None,
                   help="throughput and profile: import lightning_privdec from this tree instead (an older commit's "
                        "git worktree, for a comparison on the same machine); the problems stay this checkout's")
    p.add_argument("--no-table", action="store_true", help="print no table")
    # internal: one section in a child process
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.section_list) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.ranks is None:
        args.ranks = 2 if args.quick else 4
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (a gossip needs a neighbour)")
    if args.time_limit <= 0:
        p.error("--time-limit must be positive")
    for name, known in (("models", MODELS), ("kinds", KINDS), ("precisions", PRECISIONS)):
        chosen = getattr(args, name)
        chosen = tuple(known) if chosen is None else tuple(c.strip() for c in chosen.split(",") if c.strip())
        if set(chosen) - set(known):
            p.error(f"unknown {name} {sorted(set(chosen) - set(known))}; choose from {', '.join(known)}")
        setattr(args, name, chosen)
    listed = "quick_precisions" if args.quick else "precisions"
    rows = [(m, precision) for m in args.models for precision in MODELS[m][listed] if precision in args.precisions]
    if "throughput" in args.section_list and not rows:
        p.error(f"--models {','.join(args.models)} with --precisions {','.join(args.precisions)} leaves no throughput "
                "row to measure" + (" (--quick measures fp32 only but on gpt2)" if args.quick else ""))
    if args.library is not None and not (args.library / "lightning_privdec" / "__init__.py").exists():
        p.error(f"--library {args.library}: no lightning_privdec package there")
    return args


def torch_device(accelerator: str):  # noqa: ANN201
    import torch

    return torch.device("cuda" if accelerator == "gpu" else "cpu")


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: Any) -> None:
    """Free what the last configuration left (its model, hooks, optimizer) and restart the peak count."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: Any) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]


# ---------------------------------------------------------------------------------------------------------------------
# (a) tests
# ---------------------------------------------------------------------------------------------------------------------
def run_tests(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """pytest on the CUDA-only tests and the device-fixture tests, the device set to this run's; counts from its
    JUnit XML report."""
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    # the CUDA-only tests first and the slowest file (a Trainer per test) last: a cut run loses the least
    selection = list(QUICK_TESTS) if args.quick else [
        *(t for t in CUDA_ONLY_TESTS if t.split("::")[0] not in DEVICE_TEST_FILES), *DEVICE_TEST_FILES]
    with tempfile.TemporaryDirectory(prefix="gpu_check_tests_") as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={report}",
                   "--timeout=120", *selection]  # pytest-timeout: a hung test fails alone
        env = dict(os.environ, PRIVDEC_TEST_DEVICE=device)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        started = time.perf_counter()
        done = run_bounded(command, timeout, env=env)
        seconds = time.perf_counter() - started
        print(done["tail"][-2500:], end="", flush=True)
        result: dict[str, Any] = {"device": device, "selection": selection, "seconds": seconds,
                                  "exit_code": done["exit_code"]}  # fmt: skip
        if report.exists():
            outcomes = junit_outcomes(report)
        else:  # cut by the time limit: the outcomes pytest printed so far
            outcomes = verbose_outcomes(done["output"])
            result["incomplete"] = done["error"] or "pytest wrote no report"
    cuda_only = [t for t in outcomes if t["id"].startswith(CUDA_ONLY_TESTS)]
    return result | count_outcomes(outcomes) | {
        "collected": len(outcomes),
        "cuda_only": count_outcomes(cuda_only),
        "failures": [{"id": t["id"], "message": t["message"]} for t in outcomes if t["outcome"] in ("failed", "error")],
        "error": done["error"],  # pytest's exit status when not 0 (failed tests included)
    } | ({"tail": done["tail"]} if done["error"] else {})


def count_outcomes(outcomes: list[dict[str, str]]) -> dict[str, int]:
    return {f"{k}{'s' if k == 'error' else ''}": sum(t["outcome"] == k for t in outcomes)
            for k in ("passed", "failed", "skipped", "error")}  # fmt: skip


def verbose_outcomes(output: str) -> list[dict[str, str]]:
    """The outcomes ``pytest -v`` printed (``tests/x.py::name PASSED``): a run cut short has no JUnit report."""
    names = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error"}
    outcomes = []
    for line in output.splitlines():
        match = re.match(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", line)
        if match:
            outcomes.append({"id": match[1], "outcome": names[match[2]], "message": ""})
    return outcomes


def junit_outcomes(report: Path) -> list[dict[str, str]]:
    """Every test case of a JUnit XML report: its id (file::name), outcome and first line of message."""
    outcomes = []
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, ((node.get("message") or "").strip().splitlines() or [""])[0][:300]
                break
        outcomes.append({"id": f"{path}::{case.get('name')}", "outcome": outcome, "message": message})
    return outcomes


# ---------------------------------------------------------------------------------------------------------------------
# (b) throughput: one step per configuration, in a child process
# ---------------------------------------------------------------------------------------------------------------------
def throughput_child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    warnings.filterwarnings("ignore")
    device = torch_device(args.accelerator)
    if args.quick:
        torch.set_num_threads(1)  # a smoke run on a shared machine: no thread contention
    if device.type == "cpu":
        # oneDNN's bfloat16 convolutions, run after float32 ones of the same shapes in one process, gave weight
        # gradients unrelated to the per-example ones (torch 2.14 on CPU; the privacy engine's first-step check
        # refuses them): the CPU run uses torch's own kernels
        torch.backends.mkldnn.enabled = False
    rows = []
    for model, spec in ((m, MODELS[m]) for m in args.models):
        for precision in (p for p in spec["quick_precisions" if args.quick else "precisions"] if p in args.precisions):
            for kind in args.kinds:
                if time.time() > args.deadline:
                    rows.append({"model": model, "precision": precision, "kind": kind, "error": "not run: time limit"})
                    continue
                rows.append(measure_step(model, precision, kind, device, args.quick, args.deadline))
                print(f"  {model} {precision} {kind}: " + (rows[-1].get("error") or
                      f"{rows[-1]['samples_per_second']:,.1f} samples/s"), flush=True)  # fmt: skip
    tf32 = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
    return {"rows": rows, "targets": throughput_targets(rows) if args.accelerator == "gpu" else [], "tf32": tf32}


def measure_step(model: str, precision: str, kind: str, device: Any, quick: bool, deadline: float) -> dict[str, Any]:
    """Samples/s of ``kind``'s training step on ``model`` under ``precision``; peak GPU memory; or the error."""
    problem = MODELS[model]["quick" if quick else "full"]
    batch = problem["batch"]
    row: dict[str, Any] = {"model": model, "precision": precision, "kind": kind, "batch": batch}
    reset_peak(device)
    try:
        step, net = model_step(model, precision, kind, device, quick)
        row["parameters"] = sum(p.numel() for p in net.parameters())
        warmup, least, most = (1, 1, 1) if quick else (2, 3, 20)
        for _ in range(warmup):
            step()
        synchronize(device)
        start = time.perf_counter()
        step()  # the first timed step also sizes the rest: about 0.6 s of steps, at least `least`
        synchronize(device)
        first = time.perf_counter() - start
        remaining = max(least - 1, min(most - 1, int(0.6 / max(first, 1e-6))))
        if time.time() + remaining * first > deadline:
            remaining = min(remaining, 1)
        for _ in range(remaining):
            step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        steps = remaining + 1
        row.update(steps=steps, step_ms=1e3 * elapsed / steps, samples_per_second=batch * steps / elapsed)
    except Exception as error:  # noqa: BLE001 - a configuration that cannot run is a result
        row["error"] = error_text(error)
    row["peak_memory_bytes"] = peak_bytes(device)
    return row


def model_step(model: str, precision: str, kind: str, device: Any, quick: bool) -> tuple[Any, Any]:
    """(the step function, the model) of ``kind`` on :data:`MODELS`' ``model`` (its problem from
    benchmarks/step_time.py's ``build_problem``) under ``precision``, on ``device``."""
    from step_time import build_problem

    problem = MODELS[model]["quick" if quick else "full"]
    fresh_model, inputs, targets, loss_fn = build_problem(
        problem["name"], problem["batch"], seed=0, tokens=problem.get("tokens", 32),
        image_size=QUICK_IMAGE_SIZE if quick else 32)  # fmt: skip
    net = fresh_model().to(device)
    step = build_step(kind, precision, net, inputs.to(device), targets.to(device), loss_fn, device, problem["batch"])
    return step, net


def build_step(kind, precision, net, x, y, loss_fn, device, batch):  # noqa: ANN001, ANN201, PLR0913
    """The step function of one configuration (its model, optimizer, per-sample machinery and GradScaler built)."""
    import torch

    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    def autocast():  # noqa: ANN202
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)

    if kind == "non-private":
        return plain_step(torch.optim.SGD(net.parameters(), lr=LR), lambda: loss_fn(net(x), y), autocast, scaler)
    if kind == "opacus-ghost":
        return opacus_ghost_step(net, x, y, loss_fn, batch, autocast, scaler)

    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.algorithms.node import private_step as node_private_step
    from lightning_privdec.privacy import PrivacyParameters

    engine = DPCSGPNode(PrivacyParameters(max_grad_norm=CLIP, noise_multiplier=SIGMA), rank=0, device=device,
                        grad_sample_mode=kind)  # fmt: skip
    engine.attach(net)
    engine.noise_multiplier, engine.sample_rate, engine.expected_batch_size = SIGMA, batch / 50_000, float(batch)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)

    def private_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        scale = None if scaler is None else scaler.get_scale()
        if scale is not None:  # as PrivateDecentralizedStrategy under "16-mixed": clipping sees unscaled gradients
            engine.clipping.set_loss_scale(scale)
        with autocast():
            outputs = net(x)
        if kind == "ghost":
            losses = loss_fn(outputs, y, reduction="none")
            engine.clipping.ghost_backward(losses if scaler is None else scaler.scale(losses))
        else:
            loss = loss_fn(outputs, y)
            (loss if scaler is None else scaler.scale(loss)).backward()
        node_private_step(engine)
        if scaler is None:
            optimizer.step()
            return
        for p in net.parameters():  # the GradScaler divides by the scale it was told: multiplied back first
            if p.grad is not None:
                p.grad.mul_(scale)
        scaler.step(optimizer)
        scaler.update()

    return private_step


def opacus_ghost_step(net, x, y, loss_fn, batch, autocast, scaler):  # noqa: ANN001, ANN201, PLR0913
    """Opacus's ghost clipping as ``make_private`` sets it up: its two backward passes and its DPOptimizer's step."""
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    class Criterion(torch.nn.Module):
        reduction = "mean"

        def forward(self, outputs, targets):  # noqa: ANN001, ANN202
            return loss_fn(outputs, targets, reduction=self.reduction)

    loader = DataLoader(TensorDataset(x.cpu(), y.cpu()), batch_size=batch)
    wrapped, optimizer, criterion, _ = PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), data_loader=loader, criterion=Criterion(),
        noise_multiplier=SIGMA, max_grad_norm=CLIP, grad_sample_mode="ghost", poisson_sampling=False,
    )
    return plain_step(optimizer, lambda: criterion(wrapped(x), y), autocast, scaler)  # Opacus's two backward passes


def plain_step(optimizer: Any, loss_of: Any, autocast: Any, scaler: Any) -> Any:
    """A training step: zero the gradients, the loss under ``autocast``, backward and the optimizer's step, through
    the GradScaler when there is one."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_of()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    return step


def throughput_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and precision: the best private mode's step against the non-private step (target <= 1.5x on
    ResNet-18 and GPT-2) and its samples/s against Opacus ghost's (target >= 1.0x wherever Opacus runs)."""
    ok = {(r["model"], r["precision"], r["kind"]): r for r in rows if "samples_per_second" in r}
    verdicts = []
    for model, spec in MODELS.items():
        for precision in spec["precisions"]:
            ours = [ok[model, precision, k] for k in ("bookkeeping", "ghost") if (model, precision, k) in ok]
            base, opacus = ok.get((model, precision, "non-private")), ok.get((model, precision, "opacus-ghost"))
            if not ours:
                continue
            best = max(ours, key=lambda r: r["samples_per_second"])
            verdict: dict[str, Any] = {"model": model, "precision": precision, "best_mode": best["kind"]}
            if base is not None:
                verdict["vs_non_private"] = base["samples_per_second"] / best["samples_per_second"]  # step-time ratio
                if model in ("resnet18", "gpt2"):
                    verdict["non_private_target_met"] = verdict["vs_non_private"] <= STEP_TARGET
            if opacus is not None:
                verdict["vs_opacus_ghost"] = best["samples_per_second"] / opacus["samples_per_second"]
                verdict["opacus_target_met"] = verdict["vs_opacus_ghost"] >= OPACUS_TARGET
            verdicts.append(verdict)
    return verdicts


# ---------------------------------------------------------------------------------------------------------------------
# (f) profile: where one private step's time goes on the device
# ---------------------------------------------------------------------------------------------------------------------
def profile_child(args: argparse.Namespace) -> dict[str, Any]:
    """One fp32 private step of each :data:`PROFILED` model under torch.profiler: its wall time, the device's busy
    time (the sum of its kernels), the kernels launched, the host synchronisations, and the operators that take the
    most host time (self time, with their calls): what bounds the step, launches or arithmetic."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore")
    device = torch_device(args.accelerator)
    if args.quick:
        torch.set_num_threads(1)
    rows = []
    for model, kind in PROFILED.items():
        problem = MODELS[model]["quick" if args.quick else "full"]
        row: dict[str, Any] = {"model": model, "kind": kind, "batch": problem["batch"]}
        try:
            step, _ = model_step(model, "fp32", kind, device, args.quick)
            for _ in range(2):
                step()
            synchronize(device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            start = time.perf_counter()
            with profile(activities=activities) as prof:
                step()
                synchronize(device)
            row["wall_ms"] = 1e3 * (time.perf_counter() - start)
            events = prof.events()
            on_device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
            row["device_activities"] = len(on_device)  # kernels, copies and memsets
            row["device_busy_ms"] = sum(e.device_time for e in on_device) / 1e3 if on_device else None
            syncs = ("cudaStreamSynchronize", "cudaDeviceSynchronize") if device.type == "cuda" else (
                "aten::_local_scalar_dense",)  # the host's reads of a tensor's value (on CUDA each one syncs)
            row["host_syncs"] = sum(1 for e in events if e.name in syncs)
            averages = [a for a in prof.key_averages() if a.key.startswith("aten::")]
            averages.sort(key=lambda a: a.self_cpu_time_total, reverse=True)
            row["top_host_ops"] = [
                {"op": a.key, "calls": a.count, "self_host_ms": a.self_cpu_time_total / 1e3,
                 "self_device_ms": getattr(a, "self_device_time_total", 0.0) / 1e3} for a in averages[:12]
            ]  # fmt: skip
            row["aten_calls"] = sum(a.count for a in prof.key_averages() if a.key.startswith("aten::"))
        except Exception as error:  # noqa: BLE001 - a configuration that cannot run is a result
            row["error"] = error_text(error)
        rows.append(row)
        print(f"  {model} {kind}: " + (row.get("error") or f"{row['wall_ms']:.1f} ms, {row['device_activities']} "
              "device activities, "
              f"{row['aten_calls']} aten calls, {row['host_syncs']} host syncs"), flush=True)  # fmt: skip
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------------------------------
# the clipping attacks on the device, in a child process
# ---------------------------------------------------------------------------------------------------------------------
def attacks_child(args: argparse.Namespace) -> dict[str, Any]:
    """The crafted clipping attacks of ``lightning_privdec.audit.sensitivity`` on the device (the same batches as on
    the host, moved there): every attack (the quick run: :data:`QUICK_ATTACKS`) in every mode and precision it
    applies to, each row's largest ||S(D) - S(D \\ x)|| / C, which must stay within C (1 + 1e-5). One attack after
    the other until the section's deadline: the rows of a run cut short are kept, and the attacks not run named."""
    warnings.filterwarnings("ignore")
    from lightning_privdec.audit.sensitivity import ATTACKS, run_attacks

    device = torch_device(args.accelerator)
    started = time.perf_counter()
    rows, not_run = [], []
    for name in QUICK_ATTACKS if args.quick else tuple(ATTACKS):
        if time.time() > args.deadline:
            not_run.append(name)
            continue
        rows += [r.to_dict() for r in run_attacks((name,), device=device)]
    return {"rows": rows, "device": str(device), "attack_seconds": time.perf_counter() - started,
            "largest": max(rows, key=lambda r: r["ratio"]) if rows else None,
            "over": [r for r in rows if not r["holds"]], "not_run": not_run}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# (c) noise
# ---------------------------------------------------------------------------------------------------------------------
def noise_child(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from scipy import stats

    from lightning_privdec.privacy.keystream import KeystreamBuffers
    from lightning_privdec.privacy.noise import node_noise_generator

    device = torch_device(args.accelerator)
    on_device = KeystreamBuffers(device).keystream_on_device  # computed there (device_keystream.py), or on the host
    rows = []
    for numel in NOISE_SIZES[args.quick]:
        generator = node_noise_generator(device, None, 0)
        reset_peak(device)
        repeats = 3 if numel > 10_000_000 else 5

        def ours(numel=numel, generator=generator):  # noqa: ANN001, ANN202
            return generator.normal(numel, SIGMA, reuse_output=True)

        def reference(numel=numel):  # noqa: ANN001, ANN202
            return torch.randn(numel, device=device)

        row = {"coordinates": numel, "ns_per_coordinate": 1e9 * median_seconds(ours, device, repeats) / numel,
               "torch_randn_ns_per_coordinate": 1e9 * median_seconds(reference, device, repeats) / numel,
               "peak_memory_bytes": peak_bytes(device), "keystream_on_device": on_device}  # fmt: skip
        if args.accelerator == "gpu":
            row["target_met"] = row["ns_per_coordinate"] <= NOISE_TARGET_NS
        rows.append(row)

    # the distribution of the draws timed above (float32); the same key's draws with the keystream read on the host
    # (OpenSSL) through the same transform on the device must be equal bit for bit, and float64 draws to the CPU's
    numel, std = NOISE_SIZES[args.quick][0], 2.5
    draws = node_noise_generator(device, 11, 0).normal(numel, std)
    switch = os.environ.get("PRIVDEC_DEVICE_KEYSTREAM")
    os.environ["PRIVDEC_DEVICE_KEYSTREAM"] = "0"
    try:
        host_keyed = node_noise_generator(device, 11, 0).normal(numel, std)
    finally:
        if switch is None:
            del os.environ["PRIVDEC_DEVICE_KEYSTREAM"]
        else:
            os.environ["PRIVDEC_DEVICE_KEYSTREAM"] = switch
    wide = node_noise_generator(device, 12, 0).normal(numel, std, torch.float64)
    same_key_cpu = node_noise_generator("cpu", 12, 0).normal(numel, std, torch.float64)
    z = (draws.double() / std).cpu().numpy()
    checks: dict[str, Any] = {
        "coordinates": numel, "device": str(draws.device), "dtype": "float32", "keystream_on_device": on_device,
        # compared only where the keystream is computed on the device (else both draws read the host's)
        "equals_host_keystream_draws": bool(torch.equal(draws, host_keyed)) if on_device else None,
        "equals_cpu_draws": bool(torch.allclose(wide.cpu(), same_key_cpu, rtol=1e-12, atol=1e-12)),
        "mean": float(z.mean()), "mean_bound": 5 / math.sqrt(numel),
        "std": float(z.std()), "ks_pvalue": float(stats.kstest(z[: 2_000_000], "norm").pvalue),
    }  # fmt: skip
    tails = {}
    for k, expected in ((2, 0.0455), (3, 0.0027), (4, 6.3e-5)):  # two-sided tail mass of N(0, 1)
        observed = float(np.mean(np.abs(z) > k))
        tails[str(k)] = {"observed": observed, "expected": expected,
                         "ok": abs(observed - expected) <= 5 * math.sqrt(expected / numel) + 0.01 * expected}
    checks["tails"] = tails
    checks["passed"] = bool(
        checks["equals_cpu_draws"] and checks["equals_host_keystream_draws"] is not False
        and (on_device or args.accelerator != "gpu")
        and abs(checks["mean"]) < checks["mean_bound"] and abs(checks["std"] - 1) < 0.01 and checks["ks_pvalue"] > 1e-4 and all(t["ok"] for t in tails.values())
    )
    return {"rows": rows, "distribution": checks}


def median_seconds(fn, device: Any, repeats: int) -> float:  # noqa: ANN001
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------------
# (d) ranks: 4 gloo processes sharing the GPU, the CIFAR example per private strategy
# ---------------------------------------------------------------------------------------------------------------------
def run_ranks(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    strategies = (args.strategies.split(",") if args.strategies else ("dp_csgp",) if args.quick
                  else PRIVATE_STRATEGIES)  # fmt: skip
    steps, batch, images = (1, 2, 16) if args.quick else (20, 32, 512)
    concurrent = args.concurrent_launches or (1 if args.quick else CONCURRENT_LAUNCHES)
    # every rank of every launch shares the machine's cores: torch's intra-op threads split among them (Lightning
    # would give each single-device rank all of them, and spinning OpenMP threads then wait on each other)
    threads = max(1, (os.cpu_count() or 1) // (args.ranks * concurrent))

    def run(strategy: str, port: int) -> dict[str, Any]:
        left = deadline - time.time()
        if left < 20:
            return {"strategy": strategy, "error": "not run: time limit"}
        row = launch_example(args, strategy, steps, batch, images, timeout=min(left, 150.0), port=port,
                             threads=threads)
        print(f"  {strategy}: " + (row.get("error") or f"epsilon {row['epsilon_per_node']}, finite "
              f"{row['parameters_finite_per_node']} ({row['wall_s']:.0f} s)"), flush=True)  # fmt: skip
        if "tails" in row:  # a timed-out run: where rank 0 was (its stacks, dumped on SIGUSR1)
            print(row["tails"][0][-2500:], flush=True)
        return row

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, concurrent)) as pool:  # rows in the strategies' order
        rows = list(pool.map(run, strategies, free_ports(len(strategies))))
    return {"ranks": args.ranks, "steps": steps, "batch_size": batch, "synthetic_size": images,
            "concurrent_launches": concurrent, "threads_per_rank": threads, "rows": rows}


#: CPGT's pure epsilon-DP Laplace noise carries sqrt(d): on the example's 11M-parameter ResNet-18 it refuses epsilon = 3
#: before training and names ~1.6e8 as the budget whose noise a clipped gradient can cancel; the check runs it there to
#: exercise its CUDA path (its model is not private in any useful sense)
RANKS_KWARGS = {"cpgt": {"target_epsilon": 2e8}}
#: ``python -c STACK_DUMPING_RUNNER script args...``: runs the script with faulthandler's stack dump on SIGUSR1, which
#: a timed-out rank receives (:func:`dump_stacks`): the row then says where each rank was waiting
STACK_DUMPING_RUNNER = (
    "import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def dump_stacks(processes: list[subprocess.Popen]) -> None:
    """SIGUSR1 to each launched rank (the child of tests/multiprocess.py's watchdog, found by its parent's pid in
    /proc: kernels without CONFIG_PROC_CHILDREN have no children list), then a moment for the dumps."""
    import signal

    watchdogs = {process.pid for process in processes}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, parent = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent in watchdogs:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
    time.sleep(3.0)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (their sockets held open together while they are chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def launch_example(args: argparse.Namespace, strategy: str, steps: int, batch: int, images: int,
                   timeout: float, port: int, threads: int) -> dict[str, Any]:  # fmt: skip
    """``args.ranks`` single-device processes of examples/cifar_resnet.py forming one gloo world (each its own
    "node" to Lightning, as benchmarks/network.py launches them); rank 0's JSON line."""
    from tests.multiprocess import clean_environment, launch, stop_group

    kwargs = {"process_group_backend": "gloo", **EXTRA_KWARGS.get(strategy, {}), **RANKS_KWARGS.get(strategy, {})}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_ranks_") as tmp:
        command = [
            sys.executable, "-c", STACK_DUMPING_RUNNER, str(ROOT / "examples" / "cifar_resnet.py"), "--synthetic",
            "--json",
            "--strategy", strategy, "--accelerator", args.accelerator, "--devices", "1", "--num-nodes", str(args.ranks),
            "--max-steps", str(steps), "--batch-size", str(batch), "--synthetic-size", str(images),
            "--num-workers", "0", "--log-every-n-steps", str(steps), "--log-dir", tmp,
            "--strategy-kwargs", json.dumps(kwargs),
        ]  # fmt: skip
        processes, logs = [], []
        try:
            for rank in range(args.ranks):
                env = clean_environment() | {
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.ranks),
                    "NODE_RANK": str(rank), "LOCAL_RANK": "0", "OMP_NUM_THREADS": str(threads),
                    "CUDA_VISIBLE_DEVICES": os.environ.get(
                        "CUDA_VISIBLE_DEVICES", "0"),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                }  # fmt: skip
                logs.append(Path(tmp) / f"rank{rank}.log")
                with logs[-1].open("w") as log:
                    processes.append(launch(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp))
            end = time.monotonic() + timeout
            for process in processes:
                process.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            dump_stacks(processes)
            return {"strategy": strategy, "error": f"timed out after {timeout:.0f} s",
                    "tails": [log.read_text()[-6000:] for log in logs], "wall_s": time.perf_counter() - started}
        finally:
            for process in processes:
                stop_group(process, timeout=30)
        wall = time.perf_counter() - started
        failed = [r for r, p in enumerate(processes) if p.returncode != 0]
        lines = [line for line in logs[0].read_text().splitlines() if line.startswith("{")]
        if failed or not lines:
            rank = failed[0] if failed else 0
            tail = logs[rank].read_text().strip().splitlines()
            return {"strategy": strategy, "error": f"rank {rank} exited with {processes[rank].returncode}: "
                    + (tail[-1][:300] if tail else ""), "tail": "\n".join(tail[-25:])[-3000:], "wall_s": wall}
    result = json.loads(lines[-1])
    return {"strategy": strategy, "wall_s": wall} | {k: result[k] for k in (
        "nodes", "steps", "epsilon_per_node", "delta", "parameters_finite_per_node",
        "peak_gpu_memory_bytes_per_node", "samples_per_second_total", "train_loss", "bytes_sent_node0")}


# ---------------------------------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------------------------------
def run_bounded(command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command`` (its whole process group killed on a timeout, tests/multiprocess.py); exit code, output tail
    and error."""
    from tests.multiprocess import clean_environment, process_group

    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: what was printed survives a timeout
        try:
            with process_group(command, env=env or clean_environment(), stdout=log, stderr=subprocess.STDOUT,
                               cwd=ROOT) as process:  # fmt: skip
                process.wait(timeout=timeout)
            error = None if process.returncode == 0 else f"exit code {process.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        log.seek(0)
        output = log.read()
    return {"exit_code": process.returncode, "output": output, "tail": output[-3000:], "error": error}


def run_child_section(args: argparse.Namespace, section: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{section}_") as tmp:
        out = Path(tmp) / "out.json"
        command = [sys.executable, os.path.abspath(__file__), "--child", section, "--out", str(out),
                   "--accelerator", args.accelerator, "--deadline", str(time.time() + timeout - 10)]  # fmt: skip
        if args.quick:
            command.append("--quick")
        command += ["--models", ",".join(args.models), "--kinds", ",".join(args.kinds),
                    "--precisions", ",".join(args.precisions)]
        if args.library is not None and section in LIBRARY_SECTIONS:
            command += ["--library", str(args.library.resolve())]
        done = run_bounded(command, timeout)
        print(done["output"][-8000:], end="", flush=True)
        if not out.exists():
            return {"error": done["error"] or "the section wrote no result", "tail": done["tail"]}
        return json.loads(out.read_text())


def memory_section(sections: dict[str, Any]) -> dict[str, Any]:
    """Peak GPU memory per configuration, from the other sections (null where not measured: on CPU)."""
    rows = []
    for r in sections.get("throughput", {}).get("rows", []):
        rows.append({"configuration": f"throughput {r['model']} {r['precision']} {r['kind']}",
                     "peak_memory_bytes": r.get("peak_memory_bytes")})  # fmt: skip
    for r in sections.get("noise", {}).get("rows", []):
        rows.append({"configuration": f"noise {r['coordinates']:,} coordinates",
                     "peak_memory_bytes": r.get("peak_memory_bytes")})  # fmt: skip
    for r in sections.get("ranks", {}).get("rows", []):
        per_node = r.get("peak_gpu_memory_bytes_per_node")
        rows.append({"configuration": f"ranks {r['strategy']} (largest rank)",
                     "peak_memory_bytes": max(per_node) if per_node else None})  # fmt: skip
    return {"rows": rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        if args.library is not None:
            sys.path.insert(0, str(args.library))
        child = {"throughput": throughput_child, "noise": noise_child, "profile": profile_child,
                 "attacks": attacks_child}[args.child]  # fmt: skip
        result = child(args)
        import lightning_privdec  # noqa: PLC0415 - which tree the section ran

        result["library"] = str(Path(lightning_privdec.__file__).resolve().parents[1])
        args.out.write_text(json.dumps(result))
        return
    device = device_name(args.accelerator)
    print(f"device: {device}", flush=True)
    started = time.time()
    deadline = started + args.time_limit
    sections: dict[str, Any] = {}
    result = {
        "device": device, "accelerator": args.accelerator, "quick": args.quick,
        "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_line(), "software": software_line(opacus=True),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "complete": False, "sections": sections,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for section in (s for s in SECTIONS if s in args.section_list):
        budget = min(SECTION_LIMITS[section], deadline - time.time())
        print(f"== {section} (at most {budget:.0f} s)", flush=True)
        if budget < 15:
            sections[section] = {"error": "not run: time limit"}
            continue
        t0 = time.time()
        if section == "tests":
            sections[section] = run_tests(args, budget)
        elif section == "ranks":
            sections[section] = run_ranks(args, time.time() + budget)
        else:
            sections[section] = run_child_section(args, section, budget)
        sections[section]["seconds"] = time.time() - t0
        result["total_s"] = time.time() - started
        args.json.write_text(json.dumps(result, indent=1))  # what is done survives a kill of the whole command
    sections["memory"] = memory_section(sections)
    result.update(total_s=time.time() - started, complete=True)
    args.json.write_text(json.dumps(result, indent=1))
    if not args.no_table:
        print(format_table(result))
    print(f"results written to {args.json}")


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    """The JSON as markdown tables (what RESULTS.md takes)."""
    s = result["sections"]
    lines = [f"## gpu_check.py — {result['date']}, {result['device']}", "",
             f"Command: `{result['command']}` (total {result['total_s']:.0f} s).", "",
             f"- {result['machine']}", f"- {result['software']}", ""]  # fmt: skip
    if "tests" in s:
        t = s["tests"]
        lines += [f"Tests on {t.get('device')}: {tests_line(t)}", ""]
        for f in t.get("failures", []):
            lines.append(f"- FAILED {f['id']}: {f['message']}")
        lines.append("")
    if "throughput" in s:
        lines += ["| model | precision | step | samples/s | step ms | peak GPU MiB |", "|---|---|---|---:|---:|---:|"]
        for r in s["throughput"].get("rows", []):
            mem = _num(r.get("peak_memory_bytes") and r["peak_memory_bytes"] / 2**20, ",.0f")
            if "error" in r:
                lines.append(f"| {r['model']} | {r['precision']} | {r['kind']} | {r['error'][:120]} | | {mem} |")
            else:
                lines.append(f"| {r['model']} | {r['precision']} | {r['kind']} | {r['samples_per_second']:,.1f} "
                             f"| {r['step_ms']:.1f} | {mem} |")  # fmt: skip
        if s["throughput"].get("error"):
            lines.append(f"throughput failed: {s['throughput']['error']}")
        for v in s["throughput"].get("targets", []):
            lines.append(f"- {v['model']} {v['precision']}: best private mode {v['best_mode']}: "
                         f"{_num(v.get('vs_non_private'), '.2f')}x the non-private step"
                         + (f" (target <= {STEP_TARGET}x: {'met' if v['non_private_target_met'] else 'MISSED'})"
                            if "non_private_target_met" in v else "")
                         + f"; {_num(v.get('vs_opacus_ghost'), '.2f')}x Opacus ghost's samples/s"
                         + (f" (target >= {OPACUS_TARGET}x: {'met' if v['opacus_target_met'] else 'MISSED'})"
                            if "opacus_target_met" in v else ""))  # fmt: skip
        lines.append("")
    if "noise" in s:
        n = s["noise"]
        lines += ["| noise coordinates | keystream | ChaCha20 ns/coordinate | torch.randn ns/coordinate "
                  "| peak GPU MiB |",
                  "|---:|---|---:|---:|---:|"]  # fmt: skip
        for r in n.get("rows", []):
            mem = _num(r.get("peak_memory_bytes") and r["peak_memory_bytes"] / 2**20, ",.0f")
            where = "device" if r.get("keystream_on_device") else "host"
            lines.append(f"| {r['coordinates']:,} | {where} | {r['ns_per_coordinate']:.3f} | "
                         f"{r['torch_randn_ns_per_coordinate']:.3f} | {mem} |")  # fmt: skip
        d = n.get("distribution")
        if d:
            lines.append(f"distribution of {d['coordinates']:,} {d.get('dtype', 'float64')} draws on {d['device']}: "
                         "mean "
                         f"{d['mean']:+.2e}, std "
                         f"{d['std']:.5f}, KS p {d['ks_pvalue']:.3g}, tails " + ", ".join(
                             f"{k} sigma {v['observed']:.2e} (expected {v['expected']:.2e})"
                             for k, v in d["tails"].items()) + ", equal to the host keystream's draws: "
                         + {None: "not compared (keystream on the host)"}.get(d.get("equals_host_keystream_draws"),
                                                                              str(d.get("equals_host_keystream_draws")))
                         + ", float64 draws equal to the CPU's: "
                         f"{d['equals_cpu_draws']} "
                         f"-> {'PASSED' if d['passed'] else 'FAILED'}")  # fmt: skip
        if n.get("error"):
            lines.append(f"noise failed: {n['error']}")
        lines.append("")
    if "attacks" in s:
        a = s["attacks"]
        if a.get("rows"):
            top = a["largest"]
            lines += [f"Clipping attacks on {a['device']}: {len(a['rows'])} rows, {len(a['over'])} over C; the largest "
                      f"||S(D) - S(D \\ x)|| / C {top['ratio']:.8f} ({top['attack']}, {top['mode']}, "
                      f"{top['precision']}), in {a['attack_seconds']:.0f} s"
                      + (f"; not run (time limit): {', '.join(a['not_run'])}" if a["not_run"] else "")]  # fmt: skip
            lines += [f"- OVER C: {r['attack']} {r['mode']} {r['precision']}: {r['ratio']:.8f}" for r in a["over"]]
        elif a.get("not_run"):
            lines.append(f"Clipping attacks on {a['device']}: none run (time limit): {', '.join(a['not_run'])}")
        else:
            lines.append(f"attacks failed: {a.get('error')}")
        lines.append("")
    if "ranks" in s:
        r0 = s["ranks"]
        lines += [f"{r0.get('ranks')} ranks over gloo sharing the device, examples/cifar_resnet.py --synthetic, "
                  f"{r0.get('steps')} steps, batch {r0.get('batch_size')}, "
                  f"{r0.get('concurrent_launches', 1)} strategies at a time:", "",
                  "| strategy | epsilon per rank | parameters finite | peak GPU MiB (largest rank) | samples/s "
                  "| wall s |",
                  "|---|---|---|---:|---:|---:|"]  # fmt: skip
        for r in r0.get("rows", []):
            if "error" in r:
                lines.append(f"| {r['strategy']} | {r['error'][:160]} | | | | |")
                continue
            peak = r.get("peak_gpu_memory_bytes_per_node")
            lines.append(f"| {r['strategy']} | {', '.join(f'{e:.3g}' for e in r['epsilon_per_node'])} | "
                         f"{all(r['parameters_finite_per_node'])} | {_num(peak and max(peak) / 2**20, ',.0f')} | "
                         f"{r['samples_per_second_total']:,.1f} | {r['wall_s']:.0f} |")  # fmt: skip
        lines.append("")
    if "profile" in s:
        for r in s["profile"].get("rows", []):
            if "error" in r:
                lines.append(f"profile of {r['model']} ({r['kind']}): {r['error']}")
                continue
            lines += [f"profile of one fp32 private step, {r['model']} ({r['kind']}, batch {r['batch']}): "
                      f"{r['wall_ms']:.1f} ms wall, device busy {_num(r['device_busy_ms'], '.1f')} ms, "
                      f"{r['device_activities']} device activities (kernels, copies, memsets), {r['aten_calls']} aten "
                      f"calls, {r['host_syncs']} host syncs", "",
                      "| operator | calls | self host ms | self device ms |", "|---|---:|---:|---:|"]  # fmt: skip
            lines += [f"| {o['op']} | {o['calls']} | {o['self_host_ms']:.2f} | {o['self_device_ms']:.2f} |"
                      for o in r["top_host_ops"]]  # fmt: skip
            lines.append("")
    return "\n".join(lines)


def tests_line(t: dict[str, Any]) -> str:
    if "passed" not in t:
        return f"not run: {t.get('error')}"
    cuda = t["cuda_only"]
    return (f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped of "
            f"{t['collected']} in {t['seconds']:.0f} s; the CUDA-only ones: {cuda['passed']} passed, {cuda['failed']} "
            f"failed, {cuda['skipped']} skipped" + (f" (pytest: {t['error']})" if t.get("error") else ""))


if __name__ == "__main__":
    main()
