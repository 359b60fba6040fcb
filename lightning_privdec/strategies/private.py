"""The private strategies' Lightning glue: local DP-SGD on each node, then the algorithm's gossip.

Each node Poisson-samples its own shard, clips per-sample gradients, adds its OWN noise and records the release in
its own ledger: the node's step of :mod:`lightning_privdec.algorithms.node`, which also holds the privacy policy.
This class adds what Lightning needs: the private loader, the decisions all nodes take together (start, stop at the
budget), the backward pass (:mod:`.precision`) and the checkpoint hooks. The gossip only sees privatized updates:
it is post-processing, so compression costs no privacy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.algorithms.node import RESUME_NOISE, WriteAheadPlace
from lightning_privdec.privacy import PrivacyConfigError, PrivacyParameters
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE, GRAD_SAMPLE_MODES
from lightning_privdec.privacy.write_ahead import WriteAheadLedger, new_run_id
from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.checks import gather_tensors
from lightning_privdec.strategies.precision import PrivatePrecision
from lightning_privdec.strategies.private_trainer import (
    backward_outside_step, check_one_loader, check_private_loader, check_private_training,
    ledger_directories, max_time_timer, on_every_node, plan_ends_with_this_step, time_left, trainer_planned_steps,
)


class PrivateDecentralizedStrategy(DecentralizedStrategy):
    """Base of the private strategies: a :class:`DecentralizedStrategy` whose gradients are privatized per node.

    Args:
        max_grad_norm: per-sample clipping bound C.
        noise_multiplier: sigma; or give ``target_epsilon`` and ``target_delta`` and sigma is calibrated before
            training from the planned steps (``max_steps``, or ``max_epochs`` x batches per epoch) and q = B / J.
        accountant: ``"rdp"`` (default) or ``"prv"`` (Opacus's sound accountants). ``"gdp"`` is refused when the
            strategy is built: a central-limit approximation never calibrates sigma or enforces the budget.
        grad_sample_mode: ``"bookkeeping"`` (default: the clipped sum in one backward pass), ``"hooks"`` or
            ``"functorch"`` (per-sample gradients materialised): ``training_step`` returns the mean loss; ``"ghost"``:
            it returns the per-example losses (``reduction="none"``). All clip alike; a probe checks before the first
            update that each example's loss depends on that example only (docs/privacy.md, "What per-example
            clipping requires").
        fix_model: replace layers incompatible with per-sample DP (BatchNorm -> GroupNorm) instead of raising.
        noise_seed: ``None`` (default, secure): noise and sampling from ChaCha20 streams keyed with OS entropy
            (:mod:`lightning_privdec.privacy.noise`); an int: reproducible and NOT private, for tests and debugging.
        secure_mode: Gaussian noise with Opacus's floating-point mitigation (Holohan and Braghin 2021), at 4x its cost.
        node_local_data: each process's loader holds only its node's data, all of it the shard (a DistributedSampler
            Lightning adds is ignored); otherwise a loader without a DistributedSampler is refused.
        ledger_dir: the write-ahead privacy ledger, on disk before each message leaves, so that a resumed run counts
            the steps released after its checkpoint: ``True`` (default): next to the checkpoints, else in the log
            directory (:class:`~lightning_privdec.algorithms.node.WriteAheadPlace`); a path; ``False``/``None``: off
            (unsafe for resumes). See docs/privacy.md, "Resuming after a crash".
        resume_noise: a resumed run whose longer plan needs more noise: ``"auto"`` (default) re-calibrates sigma but
            refuses over twice the old one; ``"recalibrate"`` accepts any; ``"keep"`` keeps the old sigma and stops at
            the budget (DP-CSGP, PrivSGP, DP2-SGD). See docs/privacy.md, "Resuming with a longer plan".
        Other arguments: see :class:`DecentralizedStrategy`.

    A NaN or infinite privatized gradient stops training on that node before the update leaves it (see
    :class:`DecentralizedStrategy`); the step stays in the ledger (its batch was sampled: counting it is safe).
    """

    shared_options = ("grad_sample_mode", "fix_model", "node_local_data", "secure_mode", "resume_noise")
    local_options = ("ledger_dir",)  # a per-node path
    stop_on_nonfinite_loss = False  # an empty Poisson batch has a NaN mean loss; its privatized gradient is checked

    def __init__(
        self, topology: Any = "exponential", compressor: Any = None, *,
        max_grad_norm: float, noise_multiplier: float | None = None,
        target_epsilon: float | None = None, target_delta: float | None = None, accountant: str = "rdp",
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE, fix_model: bool = False, noise_seed: int | None = None,
        secure_mode: bool = False, node_local_data: bool = False,
        ledger_dir: str | os.PathLike | bool | None = True, resume_noise: str = "auto", **kwargs: Any,
    ) -> None:
        # the privacy parameters are checked first, before any process or graph exists
        self.privacy_parameters = self.privacy_config(
            max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            target_delta=target_delta, accountant=accountant,
        )
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise PrivacyConfigError(
                f"unknown grad_sample_mode {grad_sample_mode!r}; choose 'bookkeeping' (default), 'hooks', "
                "'functorch' or 'ghost' (training_step then returns per-sample losses)"
            )
        if resume_noise not in RESUME_NOISE:
            raise PrivacyConfigError(
                f"resume_noise must be one of {', '.join(map(repr, RESUME_NOISE))}, got {resume_noise!r}"
            )
        super().__init__(topology, compressor, **kwargs)
        self.resume_noise, self.grad_sample_mode, self.fix_model = resume_noise, grad_sample_mode, fix_model
        self.noise_seed, self.secure_mode, self.node_local_data, self.ledger_dir = (
            noise_seed, secure_mode, node_local_data, ledger_dir)
        # made at the first setup, kept for the strategy's life (a second fit() keeps counting)
        self.privacy: PrivateNodeAlgorithm | None = None
        self.private_precision: PrivatePrecision | None = None
        self.ledger_place: WriteAheadPlace | None = None
        self.budget_stopped_at_step: int | None = None
        self.noise_changes: list[str] = []  # each re-plan of sigma, in words (repeated by the end-of-fit summary)

    def configure_node(self) -> None:
        # Fix and hook the model before its parameters are broadcast, flattened and handed to the optimizer.
        if self.privacy is None:
            self.privacy = self.make_node_algorithm()
            self.connect_node_algorithm(self.privacy)
            self.private_precision = PrivatePrecision(self.privacy, self.root_device)
            self.ledger_place = WriteAheadPlace(self.ledger_dir, self.global_rank, seeded=self.noise_seed is not None)
            self.ledger_place.run = self.broadcast(new_run_id())  # a new run: a new write-ahead ledger, all nodes
        privacy = self.privacy
        on_every_node(lambda: privacy.attach(self.model, fix_model=self.fix_model))  # e.g. BatchNorm: said once
        super().configure_node()

    def privacy_config(self, **arguments: Any) -> PrivacyParameters:
        """DP-SGD's parameters, validated once; a paper with another noise or budget overrides this."""
        return PrivacyParameters(**arguments).validate()

    def configuration(self) -> dict[str, Any]:
        configuration = super().configuration()
        for name, value in vars(self.privacy_parameters).items():
            configuration.setdefault(name, value)  # a subclass's own value of the same name (CPGT's) comes first
        # whether the noise is seeded (tests) or drawn from OS entropy; a seed's value may differ per node
        configuration["noise_seed"] = "fixed seed" if self.noise_seed is not None else "OS entropy"
        return configuration

    def node_algorithm(self) -> PrivateNodeAlgorithm:
        assert self.privacy is not None, "the node algorithm is made in configure_node"
        return self.privacy

    def connect_node_algorithm(self, node: PrivateNodeAlgorithm) -> None:
        """What the node needs from the other nodes before training (Decor: pairwise secrets); nothing by default."""

    node_algorithm_class: type[PrivateNodeAlgorithm] = DPCSGPNode  # the paper's (:mod:`lightning_privdec.algorithms`)

    def node_algorithm_options(self) -> dict[str, Any]:
        """The paper's own arguments of its node algorithm (its validated options object)."""
        options = getattr(self, "options", None)
        return {} if options is None else {"options": options}

    def make_node_algorithm(self) -> PrivateNodeAlgorithm:
        """This node's algorithm, with the paper's options and this node's rank, device, noise and per-sample mode."""
        return self.node_algorithm_class(
            self.privacy_parameters, **self.node_algorithm_options(), rank=self.global_rank, device=self.root_device,
            grad_sample_mode=self.grad_sample_mode, noise_seed=self.noise_seed, secure_mode=self.secure_mode,
        )

    def _check_optimization(self, trainer: pl.Trainer) -> None:
        super()._check_optimization(trainer)
        assert self.privacy is not None and self.flat is not None and self.private_precision is not None
        self.privacy.configure_optimizer(self.optimizers[0], self.flat.numel)
        check_private_training(trainer, type(self).__name__, self.privacy_parameters.max_grad_norm)
        self.private_precision.connect(self.precision_plugin)  # "16-true"/"bf16-true" refused (docs/privacy.md)

    # ---- data: Poisson sampling of this node's shard ---------------------------------------------------------------
    def check_plan(self) -> None:
        """A paper's own check of the planned noise before training (raise PrivacyConfigError to refuse); it runs
        inside the nodes' agreement, so one node's refusal stops every node."""

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or self.privacy is None:
            return dataloader
        dataloader = check_private_loader(dataloader)
        super().process_dataloader(dataloader)  # every node has data; the steps per epoch common to all nodes
        calibrated = self.privacy.target_epsilon is not None and self.privacy_parameters.noise_multiplier is None
        k = trainer.accumulate_grad_batches  # one Poisson batch of k x batch_size per step, as k micro-batches
        runner, steps_per_epoch = self.runner, self.steps_per_epoch
        assert runner is not None and steps_per_epoch is not None
        private, resumed_sigma = on_every_node(lambda: runner.plan(
            dataloader, trainer_planned_steps(trainer, steps_per_epoch // k), self.world_size,
            node_local_data=self.node_local_data, micro_batches=k, steps_per_epoch=steps_per_epoch,
            calibrated=calibrated, resume_noise=self.resume_noise, check=self.check_plan,
        ))
        if resumed_sigma is not None:
            self._noise_changed(resumed_sigma, f"this resumed run plans {self.privacy.planned_steps} steps in all, "
                                               "the checkpoint's plan fewer")
        if self.privacy.target_epsilon is not None:  # a later fit may have budget left (a longer plan)
            spent = self.reduce_boolean_decision(self.privacy.next_step_exceeds_budget(), all=False)
            if not spent:
                self.budget_stopped_at_step = None
            elif self.budget_stopped_at_step is None:  # resumed with the budget spent (steps released after the
                self.budget_stopped_at_step = trainer.global_step  # checkpoint count): no step is taken
                trainer.should_stop = True
                rank_zero_warn(runner.budget_spent_note(type(self).__name__))
            if calibrated and max_time_timer(trainer) is not None:  # max_time: sigma follows the time the run has
                note = runner.plan_time_limit()
                if note is not None:
                    rank_zero_info(f"{type(self).__name__}: {note}")
        return private

    def _noise_changed(self, old: float, why: str) -> None:
        """Say once that sigma changed from ``old``, and why; the end-of-fit summary repeats it."""
        change, message = self.runner.noise_change(type(self).__name__, old, why)  # type: ignore[union-attr]
        self.noise_changes.append(change)
        self.say_once(message)

    def on_train_start(self) -> None:
        super().on_train_start()
        check_one_loader(self.lightning_module.trainer)
        privacy = self.privacy  # the per-example probe on every node's shard
        assert privacy is not None
        on_every_node(lambda: privacy.check_examples(partial(self.user_backward, train=None)))
        privacy.before_first_step(self.user_backward)

    def user_backward(self, batch: Any, train: bool | None = True) -> bool:
        """The user's forward and backward outside a step (PrivSGP-VR's table; the probe: ``train=None``)."""
        assert self.private_precision is not None
        return backward_outside_step(self, batch, self.private_precision.backward_outside_step, train)

    # ---- the step ------------------------------------------------------------------------------------------------
    def step_refused(self) -> bool:
        """Every node refuses a step after their shared stop at the budget (``min_steps``): nothing is released."""
        if self.budget_stopped_at_step is not None:
            self.lightning_module.trainer.should_stop = True
        return self.budget_stopped_at_step is not None

    def after_step(self) -> None:
        """After each step all nodes decide together (one-bit all-reduce) whether one more step would take any node
        past ``target_epsilon``, and if so stop there; a plan ending with this step ends as planned, unannounced.
        Under ``max_time`` sigma is first re-planned for the steps the slowest node's pace allows."""
        trainer = self.lightning_module.trainer
        assert self.runner is not None and self.privacy is not None
        if self.runner.time_replan_due():
            replanned = self.runner.replan_for_time_limit(*time_left(trainer), slowest=lambda steps: int(self.reduce(
                torch.tensor(steps, device=self.root_device), reduce_op=dist.ReduceOp.MIN)))
            if replanned is not None:
                self._noise_changed(*replanned)
        if self.privacy.target_epsilon is None or plan_ends_with_this_step(trainer):
            return
        if self.reduce_boolean_decision(self.runner.next_step_exceeds_budget(), all=False):
            trainer.should_stop = True
            self.budget_stopped_at_step = trainer.global_step + 1
            rank_zero_info(self.runner.budget_stop_note(type(self).__name__, self.budget_stopped_at_step))

    def step_options(self) -> dict[str, Any]:
        """The node's write-ahead ledger, and under "16-mixed" the rescaling of the privatized gradient."""
        assert self.private_precision is not None and self.lightning_module is not None
        return {"write_ahead": self._write_ahead_ledger(),
                "after_privatize": self.private_precision.after_privatize(self.lightning_module.parameters())}

    def closure_result(self, loss: Any) -> Any:
        return loss if self.private_precision is None else self.private_precision.closure_result(loss)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Per-sample backward (:meth:`PrivatePrecision.backward`): each of the ``accumulate_grad_batches``
        micro-batches of a logical Poisson batch is clipped and kept; the step adds one noise draw to the sum."""
        if self.private_precision is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.private_precision.backward(closure_loss, self.lightning_module.trainer.accumulate_grad_batches,
                                        lambda loss: super(PrivateDecentralizedStrategy, self).backward(
                                            loss, optimizer, *args, **kwargs))
        return closure_loss

    def on_train_end(self) -> None:
        """Print every node's final epsilon and noise, with or without PrivacyBudgetCallback (one line per node; each
        line of a run with a fixed ``noise_seed`` says that it is not private)."""
        super().on_train_end()
        if self.privacy is None or self.runner is None or self.private_precision is None:
            return
        local = [self.privacy.epsilon(), float(self.privacy.steps)]
        per_node = gather_tensors(torch.tensor(local, dtype=torch.float64, device=self.root_device)).tolist()
        rank_zero_info(self.runner.final_summary(type(self).__name__, per_node, self.noise_changes))
        self.private_precision.report_overflows(type(self).__name__, self.global_rank)

    # ---- checkpoints and the write-ahead privacy ledger ------------------------------------------------------------
    def node_state_dict(self) -> dict[str, Any]:
        state = super().node_state_dict()
        assert self.privacy is not None and self.ledger_place is not None
        self.ledger_place.checkpoint_saved = True  # from now on a resume is possible: every later step is written
        state["privacy"] = self.privacy.state_dict()
        self._write_ahead_ledger()
        entry = self.ledger_place.checkpoint_entry()
        if entry is not None:  # the resumed run reads (and continues) this node's file of this run
            state["write_ahead"] = entry
        return state

    def load_node_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_node_state_dict(state)
        assert self.privacy is not None and self.ledger_place is not None
        self.privacy.load_state_dict(state["privacy"])
        self.ledger_place.resume(state.get("write_ahead"), self.privacy)  # steps after the checkpoint stay counted

    def output_directories(self) -> list[tuple[str, str | os.PathLike[str]]]:
        directories = super().output_directories()
        if self.ledger_dir not in (True, False, None):
            directories.append(("the write-ahead ledger directory (ledger_dir)", self.ledger_dir))
        return directories

    def _write_ahead_ledger(self) -> WriteAheadLedger | None:
        """This node's write-ahead ledger (``ledger_dir``), once it has a place."""
        place, trainer = self.ledger_place, self.lightning_module.trainer
        assert place is not None  # the directories are looked up once (the log directory is broadcast)
        return place.open(lambda: ledger_directories(trainer, place.checkpoint_saved))
