"""One node's training step, without Lightning: the step the Trainer's strategies, the loopback simulator, the
privacy audit and the toy examples all run.

Per step, on the node's flat parameters (:class:`~.flat_parameters.FlatParameters`)::

    gradients()                    forward and backward at the node's model z (Lightning's closure, or the
                                   simulator's loss on its batch)
    release = node.next_release()  what this step releases (its accountant's typed release)
    node.privatize()               the paper's clipping and noise into p.grad (records nothing)
    node.ledger.record(release)    the accountant counts the release: here, for every paper
    write_ahead.write(node)        the accounting state on disk before anything leaves the node
    finite check                   a NaN/inf gradient (or loss) stops the node: no update, no message
    x <- the user's optimizer      on the push-sum numerator x (the parameters are loaded with x first, unless
                                   the de-biasing wrote x itself, y = 1, and nothing has written to either since;
                                   writes that bump no version counter, through ``p.data``, NumPy views or
                                   torch.distributed collectives, are not seen and then stay in x)
    gossip.step(x)                 the round's messages (the bytes sent) and the mixing
    gossip.debias_into(z)          the node's model for the next forward

A non-private node (SGP, D-PSGD) runs the same step without the four privacy lines. Around the steps the runner
holds the privacy policy, Lightning-free: a fit's noise plan and its checks (:meth:`NodeRunner.plan`,
:meth:`NodeRunner.check_plan`: a resumed run's new noise under ``resume_noise``, delta against the shard, a budget
that pays for one step; :func:`planned_steps` from the run's limits), the re-plan for a run cut short by a time
limit (:meth:`NodeRunner.plan_time_limit`, :meth:`NodeRunner.replan_for_time_limit`), the budget check after each
step (:meth:`NodeRunner.next_step_exceeds_budget`; the caller decides with the other nodes), the end-of-fit summary,
and where the write-ahead ledger goes (:class:`WriteAheadPlace`). What only the caller knows (the clock, the
directories, an agreement across nodes) is passed in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_privdec.algorithms.base import Gossip, PrivateNodeAlgorithm
from lightning_privdec.algorithms.flat_parameters import FlatParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.write_ahead import WriteAheadLedger


#: the choices of ``resume_noise=``: what a resumed run does when its new plan needs more noise
#: (:meth:`NodeRunner.check_plan`)
RESUME_NOISE = ("auto", "recalibrate", "keep")


class NonFiniteStepError(FloatingPointError):
    """A node's loss or gradient is NaN or infinite; raised before anything from that step leaves the node."""


def nonfinite_parameters(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or an infinity (one host sync when all are finite).

    A NaN or infinity in any entry makes its tensor's sum non-finite, so finite sums (one fast reduction each)
    clear the step; only then, or when a huge finite sum overflowed, is every entry checked.
    """
    with_grad = [(name, p.grad) for name, p in named_parameters if p.grad is not None]
    if not with_grad:
        return []
    if bool(torch.isfinite(torch.stack([g.sum() for _, g in with_grad])).all()):
        return []
    finite = torch.stack([torch.isfinite(g).all() for _, g in with_grad])
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(with_grad, finite.tolist()) if not ok]


def private_step(node: PrivateNodeAlgorithm, write_ahead: WriteAheadLedger | None = None) -> DPStepStats:
    """The private part of a step, after backward: the node's next release, the paper's :meth:`privatize` (clip and
    noise into ``p.grad``), the accountant records the release, the write-ahead ledger writes it."""
    release = node.next_release()
    if release is None:
        raise RuntimeError(f"{type(node).__name__}: a private step before the noise was planned (private_dataloader)")
    stats = node.privatize()
    node.ledger.record(release)
    if write_ahead is not None:
        write_ahead.write(node)
    return stats


class NodeRunner:
    """One node: its model, flat parameters, gossip and (private nodes) its privacy, stepped as one unit.

    Args:
        model: the module whose trainable parameters ``flat`` holds (named in error messages).
        flat: the model's flat parameters; the optimizer must update these parameter objects.
        gossip: the node's mixing (its ``x`` is the push-sum numerator).
        node: the paper's private node (None: a non-private node).
        rank: this node's id (for messages).
        check_loss: whether a non-finite loss stops the node (private nodes check only the privatized gradient: the
            mean loss of an empty Poisson batch is NaN by construction). Default: only non-private nodes.
    """

    def __init__(
        self, model: nn.Module, flat: FlatParameters, gossip: Gossip, node: PrivateNodeAlgorithm | None = None, *,
        rank: int = 0, check_loss: bool | None = None,
    ) -> None:
        self.model, self.flat, self.gossip, self.node, self.rank = model, flat, gossip, node, rank
        self.check_loss = node is None if check_loss is None else check_loss
        self._time_limit_start = 0  # the node's steps when this fit began (plan_time_limit)
        self._time_replan_at: int | None = None  # the node's step at which sigma is re-planned for a time limit
        self._holds_x: tuple[int, int, int] | None = None  # _state_version() while the parameters hold x itself

    def check_finite(self, loss: Any, step: int) -> None:
        """Stop at the first NaN or infinite gradient (or loss), before the update or the gossip."""
        bad = nonfinite_parameters(list(self.model.named_parameters()))
        bad_loss = self.check_loss and isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all()
        if not bad and not bad_loss:
            return
        problems = [f"loss ({loss.detach().reshape(-1)[0].item()})"] if bad_loss else []
        if bad:
            problems.append(f"gradient of {', '.join(bad[:3])}" + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
        raise NonFiniteStepError(
            f"node {self.rank}, step {step}: non-finite {' and '.join(problems)}. Training stops here; nothing from "
            "this step left the node (no update, no gossip), and the other nodes stop when they miss its messages. "
            "Usual causes: a learning rate too large, NaN/inf in the input data, log(0) or division by zero in the "
            "loss. Fix it and resume every node from the last checkpoint (trainer.fit(..., ckpt_path=...))."
        )

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        gradients: Callable[[], Any],
        *,
        step: int,
        update: Callable[[Callable[[], Any]], Any] | None = None,
        write_ahead: WriteAheadLedger | None = None,
        after_privatize: Callable[[], None] | None = None,
        after_gossip: Callable[[Any], None] | None = None,
    ) -> Any:
        """One training step (the module docstring's order); returns what ``update`` returned.

        Args:
            optimizer: the user's optimizer, over ``flat``'s parameters.
            gradients: forward and backward at the node's model; returns the loss (None: no loss this step).
            step: the step's index, for messages.
            update: runs the optimizer with a closure (Lightning's precision plugin); default ``optimizer.step``.
            write_ahead: this node's write-ahead ledger (None: none is written).
            after_privatize: runs after the release is recorded and written (the GradScaler's rescaling).
            after_gossip: sees the output between the gossip and the de-biasing (the divergence guard compares
                ``gossip.x`` with ``flat.buffer`` = x^{t+1/2}).
        """
        calls = 0

        def closure() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(
                    f"{type(optimizer).__name__} evaluated the closure twice in one step (LBFGS-style line search): "
                    "a decentralized node needs one forward/backward per step (one private release, one gossip "
                    "round). Use a first-order optimizer such as SGD or Adam."
                )
            loss = gradients()
            if self.node is not None:
                private_step(self.node, write_ahead)
                if after_privatize is not None:
                    after_privatize()
            self.check_finite(loss, step)  # nothing non-finite ever reaches the numerator or a neighbour
            if self._holds_x != self._state_version():  # the optimizer updates the numerator x
                self.flat.buffer.copy_(self.gossip.x)
            return loss

        output = update(closure) if update is not None else optimizer.step(closure)
        self.gossip.step(self.flat.buffer)  # x^{t+1/2} -> neighbours -> x^{t+1}, y^{t+1}
        if after_gossip is not None:
            after_gossip(output)
        self.gossip.debias_into(self.flat.buffer)  # the module holds z = x / y for the next forward
        identity = getattr(self.gossip, "debias_is_identity", None)  # a gossip without it: always load x
        self._holds_x = self._state_version() if identity is not None and identity() else None
        return output

    def _state_version(self) -> tuple[int, int, int]:
        """Changes with every write to x or to the parameters (or x's replacement): while it is what it was after a
        de-biasing that wrote x itself, the parameters hold x bit for bit and need not be loaded with it."""
        x = self.gossip.x
        return x.data_ptr(), x._version, self.flat.version()

    # ---- the privacy policy around the steps ------------------------------------------------------------------------
    def plan(
        self, loader: Any, planned_steps: int, world_size: int, *, node_local_data: bool, micro_batches: int,
        steps_per_epoch: int, calibrated: bool, resume_noise: str = "auto", check: Callable[[], None] = lambda: None,
    ) -> tuple[Any, float | None]:
        """A fit's noise plan: the node's Poisson-sampled loader of its shard and sigma for ``planned_steps``
        (``private_dataloader``), then :meth:`check_plan` and the paper's own ``check``. Returns the private loader
        and, when a resumed run's calibrated sigma (``calibrated``: not given by hand) changed with the new plan, the
        checkpoint's sigma."""
        node = self.node
        assert node is not None
        resumed_sigma = node.noise_multiplier if node.steps > 0 and calibrated else None
        private = node.private_dataloader(loader, planned_steps, world_size, node_local_data,
                                          micro_batches=micro_batches, steps_per_epoch=steps_per_epoch)
        self.check_plan(shard_size=len(private.dataset), resumed_sigma=resumed_sigma, resume_noise=resume_noise)
        check()
        return private, resumed_sigma if resumed_sigma and node.noise_multiplier != resumed_sigma else None

    def check_plan(self, *, shard_size: int, resumed_sigma: float | None = None, resume_noise: str = "auto") -> None:
        """Before training, once the noise is planned (``private_dataloader``): a resumed run's new sigma against
        ``resumed_sigma``, the checkpoint's (:meth:`check_resumed_noise`); delta against the shard of
        ``shard_size`` examples; a budget that pays for the first step. Raises PrivacyConfigError."""
        node = self.node
        if node is None:
            return
        if resumed_sigma:
            self.check_resumed_noise(resumed_sigma, resume_noise)
        if node.delta > 0:  # (CPGT is pure epsilon-DP: no delta to check)
            node.parameters.check_delta(shard_size, self.rank)
        if node.steps == 0 and node.next_step_exceeds_budget():
            raise PrivacyConfigError(
                f"target_epsilon={node.target_epsilon} cannot pay for a single step with "
                f"noise_multiplier={node.noise_multiplier:.4g} at sample rate {node.sample_rate:.4g}; raise the "
                "noise multiplier or the budget"
            )

    def check_resumed_noise(self, old_sigma: float, resume_noise: str) -> None:
        """A resumed run whose new plan re-calibrated sigma: refuse a sigma over twice the old one (``"auto"``), or
        keep the old one (``"keep"``: the budget check then stops training when the target is reached)."""
        node = self.node
        assert node is not None and node.noise_multiplier is not None
        new_sigma = node.noise_multiplier
        if new_sigma <= old_sigma or resume_noise == "recalibrate":
            return
        fixed_sigma = node.fixed_noise_multiplier
        if resume_noise == "keep":
            if not fixed_sigma:
                raise PrivacyConfigError(
                    f"resume_noise='keep' needs a fixed noise multiplier; {type(node).__name__}'s noise follows its "
                    "own plan. Use resume_noise='recalibrate', or resume with the checkpoint's plan"
                )
            node.noise_multiplier = old_sigma
            return
        if new_sigma <= 2.0 * old_sigma:
            return
        keep = (
            f"resume_noise='keep' keeps sigma = {old_sigma:.4g} and stops training when target_epsilon is reached; "
            if fixed_sigma else ""
        )
        assert node.planned_steps is not None
        raise PrivacyConfigError(
            f"node {self.rank}: this resumed run plans {node.planned_steps} steps in all, but the checkpoint's plan "
            f"was calibrated for fewer: {node.steps} steps have spent epsilon = {node.epsilon():.4g} of "
            f"target_epsilon = {node.target_epsilon}, and the {node.planned_steps - node.steps} remaining steps would "
            f"need sigma = {new_sigma:.4g} instead of {old_sigma:.4g} ({new_sigma / old_sigma:.1f}x the noise), which "
            "would likely destroy the model. Choose knowingly: raise target_epsilon (a larger total budget); "
            f"{keep}resume_noise='recalibrate' accepts sigma = {new_sigma:.4g}; or start a new run "
            "(new data, a fresh budget)"
        )

    def replan(self, total_steps: int) -> tuple[float, float] | None:
        """Re-plan a fixed sigma so that the target is spent by step ``total_steps`` (fewer than planned: the run
        will be cut short); returns (old sigma, new sigma), or None when nothing changes."""
        node = self.node
        if node is None or not node.fixed_noise_multiplier or node.planned_steps is None:
            return None
        if total_steps >= node.planned_steps or total_steps <= node.steps:
            return None
        old = node.noise_multiplier
        assert old is not None
        node.noise_multiplier = node.calibrate_remaining(total_steps - node.steps)  # type: ignore[attr-defined]
        node.planned_steps, node._certified = total_steps, None
        return old, node.noise_multiplier

    def next_step_exceeds_budget(self) -> bool:
        """Whether one more step would take this node past its ``target_epsilon`` (False without privacy)."""
        return self.node is not None and self.node.next_step_exceeds_budget()

    # ---- a run cut short by a time limit ----------------------------------------------------------------------------
    def plan_time_limit(self) -> str | None:
        """At the start of a fit whose time limit may end it early (and whose sigma was calibrated to a budget): the
        re-plan of :meth:`replan_for_time_limit` is due :data:`TIME_LIMIT_WARMUP_STEPS` steps from now. A node whose
        noise follows its own plan cannot be re-planned: returns what the user should know then."""
        node = self.node
        if node is None:
            return None
        if not node.fixed_noise_multiplier:
            return (f"the noise is planned for {node.planned_steps} steps (max_steps/max_epochs); max_time may end the "
                    "run sooner, with budget left")
        self._time_limit_start = node.steps
        self._time_replan_at = node.steps + TIME_LIMIT_WARMUP_STEPS
        return None

    def time_replan_due(self) -> bool:
        """Whether the warm-up of :meth:`plan_time_limit` has just ended (the re-plan runs once per fit)."""
        return self.node is not None and self._time_replan_at is not None and self.node.steps >= self._time_replan_at

    def replan_for_time_limit(
        self, elapsed: float, remaining: float, slowest: Callable[[int], int] = lambda steps: steps
    ) -> tuple[float, str] | None:
        """After the warm-up: the steps the time left allows at this fit's pace, the fewest over the nodes
        (``slowest``: the minimum over every node, which each node calls alike), get sigma calibrated so that the
        budget is spent by then instead of ending with most of it unspent. Returns (old sigma, why) or None."""
        self._time_replan_at = None
        node = self.node
        assert node is not None and node.planned_steps is not None
        taken = node.steps - self._time_limit_start
        per_step = max(elapsed, 1e-9) / max(taken, 1)
        affordable = slowest(taken + int(0.95 * max(remaining, 0.0) / per_step))
        planned = node.planned_steps - self._time_limit_start
        replanned = self.replan(self._time_limit_start + affordable)
        if replanned is None:
            return None
        return replanned[0], (f"at {per_step:.3g} s per step, max_time allows about {affordable} steps of this fit, "
                              f"not the {planned} planned by max_steps/max_epochs")

    # ---- what the user is told --------------------------------------------------------------------------------------
    def noise_change(self, name: str, old: float, why: str) -> tuple[str, str]:
        """sigma's change from ``old`` at this step (the steps before used ``old``), in words, and what the user is
        told: why, and that the budget is now spent by the end of the plan."""
        node = self.node
        assert node is not None and node.noise_multiplier is not None
        change = f"sigma = {old:.4g} up to step {node.steps}, {node.noise_multiplier:.4g} from step {node.steps + 1}"
        return change, (f"{name}: {why}: {change}, so that target_epsilon={node.target_epsilon} is spent by the end "
                        f"of the plan{node.privacy_caveat}")

    def budget_stop_note(self, name: str, step: int) -> str:
        """Why every node stops after ``step``: one more step would take a node past ``target_epsilon``."""
        node = self.node
        assert node is not None
        return (f"{name}: stopping after step {step}: one more step would take a node past "
                f"target_epsilon={node.target_epsilon} (delta={node.delta}){node.privacy_caveat}")

    def budget_spent_note(self, name: str) -> str:
        """Why a fit takes no step: the budget was spent before it began (a resumed run's ledger counts every step)."""
        node = self.node
        assert node is not None
        return (f"{name}: target_epsilon={node.target_epsilon} is already spent (epsilon = {node.epsilon():.4g}: the "
                "ledger counts every step released so far, and CPGT also the rounds a resume must send again): no "
                f"step is taken in this fit; raise target_epsilon above that to go on{node.privacy_caveat}")

    def final_summary(self, name: str, per_node: Sequence[tuple[float, float]], noise_changes: Sequence[str]) -> str:
        """The end-of-fit lines: the noise (and each change of it), then every node's (epsilon, steps)."""
        node = self.node
        assert node is not None
        summary = node.noise_summary() + (" (" + "; ".join(noise_changes) + ")" if noise_changes else "")
        caveat = node.privacy_caveat
        lines = [f"{name}: final privacy per node (delta = {node.delta:g}); {summary}{caveat}"]
        lines += [f"  node {rank}: epsilon = {eps:.4f} after {int(steps)} private steps{caveat}"
                  for rank, (eps, steps) in enumerate(per_node)]
        return "\n".join(lines)


#: steps timed before sigma is re-planned for a time limit (:meth:`NodeRunner.plan_time_limit`)
TIME_LIMIT_WARMUP_STEPS = 5


def planned_steps(
    batches_per_epoch: int, *, limit_batches: int | float | None, max_epochs: int | None, max_steps: int | None,
    time_limited: bool = False,
) -> int:
    """The steps a run plans (its budget is spent over them): ``max_steps``, or ``max_epochs`` x the batches per epoch
    (after ``limit_batches``: a count, or a fraction), whichever ends first. Raises PrivacyConfigError without an
    end (a time limit alone does not say how many steps it allows)."""
    if isinstance(limit_batches, int):
        batches_per_epoch = min(batches_per_epoch, limit_batches)
    elif limit_batches is not None and limit_batches < 1.0:
        batches_per_epoch = max(1, int(batches_per_epoch * limit_batches))
    by_epochs = max_epochs * batches_per_epoch if max_epochs is not None and max_epochs >= 0 else None
    if max_steps is not None and max_steps >= 0:
        return max_steps if by_epochs is None else min(max_steps, by_epochs)
    if by_epochs is None:
        raise PrivacyConfigError(
            "the privacy budget is spent over the planned number of steps, but this Trainer has no end: "
            "set max_steps or max_epochs"
            + (" as an upper bound (with max_time, sigma is re-planned for the steps the time allows once the "
               "pace is known)" if time_limited else "")
        )
    return by_epochs


class WriteAheadPlace:
    """Whether and where a node writes its write-ahead ledger (:mod:`lightning_privdec.privacy.write_ahead`), over
    every fit of one run.

    Args:
        setting: ``True``: next to the checkpoints, else in the log directory, else (once a checkpoint was saved by
            hand) in the root directory; a path: there; ``False``/``None``: off.
        rank: this node's id.
        seeded: whether the noise is seeded (nothing is written: a replayed step redraws the checkpointed noise).
    """

    def __init__(self, setting: str | os.PathLike[str] | bool | None, rank: int, seeded: bool) -> None:
        self.setting, self.rank = setting, rank
        self.enabled = bool(setting) and not seeded
        self.run: str | None = None  # the run id, shared by all nodes (set at the first setup)
        self.ledger: WriteAheadLedger | None = None
        self.checkpoint_saved = False  # from then on a resume is possible: every later step is written ahead

    def open(self, candidates: Callable[[], Sequence[str | os.PathLike[str] | None]]) -> WriteAheadLedger | None:
        """This node's ledger, opened once; None while nothing is written. With ``setting=True`` its directory is
        ``privacy_ledger`` in the first of ``candidates()`` given (the checkpoint directory, the log directory, the
        root directory once a checkpoint was saved: a run with none of them writes no file until a checkpoint of it
        is saved, as only a checkpoint can resume it and it holds every earlier step)."""
        if self.ledger is None and self.enabled and self.run is not None:
            directory = self.setting if self.setting is not True else next(
                (Path(folder) / "privacy_ledger" for folder in candidates() if folder), None)
            if directory is not None:
                self.ledger = WriteAheadLedger(directory, self.run, self.rank)  # type: ignore[arg-type]
        return self.ledger

    def checkpoint_entry(self) -> dict[str, str] | None:
        """What a checkpoint keeps so that its resumed run continues this node's file (the ledger opened first)."""
        return None if self.ledger is None else {"run": self.ledger.run_id, "dir": str(self.ledger.directory)}

    def resume(self, saved: Mapping[str, str] | None, node: PrivateNodeAlgorithm) -> None:
        """A resumed run continues the checkpoint's file (in ``setting`` when that is a path): the steps released
        after the checkpoint stay counted."""
        if saved is None or not self.enabled:
            return
        self.run = saved["run"]
        self.ledger = WriteAheadLedger(saved["dir"] if self.setting is True else self.setting,  # type: ignore[arg-type]
                                       saved["run"], self.rank)
        self.ledger.recover(node)
