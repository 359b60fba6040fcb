"""``privdec-account secldp``: the SecLDP of Decor (Allouah et al., ICML 2024) on an undirected topology.

    privdec-account secldp --topology ring --nodes 16 --sigma-cdp 90 --sigma-cor 700 --clip 1 --steps 1000 \\
        --delta 1e-5 --json

Prints the per-round slope ``epsilon_step`` (Thm. 6, Algorithms 2 and 3) against the chosen adversary and, with
``--steps`` and ``--delta``, the epsilon of ``T`` rounds (Lemmas 10 and 11); ``--sample-rate`` switches to example
level (Poisson-subsampled RDP of the whitened Gaussian).
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_privdec.cli.arguments import (
    Subcommand,
    add_topology,
    nonnegative_float,
    open_probability,
    positive_float,
    positive_int,
    probability,
    topology_from,
)
from lightning_privdec.privacy.accounting.secldp import secldp_epsilon, secldp_epsilon_example_level
from lightning_privdec.privacy.accounting.secldp_step import ADVERSARIES, collusion_level, secldp_step
from lightning_privdec.privacy.errors import PrivacyConfigError


def adversary_spec(text: str) -> str | int:
    """``eavesdropper``, ``curious`` or a number q >= 0 of colluding nodes."""
    key = text.strip().lower()
    if key in ADVERSARIES:
        return key
    try:
        q = int(key)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'eavesdropper', 'curious' or a number of colluding nodes, got {text!r}"
        ) from None
    if q < 0:
        raise argparse.ArgumentTypeError(f"the number of colluding nodes must be >= 0, got {text}")
    return q


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_topology(
        parser,
        help="ring, torus, complete or erdos-renyi (directed topologies are refused: Decor needs an undirected graph)",
    )
    parser.add_argument(
        "--sigma-cdp", type=nonnegative_float, required=True, metavar="S",
        help="std of each node's independent noise (same units as the clipped gradient)",
    )
    parser.add_argument(
        "--sigma-cor", type=nonnegative_float, required=True, metavar="S",
        help="std of each pairwise correlated noise v_ij = -v_ji",
    )
    parser.add_argument("--clip", type=positive_float, required=True, metavar="C", help="clipping threshold C")
    parser.add_argument(
        "--adversary", type=adversary_spec, default="eavesdropper", metavar="A",
        help="'eavesdropper' (default), 'curious' (honest-but-curious nodes) or Q colluding nodes",
    )
    parser.add_argument("--steps", type=positive_int, metavar="T", help="number of rounds (with --delta: epsilon)")
    parser.add_argument("--delta", type=open_probability, metavar="D", help="delta of (epsilon, delta)")
    parser.add_argument(
        "--sample-rate", type=probability, metavar="Q",
        help="example-level privacy: Poisson rate q = B / J on each shard; the noise is on the clipped sum "
        "(sensitivity C, add/remove one example). Without it: user level (sensitivity 2C, Decor's convention)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if (args.steps is None) != (args.delta is None):
        raise PrivacyConfigError("give both --steps and --delta to get epsilon (or neither for epsilon_step only)")
    if args.sample_rate is not None and args.steps is None:
        raise PrivacyConfigError("--sample-rate (example-level privacy) needs --steps and --delta")
    topology = topology_from(args)
    if not topology.is_symmetric:
        raise PrivacyConfigError(
            f"topology {args.topology!r} is directed, but Decor needs an undirected graph (each pairwise noise "
            "v_ij = -v_ji is shared by both ends of an edge); use 'ring', 'torus', 'complete' or 'erdos-renyi'"
        )
    collusion_level(args.adversary, args.nodes)  # q < n, with a clear message
    level = "user" if args.sample_rate is None else "example"
    epsilon_step = secldp_step(
        topology.graph(0), args.sigma_cdp, args.sigma_cor, args.clip, args.adversary, level=level
    )
    epsilon = None
    if args.steps is not None:
        if args.sample_rate is None:
            epsilon = secldp_epsilon(epsilon_step, args.steps, args.delta)
        else:
            epsilon = secldp_epsilon_example_level(epsilon_step, args.steps, args.delta, args.sample_rate)
    return {
        "epsilon_step": epsilon_step,
        "epsilon": epsilon,
        "topology": args.topology,
        "nodes": args.nodes,
        "sigma_cdp": args.sigma_cdp,
        "sigma_cor": args.sigma_cor,
        "clip": args.clip,
        "adversary": args.adversary,
        "level": level,
        "steps": args.steps,
        "delta": args.delta,
        "sample_rate": args.sample_rate,
    }


def describe(result: dict[str, Any]) -> str:
    adversary = result["adversary"]
    against = {"eavesdropper": "an external eavesdropper", "curious": "honest-but-curious nodes"}.get(
        adversary, f"{adversary} colluding nodes"
    )
    text = (
        f"epsilon_step = {result['epsilon_step']:.6g} (each round is (alpha, alpha * epsilon_step)-SecRDP) against "
        f"{against} on the {result['topology']} topology with {result['nodes']} nodes, "
        f"sigma_cdp = {result['sigma_cdp']:g}, sigma_cor = {result['sigma_cor']:g}, clip = {result['clip']:g} "
        f"({result['level']} level)"
    )
    if result["epsilon"] is not None:
        sampling = "" if result["sample_rate"] is None else f", Poisson sample_rate = {result['sample_rate']:g}"
        text += (
            f"; epsilon = {result['epsilon']:.4f} at delta = {result['delta']:g} after {result['steps']} rounds"
            f"{sampling} (Decor SecLDP)"
        )
    return text


SUBCOMMAND = Subcommand(
    name="secldp",
    help="Decor (Allouah et al. 2024): SecLDP of correlated-noise decentralized SGD on an undirected topology",
    add_arguments=add_arguments,
    run=run,
    describe=describe,
)
