"""The consensus step gamma of compressed gossip, chosen from the compressor and the graph (``consensus_step="auto"``).

CHOCO-SGD (Koloskova, Stich, Jaggi 2019, Theorem 2) proves that compressed gossip with error feedback converges
linearly for

    gamma* = rho^2 delta / (16 rho + rho^2 + 4 beta^2 + 2 rho beta^2 - 8 rho delta)

where delta is the compression quality, E||Q(x) - x||^2 <= (1 - delta) ||x||^2, i.e. delta = 1 - omega^2 in this
code base's convention (:meth:`Compressor.omega2`, DP-CSGP's Assumption 4: a contraction, so no 1/(1 + omega)
rescaling), rho is the spectral gap of the mixing matrix and beta = ||I - A||_2.

That value is a worst-case rate bound and far too small in practice (0.016 for RandK(0.5) on the 4-node exponential
graph, where gamma = 0.5 trains well), and its rho^2 makes it vanish on slowly mixing graphs, where the measured
stability limit hardly moves. Measured with the gossip alone (docs/compression.md, "The consensus step"), the largest
stable gamma is set by delta and beta: about delta to 2 delta for RandK, 2 to 3 delta for TopK, 1 for QSGD(8), on
exponential, one-peer exponential and directed-ring graphs of 4 and 8 nodes alike. So the automatic choice evaluates
the formula at rho = 1 and scales it by a calibration factor of 10:

    gamma_auto = min(1, 10 delta / (17 + 6 beta^2 - 8 delta)),   beta = max_k ||I - A(k)||_2,

which lands at about a quarter of the measured stability limit of every compressor x graph pair measured (RandK(0.5):
0.25; RandK(0.1), TopK(0.1): 0.044; QSGD(8) on a small model: 0.4-0.6), where consensus is still fast. Exact gossip
(no compressor, or :class:`Identity`) uses gamma = 1. A compressor whose guaranteed quality gives gamma_auto below
1e-3 (scaled sign: delta = 1/d) is refused: at such a step the nodes would hardly mix, and no step we measured made
sign compression reach consensus; an explicit ``consensus_step`` still runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_privdec.compression import Compressor, Identity
from lightning_privdec.topology import Topology

__all__ = ["CALIBRATION", "SMALLEST_AUTO_STEP", "ConsensusStep", "check_consensus_step", "choco_step", "choose_consensus_step"]

#: factor between the automatic gamma and CHOCO-SGD's gamma* at rho = 1 (see the module docstring)
CALIBRATION = 10.0
#: below this the automatic step refuses the compressor (the nodes would hardly mix)
SMALLEST_AUTO_STEP = 1e-3


def check_consensus_step(consensus_step: float | str) -> float | str:
    """``"auto"``, or a number in (0, 1] as a float; raises ValueError otherwise."""
    if consensus_step == "auto":
        return "auto"
    if isinstance(consensus_step, bool) or not isinstance(consensus_step, (int, float)) or not 0.0 < consensus_step <= 1.0:
        raise ValueError(f"consensus_step (gamma) must be 'auto' or a number in (0, 1]; got {consensus_step!r}")
    return float(consensus_step)


def choco_step(delta: float, beta: float, rho: float = 1.0) -> float:
    """CHOCO-SGD's gamma* (Koloskova et al. 2019, Theorem 2) for compression quality delta, ||I - A||_2 = beta and
    spectral gap rho."""
    return rho * rho * delta / (16 * rho + rho * rho + 4 * beta * beta + 2 * rho * beta * beta - 8 * rho * delta)


@dataclass(frozen=True)
class ConsensusStep:
    """The chosen gamma and what it was chosen from."""

    gamma: float
    omega2: float
    beta: float
    theory: float  # CHOCO-SGD's gamma* at the graph's own spectral gap, for reference

    def describe(self, compressor: Compressor, topology: Topology) -> str:
        return (
            f"consensus_step='auto' chose gamma = {self.gamma:.3g} for {compressor} (omega^2 = {self.omega2:.3g}) on "
            f"{topology.name!r} ({topology.num_nodes} node{'s' if topology.num_nodes != 1 else ''}, "
            f"||I - A||_2 = {self.beta:.3g}): CHOCO-SGD's step at "
            f"rho = 1 x {CALIBRATION:g} (its worst-case value here: {self.theory:.2g}); pass consensus_step=<number> "
            "to override"
        )


def choose_consensus_step(compressor: Compressor | None, topology: Topology, dimension: int) -> ConsensusStep:
    """gamma_auto for ``compressor`` on a ``dimension``-vector gossiped over ``topology`` (module docstring)."""
    if compressor is None or isinstance(compressor, Identity):
        return ConsensusStep(gamma=1.0, omega2=0.0, beta=float("nan"), theory=1.0)
    omega2 = float(compressor.omega2(dimension))
    delta = 1.0 - omega2
    n = topology.num_nodes
    beta = max(float(np.linalg.norm(np.eye(n) - topology.mixing_matrix(k), ord=2)) for k in range(topology.period))
    rho = 1.0 - topology.consensus_rate() ** (1.0 / topology.period)  # per round
    gamma = min(1.0, CALIBRATION * choco_step(delta, beta))
    if gamma < SMALLEST_AUTO_STEP:
        raise ValueError(
            f"consensus_step='auto' finds no useful step for {compressor} on a {dimension}-parameter model: its "
            f"guaranteed quality 1 - omega^2 = {delta:.2g} gives gamma = {gamma:.2g}, at which the nodes would hardly "
            "mix (docs/compression.md, 'The consensus step'). Use a compressor that keeps more (RandK, TopK, QSGD), "
            "or pass consensus_step=<number> to run it anyway."
        )
    return ConsensusStep(gamma=gamma, omega2=omega2, beta=beta, theory=choco_step(delta, beta, rho))
