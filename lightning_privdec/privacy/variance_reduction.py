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

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = ["SagaTable", "clip_rows", "flatten_per_sample", "saga_gradient_sum", "saga_step"]

TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def flatten_per_sample(grad_samples: Sequence[Tensor]) -> Tensor:
    """``[(B, *p.shape) for p in params]`` -> one ``(B, d)`` matrix, parameters concatenated in order."""
    batch = int(grad_samples[0].shape[0])
    return torch.cat([g.reshape(batch, math.prod(g.shape[1:])) for g in grad_samples], dim=1)


def clip_rows(rows: Tensor, max_norm: float) -> tuple[Tensor, Tensor]:
    """Each row scaled by min(1, C / (||row|| + 1e-6)) (Opacus's flat clipping); returns (clipped rows, norms)."""
    norms = torch.linalg.vector_norm(rows, dim=1)
    return rows * (max_norm / (norms + 1e-6)).clamp(max=1.0).unsqueeze(1), norms


class SagaTable:
    """One node's table of clipped per-sample gradients, one row per example of its shard, and their sum.

    Every stored row has norm <= C, also after a cast to a reduced-precision ``dtype`` (re-clipped after the cast),
    which the accounting needs. The sum ``total = sum_j table[j]`` is kept in float64 and updated incrementally
    (line 7); ``mean`` is g_bar.

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

    def _fit(self, values: Tensor) -> Tensor:
        """``values`` in the storage dtype with every row's norm <= C (re-clipped after rounding)."""
        stored = values.to(self.dtype)
        eps = torch.finfo(self.dtype).eps
        for attempt in range(8):  # rows rounded above C (by an ulp, or the cast) shrink to C (1 - 2^attempt eps)
            norms = torch.linalg.vector_norm(stored.float(), dim=1)
            over = norms > self.max_norm
            if not bool(over.any()):
                return stored
            shrink = torch.where(over, self.max_norm / norms * (1.0 - 2**attempt * eps), torch.ones_like(norms))
            stored = (stored.float() * shrink.unsqueeze(1)).to(self.dtype)
        raise RuntimeError("could not fit the table rows under the clipping bound")  # pragma: no cover

    @torch.no_grad()
    def store(self, indices: Tensor | Sequence[int], values: Tensor) -> None:
        """Line 7: g_bar += (new - old) / J and table[indices] = values (clipped gradients, one row per index)."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.rows.device)
        if index.numel() == 0:
            return
        new = self._fit(values.to(self.rows.device))
        self.total += new.sum(0, dtype=torch.float64) - self.rows[index].sum(0, dtype=torch.float64)
        self.rows[index] = new

    @torch.no_grad()
    def reset(self) -> None:
        """Zero table (a standard SAGA start; unbiased as well, only less accurate at first)."""
        self.rows.zero_()
        self.total.zero_()

    @torch.no_grad()
    def refresh_total(self) -> None:
        """Recompute the float64 sum from the rows (removes any drift of the incremental updates)."""
        self.total.copy_(self.rows.double().sum(0))


def saga_gradient_sum(table: SagaTable, indices: Tensor | Sequence[int], fresh: Tensor, sample_rate: float) -> Tensor:
    """Line 6 times qJ: ``sum_{xi in S} (c_xi - table[xi]) + q sum_j table[j]``, the table BEFORE line 7.

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
    """Lines 6-8 for one node: the released gradient g~ = (line 6 sum + N) / (qJ); then the table update (line 7).

    ``noise`` is N ~ N(0, s^2 I) on the sum (this node's own draw); ``qJ = sample_rate * table.num_rows``.
    """
    summed = saga_gradient_sum(table, indices, fresh, sample_rate)  # line 6 (table before the update)
    table.store(indices, fresh)  # line 7
    return (summed + noise.to(summed.dtype)) / (sample_rate * table.num_rows)  # line 8, divided by qJ
