"""``privdec-account privsgp-vr``: PrivSGP-VR's per-node epsilon, or the noise for a budget (sound or paper).

    privdec-account privsgp-vr --target-epsilon 3 --sample-rate 0.095 --steps 330 --delta 1e-5 --json
    privdec-account privsgp-vr --noise-multiplier 8 --sample-rate 0.095 --steps 330 --delta 1e-5 --accounting paper

``--noise-multiplier`` is s / C, the std of the noise on the released SUM in units of C. Prints the noise, the split
(sound accounting; ``null``: the joint analysis was tighter), the epsilon of the chosen accounting and, for
comparison, the epsilon the same noise gets under the paper's formula (Theorem 2 of Zhu et al. 2024: sensitivity 3C
amplified at rate q) and under the sound accounting (docs/privacy.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_privdec.cli.arguments import Subcommand, add_accountant, add_noise_or_budget, add_sampled_steps
from lightning_privdec.privacy.accounting.saga import (
    ACCOUNTINGS,
    SAGA_ACCOUNTANTS,
    saga_epsilon,
    sound_split,
)
from lightning_privdec.privacy.accounting.saga_calibration import calibrate_saga_noise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_noise_or_budget(
        parser,
        noise_help="s / C: the std of the noise on the released sum, in units of the clipping bound C",
        budget_help="budget epsilon; prints the smallest noise (and split) that meets it (within 1%%)",
    )
    add_sampled_steps(parser, "Poisson rate q = B / J", steps_metavar="K")
    parser.add_argument(
        "--accounting", choices=ACCOUNTINGS, default="sound",
        help="sound (default: the table mean is charged at every step), paper (Theorem 2's formula: sensitivity 3C "
        "amplified at rate q; not a proven guarantee) or no_amplification",
    )
    add_accountant(parser, SAGA_ACCOUNTANTS, help="rdp (default) or prv")


def run(args: argparse.Namespace) -> dict[str, Any]:
    q, steps, delta, accountant = args.sample_rate, args.steps, args.delta, args.accountant
    if args.noise_multiplier is None:
        noise = calibrate_saga_noise(
            args.target_epsilon, delta, q, steps, accounting=args.accounting, accountant=accountant
        )
        multiplier = noise.noise_multiplier
    else:
        multiplier = args.noise_multiplier
    if args.accounting == "sound" and args.noise_multiplier is None:
        split = noise.split
    else:
        split = sound_split(multiplier, q, steps, delta, accountant=accountant)
    epsilons = {
        name: saga_epsilon(multiplier, q, steps, delta, accounting=name, accountant=accountant, split=split)
        for name in ACCOUNTINGS
    }
    return {
        "epsilon": epsilons[args.accounting],
        "accounting": args.accounting,
        "noise_multiplier": multiplier,
        "split": split if args.accounting == "sound" else None,
        **{f"epsilon_{name}": value for name, value in epsilons.items()},
        "delta": delta,
        "steps": steps,
        "sample_rate": q,
        "accountant": accountant,
    }


def describe(result: dict[str, Any]) -> str:
    split, how = result["split"], ""
    if result["accounting"] == "sound":
        how = f", split rho = {split:.3f}" if split is not None else ", joint analysis"
    return (
        f"epsilon = {result['epsilon']:.4f} at delta = {result['delta']:g} ({result['accounting']} accounting{how}) "
        f"for noise std {result['noise_multiplier']:.4f} C on the released sum, sample_rate = "
        f"{result['sample_rate']:g}, steps = {result['steps']}; the same noise under the paper's formula: epsilon = "
        f"{result['epsilon_paper']:.4f}, under the sound accounting: {result['epsilon_sound']:.4f} "
        f"({result['accountant']} accountant)"
    )


SUBCOMMAND = Subcommand(
    name="privsgp-vr",
    help="PrivSGP-VR (Zhu et al. 2024): epsilon of the SAGA-corrected release (sound or paper accounting), or its "
    "noise",
    add_arguments=add_arguments,
    run=run,
    describe=describe,
)
