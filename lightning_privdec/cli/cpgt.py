"""``privdec-account cpgt``: CPGT's pure epsilon-DP (Theorem 2 of Xie et al., and the bound its proof gives).

    privdec-account cpgt --alpha 0.1 --lipschitz 2.5 --q 0.99 --noise-x 100 --noise-y 100 --sensitivity 0.9 --json
    privdec-account cpgt ... --dimension 4810 --steps 100     # l2 quantities of a d-parameter model; finite horizon
    privdec-account cpgt --alpha 0.5 --lipschitz 0.1 --noise-x 1 --noise-y 1 --sensitivity 0.01   # q chosen: 0.666

Prints ``epsilon`` (the sound whole-run bound), ``epsilon_theorem2`` (the paper's eq. (23) verbatim) and
``delta = 0``; with ``--steps``, also ``epsilon_finite``: the first K rounds without the linear-difference
Assumption 4. Without ``--q``, q is chosen as ``CPGTStrategy(noise_decay="auto")`` chooses it (``q_auto``: true).
Exit code 2 with the violated condition when Theorem 2 does not apply.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_privdec.cli.arguments import Subcommand, positive_float, positive_int
from lightning_privdec.privacy.accounting.cpgt import (
    auto_noise_decay,
    cpgt_epsilon,
    cpgt_epsilon_after,
    laplace_norm_factor,
    min_noise_decay,
    theorem2_epsilon,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--alpha", type=positive_float, required=True, metavar="A", help="step size alpha")
    parser.add_argument(
        "--lipschitz", type=positive_float, required=True, metavar="L", help="smoothness constant L of every f_i",
    )
    parser.add_argument(
        "--q", type=positive_float, metavar="Q",
        help="noise decay rate q in (0, 1); omitted: chosen from alpha, L and d_x/d_y as the strategy's "
        "noise_decay='auto' chooses it (auto_noise_decay: the q in Theorem 2's interval minimising epsilon times "
        "the tracker noise offset, Remark 2)",
    )
    parser.add_argument("--noise-x", type=positive_float, required=True, metavar="DX", help="Laplace scale d_x")
    parser.add_argument("--noise-y", type=positive_float, required=True, metavar="DY", help="Laplace scale d_y")
    parser.add_argument(
        "--sensitivity", type=positive_float, required=True, metavar="S",
        help="adjacency distance: max_x ||grad f_i(x) - grad f_i'(x)|| (the paper's delta), an l1 bound unless "
        "--dimension is given. Gradients clipped per sample to C (an l2 clip) give the l2 bound 2C/(qJ): pass it "
        "with --dimension d",
    )
    parser.add_argument(
        "--dimension", type=positive_int, metavar="D",
        help="number of parameters d: the sensitivity and L are l2 quantities and epsilon carries sqrt(d) (the "
        "Laplace loss is an l1 norm). Without it they are taken as l1 quantities",
    )
    parser.add_argument(
        "--steps", type=positive_int, metavar="K",
        help="also print epsilon_finite: the first K rounds, without assuming the linear difference (Assumption 4)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    q = args.q
    if q is None:  # as CPGTNode.configure_optimizer does for noise_decay="auto" (raises when alpha L >= 1/2)
        q = auto_noise_decay(args.alpha, args.lipschitz, args.noise_x, args.noise_y)
    common = dict(alpha=args.alpha, lipschitz=args.lipschitz, q=q, noise_x=args.noise_x, noise_y=args.noise_y,
                  sensitivity=args.sensitivity)
    factor = 1.0 if args.dimension is None else laplace_norm_factor(args.dimension, "l2")
    result: dict[str, Any] = {
        "epsilon": cpgt_epsilon(**common, norm_factor=factor),  # raises with the violated condition
        "epsilon_theorem2": theorem2_epsilon(**common),
        "delta": 0.0,
        **common,
        "q_auto": args.q is None,
        "dimension": args.dimension,
        "norm": "l1" if args.dimension is None else "l2",
        "min_q": min_noise_decay(args.alpha, args.lipschitz),
    }
    if args.steps is not None:
        result["steps"] = args.steps
        result["epsilon_finite"] = cpgt_epsilon_after(args.steps, **common, norm_factor=factor, linear_difference=False)
    return result


def describe(result: dict[str, Any]) -> str:
    text = (
        f"epsilon = {result['epsilon']:.6g} (delta = 0) for the whole CPGT run: alpha = {result['alpha']:g}, "
        f"L = {result['lipschitz']:g}, q = {result['q']:g}"
        + (" (chosen automatically, as noise_decay='auto')" if result["q_auto"] else "")
        + f", d_x = {result['noise_x']:g}, d_y = {result['noise_y']:g}, "
        f"sensitivity = {result['sensitivity']:g} ({result['norm']}"
        + ("" if result["dimension"] is None else f", d = {result['dimension']}")
        + f"); the paper's eq. (23) gives {result['epsilon_theorem2']:.6g}"
    )
    if "epsilon_finite" in result:
        text += (
            f"; without Assumption 4 (linear difference), the first {result['steps']} rounds: "
            f"{result['epsilon_finite']:.6g}"
        )
    return text


SUBCOMMAND = Subcommand(
    name="cpgt",
    help="CPGT (Xie et al.): pure epsilon-DP of compressed private gradient tracking with decaying Laplace noise",
    add_arguments=add_arguments,
    run=run,
    describe=describe,
)
