"""Non-private baselines: push-sum (Stochastic Gradient Push) and D-PSGD."""

from __future__ import annotations

from lightning_privdec.strategies.base import DecentralizedStrategy


class DecentralizedPushSumStrategy(DecentralizedStrategy):
    """Stochastic Gradient Push (Assran et al. 2019) over a directed, possibly time-varying graph.

    Column-stochastic mixing (each sender splits its mass uniformly over its out-neighbours and itself); the
    push-sum weight y de-biases the numerator, so directed graphs converge to the exact average. With a
    ``compressor``, messages are compressed with error feedback as in DP-CSGP's Algorithm 1, lines 1-7.

    ``overlap=True`` is SGP's overlap variant: each round's messages are sent without waiting, travel during the next
    ``staleness`` (tau, default 1) forward/backward passes and are mixed in tau steps late; the push-sum weight keeps
    the average exact (:mod:`lightning_privdec.algorithms.mixing`). Exact messages only (no ``compressor``).

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=4,
                            strategy=DecentralizedPushSumStrategy(topology="exponential-one-peer", overlap=True))
    """

    default_weights = "push-sum"
    required_mixing = "column"
    requires_symmetric_graph = False


class DecentralizedSGDStrategy(DecentralizedPushSumStrategy):
    """D-PSGD (Lian et al. 2017): symmetric doubly-stochastic gossip (Metropolis-Hastings weights), no push-sum weight.

    The classic baseline for undirected graphs; a directed graph is refused at setup.
    """

    supports_robust_clip = True  # its one message is the node's model
    default_weights = "metropolis"
    required_mixing = "doubly"
    requires_symmetric_graph = True

    def __init__(self, topology="ring", compressor=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(topology, compressor, **kwargs)
