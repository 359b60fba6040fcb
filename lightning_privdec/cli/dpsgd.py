"""``privdec-account dpsgd``: DP-SGD's epsilon for a noise multiplier, or the noise multiplier for an epsilon.

    privdec-account dpsgd --noise-multiplier 1.1 --sample-rate 0.01 --steps 1000 --delta 1e-5      # -> epsilon
    privdec-account dpsgd --target-epsilon 3 --sample-rate 0.01 --steps 1000 --delta 1e-5 --json  # -> sigma

The Poisson-subsampled Gaussian of DP-SGD (Abadi et al. 2016) under the RDP accountant (Mironov, Talwar, Zhang
2019) or PRV (Gopi et al. 2021); ``--accountant gdp`` also prints the central-limit GDP approximation (Dong et al.
2019) beside the RDP epsilon.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_privdec.cli.arguments import Subcommand, add_accountant, add_noise_or_budget, add_sampled_steps
from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    calibrate_noise_multiplier,
    epsilon_for,
)
from lightning_privdec.privacy.accounting.composition import gdp_epsilon_approximation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_noise_or_budget(
        parser,
        noise_help="sigma: noise std / max_grad_norm; prints the epsilon it gives",
        budget_help="budget epsilon; prints the smallest noise multiplier that meets it (within 1%%)",
    )
    add_sampled_steps(parser, "Poisson sampling rate q = B / J over the node's shard of J examples", steps_metavar="T")
    add_accountant(
        parser, (*ACCOUNTANTS, "gdp"),
        help="rdp (Mironov et al. 2019, default) or prv (Gopi et al. 2021); gdp: the rdp epsilon plus the central-limit "
        "GDP approximation (Dong et al. 2019) labelled as such (it can under-estimate epsilon, so it decides nothing)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
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


def describe(result: dict[str, Any]) -> str:
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


SUBCOMMAND = Subcommand(
    name="dpsgd",
    help="DP-SGD (Abadi et al. 2016): epsilon for a noise multiplier, or the noise multiplier for an epsilon",
    add_arguments=add_arguments,
    run=run,
    describe=describe,
)
