"""Stochastic Gradient Push (Assran, Loizou, Ballas, Rabbat, ICML 2019), Algorithm 1, for one node i: the
non-private baseline (``DecentralizedPushSumStrategy``; ``DecentralizedSGDStrategy`` is D-PSGD, Lian et al. 2017).

Per step k (the paper's line numbers; the strategy calls the pieces in this order):

    3     sample a batch, g_i = grad F_i(z_i^k)                     the user's training_step, at the de-biased z_i
    4     x_i^{k+1/2} = x_i^k - gamma g_i                           the user's optimizer, on the numerator x
    5-6   send (p^k_ji x_i^{k+1/2}, p^k_ji w_i^k) to out-neighbours j; receive from in-neighbours
    7     x_i^{k+1} = sum_j p^k_ij x_j^{k+1/2},  w_i^{k+1} = sum_j p^k_ij w_j^k
    8     z_i^{k+1} = x_i^{k+1} / w_i^{k+1}                          :func:`~.base.push_sum_gossip` (``mixing.py``)

Overlap SGP (Sec. 3, tau-overlap): lines 5-7 of round k are posted without waiting and mixed in tau steps later, so
the transfer runs during the next tau forward/backward passes (``staleness=tau``; ``mixing.py``). With
``push_sum_weight=False`` and doubly-stochastic weights the weight w stays 1: D-PSGD.
"""

from __future__ import annotations

from lightning_privdec.algorithms.base import push_sum_gossip


class SGPNode:
    """A non-private node: its gradient goes to the optimizer unchanged; it communicates by push-sum (lines 5-8)."""

    build_gossip = staticmethod(push_sum_gossip)
