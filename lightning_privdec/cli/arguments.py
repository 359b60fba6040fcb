"""What every ``privdec-account`` subcommand shares: argument types that refuse bad numbers at parse time, the
arguments several mechanisms take, and how a result is printed (a sentence, or one JSON object with ``--json``) or a
refusal turned into exit code 2 with the reason on stderr."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.topology import Topology, TopologyError, build_topology

PROG = "privdec-account"
EXIT_USAGE = 2


# ---- argument types -------------------------------------------------------------------------------------------
def _number(text: str, ok: Callable[[float], bool], requirement: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{requirement}, got {text}")
    return value


def positive_float(text: str) -> float:
    return _number(text, lambda v: v > 0, "must be > 0")


def nonnegative_float(text: str) -> float:
    return _number(text, lambda v: v >= 0, "must be >= 0")


def probability(text: str) -> float:
    """A sampling rate in (0, 1]."""
    return _number(text, lambda v: 0 < v <= 1, "must lie in (0, 1]")


def open_probability(text: str) -> float:
    """A delta in (0, 1)."""
    return _number(text, lambda v: 0 < v < 1, "must lie strictly between 0 and 1")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


# ---- arguments several subcommands take -----------------------------------------------------------------------
def add_noise_or_budget(parser: argparse.ArgumentParser, noise_help: str, budget_help: str) -> None:
    """Exactly one of ``--noise-multiplier`` (prints its epsilon) and ``--target-epsilon`` (prints its noise)."""
    level = parser.add_mutually_exclusive_group(required=True)
    level.add_argument("--noise-multiplier", type=nonnegative_float, metavar="S", help=noise_help)
    level.add_argument("--target-epsilon", type=positive_float, metavar="E", help=budget_help)


def add_sampled_steps(parser: argparse.ArgumentParser, sample_rate_help: str, steps_metavar: str) -> None:
    """``--sample-rate``, ``--steps``, ``--delta`` of a Poisson-subsampled run."""
    parser.add_argument("--sample-rate", type=probability, required=True, metavar="Q", help=sample_rate_help)
    parser.add_argument("--steps", type=positive_int, required=True, metavar=steps_metavar, help="number of steps")
    parser.add_argument("--delta", type=open_probability, required=True, metavar="D", help="delta of (epsilon, delta)")


def add_accountant(parser: argparse.ArgumentParser, choices: tuple[str, ...], help: str) -> None:
    parser.add_argument("--accountant", choices=choices, default="rdp", help=help)


def add_topology(parser: argparse.ArgumentParser, help: str) -> None:
    """``--topology``, ``--nodes``, ``--seed``: read by :func:`topology_from`."""
    parser.add_argument("--topology", required=True, metavar="NAME", help=help)
    parser.add_argument("--nodes", type=positive_int, required=True, metavar="N", help="number of nodes n")
    parser.add_argument("--seed", type=int, default=0, help="graph seed (erdos-renyi only; default 0)")


def topology_from(args: argparse.Namespace) -> Topology:
    try:
        return build_topology(args.topology, args.nodes, seed=args.seed)
    except TopologyError as err:
        raise PrivacyConfigError(str(err)) from None


# ---- one subcommand: its arguments, its computation, how its result is printed --------------------------------
def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass(frozen=True)
class Subcommand:
    """One ``privdec-account`` subcommand. ``run`` returns the JSON record and raises
    :class:`~lightning_privdec.privacy.PrivacyConfigError` on bad input; ``describe`` turns the record into a
    sentence."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]

    def add_parser(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        self.add_arguments(parser)
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
        parser.set_defaults(subcommand=self)
        return parser

    def __call__(self, args: argparse.Namespace) -> int:
        """Run and print; the exit code: 0, or 2 for bad input with the reason on stderr."""
        try:
            result = self.run(args)
        except PrivacyConfigError as err:
            print(f"{PROG} {self.name}: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        if args.json:
            print(json.dumps({k: _json_number(v) for k, v in result.items()}))
        else:
            print(self.describe(result))
        return 0
