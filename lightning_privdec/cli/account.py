"""``privdec-account``: privacy accounting from the command line, one subcommand per mechanism.

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

A subcommand is a module of this package with ``add_arguments(parser)``, ``run(args) -> dict`` (the JSON record;
raises :class:`~lightning_privdec.privacy.PrivacyConfigError` on bad input: exit code 2, message on stderr) and
``describe(record) -> str``, bundled as a :class:`~lightning_privdec.cli.arguments.Subcommand` and registered here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_privdec.cli import cpgt, dpsgd, dyn_d2p, privsgp_vr, secldp
from lightning_privdec.cli.arguments import PROG, Subcommand

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main", "register"]

SUBCOMMANDS: dict[str, Subcommand] = {}


def register(subcommand: Subcommand) -> Subcommand:
    """Add a subcommand to ``privdec-account``."""
    if subcommand.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {subcommand.name!r} is already registered")
    SUBCOMMANDS[subcommand.name] = subcommand
    return subcommand


for _module in (dpsgd, secldp, dyn_d2p, cpgt, privsgp_vr):
    register(_module.SUBCOMMAND)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Per-node privacy accounting for lightning_privdec (sample-level (epsilon, delta)-DP)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for subcommand in SUBCOMMANDS.values():
        subcommand.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``privdec-account``; returns the exit code (0, or 2 for bad input with the reason on stderr)."""
    args = build_parser().parse_args(argv)  # exits with 2 and a usage message on malformed arguments
    return args.subcommand(args)


if __name__ == "__main__":
    sys.exit(main())
