"""Book-keeping for nn.Embedding: each example's gradient norm and the sum of clipped gradients from its token ids
and output gradients, never holding the (B, V, d) per-example gradients of the table (Opacus's closed form holds
them: 2.5 GB for GPT-2's 50,257 x 768 table at 16 examples).

Example i's gradient of the table is ``W_i = sum_t e_{id_t} g_t^T``: row v is the sum of the output gradients g_t at
the positions where token v occurs, every other row is 0. So

* its norm is that of at most T row sums: the positions' keys (example, token) are sorted, the g_t of each key
  added (``index_add_``), and the rows' norms summed per example;
* the clipped sum ``sum_i c_i W_i`` is one ``index_add_`` of the weighted output gradients c_i g_t into the table's
  rows per block of examples (:func:`~.gram.block_examples`), the blocks added in float64.

Rounding (docs/privacy.md, "What clipping guarantees"), with m_i = sum_t ||g_t|| the example's mass (float64, from
per-position norm bounds): the computed row sums err from the exact ones by at most gamma_T m_i (any order of
addition), and the example's terms in the batch's sum, at most R = block_examples(T) T per entry, by
(gamma_R + 2u) m_i (the factor's multiplication included); both are added to the norm bound of the computed rows, so
the bound holds whatever order a device adds in. The padding row gets no gradient (as in autograd). An example whose
bound is not finite (a non-finite output gradient, or one whose squares overflow) adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_privdec.privacy.per_sample.gram import block_examples
from lightning_privdec.privacy.rounding import (
    U64,
    full_precision,
    gamma,
    norm_upper_bound,
    sum_by_blocks,
    sum_rounding,
    tiny,
    unit_roundoff,
)


def covers(module: nn.Module) -> bool:
    """Whether ``module`` gets this arithmetic: an nn.Embedding with a dense gradient whose rows are not scaled by
    the batch's token counts (``scale_grad_by_freq`` couples the examples; those keep Opacus's closed form)."""
    return type(module) is nn.Embedding and not module.scale_grad_by_freq and not module.sparse


def has_bookkeeping(module: nn.Module, backprops: Tensor) -> bool:
    """Whether a covered embedding's call gets this arithmetic: output gradients (B, ..., d)."""
    return covers(module) and backprops.dim() >= 2 and backprops.shape[-1] == module.embedding_dim


def _flat(module: nn.Module, ids: Tensor, g: Tensor) -> tuple[Tensor, Tensor, torch.dtype]:
    """(ids (B, T), output gradients (B, T, d) in float32 at least, zero at the padding token's positions, the work
    dtype) of a call on ids of any shape (B, ...)."""
    work = torch.promote_types(torch.promote_types(g.dtype, module.weight.dtype), torch.float32)
    batch = g.shape[0]
    ids = ids.reshape(batch, -1)
    g = g.to(work).reshape(batch, ids.shape[1], module.embedding_dim)
    if module.padding_idx is not None:  # autograd gives the padding row no gradient, whatever g holds there
        g = g.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0.0)
    return ids, g, work


@dataclass
class _Rows:
    """An embedding's per-example gradients of one or more calls on the same table, as their non-zero rows: ``rows``
    (U, d) the computed sums of the output gradients per (example, token), ``example`` and ``token`` (U,) whose rows
    they are; per example, ``estimate`` (float64) bounds the norm of the exact gradient and ``rounding`` that of the
    example's terms in the calls' clipped sums, so their sum bounds what the calls add for it (module docstring);
    ``mass`` is sum_t ||g_t||, ``summed`` the relative error of a row sum (gamma_T, 0 where no token repeats)."""

    rows: Tensor
    example: Tensor
    token: Tensor
    estimate: Tensor
    rounding: Tensor
    mass: Tensor
    summed: float


def _rows(module: nn.Module, calls: list[tuple[Tensor, Tensor]]) -> _Rows:
    """:class:`_Rows` of ``calls`` ((ids, output gradients) of ``module``'s table, one batch size), their positions
    taken together (an embedding called on a model's input and on its target, a tied table's calls)."""
    flat = [_flat(module, ids, g) for ids, g in calls]
    batch, dim, work = calls[0][1].shape[0], module.embedding_dim, flat[0][2]
    ids = torch.cat([f[0] for f in flat], dim=1)
    g = torch.cat([f[1] for f in flat], dim=1)
    steps = ids.shape[1]
    norms = norm_upper_bound(g, dim=-1) if steps else g.new_zeros(batch, 0, dtype=torch.float64)
    rounding = torch.zeros(batch, dtype=torch.float64, device=g.device)
    start = 0
    for f in flat:  # each call's clipped sum is its own, over blocks of its own positions
        terms = block_examples(f[0].shape[1]) * f[0].shape[1]
        rounding += norms[:, start : start + f[0].shape[1]].sum(dim=1) * sum_rounding(terms, work)
        rounding += terms * tiny(work) * math.sqrt(module.weight.numel())
        start += f[0].shape[1]
    mass = norms.sum(dim=1)
    keys = torch.arange(batch, device=ids.device).unsqueeze(1) * module.num_embeddings + ids.long()
    unique, inverse = torch.unique(keys.flatten(), return_inverse=True)
    if unique.numel() == keys.numel():  # no token twice in an example: the rows are the output gradients
        order = torch.argsort(keys.flatten())
        rows, unique, summed = g.reshape(-1, dim)[order], keys.flatten()[order], 0.0
    else:
        rows = g.new_zeros(unique.numel(), dim).index_add_(0, inverse, g.reshape(-1, dim))
        summed = gamma(steps, unit_roundoff(work))
    example = unique // module.num_embeddings
    squares = torch.zeros(batch, dtype=torch.float64, device=g.device)
    squares.index_add_(0, example, norm_upper_bound(rows, dim=1).square())
    estimate = squares.mul_(1 + gamma(steps + 2, U64)).sqrt_() + summed * mass
    return _Rows(rows, example, unique - example * module.num_embeddings, estimate, rounding, mass, summed)


def norm_bound(module: nn.Module, ids: Tensor, g: Tensor) -> Tensor:
    """Per example, an upper bound (float64) of the norm of what :func:`clipped_sums` adds for it at clip factor 1,
    rounding included (module docstring); inf where it is not finite."""
    if g.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=g.device)
    with full_precision():
        parts = _rows(module, [(ids, g)])
        return _finite_or_inf(parts.estimate + parts.rounding)


def tied_bound(module: nn.Module, calls: list[tuple[Tensor, Tensor]], linear: nn.Module | None = None,
               x: Tensor | None = None, g_out: Tensor | None = None, bound: Any = None) -> Tensor:
    """Per example, an upper bound (float64) of the norm of what the embedding ``calls`` on one table and, where
    given, the nn.Linear ``linear`` whose weight is that table (a tied output layer: input ``x``, output gradient
    ``g_out``, its book-keeping ``bound``) add to the table's clipped sum together, at clip factor 1.

    With E the embedding's gradient and A the output layer's, ||A + E||^2 = ||A||^2 + ||E||^2 + 2 <A, E>, where
    <A, E> = sum_t sum_v g_out[t, v] <x_t, E[v]> runs over the tokens v the example holds only (E's non-zero rows):
    computed in float32 with its error bound gamma_{d + T U + 1} sum_t ||x_t|| sum_v |g_out[t, v]| ||E[v]||, and the
    rows' own rounding ||A|| gamma_T m_i. The bound is the root of the bounds of the three terms plus both calls'
    rounding in the sums, times 1 + gamma_k for the k sums' additions; never above the triangle inequality's
    ||A|| + ||E|| (the output layer's examples computed apart have only that one)."""
    with full_precision():
        parts = _rows(module, calls)
        k = len(calls)
        if linear is None:
            joint = parts.estimate + parts.rounding
        elif bound.estimate is None or bound.rounding is None:
            k += 1
            joint = bound.upper + parts.estimate + parts.rounding
        else:
            k += 1
            triangle = bound.upper + parts.estimate + parts.rounding
            cross = _cross_upper(parts, x, g_out, bound.estimate)
            estimate_a = bound.estimate
            squared = estimate_a.square() + parts.estimate.square() + 2 * cross
            magnitude = estimate_a.square() + parts.estimate.square() + 2 * cross.abs()
            squared = (squared + 4 * U64 * magnitude).clamp_min(0)
            joint = squared.sqrt() * (1 + 1e-12) + bound.rounding + parts.rounding
            apart = bound.exact if bound.exact is not None else torch.zeros_like(triangle, dtype=torch.bool)
            joint = torch.where(apart | ~torch.isfinite(joint), triangle, torch.minimum(joint, triangle))
        return _finite_or_inf(joint * (1 + gamma(k, unit_roundoff(module.weight.dtype))))  # (sums added in its dtype)


def _cross_upper(parts: _Rows, x: Tensor, g_out: Tensor, estimate_a: Tensor) -> Tensor:
    """An upper bound (float64) of <A_i, E_i> per example (:func:`tied_bound`): its float32 value over the example's
    rows, padded to the most rows an example has, plus the error bounds."""
    batch, dim = g_out.shape[0], parts.rows.shape[1]
    work = parts.rows.dtype
    x = x.to(work).reshape(batch, -1, dim)
    g_out = g_out.to(work).reshape(batch, x.shape[1], -1)
    steps = x.shape[1]
    counts = torch.bincount(parts.example, minlength=batch)
    most = int(counts.max()) if counts.numel() else 0
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(parts.example.numel(), device=x.device) - first[parts.example]
    padded = parts.rows.new_zeros(batch, most, dim)
    padded[parts.example, slot] = parts.rows
    tokens = torch.zeros(batch, most, dtype=torch.long, device=x.device)
    tokens[parts.example, slot] = parts.token
    held = torch.zeros(batch, most, dtype=torch.bool, device=x.device)
    held[parts.example, slot] = True
    picked = torch.where(held.unsqueeze(1), g_out.gather(2, tokens.unsqueeze(1).expand(batch, steps, most)), 0.0)
    value = (torch.bmm(x, padded.transpose(1, 2)) * picked).sum(dim=(1, 2)).double()  # (B, T, U) products
    row_norms = norm_upper_bound(padded, dim=2)  # (B, U), 0 at the padding
    x_norms = norm_upper_bound(x, dim=2)  # (B, T)
    majorant = ((picked.abs().double() @ row_norms.unsqueeze(2)).squeeze(2) * x_norms).sum(dim=1) * (1 + 1e-6)
    error = (gamma(dim + steps * most + 1, unit_roundoff(work)) * majorant + estimate_a * parts.summed * parts.mass
             + steps * most * (dim + 1) * tiny(work))  # (and each product that underflows)
    return value + error


def _finite_or_inf(upper: Tensor) -> Tensor:
    return upper.masked_fill(~torch.isfinite(upper), math.inf)


def clipped_sums(
    module: nn.Module, ids: Tensor, g: Tensor, factor: Tensor, upper: Tensor, into: Tensor | None = None
) -> dict[nn.Parameter, Tensor]:
    """``{weight: sum_i factor_i W_i}``: the weighted output gradients added into the table's rows, per block of
    examples (module docstring); an example whose bound ``upper`` is not finite adds nothing. ``into``: a buffer of
    the weight's shape and dtype the sum may be written into when the batch is one block."""
    with full_precision():
        ids, g, work = _flat(module, ids, g)
        steps, dim = ids.shape[1], module.embedding_dim
        finite = torch.isfinite(upper.to(g.device))
        factor = torch.where(finite, factor.to(g.device, torch.float64), 0.0).to(work)
        weighted = torch.where(finite.view(-1, 1, 1), g * factor.view(-1, 1, 1), 0.0)
        block = block_examples(steps)
        use = into if g.shape[0] <= block and into is not None and into.dtype == work else None

        def table(ids: Tensor, weighted: Tensor) -> dict[int, Tensor]:
            out = weighted.new_zeros(module.weight.shape) if use is None else use.zero_()
            return {0: out.index_add_(0, ids.flatten(), weighted.reshape(-1, dim))}

        return {module.weight: sum_by_blocks((ids, weighted), block, table)[0]}
