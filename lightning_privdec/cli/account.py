"""``privdec-account``: privacy accounting from the command line.

Subcommands (one per mechanism; each registers itself in :data:`SUBCOMMANDS`)::

    privdec-account dpsgd --noise-multiplier 1.1 --sample-rate 0.01 --steps 1000 --delta 1e-5      # -> epsilon
    privdec-account dpsgd --target-epsilon 3 --sample-rate 0.01 --steps 1000 --delta 1e-5 --json  # -> sigma
    privdec-account secldp --topology ring --nodes 16 --sigma-cdp 90 --sigma-cor 700 --clip 1 --steps 1000 \\
        --delta 1e-5 --json                                                                  # -> epsilon (Decor)
    privdec-account dyn-d2p --target-epsilon 1 --delta 1e-5 --steps 330 --sample-rate 0.095 --clip 1 --json
                                                              # -> Dyn-D2P schedule, paper and rigorous epsilon
    privdec-account cpgt --alpha 0.1 --lipschitz 2.5 --q 0.99 --noise-x 100 --noise-y 100 --sensitivity 0.9 --json
                                                              # -> CPGT's pure epsilon (delta = 0)
    privdec-account privsgp-vr --target-epsilon 3 --sample-rate 0.095 --steps 330 --delta 1e-5 --json
                                                              # -> PrivSGP-VR's noise, split, sound and paper epsilon

To add a subcommand (e.g. ``secldp``, ``dyn-d2p``), write ``add_arguments(parser)`` and ``run(args) -> dict`` and
decorate a :class:`Subcommand` instance with :func:`register`; ``run`` returns the JSON record and raises
:class:`~lightning_privdec.privacy.PrivacyConfigError` on bad input (exit code 2, message on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    calibrate_noise_multiplier,
    epsilon_for,
    gdp_epsilon_approximation,
)
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.accounting.secldp_step import ADVERSARIES, collusion_level, secldp_step
from lightning_privdec.privacy.accounting.secldp import secldp_epsilon, secldp_epsilon_example_level
from lightning_privdec.topology import TopologyError, build_topology

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main", "register"]

PROG = "privdec-account"
EXIT_USAGE = 2


@dataclass(frozen=True)
class Subcommand:
    """One ``privdec-account`` subcommand: its arguments, its computation, and how to print its result."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(subcommand: Subcommand) -> Subcommand:
    """Add a subcommand to ``privdec-account``."""
    if subcommand.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {subcommand.name!r} is already registered")
    SUBCOMMANDS[subcommand.name] = subcommand
    return subcommand


# ---- argument types: reject bad numbers at parse time with a clear message ------------------------------------
def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A sampling rate in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def open_probability(text: str) -> float:
    """A delta in (0, 1)."""
    value = _finite(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_accounting_arguments(parser: argparse.ArgumentParser) -> None:
    """``--sample-rate``, ``--steps``, ``--delta``, ``--accountant``: shared by subsampled-Gaussian subcommands."""
    parser.add_argument(
        "--sample-rate", type=probability, required=True, metavar="Q",
        help="Poisson sampling rate q = B / J over the node's shard of J examples",
    )
    parser.add_argument("--steps", type=positive_int, required=True, metavar="T", help="number of steps")
    parser.add_argument("--delta", type=open_probability, required=True, metavar="D", help="delta of (epsilon, delta)")
    parser.add_argument(
        "--accountant", choices=(*ACCOUNTANTS, "gdp"), default="rdp",
        help="rdp (Mironov et al. 2019, default) or prv (Gopi et al. 2021); gdp: the rdp epsilon plus the central-limit "
        "GDP approximation (Dong et al. 2019) labelled as such (it can under-estimate epsilon, so it decides nothing)",
    )


# ---- dpsgd ----------------------------------------------------------------------------------------------------
def _dpsgd_arguments(parser: argparse.ArgumentParser) -> None:
    level = parser.add_mutually_exclusive_group(required=True)
    level.add_argument(
        "--noise-multiplier", type=nonnegative_float, metavar="S",
        help="sigma: noise std / max_grad_norm; prints the epsilon it gives",
    )
    level.add_argument(
        "--target-epsilon", type=positive_float, metavar="E",
        help="budget epsilon; prints the smallest noise multiplier that meets it (within 1%%)",
    )
    add_accounting_arguments(parser)


def _dpsgd_run(args: argparse.Namespace) -> dict[str, Any]:
    approximate = args.accountant == "gdp"  # the sound rdp value decides; GDP is only shown beside it
    accountant = "rdp" if approximate else args.accountant
    if args.noise_multiplier is None:
        sigma = calibrate_noise_multiplier(
            args.target_epsilon, args.delta, args.sample_rate, args.steps, accountant=accountant
        )
    else:
        sigma = args.noise_multiplier
    result = {
        "epsilon": epsilon_for(sigma, args.sample_rate, args.steps, args.delta, accountant=accountant),
        "noise_multiplier": sigma,
        "delta": args.delta,
        "steps": args.steps,
        "sample_rate": args.sample_rate,
        "accountant": accountant,
    }
    if approximate:
        result["epsilon_gdp_approximation"] = gdp_epsilon_approximation(sigma, args.sample_rate, args.steps, args.delta)
    return result


def _dpsgd_describe(result: dict[str, Any]) -> str:
    text = (
        f"epsilon = {result['epsilon']:.4f} at delta = {result['delta']:g} for noise_multiplier = "
        f"{result['noise_multiplier']:.4f}, sample_rate = {result['sample_rate']:g}, steps = {result['steps']} "
        f"({result['accountant']} accountant, DP-SGD with Poisson sampling)"
    )
    if "epsilon_gdp_approximation" in result:
        text += (
            f"\nGDP approximation (central limit theorem, NOT a bound; can under-estimate epsilon): "
            f"epsilon ~ {result['epsilon_gdp_approximation']:.4f}"
        )
    return text


register(
    Subcommand(
        name="dpsgd",
        help="DP-SGD (Abadi et al. 2016): epsilon for a noise multiplier, or the noise multiplier for an epsilon",
        add_arguments=_dpsgd_arguments,
        run=_dpsgd_run,
        describe=_dpsgd_describe,
    )
)


# ---- secldp ---------------------------------------------------------------------------------------------------
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


def _secldp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--topology", required=True, metavar="NAME",
        help="ring, torus, complete or erdos-renyi (directed topologies are refused: Decor needs an undirected graph)",
    )
    parser.add_argument("--nodes", type=positive_int, required=True, metavar="N", help="number of nodes n")
    parser.add_argument("--seed", type=int, default=0, help="graph seed (erdos-renyi only; default 0)")
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


def _secldp_run(args: argparse.Namespace) -> dict[str, Any]:
    if (args.steps is None) != (args.delta is None):
        raise PrivacyConfigError("give both --steps and --delta to get epsilon (or neither for epsilon_step only)")
    if args.sample_rate is not None and args.steps is None:
        raise PrivacyConfigError("--sample-rate (example-level privacy) needs --steps and --delta")
    try:
        topology = build_topology(args.topology, args.nodes, seed=args.seed)
    except TopologyError as err:
        raise PrivacyConfigError(str(err)) from None
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


def _secldp_describe(result: dict[str, Any]) -> str:
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


register(
    Subcommand(
        name="secldp",
        help="Decor (Allouah et al. 2024): SecLDP of correlated-noise decentralized SGD on an undirected topology",
        add_arguments=_secldp_arguments,
        run=_secldp_run,
        describe=_secldp_describe,
    )
)


# ---- dyn-d2p (lightning_privdec/cli/dyn_d2p.py) ----------------------------------------------------------------
from lightning_privdec.cli import dyn_d2p as _dyn_d2p  # noqa: E402

register(
    Subcommand(
        name=_dyn_d2p.NAME, help=_dyn_d2p.HELP, add_arguments=_dyn_d2p.add_arguments, run=_dyn_d2p.run,
        describe=_dyn_d2p.describe,
    )
)


# ---- cpgt (lightning_privdec/cli/cpgt.py) -----------------------------------------------------------------------
from lightning_privdec.cli import cpgt as _cpgt  # noqa: E402

register(
    Subcommand(name=_cpgt.NAME, help=_cpgt.HELP, add_arguments=_cpgt.add_arguments, run=_cpgt.run,
               describe=_cpgt.describe)
)


# ---- privsgp-vr (lightning_privdec/cli/privsgp_vr.py) -------------------------------------------------------------
from lightning_privdec.cli import privsgp_vr as _privsgp_vr  # noqa: E402

register(
    Subcommand(name=_privsgp_vr.NAME, help=_privsgp_vr.HELP, add_arguments=_privsgp_vr.add_arguments,
               run=_privsgp_vr.run, describe=_privsgp_vr.describe)
)


# ---- entry point ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Per-node privacy accounting for lightning_privdec (sample-level (epsilon, delta)-DP)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for subcommand in SUBCOMMANDS.values():
        sub = subparsers.add_parser(subcommand.name, help=subcommand.help, description=subcommand.help)
        subcommand.add_arguments(sub)
        sub.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
        sub.set_defaults(subcommand=subcommand)
    return parser


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``privdec-account``; returns the exit code (0, or 2 for bad input with the reason on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 and a usage message on malformed arguments
    subcommand: Subcommand = args.subcommand
    try:
        result = subcommand.run(args)
    except PrivacyConfigError as err:
        print(f"{PROG} {subcommand.name}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({k: _json_number(v) for k, v in result.items()}))
    else:
        print(subcommand.describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
