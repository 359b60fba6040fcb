"""Book-keeping for nn.Embedding: each example's gradient norm and the sum of clipped gradients from its token ids
and output gradients, never holding the (B, V, d) per-example gradients of the table (Opacus's closed form holds
them: 2.5 GB for GPT-2's 50,257 x 768 table at 16 examples).

Example i's gradient of the table is ``W_i = sum_t e_{id_t} g_t^T``: row v is the sum of the output gradients g_t at
the positions where token v occurs, every other row is 0. So

* its norm is that of at most T row sums: the positions' keys (example, token) are sorted, the g_t of each key
  added in float64 (``index_add_``), and the rows' norms summed per example;
* the clipped sum ``sum_i c_i W_i`` is one ``index_add_`` of the weighted output gradients c_i g_t into the table's
  rows per block of examples (:func:`~.gram.block_examples`), the blocks added in float64.

Rounding (docs/privacy.md, "What clipping guarantees"), with m_i = sum_t ||g_t|| the example's mass (float64, from
per-position norm bounds): the float64 row sums of an example that repeats a token err from the exact ones by at
most float64's gamma_T m_i (any order of addition: a device's atomic additions move the bound by about 1e-16 only),
and the example's terms in the batch's sum, at most R + 1 per entry
(R = block_examples(T) T, and the examples computed apart), by (gamma_{R+1} + 2u) m_i (the factor's multiplication
included); both are added to the norm bound of the computed rows, so the bound holds whatever order a device adds
in, and depends on the example alone. An example whose terms are large against its bound (u sqrt(R) 1e3 m_i above
it: tokens whose output gradients cancel) would, clipped, round the other examples' terms differently once another
example is removed: its float64 rows are added after the batch's sum instead, as book-keeping's ill-conditioned
nn.Linear examples are. The padding row gets no gradient (as in autograd). An example whose bound is not finite adds
nothing. Tables of fewer than :data:`MIN_ENTRIES` entries keep the closed form (cheaper there).
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

#: tables with fewer entries (V d) keep Opacus's closed form: each example's V d entries then cost less than this
#: arithmetic's host operations (a 64-token table: GPT-2's step 2.11x -> 2.33x its non-private one with book-keeping)
MIN_ENTRIES = 1 << 16


def covers(module: nn.Module) -> bool:
    """Whether ``module`` gets this arithmetic: an nn.Embedding of at least :data:`MIN_ENTRIES` entries with a dense
    gradient whose rows are not scaled by the batch's token counts (``scale_grad_by_freq`` couples the examples;
    those keep Opacus's closed form)."""
    return (type(module) is nn.Embedding and not module.scale_grad_by_freq and not module.sparse
            and module.weight.numel() >= MIN_ENTRIES)  # fmt: skip


def has_bookkeeping(module: nn.Module, backprops: Tensor) -> bool:
    """Whether a covered embedding's call gets this arithmetic: output gradients (B, ..., d)."""
    return covers(module) and backprops.dim() >= 2 and backprops.shape[-1] == module.embedding_dim


def _flat(module: nn.Module, ids: Tensor, g: Tensor) -> tuple[Tensor, Tensor, torch.dtype]:
    """(ids (B, T), output gradients (B, T, d) in float32 at least, zero at the padding token's positions, the work
    dtype) of a call on ids of any shape (B, ...)."""
    work = torch.promote_types(torch.promote_types(g.dtype, module.weight.dtype), torch.float32)
    batch = g.shape[0]
    ids = ids.reshape(batch, math.prod(ids.shape[1:]))
    g = g.to(work).reshape(batch, ids.shape[1], module.embedding_dim)
    if module.padding_idx is not None:  # autograd gives the padding row no gradient, whatever g holds there
        g = g.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0.0)
    return ids, g, work


@dataclass
class _Rows:
    """An embedding's per-example gradients of one or more calls on one table, as their non-zero rows: ``rows``
    (U, d) the sums of the output gradients per (example, token) in float64 (whatever order a device adds in, the
    same to about 1e-16), ``example`` and ``token`` (U,) whose rows they are, ``counts`` (B,) how many rows each
    example has; per example (float64), ``estimate`` bounds the norm of the exact gradient and ``rounding`` that of
    the example's terms in the calls' clipped sums (module docstring), ``mass`` is sum_t ||g_t||, ``summed`` the
    relative error of its row sums (float64's gamma_T, 0 where it repeats no token), ``steps`` its positions T (at
    least U_i), ``terms`` the most terms an entry of a call's sum adds (R + 1), ``work`` the sums' dtype."""

    rows: Tensor
    example: Tensor
    token: Tensor
    counts: Tensor
    estimate: Tensor
    rounding: Tensor
    mass: Tensor
    summed: Tensor
    steps: int
    terms: int
    work: torch.dtype


@dataclass
class CallBound:
    """What :func:`clipped_sums` and :func:`tied_bound` take from a call's :func:`norm_bound`: its rows, and which
    examples are computed apart (bool (B,); None: none), whose float64 rows are added after the batch's sum."""

    parts: _Rows
    apart: Tensor | None


def _rows(calls: list[tuple[nn.Module, Tensor, Tensor]]) -> _Rows:
    """:class:`_Rows` of ``calls`` ((module, ids, output gradients) on one table, one batch size), their positions
    taken together (an embedding called on a model's input and on its target, modules sharing a table)."""
    table = calls[0][0]
    flat = [_flat(module, ids, g) for module, ids, g in calls]
    batch, dim, work = flat[0][1].shape[0], table.embedding_dim, flat[0][2]
    ids = torch.cat([f[0] for f in flat], dim=1)
    g = torch.cat([f[1] for f in flat], dim=1)
    steps = ids.shape[1]
    norms = norm_upper_bound(g, dim=-1) if steps else g.new_zeros(batch, 0, dtype=torch.float64)
    terms = max(block_examples(f[0].shape[1]) * f[0].shape[1] for f in flat) + 1
    rounding = torch.zeros(batch, dtype=torch.float64, device=g.device)
    start = 0
    for f in flat:  # each call's clipped sum is its own, over blocks of its own positions (and those computed apart)
        call_terms = block_examples(f[0].shape[1]) * f[0].shape[1] + 1
        rounding += norms[:, start : start + f[0].shape[1]].sum(dim=1) * sum_rounding(call_terms, work)
        rounding += call_terms * tiny(work) * math.sqrt(table.weight.numel())
        start += f[0].shape[1]
    mass = norms.sum(dim=1)
    keys = torch.arange(batch, device=ids.device).unsqueeze(1) * table.num_embeddings + ids.long()
    unique, inverse = torch.unique(keys.flatten(), return_inverse=True)
    if unique.numel() == keys.numel():  # no token twice in an example: the rows are the output gradients
        order = torch.argsort(keys.flatten())
        rows, unique = g.reshape(-1, dim)[order].double(), keys.flatten()[order]
    else:
        rows = torch.zeros(unique.numel(), dim, dtype=torch.float64, device=g.device)
        rows.index_add_(0, inverse, g.reshape(-1, dim).double())
    example = unique // table.num_embeddings
    counts = torch.bincount(example, minlength=batch)
    summed = torch.where(counts < steps, gamma(steps, U64), 0.0).double()  # (each example's own)
    squares = torch.zeros(batch, dtype=torch.float64, device=g.device)
    squares.index_add_(0, example, norm_upper_bound(rows, dim=1).square())
    estimate = squares.mul_(1 + gamma(steps + 2, U64)).sqrt_() + summed * mass
    return _Rows(rows, example, unique - example * table.num_embeddings, counts, estimate, rounding, mass, summed,
                 steps, terms, work)


def _ill_conditioned(mass: Tensor, bound: Tensor, terms: int, u: float) -> Tensor:
    """Per example, whether its terms are large against its bound (book-keeping's criterion for nn.Linear)."""
    return mass * (u * math.sqrt(terms) * 1e3) > bound


def norm_bound(module: nn.Module, ids: Tensor, g: Tensor) -> tuple[Tensor, CallBound | None]:
    """Per example, an upper bound (float64) of the norm of what :func:`clipped_sums` adds for it at clip factor 1,
    rounding included (module docstring; inf where it is not finite), and the call's rows with the examples computed
    apart (None for an empty batch): their float64 rows, bounded by the same estimate, times 1 + 2u for their cast
    to the work dtype and their addition after the batch's sum."""
    if g.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=g.device), None
    with full_precision():
        parts = _rows([(module, ids, g)])
        u = unit_roundoff(parts.work)
        apart = _ill_conditioned(parts.mass, parts.estimate, parts.terms, u)
        upper = parts.estimate + parts.rounding
        if not bool(apart.any()):
            return _finite_or_inf(upper), CallBound(parts, None)
        upper = torch.where(apart, parts.estimate * (1 + 2 * u) * (1 + 1e-12), upper)
        return _finite_or_inf(upper), CallBound(parts, apart)


def tied_bound(calls: list[tuple[nn.Module, Tensor, Tensor]], call_uppers: list[Tensor],
               call_bounds: list[CallBound | None], linear: nn.Module | None = None, x: Tensor | None = None,
               g_out: Tensor | None = None, bound: Any = None) -> Tensor:
    """Per example, an upper bound (float64) of the norm of what the embedding ``calls`` on one table (each with its
    own bound ``call_uppers`` and :class:`CallBound`, whose rows serve a single call) and, where given, the nn.Linear
    ``linear``
    whose weight is that table (a tied output layer: input ``x``, output gradient ``g_out``, its book-keeping
    ``bound``) add to the table's clipped sum together, at clip factor 1.

    With E the embedding's gradient and A the output layer's, ||A + E||^2 = ||A||^2 + ||E||^2 + 2 <A, E>, where
    <A, E> = sum_t sum_v g_out[t, v] <x_t, E[v]> runs over the U_i tokens v the example holds only (E's non-zero
    rows): computed in float64 with its error bound gamma_{d + T U_i + 1} sum_t ||x_t|| sum_v |g_out[t, v]| ||E[v]||
    and the products' underflow, plus ||A|| gamma_T m_i for the rows' rounding. The bound is the root of the bounds
    of the three terms plus every call's rounding in its sum, times 1 + gamma_k for the k sums' additions; it is the
    triangle inequality's sum of the calls' own bounds instead where that is smaller, where a call computed the
    example apart, and where the example's terms are large against the joint bound (the calls' terms, clipped by it,
    would round the other examples' terms)."""
    batch = calls[0][2].shape[0]
    table = calls[0][0]
    k = len(calls) + (linear is not None)
    if batch == 0:
        return torch.zeros(0, dtype=torch.float64, device=calls[0][2].device)
    with full_precision():
        parts = call_bounds[0].parts if len(calls) == 1 and call_bounds[0] is not None else _rows(calls)
        u = unit_roundoff(parts.work)
        triangle = sum(call_uppers)
        apart = torch.zeros(batch, dtype=torch.bool, device=triangle.device)
        for call_bound in call_bounds:
            if call_bound is not None and call_bound.apart is not None:
                apart |= call_bound.apart
        mass = parts.mass
        if linear is None:
            joint = parts.estimate + parts.rounding
        else:
            triangle = triangle + bound.upper
            if bound.exact is not None:
                apart |= bound.exact
            if bound.estimate is None or bound.rounding is None:
                joint = triangle
            else:
                cross = _cross_upper(parts, x, g_out, bound.estimate)
                squared = bound.estimate.square() + parts.estimate.square() + 2 * cross
                magnitude = bound.estimate.square() + parts.estimate.square() + 2 * cross.abs()
                squared = (squared + 4 * U64 * magnitude).clamp_min(0)
                joint = squared.sqrt() * (1 + 1e-12) + bound.rounding + parts.rounding
                mass = mass + _linear_mass(x, g_out)
        linear_steps = 0 if x is None else _steps_of(x).shape[1]
        terms = max(parts.terms, block_examples(linear_steps) * linear_steps)
        conditioned = ~_ill_conditioned(mass, joint, terms, u)
        joint = torch.where(apart | ~conditioned | ~torch.isfinite(joint), triangle, torch.minimum(joint, triangle))
        return _finite_or_inf(joint * (1 + gamma(k, unit_roundoff(table.weight.dtype))))  # (sums: the table's dtype)


def _steps_of(t: Tensor) -> Tensor:
    """``t`` (B, ..., n) as (B, T, n)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _linear_mass(x: Tensor, g_out: Tensor) -> Tensor:
    """The output layer's terms' mass sum_t ||g_out[t]|| ||x_t|| per example (float64)."""
    return (norm_upper_bound(_steps_of(g_out), dim=-1) * norm_upper_bound(_steps_of(x), dim=-1)).sum(dim=1)


def _cross_upper(parts: _Rows, x: Tensor, g_out: Tensor, estimate_a: Tensor) -> Tensor:
    """An upper bound (float64) of <A_i, E_i> per example (:func:`tied_bound`): its value over the example's rows,
    computed in float64, the rows padded with zero rows to the positions T (a width of the shapes alone: a width
    taken from the batch's largest U_i made the reduction's rounding, and with it each example's bound, depend on
    the other examples), plus its error bounds, each of the example's own sizes."""
    batch, dim, width = g_out.shape[0], parts.rows.shape[1], parts.steps
    x, g_out = _steps_of(x).double(), _steps_of(g_out)
    steps = x.shape[1]
    first = torch.cumsum(parts.counts, 0) - parts.counts
    slot = torch.arange(parts.example.numel(), device=x.device) - first[parts.example]
    padded = parts.rows.new_zeros(batch, width, dim)
    padded[parts.example, slot] = parts.rows
    tokens = torch.zeros(batch, width, dtype=torch.long, device=x.device)
    tokens[parts.example, slot] = parts.token
    held = torch.zeros(batch, width, dtype=torch.bool, device=x.device)
    held[parts.example, slot] = True
    picked = torch.where(held.unsqueeze(1), g_out.gather(2, tokens.unsqueeze(1).expand(batch, steps, width)).double(),
                         0.0)  # g_out[t, v] (float32 or narrower: exact in float64)
    value = (torch.bmm(x, padded.transpose(1, 2)) * picked).sum(dim=(1, 2))  # (B, T, U) products
    row_norms = norm_upper_bound(padded, dim=2)  # (B, U), 0 at the padding
    x_norms = norm_upper_bound(x, dim=2)  # (B, T)
    absolute = picked.abs()
    majorant = ((absolute @ row_norms.unsqueeze(2)).squeeze(2) * x_norms).sum(dim=1) * (1 + 1e-6)
    n = (dim + steps * parts.counts + 1).double() * U64  # float64's gamma_{d + T U_i + 1}, per example
    relative = torch.where(n < 0.5, n / (1 - n), math.inf)
    underflow = (dim * absolute.sum(dim=(1, 2)) + steps * parts.counts) * tiny(torch.float64)
    return value + relative * majorant + estimate_a * parts.summed * parts.mass + underflow


def _finite_or_inf(upper: Tensor) -> Tensor:
    return upper.masked_fill(~torch.isfinite(upper), math.inf)


def clipped_sums(
    module: nn.Module, ids: Tensor, g: Tensor, factor: Tensor, upper: Tensor, call: CallBound | None = None,
    into: Tensor | None = None,
) -> dict[nn.Parameter, Tensor]:
    """``{weight: sum_i factor_i W_i}``: the weighted output gradients added into the table's rows, per block of
    examples, then the float64 rows of the examples ``call`` computes apart (module docstring); an example whose
    bound ``upper`` is not finite adds nothing. ``into``: a buffer of the weight's shape and dtype the sum may be
    written into when the batch is one block."""
    if g.shape[0] == 0:
        return {module.weight: torch.zeros_like(module.weight, dtype=torch.float64)}
    with full_precision():
        ids, g, work = _flat(module, ids, g)
        steps, dim = ids.shape[1], module.embedding_dim
        factor = factor.to(g.device, torch.float64)
        batch_factor = torch.where(torch.isfinite(upper.to(g.device)), factor, 0.0)
        apart = None if call is None else call.apart
        if apart is not None:
            batch_factor = torch.where(apart, 0.0, batch_factor)
        # in float64: a float32 sum over examples is not a sum of what each adds (rounding.sum_by_blocks)
        weighted = torch.where((batch_factor > 0).view(-1, 1, 1), g.double() * batch_factor.view(-1, 1, 1), 0.0)
        block = block_examples(steps)
        use = into if g.shape[0] <= block and into is not None and into.dtype == torch.float64 else None

        def table(ids: Tensor, weighted: Tensor) -> dict[int, Tensor]:
            out = weighted.new_zeros(module.weight.shape) if use is None else use.zero_()
            return {0: out.index_add_(0, ids.flatten(), weighted.reshape(-1, dim))}

        summed = sum_by_blocks((ids, weighted), block, table)[0]
        if apart is not None:
            parts, held = call.parts, apart[call.parts.example]  # the rows of the examples computed apart
            example, token = parts.example[held], parts.token[held]
            rows = parts.rows[held] * torch.where(torch.isfinite(upper), factor, 0.0)[example].unsqueeze(1)
            tokens, inverse = torch.unique(token, return_inverse=True)
            added = torch.zeros(tokens.numel(), dim, dtype=torch.float64, device=g.device).index_add_(0, inverse, rows)
            summed.index_add_(0, tokens, added)
        return {module.weight: summed}
