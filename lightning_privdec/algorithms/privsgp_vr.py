"""One node's privacy machinery for PrivSGP-VR: the SAGA gradient table, its noise and its (sound) accounting.

Algorithm 1 of Zhu, Huang, Wang, Xu (2024), lines 1-8, in the private strategies' step (lines 9-14, push-sum, are
the base strategy's gossip):

    1-3  fill_table(): the table at the common start z^0, one pass over the shard (nothing is released)
    5    the Poisson batch (its example ids come from the batch sampler's FIFO)
    6-8  privatize(): fresh clipped per-sample gradients, the SAGA correction with the table before its update,
         the table update, this node's own Gaussian noise on the sum, division by qJ
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_privdec.privacy.accounting.gaussian import PrivacyLedger
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.saga_accounting import (
    SagaNoise,
    calibrate_saga_noise,
    check_accounting,
    saga_epsilon,
    sound_split,
)
from lightning_privdec.privacy.sampling import PoissonBatchSampler
from lightning_privdec.privacy.variance_reduction import (
    TABLE_DTYPES,
    SagaTable,
    clip_rows_,
    saga_step,
)

__all__ = ["DEFAULT_MAX_TABLE_BYTES", "TABLE_INITS", "CompositionLedger", "SagaPrivacyEngine", "check_saga_options"]

#: default memory budget of one node's gradient table (J x d x bytes)
DEFAULT_MAX_TABLE_BYTES = 2 * 1024**3

#: "full": the paper's table at z^0 (lines 1-3, one pass over the shard); "zeros": a zero table (a standard SAGA start)
TABLE_INITS: tuple[str, ...] = ("full", "zeros")


def check_saga_options(
    *, accounting: str, accountant: str, max_table_bytes: Any, table_init: str, table_dtype: Any, grad_sample_mode: str
) -> None:
    """Reject PrivSGP-VR options that cannot work, before any process starts."""
    check_accounting(accounting, accountant)
    if grad_sample_mode == "ghost":
        raise PrivacyConfigError(
            "PrivSGP-VR stores every sampled example's clipped gradient in its table (Algorithm 1, line 7), but ghost "
            "clipping never materialises per-sample gradients. Use grad_sample_mode='bookkeeping' (default), 'hooks' or "
            "'functorch'."
        )
    if isinstance(max_table_bytes, bool) or not isinstance(max_table_bytes, (int, float)) or not max_table_bytes > 0:
        raise PrivacyConfigError(
            f"max_table_bytes must be a positive number of bytes (e.g. 2 * 1024**3), got {max_table_bytes!r}"
        )
    if table_init not in TABLE_INITS:
        raise PrivacyConfigError(
            f"table_init must be 'full' (the paper's table at z^0, one extra pass over the shard) or 'zeros', got "
            f"{table_init!r}"
        )
    if table_dtype not in TABLE_DTYPES:
        raise PrivacyConfigError(f"table_dtype must be one of {', '.join(map(str, TABLE_DTYPES))}, got {table_dtype!r}")


def _gib(size: float) -> str:
    return f"{size / 1024**3:.3g} GiB"


class CompositionLedger(PrivacyLedger):
    """A :class:`PrivacyLedger` whose entries merge with any equal ``(sigma, q)`` entry, not only the last one.

    Composition does not depend on the order of the mechanisms, and PrivSGP-VR records two alternating mechanisms
    per step; merging keeps the history at two entries. ``steps`` counts mechanisms, not optimizer steps.
    """

    @staticmethod
    def _append(history: Any, noise_multiplier: float, sample_rate: float, steps: int) -> Any:
        history = list(history)
        for i, (sigma, q, count) in enumerate(history):
            if sigma == noise_multiplier and q == sample_rate:
                history[i] = (sigma, q, count + steps)
                return history
        history.append((noise_multiplier, sample_rate, steps))
        return history

    def _epsilon(self, history: Any, delta: float) -> float:
        with warnings.catch_warnings(), np.errstate(divide="ignore"):
            warnings.filterwarnings("ignore", message="Optimal order is the")
            return super()._epsilon(history, delta)

    def epsilon_if_entries(self, entries: list[tuple[float, float]], steps: int = 1) -> float:
        """Epsilon after ``steps`` more steps, each composing all of ``entries``."""
        history = self.history
        for sigma, q in entries:
            history = self._append(history, sigma, q, steps)
        return self._epsilon(history, self._delta(None))


class SagaPrivacyEngine(DPCSGPNode):
    """PrivSGP-VR's per-node DP step: SAGA gradient table + Gaussian noise + sound accounting.

    Args:
        parameters: ``max_grad_norm`` (C), ``noise_multiplier`` (s / C: the std of the noise on the released sum, in
            units of C) or ``target_epsilon`` + ``target_delta``, and ``accountant`` ("rdp" or "prv").
        accounting: ``"sound"`` (default), ``"paper"`` (the published formula; not a proven guarantee) or
            ``"no_amplification"`` (see :mod:`lightning_privdec.privacy.saga_accounting`).
        max_table_bytes: refuse (before training) a table larger than this (J x d x bytes per element).
        table_init: ``"full"`` (the paper's lines 1-3) or ``"zeros"``.
        table_dtype: storage precision of the table (re-clipped after the cast, so every row stays within C).
        rank, device, grad_sample_mode, noise_seed: as for :class:`DPCSGPNode`.
    """

    fixed_noise_multiplier = False  # its noise follows its own plan

    supports_micro_batches = False
    micro_batch_refusal = (
        "PrivSGP-VR stores every sampled example's clipped gradient in its table and needs the whole Poisson batch "
        "at once: use accumulate_grad_batches=1 (a smaller batch_size, or a smaller model for the table)"
    )

    def __init__(
        self,
        parameters: PrivacyParameters,
        *,
        accounting: str = "sound",
        max_table_bytes: float = DEFAULT_MAX_TABLE_BYTES,
        table_init: str = "full",
        table_dtype: torch.dtype = torch.float32,
        rank: int,
        device: torch.device,
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
        noise_seed: int | None = None,
        secure_mode: bool = False,
    ) -> None:
        check_saga_options(
            accounting=accounting, accountant=parameters.accountant, max_table_bytes=max_table_bytes,
            table_init=table_init, table_dtype=table_dtype, grad_sample_mode=grad_sample_mode,
        )
        super().__init__(
            parameters, rank=rank, device=device, grad_sample_mode=grad_sample_mode, noise_seed=noise_seed,
            secure_mode=secure_mode,
        )
        self.ledger = CompositionLedger(parameters.accountant, delta=parameters.delta_for_reporting)
        self.accounting, self.max_table_bytes = accounting, max_table_bytes
        self.table_init, self.table_dtype = table_init, table_dtype
        self.split: float | None = None
        self.table: SagaTable | None = None
        self.table_ready = False
        self._batches: deque[list[int]] | None = None
        self._shard_loader: DataLoader | None = None
        self._steps = 0

    # ---- setup -------------------------------------------------------------------------------------------------------
    @property
    def noise(self) -> SagaNoise:
        assert self.noise_multiplier is not None
        return SagaNoise(self.accounting, self.noise_multiplier, self.split)

    def _parameters(self) -> list[nn.Parameter]:
        assert self._module is not None, "attach() the model first"
        return [p for p in self._module.parameters() if p.requires_grad]

    def check_table_memory(self, num_rows: int, dim: int) -> None:
        """Refuse a table above ``max_table_bytes``, naming its size and the fixes."""
        size = SagaTable.nbytes_for(num_rows, dim, self.table_dtype)
        if size > self.max_table_bytes:
            raise PrivacyConfigError(
                f"PrivSGP-VR's gradient table on node {self.rank} would need J x d x bytes = {num_rows:,} x {dim:,} x "
                f"{size // max(1, num_rows * dim)} = {_gib(size)} ({size:,} bytes), above max_table_bytes="
                f"{_gib(self.max_table_bytes)}: it stores one clipped gradient per example of the node's shard "
                "(Algorithm 1, lines 1-7). Fix: raise max_table_bytes if the device has room, use "
                "table_dtype=torch.bfloat16 (half the memory), spread the data over more nodes, use a smaller "
                "model, or use PrivSGPStrategy (no table)."
            )

    def private_dataloader(
        self,
        dataloader: DataLoader,
        planned_steps: int,
        world_size: int = 1,
        node_local_data: bool = False,
        micro_batches: int = 1,
        steps_per_epoch: int | None = None,
    ) -> DataLoader:
        """The Poisson loader of the shard, the memory check and table, and the FIFO of sampled example ids."""
        dim = sum(p.numel() for p in self._parameters())
        private = super().private_dataloader(
            dataloader, planned_steps, world_size, node_local_data, micro_batches, steps_per_epoch
        )
        shard_size = len(private.dataset)  # type: ignore[arg-type]
        self.check_table_memory(shard_size, dim)
        device = self._parameters()[0].device
        if self.table is None or (self.table.num_rows, self.table.dim) != (shard_size, dim):
            self.table = SagaTable(shard_size, dim, max_norm=self.parameters.max_grad_norm, dtype=self.table_dtype,
                                   device=device)
            self.table_ready = False
        if not self.table_ready and self.table_init == "zeros":
            self.table.reset()
            self.table_ready = True
        sampler = private.batch_sampler
        assert isinstance(sampler, PoissonBatchSampler)
        self._batches = sampler.record_batches()  # table rows = positions in the shard = the sampler's indices
        self._shard_loader = DataLoader(
            private.dataset, batch_size=dataloader.batch_size, shuffle=False, collate_fn=private.collate_fn
        )
        return private

    # ---- Algorithm 1, lines 1-3 --------------------------------------------------------------------------------------
    def before_first_step(self, backward: Callable[[Any], bool]) -> None:
        """Lines 1-3 at the starting (or resumed) parameters, unless the table is already filled."""
        if not self.table_ready:
            self.fill_table(backward)

    def fill_table(self, backward: Callable[[Any], bool]) -> None:
        """Lines 1-3: table[j] = clip(grad f_i(z^0; j)) for every example j of the shard, at the current parameters.

        ``backward(batch)`` runs the user's loss on one chunk of the shard and its backward pass (the per-sample hooks
        record the gradients); it returns False when the step produced no loss. Nothing is released; the noise and
        the sampling generators are not touched.
        """
        if self.table is None or self._shard_loader is None or self.per_sample is None:
            raise RuntimeError("SagaPrivacyEngine.fill_table called before attach() and private_dataloader()")
        params = self._parameters()
        row = 0
        for batch in self._shard_loader:
            self.per_sample.clear()
            has_loss = backward(batch)
            size = self.per_sample.batch_size
            if not has_loss or size == 0:
                raise PrivacyConfigError(
                    "training_step returned no loss on a batch of the shard while PrivSGP-VR filled its gradient table "
                    "(Algorithm 1, lines 1-3); every example needs a gradient. Use table_init='zeros' to skip the pass."
                )
            clipped = self.per_sample.flat_per_sample_grads(self.table.workspace(size, params[0].dtype))
            clip_rows_(clipped, self.parameters.max_grad_norm)
            self.table.store(range(row, row + size), clipped)
            row += size
        self.per_sample.clear()
        for p in params:
            p.grad = None
        if row != self.table.num_rows:
            raise RuntimeError(f"the table pass saw {row} examples for a shard of {self.table.num_rows}")
        self.table.refresh_total()
        self.table_ready = True

    # ---- planning ----------------------------------------------------------------------------------------------------
    def plan_noise(self, planned_steps: int) -> None:
        """Fix s (and the split) for a plan of ``planned_steps`` steps, counting the steps already spent."""
        q = self.sample_rate
        assert q is not None
        plan = (planned_steps, q)
        remaining = max(1, planned_steps - self._steps)
        history = self.ledger.history
        delta = self.delta
        if self.accounting == "paper":
            warnings.warn(
                "accounting='paper' calibrates PrivSGP-VR with the published formula (sensitivity 3C amplified at rate "
                "q), whose argument ignores that the table mean carries every example at every step. It is not a "
                "guarantee this library vouches for; use accounting='sound' (default) for reported epsilons.",
                UserWarning,
                stacklevel=2,
            )
        if self.parameters.noise_multiplier is not None:
            self.noise_multiplier = float(self.parameters.noise_multiplier)
            if self.accounting == "sound" and (self._plan != plan or self._steps == 0):
                self.split = (
                    sound_split(self.noise_multiplier, q, remaining, delta, history, self.parameters.accountant)
                    if self.noise_multiplier > 0 else None
                )
        elif self._plan == plan and self.noise_multiplier is not None and self._steps > 0:
            pass  # resumed with the plan the noise was calibrated for
        else:
            target = float(self.parameters.target_epsilon)  # type: ignore[arg-type]
            if self._steps > 0 and self.ledger.epsilon() >= target:
                raise PrivacyConfigError(
                    f"node {self.rank} has already spent epsilon={self.ledger.epsilon():.4f} of target_epsilon={target}: "
                    "there is no budget left to train on; raise target_epsilon or start a new run on new data"
                )
            noise = calibrate_saga_noise(
                target, delta, q, remaining, accounting=self.accounting, accountant=self.parameters.accountant,
                history=history,
            )
            self.noise_multiplier, self.split = noise.noise_multiplier, noise.split
        self._plan = plan
        self.planned_steps = planned_steps
        self._calibrated_until = planned_steps if self.parameters.noise_multiplier is None else None

    # ---- Algorithm 1, lines 5-8 --------------------------------------------------------------------------------------
    def _next_batch(self) -> list[int]:
        if not self._batches:
            raise RuntimeError(
                "PrivSGP-VR does not know which examples this step used: the Poisson batch sampler recorded no "
                "batch. Train with the loader returned by private_dataloader()."
            )
        return self._batches.popleft()

    def privatize(self) -> DPStepStats:
        """Lines 6-8 on this step's Poisson batch: the released gradient g~ into ``p.grad``; the table updated."""
        if self.per_sample is None or self.noise_multiplier is None or self.table is None:
            raise RuntimeError("SagaPrivacyEngine.privatize called before attach() and private_dataloader()")
        if not self.table_ready:
            raise RuntimeError("the PrivSGP-VR gradient table was not filled (fill_table) before the first step")
        assert self.sample_rate is not None
        indices = self._next_batch()
        params = self.per_sample.parameters
        C = self.parameters.max_grad_norm
        size = self.per_sample.batch_size
        if size != len(indices):
            raise RuntimeError(
                f"the step's per-sample gradients ({size}) do not match the {len(indices)} examples the "
                "sampler drew: training_step must compute one loss per example of the batch, in order"
            )
        fresh = self.per_sample.flat_per_sample_grads(self.table.workspace(size, params[0].dtype))  # reused buffer
        norms = clip_rows_(fresh, C)
        std = self.noise_multiplier * C
        noise = (self.noise_generator.normal(self.table.dim, std, fresh.dtype, fresh.device) if std > 0
                 else fresh.new_zeros(self.table.dim))
        released = saga_step(self.table, indices, fresh, self.sample_rate, noise)
        offset = 0
        for p in params:
            value = released[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
            if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype:
                p.grad.copy_(value)
            else:
                p.grad = value.clone()
        self.per_sample.clear()
        for sigma, q in self.noise.entries(self.sample_rate):
            self.ledger.record(sigma, q)
        self._steps += 1
        if norms.numel():
            mean, top, clipped = norms.mean(), norms.max(), (norms > C).float().mean()
        else:
            mean = top = clipped = torch.zeros((), device=fresh.device)
        self.last_step = DPStepStats(
            batch_size=len(indices), mean_norm=mean, max_norm=top, clipped_fraction=clipped, noise_std=std
        )
        return self.last_step

    # ---- budget ------------------------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Private steps this node has taken (all fits and resumes together)."""
        return self._steps

    def next_step_exceeds_budget(self) -> bool:
        target = self.parameters.target_epsilon
        if target is None or self.noise_multiplier is None or self.sample_rate is None:
            return False
        calibrated = getattr(self, "_calibrated_until", None)
        if calibrated is not None and self._steps + 1 <= calibrated:
            return False  # the calibration checked epsilon(planned steps) <= target, and epsilon grows with steps
        return self.ledger.epsilon_if_entries(self.noise.entries(self.sample_rate)) > target

    def report(self) -> dict[str, Any]:
        """The noise, its split and the epsilon of this node's history under each accounting (for comparison)."""
        q = self.sample_rate
        out: dict[str, Any] = {
            "accounting": self.accounting,
            "noise_multiplier": self.noise_multiplier,
            "split": self.split,
            "entries_per_step": self.noise.entries(q) if q is not None and self.noise_multiplier is not None else None,
            "steps": self._steps,
            "epsilon": self.epsilon(),
        }
        if q is not None and self.noise_multiplier and self._steps:
            for name in ("sound", "paper"):
                out[f"epsilon_{name}_formula"] = saga_epsilon(
                    self.noise_multiplier, q, self._steps, self.delta, accounting=name,
                    accountant=self.parameters.accountant, split=self.split if name == self.accounting else "best",
                )
        return out

    # ---- checkpoints: the ledger, the noise and the plan; never the table (per-sample gradients) ----------------------
    def state_dict(self) -> dict[str, Any]:
        """No table: it holds every example's clipped gradient. A resumed run rebuilds it (``fill_table``)."""
        state = super().state_dict()
        state.update(steps=self._steps, split=self.split, accounting=self.accounting)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("accounting") != self.accounting:
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint's ledger was kept with accounting={state.get('accounting')!r}, this "
                f"run uses accounting={self.accounting!r}; resume with the same accounting"
            )
        if int(state["steps"]) < self._steps:
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint has {state['steps']} private steps but this node has already taken "
                f"{self._steps}; restoring it would forget spent privacy. Resume into a fresh Trainer."
            )
        self.ledger.load_state_dict(state["ledger"])
        self.noise_multiplier = state["noise_multiplier"]
        self._plan = (int(state["plan"][0]), float(state["plan"][1])) if state["plan"] is not None else None
        self.load_generator_state(state)
        self._steps, self.split = int(state["steps"]), state["split"]
        self._calibrated_until = None  # the budget check recomputes until the next plan
        self.table_ready = False  # rebuilt at the resumed parameters (table_init="full") or zeroed
        if self.table is not None and self.table_init == "zeros":
            self.table.reset()
            self.table_ready = True
