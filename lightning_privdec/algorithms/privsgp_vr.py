"""PrivSGP-VR (Zhu, Huang, Wang, Xu, IJCAI 2024), Algorithm 1, for one node i, on flat tensors.

Mini-batch form: Poisson sampling at rate q = B / J over the node's shard of J examples, every fresh per-sample
gradient clipped to C (the paper assumes ||grad f|| <= G; here c = clip_C(grad f)), the noise on the sum, division by
the expected batch size qJ. With one example and q = 1/J it is the paper's algorithm. The paper's lines:

    1-3    table[j] = c_j(z^0) for every j of the shard; g_bar = (1/J) sum_j table[j]
                                                                    :meth:`PrivSGPVRNode.fill_table`
    4      for k = 0, 1, ..., K - 1                                 the strategy's loop (or ``simulation.py``)
    5      S ~ Poisson(q) over the shard                            :meth:`PrivSGPVRNode.private_dataloader` (the
                                                                    ids of S: the sampler's FIFO)
    6      g = (1/(qJ)) [sum_{xi in S} (c_xi(z^k) - table[xi]) + qJ g_bar], table BEFORE line 7   (eq. 6)
                                                                    :func:`saga_step`
    7      g_bar += (1/J) sum_{xi in S} (c_xi - table[xi]); table[xi] = c_xi(z^k)                 (eq. 5)
                                                                    :meth:`SagaTable.store`
    8      g~ = g + N / (qJ), N ~ N(0, s^2 I) this node's own draw  :meth:`PrivSGPVRNode.privatize`
           accounted per step as the mechanisms of :meth:`PrivSGPVRNode.next_release`: sound by default; Theorem 2's
           eq. (11) with ``accounting="paper"`` (not a guarantee)   :class:`~lightning_privdec.privacy.accounting.
                                                                    saga.SagaAccountant`
    9      x_i^{k+1/2} = x_i^k - gamma g~_i                         the user's optimizer, on the numerator x
    10-14  push-sum, exact messages: x_i^{k+1} = sum_j P_ij x_j^{k+1/2}, w_i^{k+1} = sum_j P_ij w_j, z = x / w
                                                                    :func:`~.base.push_sum_gossip` (``mixing.py``)

Unbiased whatever the table holds: E_S[sum_{xi in S} (c_xi - table[xi])] = q sum_j (c_j - table[j]), so E[g~] is the
full clipped gradient (1/J) sum_j c_j. qJ g_bar = q sum_j table[j]: every table row is in every release, which the
accounting charges without amplification. Differences from the paper, on purpose: per-sample clipping instead of
assumed bounded gradients (every table row is within C, which the accounting needs); Poisson mini-batches; noise
calibrated by a sound accountant (docs/privacy.md, "PrivSGP-VR").
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy.accounting.saga import (
    SagaAccountant,
    SagaNoise,
    SagaRelease,
    check_accounting,
    saga_epsilon,
    sound_split,
)
from lightning_privdec.privacy.accounting.saga_calibration import calibrate_saga_noise
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats, clip_rows_
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.local_dp import GaussianMechanism
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.privacy.sampling import PoissonBatchSampler
from lightning_privdec.tensors import split_like

#: default memory budget of one node's gradient table (J x d x bytes)
DEFAULT_MAX_TABLE_BYTES = 2 * 1024**3
#: "full": the paper's table at z^0 (lines 1-3, one pass over the shard); "zeros": a zero table (a standard SAGA start)
TABLE_INITS: tuple[str, ...] = ("full", "zeros")
TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: the float64 sum of the table is recomputed from its rows after this many passes' worth (x J) of stored rows
REFRESH_PASSES = 32


@dataclass(frozen=True)
class PrivSGPVROptions:
    """PrivSGP-VR's own arguments, validated once: by the strategy when it is built (before any process starts), or
    by the node when it is given them as keywords.

    ``accounting``: ``"sound"``, ``"paper"`` or ``"no_amplification"`` (:mod:`~lightning_privdec.privacy.accounting.
    saga`); ``max_table_bytes``: refuse a larger table before training; ``table_init``: ``"full"`` (lines 1-3) or
    ``"zeros"``; ``table_dtype``: storage precision of the table (rows re-clipped after the cast).
    """

    accounting: str = "sound"
    max_table_bytes: float = DEFAULT_MAX_TABLE_BYTES
    table_init: str = "full"
    table_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_accounting(self.accounting, "rdp")
        size = self.max_table_bytes
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise PrivacyConfigError(f"max_table_bytes must be a positive number of bytes (e.g. 2 * 1024**3), got {size!r}")
        if self.table_init not in TABLE_INITS:
            raise PrivacyConfigError(f"table_init must be 'full' (the paper's table at z^0, one extra pass over the "
                                     f"shard) or 'zeros', got {self.table_init!r}")
        if self.table_dtype not in TABLE_DTYPES:
            raise PrivacyConfigError(f"table_dtype must be one of {', '.join(map(str, TABLE_DTYPES))}, got "
                                     f"{self.table_dtype!r}")

    def check(self, accountant: str, grad_sample_mode: str) -> None:
        """The options against the privacy parameters: an accountant that composes two mechanisms, real rows."""
        check_accounting(self.accounting, accountant)
        if grad_sample_mode == "ghost":
            raise PrivacyConfigError(
                "PrivSGP-VR stores every sampled example's clipped gradient in its table (Algorithm 1, line 7), but "
                "ghost clipping never materialises per-sample gradients. Use grad_sample_mode='bookkeeping' (default), "
                "'hooks' or 'functorch'."
            )


class SagaTable:
    """One node's table of clipped per-sample gradients (one row per example of its shard) and their float64 sum.

    Every stored row has norm <= C, also after a cast to a reduced-precision ``dtype`` (re-clipped after the cast),
    which the accounting needs. :meth:`workspace` is a reusable B x d buffer for a step's per-sample gradients: with it
    and :meth:`store` a step allocates nothing of size B x d.
    """

    def __init__(self, num_rows: int, dim: int, *, max_norm: float, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.num_rows, self.dim, self.max_norm, self.dtype = int(num_rows), int(dim), float(max_norm), dtype
        self.rows = torch.zeros(self.num_rows, self.dim, dtype=dtype, device=device)
        self.total = torch.zeros(self.dim, dtype=torch.float64, device=device)
        self._workspace = torch.empty(0, self.dim, device=device)
        self._rows_since_refresh = 0
        # row norms are checked in the table's precision (float32 at least) against C rounded down to it
        self._norm_dtype = torch.promote_types(dtype, torch.float32)
        bound = torch.tensor(self.max_norm, dtype=self._norm_dtype)
        self._bound = float(torch.nextafter(bound, torch.zeros_like(bound)) if float(bound) > self.max_norm else bound)

    @staticmethod
    def nbytes_for(num_rows: int, dim: int, dtype: torch.dtype = torch.float32) -> int:
        """Memory of a J x d table of ``dtype`` (the float64 sum of d entries comes on top)."""
        return int(num_rows) * int(dim) * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.total.numel() * self.total.element_size()

    @property
    def mean(self) -> Tensor:
        """g_bar = (1/J) sum_j table[j] (float64)."""
        return self.total / self.num_rows

    def workspace(self, batch: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A ``(batch, d)`` buffer for one step's per-sample gradients, reused (grown by a quarter when a Poisson batch
        is larger than any before); overwritten by the next call."""
        if self._workspace.shape[0] < batch or self._workspace.dtype != dtype:
            rows = max(batch, int(1.25 * batch) if self._workspace.shape[0] else batch)
            self._workspace = torch.empty(rows, self.dim, dtype=dtype, device=self.rows.device)
        return self._workspace[:batch]

    def _fit(self, values: Tensor) -> Tensor:
        """``values`` in the storage dtype with every row's norm <= C (a row rounded above C by an ulp, or by the cast,
        shrinks to C (1 - 2^attempt eps), in place when the dtypes agree)."""
        stored = values.to(self.dtype)
        eps = torch.finfo(self.dtype).eps
        for attempt in range(8):
            norms = torch.linalg.vector_norm(stored, dim=1, dtype=self._norm_dtype)
            over = (norms > self._bound).nonzero().flatten()
            if over.numel() == 0:
                return stored
            for row, factor in zip(over.tolist(), (self.max_norm / norms[over] * (1.0 - 2**attempt * eps)).tolist()):
                stored[row] = (stored[row].to(self._norm_dtype) * factor).to(self.dtype)
        raise RuntimeError("could not fit the table rows under the clipping bound")  # pragma: no cover

    @torch.no_grad()
    def store(self, indices: Tensor | Sequence[int], values: Tensor) -> Tensor:
        """Line 7: table[indices] = values and g_bar += (new - old) / J; returns sum_{xi in S} (values[xi] - old
        table[xi]), line 6's correction, as stored, summed in float64. The float64 sum is recomputed from the rows every
        ``REFRESH_PASSES`` passes' worth of stored rows, so the rounding of the corrections cannot accumulate."""
        index = torch.as_tensor(indices, dtype=torch.long).tolist()
        if len(index) != values.shape[0]:
            raise RuntimeError(f"{values.shape[0]} per-sample gradients for {len(index)} sampled examples")
        if len(set(index)) != len(index):
            raise RuntimeError("an example was sampled twice in one batch; each table row is replaced once per step")
        # float64: a float32 sum over examples would round every other example's row anew when one leaves the batch
        correction = torch.zeros(self.dim, dtype=torch.float64, device=self.rows.device)
        if not index:
            return correction
        new = self._fit(values.to(self.rows.device))
        for position, row in enumerate(index):
            correction.sub_(self.rows[row]).add_(new[position])
            self.rows[row].copy_(new[position])
        self.total.add_(correction)
        self._rows_since_refresh += len(index)
        if self._rows_since_refresh >= REFRESH_PASSES * self.num_rows:
            self.refresh_total()
        return correction

    @torch.no_grad()
    def reset(self) -> None:
        """A zero table (a standard SAGA start; unbiased as well, only less accurate at first)."""
        self.rows.zero_()
        self.total.zero_()

    @torch.no_grad()
    def refresh_total(self) -> None:
        """Recompute the float64 sum from the rows, row by row (no J x d float64 copy)."""
        self.total.zero_()
        for row in self.rows:
            self.total.add_(row)
        self._rows_since_refresh = 0


def saga_step(table: SagaTable, indices: Tensor | Sequence[int], fresh: Tensor, sample_rate: float,
              noise: Tensor) -> Tensor:
    """Lines 6-8: g~ = (line 6's sum + N) / (qJ), with the table updated (line 7) in the same pass."""
    mean_term = sample_rate * table.total  # line 6: q sum_j table[j], the table before line 7
    correction = table.store(indices, fresh)  # lines 6-7: sum_{xi in S} (c_xi - table[xi]); table[xi] = c_xi
    summed = correction + mean_term.to(correction.dtype)
    # line 8, divided by qJ: in float64, the noisy value rounded to the rows' dtype once (post-processing)
    return ((summed + noise.to(summed.dtype)) / (sample_rate * table.num_rows)).to(fresh.dtype)


class PrivSGPVRNode(PrivateNodeAlgorithm):
    """One PrivSGP-VR node: the SAGA table, this node's Gaussian noise on the released sum, its accountant.

    Args:
        parameters: ``max_grad_norm`` (C), ``noise_multiplier`` (s / C: the std of the noise on the released sum, in
            units of C) or ``target_epsilon`` + ``target_delta``, and ``accountant`` ("rdp" or "prv").
        options: a :class:`PrivSGPVROptions` already checked against ``parameters`` (:meth:`PrivSGPVROptions.check`:
            the strategy's), or its fields as keywords (``accounting=``, ``max_table_bytes=``, ...), checked here.
        rank, device, grad_sample_mode, noise_seed, secure_mode: see :class:`PrivateNodeAlgorithm`.
    """

    gaussian: GaussianMechanism  # this node's Gaussian noise (made in __init__)

    def __init__(self, parameters: PrivacyParameters, *, options: PrivSGPVROptions | None = None, **kwargs: Any) -> None:
        fields = {name: kwargs.pop(name) for name in PrivSGPVROptions.__dataclass_fields__ if name in kwargs}
        if options is None:  # a strategy's options were checked when it was built
            options = PrivSGPVROptions(**fields)
            options.check(parameters.accountant, kwargs.get("grad_sample_mode", DEFAULT_GRAD_SAMPLE_MODE))
        self.options = options
        super().__init__(parameters, **kwargs)
        self.sampler.micro_batch_refusal = (
            "PrivSGP-VR stores every sampled example's clipped gradient in its table and needs the whole Poisson "
            "batch at once: use accumulate_grad_batches=1 (a smaller batch_size, or a smaller model for the table)"
        )
        self.gaussian = self.gaussian_mechanism()  # line 8's N(0, s^2 I), drawn by the node itself
        self.split: float | None = None
        self.table: SagaTable | None = None
        self.table_ready = False
        self._plan: tuple[int, float] | None = None  # (planned steps, q) the noise was fixed for
        self._sampled: deque[list[int]] | None = None
        self._shard_loader: DataLoader | None = None

    @property
    def accounting(self) -> str:
        return self.options.accounting

    @property
    def noise(self) -> SagaNoise:
        assert self.noise_multiplier is not None
        return SagaNoise(self.accounting, self.noise_multiplier, self.split)

    def make_accountant(self) -> SagaAccountant:
        return SagaAccountant(self.parameters.accountant, delta=self.parameters.delta_for_reporting)

    # ---- line 5: the Poisson loader of the shard, and the table it indexes -------------------------------------------
    def private_dataloader(self, dataloader: DataLoader, planned_steps: int, *args: Any, **kwargs: Any) -> DataLoader:
        """The Poisson loader (line 5), the noise plan, the table (memory checked) and the FIFO of sampled ids."""
        private = super().private_dataloader(dataloader, planned_steps, *args, **kwargs)
        params = self.clipping.parameters
        shard, dim = len(private.dataset), sum(p.numel() for p in params)  # type: ignore[arg-type]
        self.check_table_memory(shard, dim)
        if self.table is None or (self.table.num_rows, self.table.dim) != (shard, dim):
            self.table = SagaTable(shard, dim, max_norm=self.parameters.max_grad_norm, dtype=self.options.table_dtype,
                                   device=params[0].device)
            self.table_ready = False
        if not self.table_ready and self.options.table_init == "zeros":
            self.table.reset()
            self.table_ready = True
        sampler = private.batch_sampler
        assert isinstance(sampler, PoissonBatchSampler)
        self._sampled = sampler.record_batches()  # table rows = positions in the shard = the sampler's indices
        self._shard_loader = DataLoader(private.dataset, batch_size=dataloader.batch_size, shuffle=False,
                                        collate_fn=private.collate_fn)
        return private

    def check_table_memory(self, num_rows: int, dim: int) -> None:
        """Refuse a table above ``max_table_bytes``, naming its size and the fixes."""
        size, most = SagaTable.nbytes_for(num_rows, dim, self.options.table_dtype), self.options.max_table_bytes
        if size > most:
            raise PrivacyConfigError(
                f"PrivSGP-VR's gradient table on node {self.rank} would need J x d x bytes = {num_rows:,} x {dim:,} x "
                f"{size // max(1, num_rows * dim)} = {size / 1024**3:.3g} GiB ({size:,} bytes), above max_table_bytes="
                f"{most / 1024**3:.3g} GiB: it stores one clipped gradient per example of the node's shard (Algorithm "
                "1, lines 1-7). Fix: raise max_table_bytes if the device has room, use table_dtype=torch.bfloat16 "
                "(half the memory), spread the data over more nodes, use a smaller model, or use PrivSGPStrategy "
                "(no table)."
            )

    # ---- lines 1-3 ---------------------------------------------------------------------------------------------------
    def before_first_step(self, backward: Callable[[Any], bool]) -> None:
        if not self.table_ready:
            self.fill_table(backward)

    def fill_table(self, backward: Callable[[Any], bool]) -> None:
        """Lines 1-3: table[j] = clip(grad f_i(z^0; j)) for every example j of the shard, at the current parameters.

        ``backward(batch)`` runs the user's loss and backward on one chunk of the shard and says whether there was a
        loss. Nothing is released; the noise and sampling generators are not touched.
        """
        per_sample = self.clipping.per_sample
        if self.table is None or self._shard_loader is None or per_sample is None:
            raise RuntimeError("PrivSGPVRNode.fill_table called before attach() and private_dataloader()")
        params, row = self.clipping.parameters, 0
        for batch in self._shard_loader:
            per_sample.clear()
            has_loss, size = backward(batch), per_sample.batch_size
            if not has_loss or size == 0:
                raise PrivacyConfigError(
                    "training_step returned no loss on a batch of the shard while PrivSGP-VR filled its gradient table "
                    "(Algorithm 1, lines 1-3); every example needs a gradient. Use table_init='zeros' to skip the pass."
                )
            clipped = per_sample.flat_per_sample_grads(self.table.workspace(size, params[0].dtype))
            clip_rows_(clipped, self.parameters.max_grad_norm)
            self.table.store(range(row, row + size), clipped)
            row += size
        per_sample.clear()
        for p in params:
            p.grad = None
        if row != self.table.num_rows:
            raise RuntimeError(f"the table pass saw {row} examples for a shard of {self.table.num_rows}")
        self.table.refresh_total()
        self.table_ready = True

    # ---- the noise s (and its split) for the planned steps -----------------------------------------------------------
    def plan_noise(self, planned_steps: int) -> None:
        """Fix s (and the split) for ``planned_steps`` steps in all, counting the steps already spent: a given s is
        kept; a budget is calibrated over the steps left, unless resumed with the plan it was calibrated for."""
        q, spent = self.sample_rate, self.ledger.steps
        assert q is not None
        plan, remaining, history = (planned_steps, q), max(1, planned_steps - spent), self.ledger.history
        if self.accounting == "paper":
            warnings.warn(
                "accounting='paper' calibrates PrivSGP-VR with the published formula (sensitivity 3C amplified at rate "
                "q), whose argument ignores that the table mean carries every example at every step. It is not a "
                "guarantee this library vouches for; use accounting='sound' (default) for reported epsilons.",
                UserWarning, stacklevel=2,
            )
        if self.parameters.noise_multiplier is not None:
            self.noise_multiplier = float(self.parameters.noise_multiplier)
            if self.accounting == "sound" and (self._plan != plan or spent == 0):
                self.split = (sound_split(self.noise_multiplier, q, remaining, self.delta, history,
                                          self.parameters.accountant) if self.noise_multiplier > 0 else None)
        elif self._plan != plan or self.noise_multiplier is None or spent == 0:
            target = float(self.parameters.target_epsilon)  # type: ignore[arg-type]
            if spent > 0 and self.ledger.epsilon() >= target:
                raise PrivacyConfigError(
                    f"node {self.rank} has already spent epsilon={self.ledger.epsilon():.4f} of target_epsilon={target}: "
                    "there is no budget left to train on; raise target_epsilon or start a new run on new data"
                )
            noise = calibrate_saga_noise(target, self.delta, q, remaining, accounting=self.accounting,
                                         accountant=self.parameters.accountant, history=history)
            self.noise_multiplier, self.split = noise.noise_multiplier, noise.split
        self._plan = plan

    def next_release(self) -> SagaRelease | None:
        """The mechanisms one step composes (:meth:`SagaNoise.entries`)."""
        if self.noise_multiplier is None or self.sample_rate is None:
            return None
        return SagaRelease.of(self.noise.entries(self.sample_rate))

    # ---- lines 6-8 ---------------------------------------------------------------------------------------------------
    def privatize(self) -> DPStepStats:
        """Lines 6-8 on this step's Poisson batch: the released g~ into ``p.grad``, the table updated."""
        release, per_sample = self.next_release(), self.clipping.per_sample
        if per_sample is None or release is None or self.table is None:
            raise RuntimeError("PrivSGPVRNode.privatize called before attach() and private_dataloader()")
        if not self.table_ready:
            raise RuntimeError("the PrivSGP-VR gradient table was not filled (fill_table) before the first step")
        if not self._sampled:
            raise RuntimeError("PrivSGP-VR does not know which examples this step used: the Poisson batch sampler "
                               "recorded no batch. Train with the loader returned by private_dataloader().")
        indices, params, C = self._sampled.popleft(), per_sample.parameters, self.parameters.max_grad_norm
        size = per_sample.batch_size
        if size != len(indices):
            raise RuntimeError(
                f"the step's per-sample gradients ({size}) do not match the {len(indices)} examples the sampler drew: "
                "training_step must compute one loss per example of the batch, in order"
            )
        fresh = per_sample.flat_per_sample_grads(self.table.workspace(size, params[0].dtype))  # c_xi(z^k)
        norms = clip_rows_(fresh, C)
        std = self.noise_multiplier * C  # type: ignore[operator]
        noise = (self.gaussian.normal(self.table.dim, std, fresh.dtype, fresh.device) if std > 0
                 else fresh.new_zeros(self.table.dim))
        released = saga_step(self.table, indices, fresh, self.sample_rate, noise)  # type: ignore[arg-type]
        for p, value in zip(params, split_like(released, params)):  # into p.grad where it fits (a flat buffer's view)
            if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype:
                p.grad.copy_(value)
            else:
                p.grad = value.to(p.dtype).clone()
        per_sample.clear()
        zero = torch.zeros((), device=fresh.device)
        self.last_step = DPStepStats(
            batch_size=len(indices), mean_norm=norms.mean() if size else zero, max_norm=norms.max() if size else zero,
            clipped_fraction=(norms > C).float().mean() if size else zero, noise_std=std,
        )
        return self.last_step

    def noise_summary(self) -> str:
        """The line every private strategy prints at the end of a fit (its mechanisms: the setup line)."""
        C = self.parameters.max_grad_norm
        return (f"Gaussian noise sigma = {self.noise_multiplier or 0.0:.4g} x C (C = {C:g}), "
                f"Poisson q = {self.sample_rate or 0.0:.4g}, {self.ledger.accountant} accountant")

    def report(self) -> dict[str, Any]:
        """The noise, its split and the epsilon of this node's steps under each accounting (for comparison)."""
        q, m, steps = self.sample_rate, self.noise_multiplier, self.steps
        entries = tuple(self.noise.entries(q)) if q is not None and m is not None else None
        out: dict[str, Any] = {"accounting": self.accounting, "noise_multiplier": m, "split": self.split,
                               "entries_per_step": entries, "steps": steps, "epsilon": self.epsilon()}
        if q is not None and m and steps:
            for name in ("sound", "paper"):
                out[f"epsilon_{name}_formula"] = saga_epsilon(
                    m, q, steps, self.delta, accounting=name, accountant=self.parameters.accountant,
                    split=self.split if name == self.accounting else "best",
                )
        return out

    # ---- checkpoints: the accountant, the noise and the plan; never the table (per-sample gradients) -----------------
    def plan_state(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "plan": list(self._plan) if self._plan else None,
                "split": self.split, "accounting": self.accounting}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        self.noise_multiplier, self.split = state["noise_multiplier"], state["split"]
        self._plan = (int(state["plan"][0]), float(state["plan"][1])) if state["plan"] is not None else None
        self.table_ready = False  # rebuilt at the resumed parameters (table_init="full") or zeroed
        if self.table is not None and self.options.table_init == "zeros":
            self.table.reset()
            self.table_ready = True

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state of the same accounting (:meth:`PrivateNodeAlgorithm.load_state_dict`)."""
        if state.get("accounting") != self.accounting:
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint's ledger was kept with accounting={state.get('accounting')!r}, this "
                f"run uses accounting={self.accounting!r}; resume with the same accounting"
            )
        super().load_state_dict(state)
