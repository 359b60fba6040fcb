"""The private step shared by every private strategy: local DP-SGD on each node, then the algorithm's gossip.

Each node Poisson-samples its own shard at q = B / J, clips per-sample gradients to C, adds its OWN Gaussian noise
N(0, sigma^2 C^2 I), divides by qJ, and records the step in its own ledger: the node's step of
:mod:`lightning_privdec.algorithms.node`, with this node's write-ahead ledger. The gossip that follows only sees
privatized updates, so it is post-processing: compression costs no privacy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from lightning_privdec.privacy import PrivacyConfigError, PrivacyParameters
from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.algorithms.node import RESUME_NOISE
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE, GRAD_SAMPLE_MODES, mean_loss_multiplier
from lightning_privdec.privacy.write_ahead import WriteAheadLedger, new_run_id
from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.checks import gather_from_nodes, gather_tensors, raised_on_every_node

log = logging.getLogger("lightning.pytorch")  # Lightning's console handler; used for each node's own lines

#: steps timed before sigma is re-planned for ``Trainer(max_time=...)``
MAX_TIME_WARMUP_STEPS = 5


def _stop_every_node_on(problem: PrivacyConfigError | None) -> None:
    """One node's configuration error stops every node here, instead of leaving the others waiting for it (every
    node calls this at the same point); rank 0 prints the first failing node's message, the others stay quiet."""
    failed = [(r, m) for r, m in enumerate(gather_from_nodes(problem and str(problem))) if m is not None]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if problem is not None:
        raise raised_on_every_node(problem, rank)
    if failed:
        error = PrivacyConfigError(f"node {failed[0][0]} cannot train privately, so no node starts: {failed[0][1]}")
        raise raised_on_every_node(error, rank)


def _max_time_timer(trainer: pl.Trainer) -> Timer | None:
    """The Timer that ``Trainer(max_time=...)`` installs, if any."""
    return next((c for c in trainer.callbacks if isinstance(c, Timer) and c._duration is not None), None)


class PrivateDecentralizedStrategy(DecentralizedStrategy):
    """Base of the private strategies: a :class:`DecentralizedStrategy` whose gradients are privatized per node.

    Args:
        max_grad_norm: per-sample clipping bound C.
        noise_multiplier: sigma; or give ``target_epsilon`` and ``target_delta`` and sigma is calibrated before
            training from the planned steps (``max_steps``, or ``max_epochs`` x batches per epoch) and q = B / J.
        accountant: ``"rdp"`` (default) or ``"prv"`` (Opacus's sound accountants). ``"gdp"`` is refused when the
            strategy is built: a central-limit approximation never calibrates sigma or enforces the budget.
        grad_sample_mode: ``"bookkeeping"`` (default: one backward pass, the clipped sum without per-sample
            gradients in memory), ``"hooks"`` or ``"functorch"`` (per-sample gradients materialised): ``training_step``
            returns the batch mean of per-example losses; or ``"ghost"``: ghost clipping, for which ``training_step``
            returns the per-example losses (``reduction="none"``, shape ``(batch,)``). All clip the same way. Every
            layer must see the examples along dimension 0 and each example's loss depend on that example only; a
            probe checks both before the first update (docs/privacy.md, "What per-example clipping requires").
        fix_model: replace layers incompatible with per-sample DP (BatchNorm -> GroupNorm) instead of raising.
        noise_seed: ``None`` (default, secure): noise and Poisson sampling from ChaCha20 streams keyed with 256 bits
            of OS entropy per node and run (:mod:`lightning_privdec.privacy.noise`); an int: reproducible streams
            derived from (seed, rank), NOT private (whoever knows the seed knows the noise): for tests and debugging.
        secure_mode: Gaussian noise with Opacus's floating-point mitigation (each coordinate the sum of four draws,
            halved; Holohan and Braghin 2021): mitigates the floating-point attacks on the sampler at 4x its cost.
        node_local_data: each process's training loader already holds only that node's data (no
            DistributedSampler); otherwise a missing sampler is refused, as every node would sample every example.
        ledger_dir: the write-ahead privacy ledger (:mod:`lightning_privdec.privacy.write_ahead`): before a step's
            message leaves a node, the node's accounting state is written to ``<ledger_dir>/<run id>/node_<rank>.pt``,
            so that a run resumed after a crash still counts the steps released after its checkpoint. ``True``
            (default): next to the checkpoints (``<ModelCheckpoint.dirpath>/privacy_ledger``), else in the logger's
            directory (``<trainer.log_dir>/privacy_ledger``); a run with neither writes nothing until a checkpoint of
            it is saved by hand (then ``<default_root_dir>/privacy_ledger``). A resumed run uses the directory its
            checkpoint names. A path: there. ``False``/``None``: off (unsafe for resumes: steps released after
            the last checkpoint are then not counted). Runs with a fixed ``noise_seed`` write none (a replayed step
            redraws the checkpointed noise and batch).
        resume_noise: what a run resumed with a longer (or otherwise changed) plan does when the budget left needs
            more noise: ``"auto"`` (default) re-calibrates sigma for the remaining steps but refuses, before the first
            resumed step, when the new sigma is more than twice the old one (the remaining budget would be spent on
            a model the noise destroys); ``"recalibrate"`` accepts the new sigma whatever it is; ``"keep"`` keeps the
            checkpoint's sigma and stops training when the budget is spent (fixed-sigma algorithms: DP-CSGP, PrivSGP,
            DP2-SGD).
        Other arguments: see :class:`DecentralizedStrategy`.

    A NaN or infinite privatized gradient stops training on that node before the update leaves it (see
    :class:`DecentralizedStrategy`); the step stays in the ledger (its batch was sampled: counting it is safe).
    """

    shared_options = ("grad_sample_mode", "fix_model", "node_local_data", "secure_mode", "resume_noise")
    local_options = ("ledger_dir",)  # a per-node path
    stop_on_nonfinite_loss = False  # an empty Poisson batch has a NaN mean loss; its privatized gradient is checked

    def __init__(
        self,
        topology: Any = "exponential",
        compressor: Any = None,
        *,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        accountant: str = "rdp",
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
        fix_model: bool = False,
        noise_seed: int | None = None,
        secure_mode: bool = False,
        node_local_data: bool = False,
        ledger_dir: str | os.PathLike | bool | None = True,
        resume_noise: str = "auto",
        **kwargs: Any,
    ) -> None:
        # the privacy parameters are checked first, before any process or graph exists
        self.privacy_parameters = self.privacy_config(
            max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
            target_delta=target_delta, accountant=accountant,
        )
        self.nonfinite_examples = 0  # "16-mixed": examples whose overflowed per-example gradient parts were zeroed
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
        self.resume_noise = resume_noise
        self.grad_sample_mode = grad_sample_mode
        self.fix_model = fix_model
        self.noise_seed = noise_seed
        self.secure_mode = secure_mode
        self.node_local_data = node_local_data
        self.privacy: PrivateNodeAlgorithm | None = None
        self.budget_stopped_at_step: int | None = None
        self.ledger_dir = ledger_dir
        self.write_ahead: WriteAheadLedger | None = None
        self._ledger_run: str | None = None
        self._checkpoint_saved = False
        self._time_replan_at: int | None = None  # ledger step at which sigma is re-planned for max_time
        self._fit_start_steps = 0
        self.noise_changes: list[str] = []  # each re-plan of sigma, in words (repeated by the end-of-fit summary)

    def privacy_config(self, **arguments: Any) -> PrivacyParameters:
        """The paper's privacy parameters from the strategy's arguments, validated once: here DP-SGD's (a noise
        multiplier, or a budget to calibrate it to); a paper whose noise or budget has another shape overrides this
        and keeps the rest in its options object."""
        return PrivacyParameters(**arguments).validate()

    def configure_ddp(self) -> None:
        # Fix and hook the model before its parameters are broadcast, flattened and handed to the optimizer. The node's
        # privacy (and its ledger) lives as long as the strategy: a second fit() keeps counting.
        if self.privacy is None:
            self.privacy = self.make_node_algorithm()
            self.connect_node_algorithm(self.privacy)
            self._ledger_run = self.broadcast(new_run_id())  # a new run: a new write-ahead ledger, shared by all nodes
        problem: PrivacyConfigError | None = None
        try:
            self.privacy.attach(self.model, fix_model=self.fix_model)
        except PrivacyConfigError as exc:  # e.g. BatchNorm: refused on every node, said once
            problem = exc
        _stop_every_node_on(problem)
        super().configure_ddp()

    def configuration(self) -> dict[str, Any]:
        configuration = super().configuration()
        for name, value in vars(self.privacy_parameters).items():
            configuration.setdefault(name, value)  # a subclass's own value of the same name (CPGT's) comes first
        # whether the noise is seeded (tests) or drawn from OS entropy; a seed's value may differ per node
        configuration["noise_seed"] = "fixed seed" if self.noise_seed is not None else "OS entropy"
        return configuration

    def node_algorithm(self) -> PrivateNodeAlgorithm:
        assert self.privacy is not None, "the node algorithm is made in configure_ddp"
        return self.privacy

    def connect_node_algorithm(self, node: PrivateNodeAlgorithm) -> None:
        """What the node needs from the other nodes before training (Decor: pairwise secrets); nothing by default."""

    #: the paper's node algorithm (:mod:`lightning_privdec.algorithms`)
    node_algorithm_class: type[PrivateNodeAlgorithm] = DPCSGPNode

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
        assert self.privacy is not None and self.flat is not None
        self.privacy.configure_optimizer(self.optimizers[0], self.flat.numel)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            raise PrivacyConfigError(
                f"{type(self).__name__} supports automatic optimization only: with manual optimization the "
                "strategy cannot tell which backward passes make one private step. Remove "
                "`self.automatic_optimization = False`."
            )
        if trainer.gradient_clip_val:
            raise PrivacyConfigError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) cannot be combined with "
                f"{type(self).__name__}: "
                "Lightning would clip the privatized gradient after its noise is added, shrinking noise and signal "
                "alike without bounding any example further (each example's gradient is already clipped to "
                f"max_grad_norm={self.privacy_parameters.max_grad_norm} before the noise). Remove gradient_clip_val; "
                "the per-example bound is max_grad_norm."
            )
        scaler = self._loss_scaler()
        if scaler is not None:  # "16-mixed" (docs/privacy.md)
            # no step ever overflows (an overflowed example is zeroed instead), so a growing scale would only grow,
            # until every example overflows: the scale is held at its initial value. Created now, so that a first
            # step without a backward pass (an empty Poisson batch) is unscaled like any other
            scaler.set_growth_factor(1.0)
            scaler.scale(torch.zeros((), device=self.root_device))
        if isinstance(self.precision_plugin, HalfPrecision):
            raise PrivacyConfigError(
                f"precision={trainer.precision!r} keeps parameters, gradients and noise in "
                f"{self.precision_plugin._desired_input_dtype}: the clipped sum and the Gaussian noise would be "
                "rounded to 8 (bfloat16) or 11 (float16) significant bits and added in that precision, which is not "
                "the Gaussian mechanism the accountant prices (low-precision noise is open to floating-point attacks, "
                "Mironov 2012). Use precision='bf16-mixed' (float32 parameters; clipping and noise in float32) or "
                "'32-true'."
            )

    # ---- data: Poisson sampling of this node's shard ---------------------------------------------------------------
    def check_plan(self) -> None:
        """A paper's own check of the planned noise before training (raise PrivacyConfigError to refuse); it runs
        inside the nodes' agreement, so one node's refusal stops every node."""

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or self.privacy is None:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise PrivacyConfigError(
                f"private strategies need a torch DataLoader for training (got {type(dataloader).__name__}) to "
                "Poisson-sample each node's shard"
            )
        if isinstance(dataloader.dataset, IterableDataset):
            raise PrivacyConfigError(
                "private strategies cannot train on an IterableDataset: Poisson sampling, which the accountant's "
                "amplification by subsampling assumes, needs a finite shard whose examples can be drawn by index. "
                "Use a map-style Dataset (with __len__ and __getitem__; e.g. TensorDataset, or list(...) of a stream "
                "that fits in memory), or a non-private strategy for streaming data"
            )
        super().process_dataloader(dataloader)  # every node has data; the steps per epoch common to all nodes
        problem: Exception | None = None
        try:
            # a noise given by hand is never changed
            calibrated = self.privacy.target_epsilon is not None and self.privacy_parameters.noise_multiplier is None
            resumed_sigma = self.privacy.noise_multiplier if self.privacy.steps > 0 and calibrated else None
            k = trainer.accumulate_grad_batches  # one Poisson batch of k x batch_size per step, as k micro-batches
            assert self.steps_per_epoch is not None
            private = self.privacy.private_dataloader(
                dataloader, self._planned_steps(trainer, self.steps_per_epoch // k), self.world_size,
                self.node_local_data, micro_batches=k, steps_per_epoch=self.steps_per_epoch,
            )
            assert self.runner is not None
            self.runner.check_plan(shard_size=len(private.dataset), resumed_sigma=resumed_sigma,  # type: ignore[arg-type]
                                   resume_noise=self.resume_noise)
            self.check_plan()
        except PrivacyConfigError as exc:
            problem = exc
        _stop_every_node_on(problem)
        if resumed_sigma and self.privacy.noise_multiplier != resumed_sigma:
            self._noise_changed(resumed_sigma, f"this resumed run plans {self.privacy.planned_steps} steps in all, "
                                               "the checkpoint's plan fewer")
        if self.privacy.target_epsilon is not None:  # a later fit may have budget left (a longer plan)
            spent = self.reduce_boolean_decision(self.privacy.next_step_exceeds_budget(), all=False)
            if not spent:
                self.budget_stopped_at_step = None
            elif self.budget_stopped_at_step is None:  # resumed with the budget spent (steps released after the
                self.budget_stopped_at_step = trainer.global_step  # checkpoint count): no step is taken
                trainer.should_stop = True
                rank_zero_warn(
                    f"{type(self).__name__}: target_epsilon={self.privacy.target_epsilon} is already spent "
                    f"(epsilon = {self.privacy.epsilon():.4g}: the ledger counts every step released so far, and CPGT "
                    "also the rounds a resume must send again): no step is taken in this fit; raise target_epsilon "
                    f"above that to go on{self.privacy.privacy_caveat}"
                )
        self._plan_for_max_time(trainer)
        return private

    # ---- max_time: the plan follows the time the run has -------------------------------------------------------
    def _plan_for_max_time(self, trainer: pl.Trainer) -> None:
        """With ``Trainer(max_time=...)`` and a budget to calibrate to, re-plan sigma once the pace is known."""
        self._time_replan_at = None
        timer = _max_time_timer(trainer)
        node = self.privacy
        if timer is None or node is None or self.privacy_parameters.noise_multiplier is not None:
            return
        if node.target_epsilon is None:
            return
        if not node.fixed_noise_multiplier:
            rank_zero_info(
                f"{type(self).__name__}: the noise is planned for {node.planned_steps} steps (max_steps/max_epochs); "
                "max_time may end the run sooner, with budget left"
            )
            return
        self._fit_start_steps = node.steps
        self._time_replan_at = node.steps + MAX_TIME_WARMUP_STEPS

    def _replan_for_max_time(self, trainer: pl.Trainer) -> None:
        """After the warm-up: the steps max_time allows at the slowest node's pace (fewer than planned) get sigma
        calibrated so that the budget is spent by then, instead of ending with most of it unspent."""
        self._time_replan_at = None
        node, timer = self.privacy, _max_time_timer(trainer)
        assert node is not None and timer is not None and node.planned_steps is not None
        taken = node.steps - self._fit_start_steps
        per_step = max(timer.time_elapsed(), 1e-9) / max(taken, 1)
        affordable = taken + int(0.95 * max(timer.time_remaining() or 0.0, 0.0) / per_step)
        affordable = int(self.reduce(torch.tensor(affordable, device=self.root_device), reduce_op=dist.ReduceOp.MIN))
        planned = node.planned_steps - self._fit_start_steps
        assert self.runner is not None
        replanned = self.runner.replan(self._fit_start_steps + affordable)
        if replanned is None:
            return
        old, _ = replanned
        self._noise_changed(old, f"at {per_step:.3g} s per step, max_time allows about {affordable} steps of this "
                                 f"fit, not the {planned} planned by max_steps/max_epochs")

    def _noise_changed(self, old: float, why: str) -> None:
        """Say once that sigma changed from ``old`` for the steps from now on, and why; the end-of-fit summary
        repeats it (the steps before used ``old``)."""
        node = self.privacy
        assert node is not None and node.noise_multiplier is not None
        new, step = node.noise_multiplier, node.steps
        change = f"sigma = {old:.4g} up to step {step}, {new:.4g} from step {step + 1}"
        self.noise_changes.append(change)
        self.say_once(
            f"{type(self).__name__}: {why}: {change}, so that target_epsilon={node.target_epsilon} "
            f"is spent by the end of the plan{node.privacy_caveat}"
        )

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        loaders = trainer.fit_loop._combined_loader
        if loaders is not None and len(loaders.flattened) > 1:
            raise PrivacyConfigError(
                f"private strategies train on ONE DataLoader; got {len(loaders.flattened)}. Each would have its own "
                "sampling rate q while the accountant records one per step: combine the datasets into one loader."
            )
        assert self.privacy is not None
        self._check_examples()
        self.privacy.before_first_step(self.user_backward)

    def _check_examples(self) -> None:
        """Before the first update: every node runs the per-example probe on its shard
        (:meth:`~lightning_privdec.algorithms.base.PrivateNodeAlgorithm.check_examples`); one node's refusal stops
        every node here, with its message."""
        assert self.privacy is not None
        problem: PrivacyConfigError | None = None
        try:
            self.privacy.check_examples(partial(self.user_backward, train=None))
        except PrivacyConfigError as exc:
            problem = exc
        _stop_every_node_on(problem)

    def user_backward(self, batch: Any, train: bool | None = True) -> bool:
        """The user's forward and backward on one batch outside a training step (nothing logged, no optimizer);
        whether a loss was returned. For work an algorithm does at the starting parameters (PrivSGP-VR's table) and
        for the per-example probe (``train=None``: the modules' train/eval modes as they are). Ghost clipping's
        per-sample losses are summed."""
        module = self.lightning_module
        assert module is not None
        modes = [(m, m.training) for m in module.modules()]
        if train is not None:
            module.train(train)
        module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
        try:
            with torch.enable_grad():
                output = self.training_step(self.batch_to_device(batch), 0)
                loss = output.get("loss") if isinstance(output, dict) else output
                if loss is None:
                    return False
                if self.privacy is not None and self.privacy.clipping.ghost is not None:  # per-sample losses
                    self.privacy.clipping.ghost.check_loss_shape(loss)
                    loss = loss.sum()
                scaler = self._tell_loss_scale()  # "16-mixed": as in a training step (backward)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                return True
        finally:
            del module.log, module.log_dict  # the class's own methods again
            for m, training in modes:
                m.training = training

    @staticmethod
    def _planned_steps(trainer: pl.Trainer, batches_per_epoch: int) -> int:
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            batches_per_epoch = min(batches_per_epoch, limit)
        elif limit is not None and limit < 1.0:
            batches_per_epoch = max(1, int(batches_per_epoch * limit))
        epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        if epochs == 1000 and (trainer.max_steps is None or trainer.max_steps < 0) and _max_time_timer(trainer) is None:
            rank_zero_warn(
                "the privacy budget is planned over Lightning's default of max_epochs=1000; set max_epochs or "
                "max_steps to the training you intend, or sigma will be far larger than needed"
            )
        by_epochs = epochs * batches_per_epoch if epochs >= 0 else None
        if trainer.max_steps is not None and trainer.max_steps >= 0:
            return trainer.max_steps if by_epochs is None else min(trainer.max_steps, by_epochs)
        if by_epochs is None:
            raise PrivacyConfigError(
                "the privacy budget is spent over the planned number of steps, but this Trainer has no end: "
                "set max_steps or max_epochs"
                + (" as an upper bound (with max_time, sigma is re-planned for the steps the time allows once the "
                   "pace is known)" if _max_time_timer(trainer) is not None else "")
            )
        return by_epochs

    # ---- the step ------------------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The private step, kept within ``target_epsilon``.

        After each step all nodes decide together whether one more step would take any node past the target; if so
        training stops there, on every node at the same step. A step that would exceed the budget anyway (Lightning's
        ``min_epochs``/``min_steps`` keep the loop running) is refused: no data is touched and nothing is released.
        A new ``fit`` re-checks the budget at setup (a budget that cannot pay for one step is refused there).
        """
        if self.budget_stopped_at_step is not None:  # the shared decision taken after the last step
            self.lightning_module.trainer.should_stop = True
            return None  # every node refuses the same steps: no data touched, nothing released
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._time_replan_at is not None and self.privacy is not None and self.privacy.steps >= self._time_replan_at:
            self._replan_for_max_time(self.lightning_module.trainer)
        self._check_budget_after_step()
        return output

    def _check_budget_after_step(self) -> None:
        """All nodes decide together (one-bit all-reduce) whether one more step would exceed the target. A run whose
        plan ends with this step ends as planned (no budget stop is announced)."""
        assert self.privacy is not None
        if self.privacy.target_epsilon is None:
            return
        if not self.reduce_boolean_decision(self.privacy.next_step_exceeds_budget(), all=False):
            return
        trainer = self.lightning_module.trainer
        if self._plan_ends_with_this_step(trainer):
            return
        trainer.should_stop = True
        self.budget_stopped_at_step = trainer.global_step + 1
        rank_zero_info(
            f"{type(self).__name__}: stopping after step {self.budget_stopped_at_step}: one more step would take a "
            f"node past target_epsilon={self.privacy.target_epsilon} (delta={self.privacy.delta})"
            f"{self.privacy.privacy_caveat}"
        )

    @staticmethod
    def _plan_ends_with_this_step(trainer: pl.Trainer) -> bool:
        """Whether the Trainer stops after the step now being taken anyway (max_steps, or the last batch of the last
        epoch), identically on every node."""
        completed = trainer.global_step + 1
        if trainer.max_steps is not None and 0 <= trainer.max_steps <= completed:
            return True
        last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
        return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def on_train_end(self) -> None:
        """Print every node's final epsilon and noise, with or without PrivacyBudgetCallback (one line per node; each
        line of a run with a fixed ``noise_seed`` says that it is not private)."""
        super().on_train_end()
        if self.privacy is None:
            return
        local = torch.tensor([self.privacy.epsilon(), float(self.privacy.steps)], dtype=torch.float64,
                             device=self.root_device)
        gathered = gather_tensors(local).tolist()
        summary = self.privacy.noise_summary()  # the configuration is the same on every node (checked at setup)
        if self.noise_changes:
            summary += " (" + "; ".join(self.noise_changes) + ")"
        caveat = self.privacy.privacy_caveat
        lines = [f"{type(self).__name__}: final privacy per node (delta = {self.privacy.delta:g}); {summary}{caveat}"]
        lines += [f"  node {rank}: epsilon = {eps:.4f} after {int(steps)} private steps{caveat}"
                  for rank, (eps, steps) in enumerate(gathered)]
        rank_zero_info("\n".join(lines))
        if self.nonfinite_examples:  # each node its own: the count depends on its data and is never sent
            log.info(
                f"{type(self).__name__}, node {self.global_rank}: {self.nonfinite_examples} examples overflowed "
                "float16 under precision='16-mixed' and contributed zero where they did; float16 stops at 65504: "
                "precision='bf16-mixed' avoids it (or, for backward overflows, a smaller GradScaler init_scale)"
            )

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Per-sample backward; with ``accumulate_grad_batches = k`` each of the k micro-batches of a logical Poisson
        batch is clipped here and kept (Lightning divides the loss by k: it is undone, so every example is clipped
        at its own gradient), and the step adds one noise draw to the sum (``optimizer_step``)."""
        if self.privacy is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        k = self.lightning_module.trainer.accumulate_grad_batches
        loss = closure_loss * k if k > 1 else closure_loss
        scaler = self._tell_loss_scale()
        loss = self._power_of_two_mean(loss)
        clipping = self.privacy.clipping
        if clipping.ghost is not None:  # per-sample losses: the clipped sum without per-sample gradients
            clipping.ghost_backward(scaler.scale(loss) if scaler is not None else loss)
        else:
            super().backward(loss, optimizer, *args, **kwargs)
        if k > 1:
            clipping.accumulate_micro_batch()
        return closure_loss

    def _power_of_two_mean(self, loss: Tensor) -> Tensor:
        """Under "bf16-mixed" and "16-mixed": the mean loss times :func:`mean_loss_multiplier` (the per-sample
        gradients are told), so that half-precision output gradients do not depend on the batch size."""
        per_sample = self.privacy.clipping.per_sample
        if per_sample is None or self.precision_plugin.precision not in ("bf16-mixed", "16-mixed"):
            return loss
        expected = (self.privacy.expected_batch_size or 0) / self.privacy.sampler.micro_batches
        multiplier = mean_loss_multiplier(per_sample.forward_batch_size, expected or None)
        per_sample.set_mean_loss_multiplier(multiplier)
        return loss * multiplier if multiplier != 1.0 else loss

    def step_options(self) -> dict[str, Any]:
        """The node's write-ahead ledger, and under "16-mixed" the rescaling of the privatized gradient."""
        assert self.privacy is not None
        options: dict[str, Any] = {"write_ahead": self._write_ahead_ledger()}
        if self._loss_scaler() is not None:  # the scale the step's backward passes were told
            options["after_privatize"] = lambda: self._rescale_for_unscaling(self.privacy.clipping.loss_scale)
        return options

    def closure_result(self, loss: Any) -> Any:
        """Under "16-mixed" never None (a step whose batch was empty): Lightning's precision plugin would then skip
        the optimizer step, and the node would gossip a model without its noise-only update."""
        if loss is None and self._loss_scaler() is not None:
            return torch.zeros((), device=self.root_device)
        return loss

    def _loss_scaler(self) -> Any:
        """The float16 GradScaler of ``precision="16-mixed"``, or None."""
        return getattr(self.precision_plugin, "scaler", None)

    def _tell_loss_scale(self) -> Any:
        """Before a backward pass under "16-mixed": the node learns the scale the loss is multiplied by (clipping must
        not see it); returns the GradScaler, or None."""
        scaler = self._loss_scaler()
        if scaler is not None:
            assert self.privacy is not None
            self.privacy.clipping.set_loss_scale(scaler.get_scale())
        return scaler

    def _rescale_for_unscaling(self, scale: float) -> None:
        """``precision="16-mixed"``: the privatized gradient is unscaled (clipping saw unscaled per-example gradients);
        Lightning's precision plugin divides every gradient by the scale before the optimizer step, so it is
        multiplied by the scale here (exact for the power-of-two scales GradScaler uses). It is finite (an
        overflowed example's part is zeroed, never the whole step skipped), so the GradScaler skips no step on any
        node and the ledger counts every step: a skip would release, without noise, whether some example
        overflowed."""
        assert self.privacy is not None and self.lightning_module is not None
        self.nonfinite_examples += self.privacy.clipping.take_nonfinite_examples()
        for p in self.lightning_module.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def node_state_dict(self) -> dict[str, Any]:
        state = super().node_state_dict()
        assert self.privacy is not None
        self._checkpoint_saved = True  # from now on a resume is possible: every later step is written ahead
        state["privacy"] = self.privacy.state_dict()
        ledger = self._write_ahead_ledger()
        if ledger is not None:  # the resumed run reads (and continues) this node's file of this run
            state["write_ahead"] = {"run": ledger.run_id, "dir": str(ledger.directory)}
        return state

    def load_node_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_node_state_dict(state)
        assert self.privacy is not None
        self.privacy.load_state_dict(state["privacy"])
        saved = state.get("write_ahead")
        if saved is not None and self._writes_ahead():
            self._ledger_run = saved["run"]
            directory = saved["dir"] if self.ledger_dir is True else self.ledger_dir
            self.write_ahead = WriteAheadLedger(directory, saved["run"], self.global_rank)  # type: ignore[arg-type]
            self.write_ahead.recover(self.privacy)  # steps released after the checkpoint stay counted

    # ---- the write-ahead privacy ledger --------------------------------------------------------------------------
    def output_directories(self) -> list[tuple[str, str | os.PathLike[str]]]:
        directories = super().output_directories()
        if self.ledger_dir not in (True, False, None):
            directories.append(("the write-ahead ledger directory (ledger_dir)", self.ledger_dir))
        return directories

    def _writes_ahead(self) -> bool:
        return bool(self.ledger_dir) and self.noise_seed is None

    def _write_ahead_ledger(self) -> WriteAheadLedger | None:
        if self.write_ahead is None and self._writes_ahead() and self._ledger_run is not None:
            directory = self.ledger_dir
            if directory is True:
                directory = self._default_ledger_directory()
                if directory is None:
                    return None
            self.write_ahead = WriteAheadLedger(directory, self._ledger_run, self.global_rank)  # type: ignore[arg-type]
        return self.write_ahead

    def _default_ledger_directory(self) -> Path | None:
        """``privacy_ledger`` next to the checkpoints, else in the logger's directory; a run with neither writes no
        file until a checkpoint of it is saved (only a checkpoint can resume it, and it holds every earlier step)."""
        trainer = self.lightning_module.trainer
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if dirpath:
            return Path(dirpath) / "privacy_ledger"
        if trainer.loggers and trainer.log_dir:
            return Path(trainer.log_dir) / "privacy_ledger"
        if self._checkpoint_saved:
            return Path(trainer.default_root_dir) / "privacy_ledger"
        return None
