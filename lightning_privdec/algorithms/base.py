"""What every paper's algorithm file implements, and the private node's lifecycle written once.

A strategy drives one :class:`NodeAlgorithm` per node, once per optimizer step (``strategies/base.py``):

    closure (forward, backward at the node's model)  ->  release = next_release()  ->  privatize()  (clip, noise:
    the paper's direction)  ->  accountant.record(release)  ->  write-ahead ledger  ->  the user's optimizer
    updates x  ->  gossip.step(x)  (communicate)  ->  gossip.debias_into(params)  (the node's model)

That step is written once, in :mod:`.node` (:class:`~.node.NodeRunner`), for the Trainer's strategies and the
simulator alike; a paper's :meth:`~PrivateNodeAlgorithm.privatize` records nothing.

A paper's file (``dp_csgp.py``, ``dyn_d2p.py``, ...) supplies :meth:`NodeAlgorithm.build_gossip` (its mixing) and,
when private, subclasses :class:`PrivateNodeAlgorithm` with :meth:`~PrivateNodeAlgorithm.make_accountant`,
:meth:`~PrivateNodeAlgorithm.plan_noise`, :meth:`~PrivateNodeAlgorithm.next_release` and
:meth:`~PrivateNodeAlgorithm.privatize`. The lifecycle around them - the budget check, the plan for the steps left,
checkpoints that never roll back, the write-ahead state - is :class:`PrivateNodeAlgorithm`'s, for every paper.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_privdec.algorithms.mixing import PushSumGossip
from lightning_privdec.comm import Exchange
from lightning_privdec.compression import Compressor
from lightning_privdec.privacy.accounting import Accountant
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.local_dp import (
    GaussianMechanism,
    PerSampleClipping,
    ShardSampler,
)
from lightning_privdec.privacy.noise import seed_caveat
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.privacy.validation import check_positive
from lightning_privdec.privacy.write_ahead import strip_generators
from lightning_privdec.topology import Topology


class Gossip(Protocol):
    """How a node communicates (``step``) and which model it holds (``debias_into``): the mixing of its paper."""

    x: Tensor
    round: int

    def step(self, x_half: Tensor) -> None: ...

    def debias_into(self, out: Tensor) -> None: ...

    def debias_is_identity(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class NodeAlgorithm(Protocol):
    """One node of a paper's Algorithm 1 on flat tensors: its mixing, and (private ones) its release per step."""

    def build_gossip(
        self, x0: Tensor, *, rank: int, topology: Topology, exchange: Exchange, compressor: Compressor | None,
        push_sum_weight: bool, seed: int, consensus_step: float | str, staleness: int,
    ) -> Gossip: ...


def push_sum_gossip(
    x0: Tensor, *, rank: int, topology: Topology, exchange: Exchange, compressor: Compressor | None,
    push_sum_weight: bool, seed: int, consensus_step: float | str, staleness: int,
) -> PushSumGossip:
    """The push-sum mixing most papers share (exact, overlapped or compressed; D-PSGD without the weight)."""
    return PushSumGossip(
        x0, rank=rank, topology=topology, exchange=exchange, compressor=compressor, push_sum_weight=push_sum_weight,
        reference=x0, seed=seed, consensus_step=consensus_step, staleness=staleness,
    )


class PrivateNodeAlgorithm(ABC):
    """A private node: the local DP-SGD pieces its paper uses, one accountant, and the lifecycle.

    Every node holds a :class:`~lightning_privdec.privacy.local_dp.ShardSampler` (:attr:`sampler`) and a
    :class:`~lightning_privdec.privacy.local_dp.PerSampleClipping` (:attr:`clipping`); a paper whose noise is
    Gaussian makes its :class:`~lightning_privdec.privacy.local_dp.GaussianMechanism` (:attr:`gaussian`) itself.

    Args:
        parameters: the user's privacy parameters (validated when the strategy was built).
        rank: this node's id (keys its own noise and sampling streams).
        device: where the noise is drawn (the model's device).
        grad_sample_mode: how per-sample gradients are computed (:class:`~lightning_privdec.privacy.local_dp.
            PerSampleClipping`).
        noise_seed: ``None`` (default) keys noise and sampling with 256 bits of OS entropy each; an int makes them
            reproducible (tests only, NOT private: whoever knows the seed knows the noise).
        secure_mode: Gaussian noise with Opacus's floating-point mitigation.
    """

    #: whether sigma is one planned number (then a strategy may keep it, or re-plan it for the steps a time limit
    #: allows, with :meth:`calibrate_remaining`)
    fixed_noise_multiplier: bool = False
    #: relative slack of the budget check (a scale calibrated in closed form spends the target up to float rounding)
    budget_tolerance: float = 0.0

    def __init__(
        self, parameters: PrivacyParameters, *, rank: int, device: torch.device | str = "cpu",
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE, noise_seed: int | None = None, secure_mode: bool = False,
    ) -> None:
        self.parameters = parameters
        self.rank, self.device, self.noise_seed, self.secure_mode = rank, device, noise_seed, secure_mode
        self.sampler = ShardSampler(rank=rank, noise_seed=noise_seed)
        self.clipping = PerSampleClipping(parameters.max_grad_norm, grad_sample_mode)
        self.gaussian: GaussianMechanism | None = None
        self.noise_multiplier: float | None = None
        self.last_step: DPStepStats | None = None
        self.ledger: Accountant = self.make_accountant()
        self.planned_steps: int | None = None
        # (release, ledger steps when counted, further steps with that release that fit the target)
        self._certified: tuple[Any, int, int] | None = None

    def gaussian_mechanism(self) -> GaussianMechanism:
        """This node's Gaussian noise stream (for the papers whose noise is Gaussian)."""
        return GaussianMechanism(rank=self.rank, device=self.device, noise_seed=self.noise_seed,
                                 secure_mode=self.secure_mode)

    build_gossip = staticmethod(push_sum_gossip)

    # ---- what each paper supplies --------------------------------------------------------------------------------
    @abstractmethod
    def make_accountant(self) -> Accountant:
        """This node's accountant (its mechanism's)."""

    @abstractmethod
    def plan_noise(self, planned_steps: int) -> None:
        """Fix the noise for a plan of ``planned_steps`` steps in all (the ledger may hold steps of earlier fits)."""

    @abstractmethod
    def next_release(self) -> Any:
        """What the next step will release: an instance of the accountant's
        :attr:`~lightning_privdec.privacy.accounting.Accountant.release_type` (None: not planned yet)."""

    @abstractmethod
    def privatize(self) -> DPStepStats:
        """The paper's private step on this node's gradients (into ``p.grad``). It records nothing: the node's step
        (:func:`~.node.private_step`) records :meth:`next_release`, taken before this call, in :attr:`ledger`."""

    @abstractmethod
    def noise_summary(self) -> str:
        """The noise this node adds and how it is accounted, in one line (printed at the end of every fit)."""

    # ---- hooks a paper may use (no-ops by default) ----------------------------------------------------------------
    def configure_optimizer(self, optimizer: torch.optim.Optimizer, dimension: int) -> None:
        """See the user's optimizer and the model's size d before training (CPGT's step size and Laplace norm)."""

    def before_first_step(self, backward: Callable[[Any], bool]) -> None:
        """Work at the starting parameters before the first step; ``backward(batch)`` runs the user's forward and
        backward on a batch and says whether it did (PrivSGP-VR fills its SAGA table here)."""

    # ---- the lifecycle -------------------------------------------------------------------------------------------
    def private_dataloader(
        self,
        dataloader: DataLoader,
        planned_steps: int,
        world_size: int = 1,
        node_local_data: bool = False,
        micro_batches: int = 1,
        steps_per_epoch: int | None = None,
    ) -> DataLoader:
        """Poisson sampling of this node's shard (:meth:`ShardSampler.sample`), then the noise plan."""
        private = self.sampler.sample(dataloader, world_size, node_local_data, micro_batches, steps_per_epoch)
        self.plan_noise(planned_steps)
        self.planned_steps = planned_steps
        self._certified = None
        return private

    def attach(self, module: nn.Module, fix_model: bool = False) -> None:
        """The node's model: validated (or fixed) for per-sample clipping, which hooks into it."""
        self.clipping.attach(module, fix_model)

    def check_examples(self, backward: Callable[[Any], Any]) -> str | None:
        """Before the first step (once): the probe that per-sample gradients are per example
        (:meth:`PerSampleClipping.check_examples`), on 2 to 64 examples of the shard (the expected micro-batch
        size). None: no per-example clipping to check (Decor's user level)."""
        sampler = self.sampler
        if sampler.examples is None:
            return self.clipping.examples_checked
        size = round((sampler.expected_batch_size or 2) / sampler.micro_batches)
        return self.clipping.check_examples(backward, sampler.examples, min(64, max(2, size)))

    @property
    def sample_rate(self) -> float | None:
        """q, the Poisson rate of this node's shard (None before :meth:`private_dataloader`; set by hand only for a
        node stepped without a loader, as in benchmarks)."""
        return self.sampler.sample_rate

    @sample_rate.setter
    def sample_rate(self, value: float) -> None:
        self.sampler.sample_rate = value

    @property
    def expected_batch_size(self) -> float | None:
        """qJ, the expected batch size that a step's clipped sum is divided by."""
        return self.sampler.expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: float) -> None:
        self.sampler.expected_batch_size = check_positive(value, "expected_batch_size")

    @property
    def expected_micro_batch_size(self) -> float | None:
        """The expected size of one backward pass's batch: qJ over the micro-batches of a logical step."""
        expected = self.sampler.expected_batch_size
        return expected / self.sampler.micro_batches if expected else None

    @property
    def privacy_caveat(self) -> str:
        """What every line stating this node's privacy ends with: the fixed-seed caveat, or nothing."""
        return seed_caveat(self.noise_seed)

    @property
    def delta(self) -> float:
        return self.parameters.delta_for_reporting

    @property
    def target_epsilon(self) -> float | None:
        """The budget the node stops before exceeding (None: no budget)."""
        return self.parameters.target_epsilon

    @property
    def steps(self) -> int:
        """Private steps this node has taken (all fits and resumes together)."""
        return self.ledger.steps

    def epsilon(self) -> float:
        """Epsilon this node's data has spent so far (at :attr:`delta`), from its accountant."""
        return self.ledger.epsilon()

    def next_step_exceeds_budget(self) -> bool:
        """Whether one more step would take this node past ``target_epsilon`` (False without a target).

        Runs after every step, so it does not recompute the accountant each time: for the next release it finds once
        how many more such steps fit (:meth:`Accountant.steps_within`) and then only counts; the count is redone
        whenever the release or the ledger change otherwise.
        """
        target, release = self.target_epsilon, self.next_release()
        if target is None or release is None:
            return False
        certified = self._certified
        if certified is None or certified[0] != release or self.ledger.steps < certified[1]:
            limit = target * (1.0 + self.budget_tolerance)
            certified = self._certified = (release, self.ledger.steps, self.ledger.steps_within(limit, release))
        _, base, fitting = certified
        return self.ledger.steps - base + 1 > fitting

    def step_metrics(self) -> dict[str, float]:
        """This node's noise and sampling now (logged by the budget callback as ``privacy/<key>``)."""
        return {
            "noise_multiplier": float(self.noise_multiplier or 0.0),
            "sample_rate": float(self.sample_rate or 0.0),
            "steps": float(self.steps),
        }

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def plan_state(self) -> dict[str, Any]:
        """The noise plan a checkpoint keeps beside the ledger (plain types)."""
        return {"noise_multiplier": self.noise_multiplier}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        self.noise_multiplier = state["noise_multiplier"]

    def state_dict(self) -> dict[str, Any]:
        """The ledger and the plan. Generator states only with a fixed ``noise_seed`` (tests): a secure generator's
        key is never written anywhere (a resumed secure run draws a fresh key from OS entropy). ``steps`` beside the
        ledger is for readers of the checkpoint (every paper's node state has always had it); loading ignores it."""
        return {"steps": self.steps, "ledger": self.ledger.state_dict(), **self.plan_state(), **self.generator_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a checkpointed ledger and plan. Never rolls back (:meth:`Accountant.load_state_dict`)."""
        self.ledger.load_state_dict(state["ledger"], owner=f"node {self.rank}")
        self._certified = None
        self.load_plan_state(state)
        self.load_generator_state(state)

    def accounting_state(self) -> dict[str, Any]:
        """:meth:`state_dict` without generator states: what the write-ahead ledger writes before each release
        (:mod:`lightning_privdec.privacy.write_ahead`)."""
        return strip_generators(self.state_dict())

    def generator_state(self) -> dict[str, Any]:
        """The noise and sampling streams' states, only with a fixed ``noise_seed`` (tests)."""
        if self.noise_seed is None:
            return {}
        state = {"sampling_generator": self.sampler.generator.get_state()}
        if self.gaussian is not None:
            state["noise_generator"] = self.gaussian.generator.get_state()
        return state

    def load_generator_state(self, state: Mapping[str, Any]) -> None:
        if self.noise_seed is None:
            return
        if "sampling_generator" in state:
            self.sampler.generator.set_state(state["sampling_generator"])
        if self.gaussian is not None and "noise_generator" in state:
            self.gaussian.generator.set_state(state["noise_generator"])

    def load_accounting_state(self, state: Mapping[str, Any]) -> None:
        """Take a later accounting state of the same run (the write-ahead ledger's): ledger and plan. The model, the
        generators and the gossip keep the checkpoint's state."""
        self.load_state_dict(strip_generators(state))
