"""The private step of two versions of the library, measured in interleaved rounds on the same models.

On a shared machine the load moves a single measurement by tens of percent within minutes; this script alternates
the two library trees (e.g. a ``git worktree`` of an older commit and this checkout) process by process, round after
round, so that both see the same load on average, and prints the median over rounds of each tree's median step.

    git worktree add --detach /tmp/before b61b9f6
    python benchmarks/interleaved_step_time.py --before /tmp/before --after . --model gpt2 --batch-size 16 --rounds 4

A step is forward + backward + clip + noise (one DP-CSGP node's ``privatize``, no optimizer step), one process, one
thread, process CPU time, as in ``step_time.py --modes-only``; the problems are ``step_time.build_problem``'s (taken
from this checkout for both trees).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("plain", "bookkeeping", "ghost")

CHILD = """
import json, statistics, sys, time, warnings
tree, here, mode, model_name, batch, steps = sys.argv[1:7]
sys.path.insert(0, here)
sys.path.insert(0, tree)
import torch
torch.set_num_threads(1)
warnings.filterwarnings("ignore")
import lightning_privdec
assert lightning_privdec.__file__.startswith(tree), lightning_privdec.__file__
import step_time
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
fresh, inputs, targets, loss_fn = step_time.build_problem(model_name, int(batch), 0)
model = fresh()
if mode == "plain":
    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
else:
    node = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), rank=0,
                      device=torch.device("cpu"), grad_sample_mode=mode, noise_seed=0)
    node.attach(model)
    node.noise_multiplier, node.sample_rate, node.expected_batch_size = 1.0, int(batch) / 2048, float(batch)
    try:
        from lightning_privdec.algorithms.node import private_step
    except ImportError:  # a tree from before the node step: privatize records its release itself
        private_step = type(node).privatize
    def step():
        model.zero_grad(set_to_none=True)
        if mode == "ghost":
            getattr(node, "clipping", node).ghost_backward(loss_fn(model(inputs), targets, reduction="none"))
        else:
            loss_fn(model(inputs), targets).backward()
        private_step(node)
for _ in range(3):
    step()
times = []
for _ in range(int(steps)):
    start = time.process_time()
    step()
    times.append(time.process_time() - start)
print(json.dumps(1e3 * statistics.median(times)))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the older library tree (a git worktree)")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="the newer tree (default: this checkout)")
    parser.add_argument("--model", default="gpt2", help="a step_time.build_problem name (gpt2, resnet18, ...)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per process (after 3 warm-up steps)")
    return parser.parse_args(argv)


def measure(tree: Path, mode: str, args: argparse.Namespace) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree.resolve()), str(HERE), mode, args.model, str(args.batch_size),
         str(args.steps)],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    results: dict[tuple[str, str], list[float]] = {(t, m): [] for t in trees for m in MODES}
    for _ in range(args.rounds):
        for tree_name, tree in trees.items():
            for mode in MODES:
                results[tree_name, mode].append(measure(tree, mode, args))
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"{args.model}, batch {args.batch_size}: median over {args.rounds} interleaved rounds of each process's "
          f"median CPU ms per step ({args.steps} steps, one thread)\n")
    print("| mode | before | after | after / before | before / non-private | after / non-private |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in MODES:
        b, a = median["before", mode], median["after", mode]
        print(f"| {mode} | {b:.1f} | {a:.1f} | {a / b:.3f} | {b / median['before', 'plain']:.2f}x | "
              f"{a / median['after', 'plain']:.2f}x |")
    print("\nper round (before, after):", json.dumps({m: list(zip(results["before", m], results["after", m]))
                                                      for m in MODES}))


if __name__ == "__main__":
    main()
