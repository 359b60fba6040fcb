"""PrivSGP-VR's SAGA step on one node (Zhu, Huang, Wang, Xu 2024, Algorithm 1, lines 1-8), on flat tensors.

Mini-batch form: Poisson sampling at rate q = B / J over the node's shard of J examples, every fresh per-sample
gradient clipped to C (the paper assumes ||grad f|| <= G; here c = clip_C(grad f)), noise on the sum, division by the
expected batch size qJ. With one example and q = 1/J it is the paper's algorithm::

    1-3  table[j] = c_j(z^0) for every j of the shard;  g_bar = (1/J) sum_j table[j]
    5    S ~ Poisson(q)
    6    g = (1/(qJ)) [ sum_{xi in S} (c_xi(z^k) - table[xi]) + qJ g_bar ]           (table BEFORE line 7)
    7    g_bar += (1/J) sum_{xi in S} (c_xi(z^k) - table[xi]);  table[xi] = c_xi(z^k)
    8    g~ = g + N / (qJ),  N ~ N(0, s^2 I)

Unbiased whatever the table holds: E_S[sum_{xi in S}(c_xi - table[xi])] = q sum_j (c_j - table[j]), hence
E[g~] = (1/(qJ)) [q sum_j c_j - q sum_j table[j] + qJ g_bar] = (1/J) sum_j c_j, the full clipped gradient.

qJ g_bar = q sum_j table[j]: the released sum contains every table row, weighted q, at every step — the term the
accounting must charge without amplification (lightning_privdec.privacy.saga_accounting).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_privdec.privacy.dp_step import clip_factor
from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = ["SagaTable", "clip_rows", "clip_rows_", "saga_gradient_sum", "saga_step"]

TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: the float64 sum of the table is recomputed from its rows after this many passes' worth (x J) of stored rows
REFRESH_PASSES = 32


def clip_rows(rows: Tensor, max_norm: float) -> tuple[Tensor, Tensor]:
    """Each row scaled by min(1, C / (||row|| + 1e-6)) (Opacus's flat clipping); returns (clipped rows, norms)."""
    clipped = rows.clone()
    return clipped, clip_rows_(clipped, max_norm)


def clip_rows_(rows: Tensor, max_norm: float) -> Tensor:
    """:func:`clip_rows` in place (no B x d temporary); returns the norms before clipping."""
    norms = torch.linalg.vector_norm(rows, dim=1)
    rows.mul_(clip_factor(norms, max_norm).unsqueeze(1))
    return norms


class SagaTable:
    """One node's table of clipped per-sample gradients, one row per example of its shard, and their sum.

    Every stored row has norm <= C, also after a cast to a reduced-precision ``dtype`` (re-clipped after the cast),
    which the accounting needs. The sum ``total = sum_j table[j]`` is kept in float64 and updated incrementally
    (line 7); ``mean`` is g_bar. :meth:`workspace` is a reusable B x d buffer for a step's per-sample gradients:
    with it and :meth:`store` a step allocates nothing of size B x d (on CPU, fresh large allocations cost page
    faults that dominated the step).

    Args:
        num_rows: J, the shard size.
        dim: d, the number of trainable parameters.
        max_norm: C.
        dtype: storage precision (float32 default; bfloat16/float16 halve the memory).
        device: where the table lives (the model's device).
    """

    def __init__(
        self, num_rows: int, dim: int, *, max_norm: float, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if dtype not in TABLE_DTYPES:
            raise PrivacyConfigError(f"table_dtype must be one of {TABLE_DTYPES}, got {dtype!r}")
        self.num_rows, self.dim, self.max_norm, self.dtype = int(num_rows), int(dim), float(max_norm), dtype
        self.rows = torch.zeros(self.num_rows, self.dim, dtype=dtype, device=device)
        self.total = torch.zeros(self.dim, dtype=torch.float64, device=device)
        self._workspace = torch.empty(0, self.dim, device=device)
        self._rows_since_refresh = 0
        # row norms are checked in the table's precision (float32 at least) against C rounded down to it
        self._norm_dtype = torch.promote_types(dtype, torch.float32)
        bound = torch.tensor(self.max_norm, dtype=self._norm_dtype)
        if float(bound) > self.max_norm:
            bound = torch.nextafter(bound, torch.zeros_like(bound))
        self._bound = float(bound)  # exactly representable in the norm dtype

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
        """A ``(batch, d)`` buffer of ``dtype`` for one step's per-sample gradients, reused across steps (grown by a
        quarter when a Poisson batch is larger than any before). Its contents are overwritten by the next call."""
        if self._workspace.shape[0] < batch or self._workspace.dtype != dtype:
            rows = max(batch, int(1.25 * batch) if self._workspace.shape[0] else batch)
            self._workspace = torch.empty(rows, self.dim, dtype=dtype, device=self.rows.device)
        return self._workspace[:batch]

    def _fit(self, values: Tensor) -> Tensor:
        """``values`` in the storage dtype with every row's norm <= C (rows rounded above C by an ulp, or by the cast,
        shrink to C (1 - 2^attempt eps)). When the dtypes agree this is ``values`` itself, such rows rescaled in place."""
        stored = values.to(self.dtype)
        eps = torch.finfo(self.dtype).eps
        for attempt in range(8):
            norms = torch.linalg.vector_norm(stored, dim=1, dtype=self._norm_dtype)
            over = (norms > self._bound).nonzero().flatten()
            if over.numel() == 0:
                return stored
            shrink = (self.max_norm / norms[over] * (1.0 - 2**attempt * eps)).tolist()
            for row, factor in zip(over.tolist(), shrink):  # row by row: no temporary of the batch's size
                if stored.dtype in (torch.float32, torch.float64):
                    stored[row].mul_(factor)
                else:
                    stored[row] = (stored[row].float() * factor).to(self.dtype)
        raise RuntimeError("could not fit the table rows under the clipping bound")  # pragma: no cover

    @torch.no_grad()
    def store(self, indices: Tensor | Sequence[int], values: Tensor) -> Tensor:
        """Line 7: table[indices] = values (clipped gradients, one row per index) and g_bar += (new - old) / J.

        Returns ``sum_{xi in S} (values[xi] - old table[xi])``, the correction of line 6 (float32 or wider), as
        stored (a row of ``values`` may shrink by an ulp to stay within C). One pass over the rows: no B x d
        temporary when ``values`` has the storage dtype. The float64 sum takes the correction as computed (in float32
        for float32 values) and is recomputed from the rows after every ``REFRESH_PASSES`` passes' worth of stored rows,
        so the rounding of the per-step corrections cannot accumulate.
        """
        index = torch.as_tensor(indices, dtype=torch.long).tolist()
        if len(index) != values.shape[0]:
            raise RuntimeError(f"{values.shape[0]} per-sample gradients for {len(index)} sampled examples")
        if len(set(index)) != len(index):
            raise RuntimeError("an example was sampled twice in one batch; each table row is replaced once per step")
        correction = torch.zeros(self.dim, dtype=torch.promote_types(values.dtype, torch.float32), device=self.rows.device)
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
        """Zero table (a standard SAGA start; unbiased as well, only less accurate at first)."""
        self.rows.zero_()
        self.total.zero_()

    @torch.no_grad()
    def refresh_total(self) -> None:
        """Recompute the float64 sum from the rows, row by row (no J x d float64 copy); removes any drift of the
        incremental updates."""
        self.total.zero_()
        for row in self.rows:
            self.total.add_(row)
        self._rows_since_refresh = 0


def saga_gradient_sum(table: SagaTable, indices: Tensor | Sequence[int], fresh: Tensor, sample_rate: float) -> Tensor:
    """Line 6 times qJ: ``sum_{xi in S} (c_xi - table[xi]) + q sum_j table[j]``, the table BEFORE line 7 (left
    unchanged; :func:`saga_step` computes the same sum while it updates the table).

    ``fresh`` holds the batch's clipped gradients c_xi, one row per index, in the order of ``indices``.
    """
    index = torch.as_tensor(indices, dtype=torch.long, device=table.rows.device)
    if fresh.shape[0] != index.numel():
        raise RuntimeError(f"{fresh.shape[0]} per-sample gradients for {index.numel()} sampled examples")
    correction = (fresh - table.rows[index].to(fresh.dtype)).sum(0) if index.numel() else fresh.new_zeros(table.dim)
    return correction + (sample_rate * table.total).to(fresh.dtype)


def saga_step(
    table: SagaTable, indices: Tensor | Sequence[int], fresh: Tensor, sample_rate: float, noise: Tensor
) -> Tensor:
    """Lines 6-8 for one node: the released gradient g~ = (line 6 sum + N) / (qJ), and the table update (line 7).

    ``noise`` is N ~ N(0, s^2 I) on the sum (this node's own draw); ``qJ = sample_rate * table.num_rows``. ``fresh``
    may be rescaled in place by an ulp (see :meth:`SagaTable.store`).
    """
    mean_term = sample_rate * table.total  # line 6: q sum_j table[j], the table before line 7
    correction = table.store(indices, fresh)  # lines 6-7: sum_{xi in S} (c_xi - table[xi]); table[xi] = c_xi
    summed = correction + mean_term.to(correction.dtype)
    return (summed + noise.to(summed.dtype)) / (sample_rate * table.num_rows)  # line 8, divided by qJ
