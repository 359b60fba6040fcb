"""Empirical privacy audits: canaries in one training run give a lower bound on epsilon at a stated confidence.

``run_audit("dp_csgp", epsilon=2, canaries=1000)`` runs a private strategy on simulated nodes with gradient canaries
on node 0 and bounds, from node 0's messages, how much privacy the run really lost (Steinke, Nasr, Jagielski 2023);
a correct mechanism stays below its accountant's epsilon, a broken one (no noise, no clipping) does not. See
docs/audit.md and the ``privdec-audit`` command.
"""

from lightning_privdec.audit.canaries import AuditModel, CanaryDesign, audit_loss, node_dataset
from lightning_privdec.audit.observer import WireTap, cpgt_observations, push_sum_released
from lightning_privdec.audit.one_run import GuessOutcome, epsilon_lower_bound, guess, p_value, score_audit
from lightning_privdec.audit.runner import AUDITED_STRATEGIES, BREAKS, AuditReport, run_audit

__all__ = [
    "AUDITED_STRATEGIES",
    "BREAKS",
    "AuditModel",
    "AuditReport",
    "CanaryDesign",
    "GuessOutcome",
    "WireTap",
    "audit_loss",
    "cpgt_observations",
    "epsilon_lower_bound",
    "guess",
    "node_dataset",
    "p_value",
    "push_sum_released",
    "run_audit",
    "score_audit",
]
