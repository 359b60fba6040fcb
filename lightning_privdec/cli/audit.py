"""``privdec-audit``: an empirical lower bound on a private strategy's epsilon, next to the accountant's.

::

    privdec-audit --strategy dp_csgp --epsilon 2 --canaries 1000 --json     # honest: bound <= claimed epsilon
    privdec-audit --strategy dp_csgp --break noise                          # broken: bound > claimed epsilon
    privdec-audit --strategy all                                            # every private strategy, one table
    privdec-audit --clipping                                                # the clipping attack, every mode
    privdec-audit --break norm                                              # ... with a norm that under-estimates

Each audit runs the strategy on simulated nodes with m gradient canaries on node 0 (each included with probability
1/2), reads every message on the wire, and turns the auditor's guesses into the one-run bound of Steinke, Nasr and
Jagielski (2023) at ``--confidence``. ``--clipping`` adds the clipping attack (:mod:`lightning_privdec.audit.
sensitivity`): crafted examples against ||S(D) - S(D \\ x)|| <= C in every per-sample mode and precision; ``--break
norm`` runs it alone with the unguarded Gram norm, which it must catch. Exit status: 0 when every bound stays within its claimed epsilon, 1 when some
bound exceeds it (the run leaks more than its accountant says: expected for ``--break``), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from lightning_privdec.audit.runner import AUDITED_STRATEGIES, BREAKABLE, BREAKS, AuditReport, run_audit
from lightning_privdec.audit.sensitivity import ATTACKS, TOLERANCE, AttackResult, broken_norms, run_attacks
from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = ["build_parser", "main"]

PROG = "privdec-audit"
EXIT_VIOLATION, EXIT_USAGE = 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Audit a private strategy with canaries in one run: an empirical lower bound on epsilon "
        "(Steinke, Nasr, Jagielski 2023) next to the accountant's epsilon.",
    )
    parser.add_argument("--strategy", nargs="+", default=["dp_csgp"], metavar="NAME",
                        help=f"one or more of {', '.join(AUDITED_STRATEGIES)}, or 'all' (default: dp_csgp)")
    parser.add_argument("--epsilon", type=float, default=2.0, help="target epsilon the noise is calibrated to")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (CPGT is pure DP: delta = 0)")
    parser.add_argument("--canaries", type=int, default=1000, help="m, each included with probability 1/2")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (node 0 holds the canaries)")
    parser.add_argument("--steps", type=int, default=100, help="rounds of the run (the plan sigma is set for)")
    parser.add_argument("--sample-rate", type=float, default=None,
                        help="Poisson rate q = B / J (default 0.1; CPGT 1.0, full gradients)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD step size (CPGT's alpha)")
    parser.add_argument("--clip", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--canary-norm", type=float, default=500.0, help="gradient norm of every canary (>= C)")
    parser.add_argument("--examples", type=int, default=200, help="ordinary examples on node 0")
    parser.add_argument("--break", dest="broken", choices=(*BREAKS, "norm"), default=None,
                        help="a deliberately broken run: 'noise' switched off, or 'clipping' skipped (C x 1000 at "
                        "the same noise std); the claimed epsilon stays the honest configuration's; 'norm': the "
                        "clipping attack against per-example norms without their rounding bound")
    parser.add_argument("--attack", nargs="+", choices=tuple(ATTACKS), default=None, metavar="NAME",
                        help=f"the clipping attacks to run (default: all of {', '.join(ATTACKS)})")
    parser.add_argument("--clipping", action="store_true",
                        help="also run the clipping attack: crafted examples against ||S(D) - S(D without x)|| <= C "
                        "in every per-sample mode and precision")
    parser.add_argument("--attack-device", default="cpu", metavar="DEVICE",
                        help="where the clipping attack runs: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound")
    parser.add_argument("--guesses", type=int, nargs="+", default=None, metavar="R",
                        help="numbers of guesses r to try (Bonferroni-corrected; default 2%%..100%% of m)")
    parser.add_argument("--seed", type=int, default=0, help="canaries, data, noise and sampling streams")
    parser.add_argument("--strategy-kwargs", default="{}",
                        help='extra strategy arguments as JSON, e.g. \'{"rho_c": 4}\'')
    parser.add_argument("--json", action="store_true", help="print JSON (an object, or a list for several audits)")
    return parser


def _strategies(names: Sequence[str], broken: str | None) -> list[str]:
    """The strategies to audit; ``all`` means every one (every breakable one with ``--break``)."""
    if list(names) == ["all"]:
        return list(BREAKABLE if broken else AUDITED_STRATEGIES)
    unknown = [n for n in names if n not in AUDITED_STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(AUDITED_STRATEGIES)} or 'all'")
    fixed = [n for n in names if broken and n not in BREAKABLE]
    if fixed:
        raise ValueError(
            f"--break needs noise levels given explicitly, and {', '.join(fixed)} derives its own from the budget; "
            f"use one of {', '.join(BREAKABLE)}"
        )
    return list(names)


def _row(report: AuditReport) -> str:
    name = report.strategy + (f" (broken: {report.broken})" if report.broken else "")
    verdict = "ok" if report.consistent else "EXCEEDS CLAIM"
    return (f"{name:<30} {report.claimed_epsilon:>9.3f} {report.delta:>8.0e} {report.lower_bound:>8.3f} "
            f"{report.confidence:>5.0%} {report.canaries:>6d} {report.guesses:>6d} {report.correct:>6d} "
            f"{report.seconds:>6.1f}  {verdict}")


HEADER = (f"{'strategy':<30} {'claimed ε':>9} {'δ':>8} {'ε lower':>8} {'conf':>5} {'m':>6} {'r':>6} {'v':>6} "
          f"{'s':>6}  verdict")


def _clipping_rows(names: Sequence[str] | None, broken: bool, as_json: bool, device: str) -> list[AttackResult]:
    """The clipping attack's table (or nothing printed under ``--json``)."""
    with broken_norms() if broken else nullcontext():
        results = run_attacks(tuple(names) if names else None, device=device)
    if not as_json:
        print(f"\nclipping attack on {device}{' (broken: norm without its rounding bound)' if broken else ''}: largest "
              f"||S(D) - S(D \\ x)|| / C over the batch, allowed 1 + {TOLERANCE:g}")
        print(f"{'attack':<26} {'mode':<12} {'precision':<11} {'ratio':>12}  verdict")
        for r in results:
            print(f"{r.attack:<26} {r.mode:<12} {r.precision:<11} {r.ratio:>12.8f}  {'ok' if r.holds else 'EXCEEDS C'}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the audit builds hundreds of nodes: their set-up lines (per-sample mode, noise plan) would bury its tables
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        return _audit(args)
    finally:
        logger.setLevel(level)


def _audit(args: argparse.Namespace) -> int:
    if args.broken == "norm":
        attacks = _clipping_rows(args.attack, broken=True, as_json=args.json, device=args.attack_device)
        if args.json:
            print(json.dumps({"clipping_attack": [r.to_dict() for r in attacks]}, indent=2))
        return 0 if all(r.holds for r in attacks) else EXIT_VIOLATION
    try:
        names = _strategies(args.strategy, args.broken)
        extra: dict[str, Any] = json.loads(args.strategy_kwargs)
        if not isinstance(extra, dict):
            raise ValueError(f"--strategy-kwargs must be a JSON object, got {args.strategy_kwargs!r}")
        reports: list[AuditReport] = []
        for name in names:
            report = run_audit(
                name, epsilon=args.epsilon, delta=args.delta, canaries=args.canaries, nodes=args.nodes,
                steps=args.steps, sample_rate=args.sample_rate, lr=args.lr, clip=args.clip,
                canary_norm=args.canary_norm, examples=args.examples, broken=args.broken,
                confidence=args.confidence, seed=args.seed, guess_counts=args.guesses, strategy_kwargs=extra,
            )
            if not args.json:
                print(("" if reports else HEADER + "\n") + _row(report), flush=True)
            reports.append(report)
    except (ValueError, PrivacyConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    attacks = _clipping_rows(args.attack, broken=False, as_json=args.json, device=args.attack_device) if args.clipping else []
    if args.json:
        records = [r.to_dict() for r in reports]
        output: Any = records[0] if len(records) == 1 else records
        if attacks:
            output = {"audits": records, "clipping_attack": [r.to_dict() for r in attacks]}
        print(json.dumps(output, indent=2))
    return 0 if all(r.consistent for r in reports) and all(r.holds for r in attacks) else EXIT_VIOLATION


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
