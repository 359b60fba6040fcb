"""``privdec-account dyn-d2p``: Dyn-D2P's noise schedule for a budget, with the paper's and the rigorous epsilon.

    privdec-account dyn-d2p --target-epsilon 1 --delta 1e-5 --steps 330 --sample-rate 0.095 \\
        --rho-c 2 --rho-mu 2 --clip 1 [--variant dyn] [--calibration rigorous|paper] [--accountant rdp|prv] --json

Dyn-D2P (Zhu et al.), Sec. 4: mu_tot from (epsilon, delta) by eq. (4), mu_0 by eq. (8) (eq. (9) for a constant mu),
then C_k = C_0 rho_c^(-k/K), mu_k = mu_0 rho_mu^(k/K), sigma_k = C_k / mu_k; the epsilon of that schedule by the
paper's central-limit composition and by a rigorous accountant (RDP or PRV).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning_privdec.cli.arguments import (
    PROG,
    Subcommand,
    add_accountant,
    open_probability,
    positive_float,
    positive_int,
    probability,
)
from lightning_privdec.privacy.accounting.schedule import CALIBRATIONS, VARIANTS, calibrate_schedule, gdp_mu_from_dp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-epsilon", type=positive_float, required=True, metavar="E", help="budget epsilon")
    parser.add_argument("--delta", type=open_probability, required=True, metavar="D", help="budget delta")
    parser.add_argument("--steps", type=positive_int, required=True, metavar="K", help="planned steps K")
    parser.add_argument(
        "--sample-rate", type=probability, required=True, metavar="Q",
        help="Poisson rate q = B / J on the node's shard (the paper's 1/J)",
    )
    parser.add_argument("--clip", type=positive_float, required=True, metavar="C0", help="initial clip C_0")
    parser.add_argument("--rho-c", type=float, default=2.0, metavar="RC", help="clip decay factor (>= 1, default 2)")
    parser.add_argument("--rho-mu", type=float, default=2.0, metavar="RM", help="mu growth factor (>= 1, default 2)")
    parser.add_argument("--variant", choices=VARIANTS, default="dyn", help="dyn (default), dyn_c, dyn_mu or const")
    parser.add_argument(
        "--calibration", choices=CALIBRATIONS, default="rigorous",
        help="rigorous (mu_0 such that the rigorous accountant spends the target; default) or paper (eqs. 4, 8, 9)",
    )
    add_accountant(parser, ("rdp", "prv"), help="rigorous accountant (default rdp)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    schedule = calibrate_schedule(
        args.target_epsilon, args.delta, args.steps, args.sample_rate, args.clip, rho_c=args.rho_c,
        rho_mu=args.rho_mu, variant=args.variant, calibration=args.calibration, accountant=args.accountant,
    )
    summary = schedule.summary(args.delta, args.accountant)
    result = {
        "target_epsilon": args.target_epsilon,
        "delta": args.delta,
        "steps": args.steps,
        "sample_rate": args.sample_rate,
        "clip": args.clip,
        "variant": args.variant,
        "calibration": args.calibration,
        "accountant": args.accountant,
        "rho_c": summary["rho_c"],
        "rho_mu": summary["rho_mu"],
        "mu_tot": gdp_mu_from_dp(args.target_epsilon, args.delta),
        "mu0": summary["mu0"],
        "mu_last": summary["mu_last"],
        "clip_first": summary["clip_first"],
        "clip_last": summary["clip_last"],
        "sigma_first": summary["sigma_first"],
        "sigma_last": summary["sigma_last"],
        "mu_clt": summary["mu_clt"],
        "epsilon_paper_clt": summary["epsilon_paper_clt"],
        "epsilon_rigorous": summary["epsilon_rigorous"],
    }
    if result["epsilon_paper_clt"] < result["epsilon_rigorous"]:
        print(
            f"{PROG}: note: the paper's CLT epsilon ({result['epsilon_paper_clt']:.4f}) is below the "
            f"rigorous {args.accountant} epsilon ({result['epsilon_rigorous']:.4f}) of this schedule: the CLT "
            "approximation under-states the privacy loss here",
            file=sys.stderr,
        )
    return result


def describe(result: dict[str, Any]) -> str:
    return (
        f"Dyn-D2P {result['variant']} ({result['calibration']} calibration) for epsilon = {result['target_epsilon']:g} "
        f"at delta = {result['delta']:g}, {result['steps']} steps, q = {result['sample_rate']:g}: mu_tot = "
        f"{result['mu_tot']:.4f} (eq. 4), mu_0 = {result['mu0']:.4f}, clip {result['clip_first']:.4g} -> "
        f"{result['clip_last']:.4g}, sigma {result['sigma_first']:.4g} -> {result['sigma_last']:.4g}; "
        f"epsilon = {result['epsilon_rigorous']:.4f} ({result['accountant']} accountant), "
        f"{result['epsilon_paper_clt']:.4f} (paper, CLT approximation)"
    )


SUBCOMMAND = Subcommand(
    name="dyn-d2p",
    help="Dyn-D2P (Zhu et al.): the clip/noise schedule for a budget, its paper (CLT approximation) epsilon and its "
    "rigorous epsilon",
    add_arguments=add_arguments,
    run=run,
    describe=describe,
)
