"""Book-keeping's per-layer arithmetic: each example's squared gradient norm and the sum of CLIPPED gradients of one
layer call, from its inputs ``a`` and output gradients ``g`` alone (Bu, Wang, Zha, Karypis 2023), never holding the
per-sample gradients of the whole batch.

A layer whose output is a product ``s = W u`` over positions t = 1..T (nn.Linear on (B, T, d): u = a; a convolution:
u = the unfolded input patches, T = output positions) has per-example weight gradient ``G_i U_i^T`` with
``G_i`` of shape (d_out, T) and ``U_i`` of shape (p, T). Its squared norm is computed the cheaper of two ways:

* ghost norm (Li, Tramer, Liang, Hashimoto 2022, Sec. 4): ``||G_i U_i^T||^2 = <G_i^T G_i, U_i^T U_i>``, two T x T
  Gram matrices, cost ~ B T^2 (p + d_out); for T = 1 it is ``||g_i||^2 ||a_i||^2`` (Goodfellow 2015);
* for a convolution, the same ghost norm with ``U_i^T U_i`` built from the Gram matrix of the padded INPUT's
  positions, ``S_i = A_i^T A_i`` (N x N, N padded positions): patches t and t' overlap, and
  ``(U_i^T U_i)[t, t'] = sum_{kernel taps k} S_i[pos(t) + k, pos(t') + k]``; cost ~ B (N^2 c_in + T^2 d_out + K T^2)
  for K taps, about K times less than unfolding when the map is small (ResNet's 8x8 and 4x4 stages);
* one example at a time: its weight gradient (a batch-of-one weight-gradient call), its norm, then dropped;
  cost ~ B T p d_out, the weight gradient's own cost, memory one example's gradient.

:func:`norm_method` picks the cheapest of these by multiply-adds (per group of a grouped convolution). The clipped
sum ``sum_i c_i G_i U_i^T`` is then ONE weight-gradient computation with the output gradients scaled by ``c_i`` (a
matrix product for nn.Linear, ``convolution_backward`` for convolutions or, where a convolution's output has few
positions, matrix products of its input patches), except for a convolution whose norms were computed one example at
a time and whose examples' weight gradients hold no more entries than its input, its output gradient or
``PER_EXAMPLE_ENTRIES`` (:func:`~.bookkeeping_conv.keeps_rows`): those gradients are kept, and its clipped sum is
their weighted sum, B rows instead of a second computation of T p d_out per example.

Rounding: every norm that sets a clip factor is an upper bound of the norm of what the example adds, whatever the
inputs (:func:`norm_bound`; docs/privacy.md, "What clipping guarantees"). With m_i = sum_t ||g_t|| ||u_t|| the
example's mass (float64, from per-token norms), the Gram norm errs by at most gamma m_i^2 (:func:`_gram_error`), a
per-example or bias sum by gamma_T m_i, and the example's terms in the batch's sum by (gamma_R + 4u) m_i; each
bound is added. An example whose bound is loose, or whose terms are large against its norm, is computed alone in
float64 and added after the batch's product (:class:`NormBound`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_privdec.privacy.per_sample import bookkeeping_embedding
from lightning_privdec.privacy.per_sample.bookkeeping_conv import (  # one chunk size for both per-example paths
    PER_EXAMPLE_ENTRIES,
    _conv_estimates,
    _conv_weight_grad,
    _patch_norms,
    keeps_rows,
    sum_of_rows,
    sums_by_rows,
    writes_into,
)
from lightning_privdec.privacy.per_sample.gram import (
    _bias_bound,
    _gram_error,
    _gram_inner_products,
    _huge_inputs,
    _plus,
    _root_upper,
    block_examples,
)
from lightning_privdec.privacy.rounding import U64 as _U64
from lightning_privdec.privacy.rounding import (
    full_precision,
    gamma,
    norm_upper_bound,
    sum_by_blocks,
    sum_rounding,
    unit_roundoff,
    weighted_row_sum,
)
from lightning_privdec.privacy.rounding import tiny as _tiny

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
def _steps(module: nn.Module, g: Tensor) -> int:
    """Positions (tokens) per example of a layer call with output gradient ``g``."""
    return math.prod(g.shape[1:-1]) if _is_linear(module) else math.prod(g.shape[2:])


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's attention and MLP): ``y = x W + b`` with W of shape (in, out), a linear
    layer whose weight is stored transposed."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def transposed_linear_grad_samples(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict:
    """Per-example gradients of a :func:`is_transposed_linear` layer (the closed-form rule of the other modes)."""
    a, out = activations[0].to(backprops.dtype), {}
    if layer.weight.requires_grad:
        out[layer.weight] = torch.einsum("n...i,n...j->nij", a, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = torch.einsum("n...k->nk", backprops)
    return out


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear or is_transposed_linear(module)


def covers(module: nn.Module) -> bool:
    """Whether ``module``'s type gets this arithmetic: nn.Linear (or Hugging Face's transposed ``Conv1D``), a
    zero-padded convolution with numeric padding, or an nn.Embedding (:mod:`.bookkeeping_embedding`)."""
    if _is_linear(module) or bookkeeping_embedding.covers(module):
        return True
    return type(module) in _CONVOLUTIONS and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def has_bookkeeping(module: nn.Module, backprops: Tensor) -> bool:
    """Whether a rule layer's call gets this arithmetic: a covered layer on (B, d) or (B, T, d) (nn.Linear) or on
    batch-first (B, C, *spatial) inputs (convolutions), or a trainable embedding's (B, ..., d) output gradients."""
    if type(module) is nn.Embedding:
        return module.weight.requires_grad and bookkeeping_embedding.has_bookkeeping(module, backprops)
    if not covers(module):
        return False
    return backprops.dim() in (2, 3) if _is_linear(module) else backprops.dim() == module.weight.dim()


def squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype, method: str | None = None) -> Tensor:
    """Squares of :func:`norm_bound`'s upper bounds (``||grad_i||^2`` of ``module``'s trainable parameters, rounding
    included), shape (B,), in ``dtype``; by ``method`` (default: :func:`norm_method`'s choice)."""
    return norm_bound(module, a, g, method).upper.square().to(dtype)


@dataclass
class NormBound:
    """One layer call's per-example norms, as :func:`clipped_sums` needs them.

    ``upper[i]`` (float64) bounds, whatever the inputs and the rounding, the norm of what :func:`clipped_sums` adds
    for example i at clip factor 1: the exact per-example gradient's norm plus every rounding error of computing it
    and of the example's terms in the batch's sum. ``exact`` marks the ill-conditioned examples (their Gram-matrix
    norm would be loose, or their large, cancelling terms would round the batch's sum): their gradients
    ``exact_grads`` (float64, one row per marked example) are computed apart and added after the batch's sum.
    ``rows``: a convolution's per-example weight gradients (B, weight entries) kept from its norms
    (:func:`~.bookkeeping_conv.keeps_rows`), whose weighted sum is its clipped weight sum; ``upper`` also covers that
    sum's rounding; the rows of examples computed apart are zeroed (:func:`compute_exact`). ``upper`` is the sum of
    ``estimate`` (a bound of the exact gradient's norm) and ``rounding`` (that of the example's terms in the batch's
    sum), kept where known for the joint bound of a tied embedding (:mod:`.bookkeeping_embedding`); an example in
    ``exact`` has only ``upper``. An embedding's rows and examples computed apart are ``embedding``
    (:class:`~.bookkeeping_embedding.CallBound`), not ``exact``.
    """

    upper: Tensor
    exact: Tensor | None = None
    exact_grads: dict[nn.Parameter, Tensor] = field(default_factory=dict)
    rows: Tensor | None = None
    estimate: Tensor | None = None
    rounding: Tensor | None = None
    embedding: Any = None


def norm_bound(
    module: nn.Module, a: Tensor, g: Tensor, method: str | None = None, *, defer_exact: bool = False,
    keep_rows: bool = False,
) -> NormBound:
    """Per-example upper bounds of the gradient norms of a covered layer call (module docstring, "Rounding").
    ``defer_exact``: leave the ill-conditioned examples marked in ``exact`` without computing them (no host
    synchronisation); :func:`compute_exact` finishes them. ``keep_rows``: a convolution's per-example weight
    gradients are kept where :func:`~.bookkeeping_conv.keeps_rows` says so (for :func:`clipped_sums`)."""
    if type(module) is nn.Embedding:  # its rows and examples computed apart: bound.embedding
        upper, call = bookkeeping_embedding.norm_bound(module, a, g)
        return NormBound(upper, embedding=call)
    work = _work_dtype(module, g)
    batch = g.shape[0]
    if batch == 0:
        return NormBound(torch.zeros(0, dtype=torch.float64, device=g.device))
    kept = None
    with full_precision():
        a = a.to(work) if a.is_floating_point() else a
        g = g.to(work)
        if _is_linear(module):
            estimate, mass, loose, rows = _linear_estimates(module, a, g, method)
        else:
            estimate, mass, loose, rows, kept = _conv_estimates(module, a, g, method or norm_method(module, a, g),
                                                                keep_rows and keeps_rows(module, a, g))
        u = unit_roundoff(work)
        # the clipped sum's rounding of this example's terms, charged at float32's rates (`rows` = block_examples(T)
        # T terms per entry, or T where each example's product is its own, the factor's multiplication and two more
        # roundings, 2u, and the products' underflow): the sum over examples is float64 (rounding.sum_by_blocks), so
        # this overestimates it; independent of the batch size
        rounding = mass * (sum_rounding(rows, work) + 2 * u) + rows * _tiny(work) * math.sqrt(_numel(module))
        upper = estimate + rounding
        # an example whose terms are large against its norm would round the whole batch's sum: computed apart
        isolate = mass * (u * math.sqrt(rows) * 1e3) > estimate
        # an example whose output gradients are all exactly 0 adds exactly 0 (its finite inputs times 0; a non-finite
        # input makes its bound non-finite): its gradient is known exactly, though its bound is all rounding floors
        zero = _all_zero(g)
        exact = ((isolate if loose is None else loose | isolate) & ~zero) | ~torch.isfinite(upper)
    bound = NormBound(upper, exact, rows=kept, estimate=estimate, rounding=rounding)
    return bound if defer_exact else compute_exact(module, a, g, bound)


def _all_zero(g: Tensor) -> Tensor:
    """Per example, whether every entry of ``g`` is exactly 0 (a NaN is not; an example without entries is): the
    largest magnitude, one pass and a reduction (a comparison of every entry, then ``any``, took 3x as long)."""
    rows = g.flatten(1)
    if rows.shape[1] == 0:
        return torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
    return rows.abs().amax(dim=1) == 0


#: layer calls of one shape are stacked for :func:`norm_bounds` while their inputs and output gradients together hold
#: at most this many entries on a CPU (past it a call's own arithmetic costs more than its operations' fixed costs)
STACK_ENTRIES = 1 << 20
#: on a GPU an operation's fixed cost (its launch, ~10 us) is that of far more arithmetic: calls this many times
#: larger are stacked there (GPT-2 small's layers at 32 sequences of 128 tokens: 6-16M entries each)
DEVICE_STACK_FACTOR = 64
#: a stack holds at most this many entries (its copies of the inputs and output gradients: 512 MiB in float32)
GROUP_ENTRIES = 1 << 27


def stack_entries(device: torch.device) -> int:
    """The most entries a layer call (or a materialised per-example gradient) may hold to be stacked on ``device``."""
    return STACK_ENTRIES if device.type == "cpu" else STACK_ENTRIES * DEVICE_STACK_FACTOR


def _shape_key(module: nn.Module, a: Tensor, g: Tensor) -> tuple | None:
    """What :func:`norm_bound` reads of a call besides its examples' values: calls with equal keys get the same
    arithmetic per example, whether alone or stacked along the batch dimension; None: not stacked."""
    if type(module) is nn.Embedding or a.numel() + g.numel() > stack_entries(g.device) or a.dim() < 2:
        return None
    weight, bias = module.weight, module.bias
    key = (type(module), weight.shape, weight.dtype, weight.requires_grad, bias is not None and bias.requires_grad,
           a.shape[1:], a.dtype, g.shape[1:], g.dtype, g.device)
    if _is_linear(module):
        return key
    return key + (module.stride, module.padding, module.dilation, module.groups)


def norm_bounds(calls: list[tuple[nn.Module, Tensor, Tensor]]) -> list[NormBound]:
    """:func:`norm_bound` (``defer_exact``, ``keep_rows``) of each ``(module, a, g)``, the calls of one shape
    (:func:`_shape_key`: the query, key and value projections of every layer of a transformer) computed together,
    stacked along the batch dimension: every quantity of the bound is per example, so each example's bound is what
    its call alone would give (up to the rounding of its own products, which the bound covers), in a few operations
    instead of a few per call."""
    out: list[NormBound | None] = [None] * len(calls)
    keys = [_shape_key(module, a, g) for module, a, g in calls]
    for members in _groups(keys, [a.numel() + g.numel() for _, a, g in calls]):
        if len(members) == 1:
            module, a, g = calls[members[0]]
            out[members[0]] = norm_bound(module, a, g, defer_exact=True, keep_rows=True)
            continue
        module = calls[members[0]][0]
        a = torch.cat([calls[k][1] for k in members])
        stacked = norm_bound(module, a, torch.cat([calls[k][2] for k in members]), defer_exact=True, keep_rows=True)
        start = 0
        for k in members:
            rows = slice(start, start + calls[k][2].shape[0])
            start = rows.stop
            out[k] = NormBound(*(None if part is None else part[rows] for part in (stacked.upper, stacked.exact)),
                               rows=None if stacked.rows is None else stacked.rows[rows],
                               estimate=None if stacked.estimate is None else stacked.estimate[rows],
                               rounding=None if stacked.rounding is None else stacked.rounding[rows])
    return out  # type: ignore[return-value]


def compute_exact(module: nn.Module, a: Tensor, g: Tensor, bound: NormBound) -> NormBound:
    """``bound`` with its ill-conditioned examples' gradients computed in float64 and their bounds replaced (one
    host synchronisation: whether there are any)."""
    if bound.exact is None or bound.exact_grads or not bool(bound.exact.any()):
        return bound  # (clipped_sums reads ``exact`` only together with ``exact_grads``)
    work = _work_dtype(module, g)
    with full_precision():
        grads, exact_upper = _exact_gradients(module, a[bound.exact], g[bound.exact], work)
    upper = bound.upper.clone()
    upper[bound.exact] = exact_upper
    # their kept rows leave the rows' sum (zeroed, not multiplied by 0: an overflowed row is infinite, and 0 inf NaN)
    rows = None if bound.rows is None else bound.rows.masked_fill(bound.exact.unsqueeze(1), 0)
    return NormBound(upper, bound.exact, grads, rows, bound.estimate, bound.rounding)


def clipped_sums(
    module: nn.Module, a: Tensor, g: Tensor, factor: Tensor, bound: NormBound | None = None, into: Into = None
) -> dict[nn.Parameter, Tensor]:
    """``sum_i factor_i grad_i`` for each trainable parameter of ``module``: one weight-gradient computation over
    the batch (in float64, full precision), or the weighted sum of ``bound.rows`` for the weight where it
    kept them, plus the examples ``bound`` computed apart (``bound.exact``). ``into(p)``: a float64 buffer of p's
    shape that p's sum may be written into (or None), when it is one product."""
    if type(module) is nn.Embedding:
        if bound is None:
            bound = norm_bound(module, a, g)
        return bookkeeping_embedding.clipped_sums(module, a, g, factor, bound.upper, bound.embedding,
                                                  None if into is None else into(module.weight))
    factor = factor.to(g.device, torch.float64)
    exact = bound.exact if bound is not None and bound.exact_grads else None
    with full_precision():
        batch_factor = factor if exact is None else torch.where(exact, 0.0, factor)
        # blocks of block_examples(T) examples bound the float64 temporaries of one product
        block = block_examples(_steps(module, g))
        weight = None

        def buffer() -> Tensor | None:  # the weight's kept buffer, for a sum written in one piece (none where
            return into(module.weight) if into is not None and exact is None else None  # examples computed apart add)

        if bound is not None and bound.rows is not None:  # the kept per-example weight gradients: their weighted sum
            if bound.rows.shape[0] != g.shape[0]:
                raise RuntimeError(f"{bound.rows.shape[0]} kept per-example gradients for {g.shape[0]} examples")
            weight = weighted_row_sum(batch_factor, bound.rows).view(module.weight.shape)
        elif _is_linear(module) and sums_by_example_products(module, a, g):
            # long sequences on a CPU: the examples' own float32 products summed in float64 (float64 products are
            # slow there)
            weight = _sum_of_example_products(module, a, g, batch_factor, buffer())
        elif not _is_linear(module) and module.weight.requires_grad and sums_by_rows(module, g.shape[2:]):
            # a convolution on a large map: its examples' float32 rows summed in float64 (float64 kernels are slow)
            work = _work_dtype(module, g)
            weight = sum_of_rows(module, a.to(work), g.to(work), batch_factor, buffer())
        if weight is None:  # one float64 weight-gradient product per block, the bias's sum with it
            into = into if g.shape[0] <= block and exact is None else None
            out = sum_by_blocks((a, g, batch_factor), block,
                                lambda a, g, c: _weight_gradient(module, _in_float64(a), _weighted(g, c), into))
        else:
            out = {module.weight: weight}
            if _is_linear(module):
                out.update(_linear_bias_sum(module, g, batch_factor))
            else:
                out.update(sum_by_blocks((g, batch_factor), block,
                                         lambda g, c: _bias_gradient(module, _weighted(g, c))))
    if exact is not None:
        for p, grads in bound.exact_grads.items():
            out[p] = out[p] + torch.einsum("k,k...->...", factor[exact], grads)
    return out


def clipped_sums_of(
    calls: list[tuple[nn.Module, Tensor, Tensor, Tensor, NormBound]], into: Into = None
) -> list[dict[nn.Parameter, Tensor]]:
    """:func:`clipped_sums` of each ``(module, a, g, factor, bound)`` (``into`` as there); the nn.Linear calls of
    one shape (:func:`_shape_key`) and batch size whose examples fit one block and have none computed apart, in one
    batched product: each layer's sum is the same B T-row product as alone (the bound's gamma holds for any order of
    its terms)."""
    keys = []
    for module, a, g, _, bound in calls:
        key = _shape_key(module, a, g)
        one_block = g.shape[0] <= block_examples(_steps(module, g))
        stack = (key is not None and _is_linear(module) and one_block and not bound.exact_grads and g.dim() > 1
                 and not sums_by_example_products(module, a, g))
        keys.append((*key, g.shape[0]) if stack else None)  # (the products are stacked, not concatenated)
    out: list[dict[nn.Parameter, Tensor]] = [{} for _ in calls]
    for members in _groups(keys, [a.numel() + g.numel() for _, a, g, _, _ in calls]):
        if len(members) == 1:
            module, a, g, factor, bound = calls[members[0]]
            out[members[0]] = clipped_sums(module, a, g, factor, bound, into)
            continue
        module, a, g = calls[members[0]][:3]
        with full_precision():
            inputs = torch.stack([_in_float64(calls[k][1]).reshape(-1, a.shape[-1]) for k in members])  # (L, B T, p)
            weighted = torch.stack([
                _weighted(calls[k][2], calls[k][3]).reshape(-1, g.shape[-1]) for k in members
            ])  # (L, B T, d_out)  fmt: skip
            weights, biases = _linear_grads(module, inputs, weighted)
        for j, k in enumerate(members):  # own memory: they become the parameters' .grad
            layer = calls[k][0]
            if weights is not None:
                out[k][layer.weight] = weights[j].clone()
            if biases is not None:
                out[k][layer.bias] = biases[j].clone()
    return out


def _weight_gradient(module: nn.Module, a: Tensor, weighted: Tensor, into: Into = None) -> dict[nn.Parameter, Tensor]:
    """The layer's parameter gradients for input ``a`` and output gradient ``weighted``, summed over the examples:
    one weight-gradient product (an nn.Linear's weight, or a convolution's with dead taps, written into
    ``into(weight)`` when that gives a buffer)."""
    weight, bias = module.weight, module.bias
    out: dict[nn.Parameter, Tensor] = {}
    if _is_linear(module):
        grads = _linear_grads(module, a.reshape(-1, a.shape[-1]), weighted.reshape(-1, weighted.shape[-1]),
                              None if into is None or not weight.requires_grad else into(weight))  # fmt: skip
        return {p: grad for p, grad in zip((weight, bias), grads) if grad is not None}
    if weight.requires_grad:
        writes = into is not None and writes_into(module, a.shape[2:], weighted.shape[2:], weighted.dtype)
        out[weight] = _conv_weight_grad(module, weighted, a, out=into(weight) if writes else None)
    out.update(_bias_gradient(module, weighted))
    return out


def _bias_gradient(module: nn.Module, weighted: Tensor) -> dict[nn.Parameter, Tensor]:
    """A convolution's bias gradient for output gradient ``weighted``, summed over the examples (as in
    :func:`_weight_gradient`; nothing when it has none or it is frozen)."""
    bias = module.bias
    if bias is None or not bias.requires_grad:
        return {}
    return {bias: weighted.sum(dim=[0, *range(2, weighted.dim())])}


def _linear_bias_sum(module: nn.Module, g: Tensor, factor: Tensor) -> dict[nn.Parameter, Tensor]:
    """An nn.Linear's (or Conv1D's) clipped bias sum ``sum_i factor_i sum_t g_it``: each example's sum over its
    positions in float64 (accumulated as it reads g: no float64 copy of it), then their weighted sum, in float64
    (nothing when it has no trainable bias). An example with factor 0 adds nothing, even an overflowed one."""
    bias = module.bias
    if bias is None or not bias.requires_grad:
        return {}
    sums = g.reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1, dtype=torch.float64)  # (B, d_out)
    sums = sums.masked_fill(factor.view(-1, 1) == 0, 0.0)
    return {bias: torch.mv(sums.t(), factor.to(sums.device, torch.float64))}


def _linear_grads(
    module: nn.Module, a: Tensor, weighted: Tensor, out: Tensor | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """An nn.Linear's (or Conv1D's) weight and bias gradients, None where frozen, for rows ``a`` (..., R, p) and
    ``weighted`` (..., R, d_out) summed over the R rows; a leading dimension holds layers stacked. ``out``: where the
    weight's product is written (the same product, without a fresh allocation)."""
    weight, bias = module.weight, module.bias
    weights = None
    if weight.requires_grad:
        left, right = (a.mT, weighted) if is_transposed_linear(module) else (weighted.mT, a)
        weights = left @ right if out is None else torch.matmul(left, right, out=out)
    biases = weighted.sum(dim=-2) if bias is not None and bias.requires_grad else None
    return weights, biases


#: an nn.Linear (or Conv1D) call over at least this many positions per example, on a CPU in float32 work, with at
#: least :data:`EXAMPLE_PRODUCT_ENTRIES` weight entries, gets its clipped weight sum as its examples' own float32
#: products summed in float64 (:func:`_sum_of_example_products`), not one float64 product over the batch. Batch 16,
#: one core (AMD EPYC), ms, float64 product against example products (:func:`clipped_sums`, bias included): 64
#: positions, 768 x 3072 107 against 79, 3072 x 768 99 against 83, 768 x 768 34 against 22; the products alone at 128
#: positions 244 against 130, at 16 positions 26 against 31-42
EXAMPLE_PRODUCT_STEPS = 64
EXAMPLE_PRODUCT_ENTRIES = 1 << 16
#: weight entries per tile of :func:`_sum_of_example_products`: the tile's float64 sum and one example's float32
#: product of it (12 bytes an entry, 3 MiB) stay in the cache while every example adds into the tile
PRODUCT_TILE_ENTRIES = 1 << 18
#: an example of :func:`_sum_of_example_products` whose weight mass sum_t ||g_t|| ||a_t|| reaches this is computed
#: apart in float64 (:func:`norm_bound`): its float32 product's terms and partial sums reach at most its mass times
#: (1 + gamma_T), below float32's largest value 2^128 (1 - 2^-24) under this; so no example with a nonzero factor
#: overflows there, and the layer never needs another sum for one batch than for the batch without an example
#: (a whole-layer fallback to the float64 product for D but not D \ x moved the sum by 1.00012 C, with 31 copies of
#: the other example, and 1.00028 C with 63: a review's crafted batch, attack overflow_example_products)
PRODUCT_MASS_LIMIT = 2.0**126


def sums_by_example_products(module: nn.Module, a: Tensor, g: Tensor) -> bool:
    """Whether an nn.Linear's (or Conv1D's) clipped weight sum is :func:`_sum_of_example_products`."""
    return (g.device.type == "cpu" and a.is_floating_point() and module.weight.requires_grad
            and _work_dtype(module, g) == torch.float32 and g.dim() > 2
            and _steps(module, g) >= EXAMPLE_PRODUCT_STEPS and module.weight.numel() >= EXAMPLE_PRODUCT_ENTRIES)


def _sum_of_example_products(
    module: nn.Module, a: Tensor, g: Tensor, factor: Tensor, out: Tensor | None = None
) -> Tensor:
    """``sum_i factor_i grad_i`` of an nn.Linear's (or Conv1D's) weight, in float64 (written into ``out`` when
    given): example i's gradient ``G_i^T A_i`` a float32 product over its own T positions, then multiplied by its
    factor and added in float64, a tile of the weight's rows at a time (the tile's float64 sum stays in the cache
    while every example adds into it). The product's rounding, at most gamma_T of the example's mass, is the
    example's own, inside its bound (:func:`norm_bound` charges gamma_T for these calls); removing an example
    changes the others' terms by nothing, and their float64 sum by gamma64_B of their mass, as
    :func:`~lightning_privdec.privacy.rounding.weighted_row_sum` argues. The products are alike for every example
    whatever its index: each reads its rows from the same offsets of a 64-byte aligned example slot (the inputs as
    they are when their examples start on a 64-byte boundary, else a padded copy), in tiles set by the weight's shape
    alone. An example whose factor is 0 adds nothing (an overflowed product times 0 would be NaN); no example with a
    nonzero factor overflows (:data:`PRODUCT_MASS_LIMIT`)."""
    batch, steps = g.shape[0], _steps(module, g)
    inputs, grads = _example_slots(a, batch, steps), _example_slots(g, batch, steps)  # (B, T, p), (B, T, d_out)
    left, right = (inputs, grads) if is_transposed_linear(module) else (grads, inputs)  # weight_i = left_i^T right_i
    rows, cols = left.shape[2], right.shape[2]
    out = torch.empty((rows, cols), dtype=torch.float64, device=g.device) if out is None else out
    total = out.view(rows, cols)
    weights = factor.tolist()
    examples = [i for i in range(batch) if weights[i] != 0.0]
    if not examples:
        return out.zero_()
    tile = max(1, PRODUCT_TILE_ENTRIES // cols)
    product = torch.empty((tile, cols), dtype=torch.float32, device=g.device)
    for start in range(0, rows, tile):
        tile_sum, tile_product = total[start : start + tile], product[: min(tile, rows - start)]
        for k, i in enumerate(examples):
            torch.mm(left[i, :, start : start + tile].mT, right[i], out=tile_product)
            if k == 0:  # (widened exactly, then multiplied in float64)
                tile_sum.copy_(tile_product).mul_(weights[i])
            else:
                tile_sum.add_(tile_product, alpha=weights[i])
    return out


def _example_slots(x: Tensor, batch: int, steps: int) -> Tensor:
    """``x`` as (B, T, features) float32 whose examples start on 64-byte boundaries, 16-entry aligned offsets
    apart (x itself where it is so already)."""
    x = x.reshape(batch, steps, x.shape[-1])
    entries = steps * x.shape[2]
    if x.dtype == torch.float32 and x.is_contiguous() and x.data_ptr() % 64 == 0 and entries % 16 == 0:
        return x
    slots = torch.empty((batch, -(-entries // 16) * 16), dtype=torch.float32, device=x.device)
    view = slots[:, :entries].view(batch, steps, x.shape[2])
    return view.copy_(x)


#: where a parameter's clipped sum may be written: ``into(p)`` is a float64 buffer of p's shape, or None (a fresh
#: tensor); an allocation of tens of MB costs its page faults on every step on a CPU (16 ms of a 24 ms product for a
#: 3072 x 3072 layer here), a reused buffer none
Into = Callable[[nn.Parameter], "Tensor | None"] | None


def _weighted(g: Tensor, factor: Tensor) -> Tensor:
    """Each example's output gradients times its factor, in float64 (the clipped sum's product runs in float64:
    :func:`~lightning_privdec.privacy.rounding.sum_by_blocks`): one pass, which widens each entry exactly and rounds
    its product once, as widening first and then multiplying would (that took a second pass and a second tensor of
    the output gradients' size in float64: 1.2 s of GPT-2 small's step, whose 50,257 outputs per token it holds)."""
    return torch.mul(g, factor.to(g.device, torch.float64).view(-1, *([1] * (g.dim() - 1))))


def _in_float64(a: Tensor) -> Tensor:
    """A layer's input for the clipped sum's float64 product (an index tensor as it is)."""
    return a.to(torch.float64) if a.is_floating_point() else a


def _groups(keys: list[tuple | None], entries: list[int]) -> list[list[int]]:
    """The indices of equal keys together, in first-seen order, split where a group would hold more than
    :data:`GROUP_ENTRIES` of ``entries``; a None key alone."""
    groups: dict[tuple, list[list[int]]] = {}
    held: dict[tuple, int] = {}  # the entries of each key's last group
    for k, key in enumerate(keys):
        key = (k,) if key is None else key
        chunks = groups.setdefault(key, [[]])
        if chunks[-1] and held[key] + entries[k] > GROUP_ENTRIES:
            chunks.append([])
            held[key] = 0
        chunks[-1].append(k)
        held[key] = held.get(key, 0) + entries[k]
    return [chunk for chunks in groups.values() for chunk in chunks]


def norm_method(module: nn.Module, a: Tensor, g: Tensor) -> str:
    """How a layer call's per-example norms are computed, for input ``a`` and output gradient ``g``: ``"ghost"``
    (Gram matrices of unfolded patches or, for nn.Linear, of the inputs), ``"input_gram"`` (convolutions: the
    patches' Gram from the input's, module docstring) or ``"per_example"``, whichever needs the fewest
    multiply-adds per example and group."""
    if _is_linear(module):
        steps, (p, d_out) = (1 if g.dim() == 2 else g.shape[1]), module.weight.shape
        return "ghost" if steps == 1 or steps * (p + d_out) < p * d_out else "per_example"
    if type(module) is nn.Conv3d:
        return "per_example"  # no unfold for 3-d inputs
    steps = math.prod(g.shape[2:])
    if steps == 1:
        return "ghost"  # ||g_i||^2 ||u_i||^2
    p, d_out = module.weight[0].numel(), module.out_channels // module.groups
    padded = math.prod(size + 2 * pad for size, pad in zip(a.shape[2:], module.padding))
    costs = {
        "ghost": steps * steps * (p + d_out),
        "input_gram": padded * padded * (module.in_channels // module.groups)
        + steps * steps * (d_out + math.prod(module.kernel_size)),
        "per_example": steps * p * d_out,
    }
    return min(costs, key=costs.__getitem__)


# ---- rounding -------------------------------------------------------------------------------------------------------
def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)


def _work_dtype(module: nn.Module, g: Tensor) -> torch.dtype:
    """float32 at least: half-precision inputs and output gradients (autocast) are promoted, exactly."""
    return torch.promote_types(torch.promote_types(g.dtype, module.weight.dtype), torch.float32)


# ---- nn.Linear, Conv1D ----------------------------------------------------------------------------------------------
def _linear_estimates(
    module: nn.Module, a: Tensor, g: Tensor, method: str | None
) -> tuple[Tensor, Tensor, Tensor | None, int]:
    """(upper bound of each example's exact gradient norm, its terms' mass sum_t ||g_t|| (||u_t|| + 1), whether the
    bound is loose (None: no example is), the rows of the batch's sum) for nn.Linear on (B, d) or (B, T, d)."""
    if g.dim() == 2:
        a, g = a.unsqueeze(1), g.unsqueeze(1)
    batch, steps, d_out, p = g.shape[0], g.shape[1], g.shape[-1], a.shape[-1]
    u, tiny = unit_roundoff(g.dtype), _tiny(g.dtype)
    # the sums below start from their first term (no zeros to add it to: each a launch on a GPU); None: no term yet
    squared: Tensor | None = None
    mass: Tensor | None = None
    loose: Tensor | None = None
    ghost = steps > 1 and module.weight.requires_grad and (method or norm_method(module, a, g)) == "ghost"
    if ghost:  # per-token norms from the Gram matrices' diagonals (no pass of their own)
        estimate, g_squares, a_squares = _gram_inner_products(g.transpose(1, 2), a.transpose(1, 2))
        eps = _gram_error(d_out, p, u, steps)
        gn, an = _root_upper(g_squares, d_out, g.dtype, eps), _root_upper(a_squares, p, g.dtype, eps)
    else:
        gn = norm_upper_bound(g, dim=-1)  # (B, T)
        an = norm_upper_bound(a, dim=-1) if module.weight.requires_grad else None
    if module.weight.requires_grad:
        loose = _huge_inputs(an)
        weight_mass = (gn * an).sum(dim=1)
        if steps == 1:  # ||g|| ||a||, in float64
            squared = (weight_mass * (1 + gamma(d_out + p + 4, _U64))).square()
        elif ghost:  # the floors of gn and an cover the Gram entries' underflow (:func:`_root_upper`)
            error = weight_mass.square().mul_(eps).add_(steps * steps * tiny)
            squared = torch.minimum(estimate.clamp_min(0) + error, weight_mass.square() * (1 + 1e-9))
            loose = loose | ~(error <= 0.1 * estimate)  # also when the estimate is not finite
        else:
            norms = _per_example_weight_norms(g, a)
            error = gamma(steps, u) * weight_mass + steps * tiny * math.sqrt(d_out * p)
            squared = (norms + error).square()
            loose = loose | ~(error <= 0.05 * norms)
        mass = weight_mass
    if module.bias is not None and module.bias.requires_grad:
        if steps == 1:  # the bias gradient is g itself, one term: gn bounds its norm, with no sum to round
            squared = _plus(squared, gn[:, 0].square())
            mass = _plus(mass, gn[:, 0])
        else:
            bias_bound, bias_mass, bias_loose = _bias_bound(gn, g.sum(dim=1), u, squared)
            squared = _plus(squared, bias_bound.square())
            loose = bias_loose if loose is None else loose | bias_loose
            mass = _plus(mass, bias_mass)
    if squared is None:  # no trainable parameter (not recorded as such; kept for completeness)
        squared = mass = torch.zeros(batch, dtype=torch.float64, device=g.device)
    # the clipped sum's rows per product: an example's own T (_sum_of_example_products), else a block's
    own_products = sums_by_example_products(module, a, g)
    if own_products:  # an example whose float32 product could overflow is computed apart (PRODUCT_MASS_LIMIT)
        loose = loose | (weight_mass >= PRODUCT_MASS_LIMIT)
    rows = steps if own_products else block_examples(steps) * steps
    return squared.sqrt() * (1 + 1e-12), mass, loose, rows


def _per_example_weight_norms(g: Tensor, a: Tensor) -> Tensor:
    """:func:`norm_upper_bound` of each example's weight gradient ``g_i^T a_i`` (g (B, T, d_out), a (B, T, p)),
    computed for as many examples at once as :data:`PER_EXAMPLE_ENTRIES` allows (each example's product and norm
    are the same operations as one at a time)."""
    batch, d_out, p = g.shape[0], g.shape[-1], a.shape[-1]
    chunk = max(1, PER_EXAMPLE_ENTRIES // max(d_out * p, 1))
    return torch.cat([norm_upper_bound(torch.bmm(g[i : i + chunk].transpose(1, 2), a[i : i + chunk]), dim=(1, 2))
                      for i in range(0, batch, chunk)])  # fmt: skip


def exact_rows(module: nn.Module, a: Tensor, g: Tensor, samples: dict[nn.Parameter, Tensor]) -> dict:
    """A rule's materialised per-example gradients of a covered layer with its ill-conditioned rows recomputed in
    float64: rows whose terms are large against their norm (cancelling tokens or positions) round differently in
    batches of different sizes, which no norm of the rounded row bounds; exact rows do not. An embedding's rows
    (Opacus's scatter of its output gradients) are returned as they are."""
    if type(module) is nn.Embedding:
        return samples
    work = _work_dtype(module, g)
    a, g = (a.to(work) if a.is_floating_point() else a), g.to(work)
    mass, steps = _mass(module, a, g)
    norms = torch.linalg.vector_norm(
        torch.stack([norm_upper_bound(gs.flatten(1), dim=1) for gs in samples.values()]),
        dim=0,
    )
    exact = ~(unit_roundoff(work) * math.sqrt(steps) * mass <= 1e-3 * norms)
    if not bool(exact.any()):
        return samples
    grads, _ = _exact_gradients(module, a[exact], g[exact], work)
    out = dict(samples)
    for p, rows in grads.items():
        out[p] = samples[p].clone()
        out[p][exact] = rows.to(samples[p].dtype).view(-1, *samples[p].shape[1:])
    return out


def _mass(module: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, int]:
    """Each example's terms' mass sum_t ||g_t|| (||u_t|| + 1) (float64) and the number of terms T."""
    weight, bias = module.weight.requires_grad, module.bias is not None and module.bias.requires_grad
    if _is_linear(module):
        if g.dim() == 2:
            a, g = a.unsqueeze(1), g.unsqueeze(1)
        gn = norm_upper_bound(g, dim=-1)
        mass = torch.zeros_like(gn[:, 0])
        if weight:
            mass += (gn * norm_upper_bound(a, dim=-1)).sum(dim=1)
        if bias:
            mass += gn.sum(dim=1)
        return mass, g.shape[1]
    batch, steps = g.shape[0], math.prod(g.shape[2:])
    mass = torch.zeros(batch, dtype=torch.float64, device=g.device)
    if weight:
        gn = norm_upper_bound(g.reshape(batch, module.groups, -1, steps), dim=2)
        mass += (gn * _patch_norms(module, a, g.shape[2:])).sum(dim=(1, 2))
    if bias:
        mass += norm_upper_bound(g.reshape(batch, -1, steps), dim=1).sum(dim=1)
    return mass, steps


def _exact_gradients(module: nn.Module, a: Tensor, g: Tensor, work: torch.dtype) -> tuple[dict, Tensor]:
    """The per-example gradients of the selected (ill-conditioned) examples in float64, and upper bounds of the
    norms of what they add to the sum (their float64 rounding and the addition, with a margin of 2u of ``work``).
    The terms' mass only scales float64 rounding: a convolution's patch norms are the upper bounds
    :func:`_patch_norms` gives in ``work`` (its float64 convolution of the squares took three times as long), or in
    float64 where a square overflowed ``work`` (a finite input of 1e20: float32's bound is infinite, and 0 times it
    NaN)."""
    given = a
    a = a.double() if a.is_floating_point() else a
    g = g.double()
    weight, bias = module.weight, module.bias
    grads: dict[nn.Parameter, Tensor] = {}
    if _is_linear(module):
        if g.dim() == 2:
            a, g = a.unsqueeze(1), g.unsqueeze(1)
        gn, an = torch.linalg.vector_norm(g, dim=-1), torch.linalg.vector_norm(a, dim=-1)
        terms, mass = g.shape[1], torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
        if weight.requires_grad:
            transposed = is_transposed_linear(module)  # weight (p, d_out)
            grads[weight] = torch.einsum("ktp,ktd->kpd", a, g) if transposed else torch.einsum("ktd,ktp->kdp", g, a)
            mass += (gn * an).sum(dim=1)
    else:
        gn = torch.linalg.vector_norm(g.reshape(g.shape[0], module.groups, -1, math.prod(g.shape[2:])), dim=2)
        terms = math.prod(g.shape[2:]) + module.weight[0].numel()
        mass = torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
        if weight.requires_grad:
            grads[weight] = torch.cat([_conv_weight_grad(module, g[i : i + 1], a[i : i + 1]).unsqueeze(0)
                                       for i in range(g.shape[0])])  # fmt: skip
            patch_norms = _patch_norms(module, given.to(work), g.shape[2:])  # (autocast: bfloat16 / float16 inputs)
            if not bool(torch.isfinite(patch_norms).all()):
                patch_norms = _patch_norms(module, a, g.shape[2:])
            mass += (gn * patch_norms).sum(dim=(1, 2))
        gn = torch.linalg.vector_norm(g.flatten(2), dim=1)  # the bias's terms: whole output vectors
    if bias is not None and bias.requires_grad:
        grads[bias] = g.sum(dim=1) if _is_linear(module) else g.flatten(2).sum(dim=2)
        mass += gn.sum(dim=1)
    norms = torch.linalg.vector_norm(torch.cat([v.flatten(1) for v in grads.values()], dim=1), dim=1)
    upper = (norms + gamma(terms, _U64) * mass) * (1 + 2 * unit_roundoff(work)) * (1 + 1e-12)
    return grads, upper


def linear_holding(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An nn.Linear holding ``weight`` and ``bias`` themselves (no new Parameter, no memory, registered nowhere): the
    record's layer when a unit's own code computes a product (attention's projections, a recurrent layer's)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.out_features, layer.in_features = weight.shape
    layer.weight = weight
    layer.register_parameter("bias", bias)
    return layer
