"""Gram-matrix norms and the rounding bounds book-keeping's nn.Linear and convolution arithmetic share
(:mod:`.bookkeeping`, "Rounding")."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_privdec.privacy.rounding import (
    SUM_BLOCK,
    gamma,
    norm_upper_bound,
    unit_roundoff,
)
from lightning_privdec.privacy.rounding import U64 as _U64
from lightning_privdec.privacy.rounding import tiny as _tiny

#: rows (examples x positions, at most SUM_BLOCK examples) per weight-gradient product of a clipped sum
#: (:func:`clipped_sums`): an example's terms are rounded with those of the other examples of its block only, so the
#: rounding bound of its terms, gamma_R with R = :func:`block_examples` T, depends on the layer's positions T, not
#: on the batch size; small enough that honest examples of convolutions on large maps (T = 1024: 8 examples a
#: product) are neither isolated nor clipped much below C by it (gamma_R = 4.9e-4 of their mass; a norm is about
#: mass / sqrt(T))
SUM_ROWS = 8192


def block_examples(steps: int) -> int:
    """Examples per weight-gradient product of a layer with ``steps`` positions (tokens) per example."""
    return max(1, min(SUM_BLOCK, SUM_ROWS // max(steps, 1)))


#: a Gram matrix over more than this many entries per token is the float64 sum of the Grams of blocks of this many
#: (:func:`_gram`): each entry then errs by gamma_1024 of its terms' magnitudes, not gamma_d (0.3% for the 50,257
#: logits of GPT-2's output layer, which made every example's bound loose and computed apart)
GRAM_BLOCK = 1024


def _gram(x: Tensor) -> Tensor:
    """``x^T x`` per example for x (B, d, T): (B, T, T) in x's dtype, or for d > :data:`GRAM_BLOCK` the float64 sum
    of the Grams of its blocks of GRAM_BLOCK rows (error: :func:`_gram_entry_error`)."""
    d = x.shape[1]
    if d <= GRAM_BLOCK:
        return torch.bmm(x.transpose(1, 2), x)
    total = None
    for start in range(0, d, GRAM_BLOCK):
        block = x[:, start : start + GRAM_BLOCK]
        part = torch.bmm(block.transpose(1, 2), block).double()
        total = part if total is None else total.add_(part)
    return total


def _gram_entry_error(d: int, u: float) -> float:
    """Relative bound of an entry of :func:`_gram` over d terms against the sum of its terms' magnitudes: gamma_d,
    or for blocks gamma_1024 and the float64 sum of the blocks' values."""
    if d <= GRAM_BLOCK:
        return gamma(d, u)
    block = gamma(GRAM_BLOCK, u)
    return block + gamma(-(-d // GRAM_BLOCK), _U64) * (1 + block)


def _gram_error(d_out: int, p: int, u: float, steps: int, p_blocked: bool = True) -> float:
    """Relative bound of the ghost norm sum_{t,t'} (g_t . g_t')(u_t . u_t') against (sum_t ||g_t|| ||u_t||)^2:
    each Gram entry errs by :func:`_gram_entry_error` of its ||g_t|| ||g_t'|| (Cauchy-Schwarz; ``p_blocked`` False:
    U's Gram was computed elsewhere as p-long sums, gamma_p), their product by u, the float64 sum of T^2 terms by
    gamma_{T^2} (module docstring, "Rounding")."""
    gd, sum_error = _gram_entry_error(d_out, u), gamma(steps * steps, _U64)
    gp = _gram_entry_error(p, u) if p_blocked else gamma(p, u)
    entry = (gd + gp + gd * gp) * (1 + u) + u
    return (entry * (1 + sum_error) + sum_error) * (1 + 1e-9)


def _plus(total: Tensor | None, term: Tensor) -> Tensor:
    """``total + term``, ``term`` itself for no total yet (what adding it to zeros gives, bit for bit: +0 + x = x for
    every x but -0, and these sums' terms are norms, masses and squares: never -0)."""
    return term if total is None else total + term


def _bias_bound(
    token_norms: Tensor, summed: Tensor, u: float, weight_squared: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The bias gradient sum_t g_t of each example: an upper bound of its norm (the computed sum errs by at most
    gamma_{T-1} sum_t ||g_t||), that mass, and whether the bound is loose against the layer call's whole norm (the
    squared bound ``weight_squared`` of its weight's part and the bias's): a bias whose gradient cancels to about 0
    while the weight's does not (a key projection's bias before a softmax) leaves the call's bound tight, and is not
    computed apart; ``token_norms`` (B, T) bound ||g_t||; ``weight_squared`` None: no trainable weight."""
    steps = token_norms.shape[1]
    mass = token_norms.sum(dim=1)
    norms = norm_upper_bound(summed, dim=1)
    error = gamma(steps - 1, u) * mass
    if steps > 1:
        whole = norms.square() if weight_squared is None else weight_squared + norms.square()
        loose = ~(error <= 0.05 * whole.sqrt())
    else:
        loose = torch.zeros_like(norms, dtype=torch.bool)
    return norms + error, mass, loose


def _gram_inner_products(g: Tensor, u: Tensor | None, u_gram: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``<G_i^T G_i, U_i^T U_i>`` for batches G (B, d_out, T) and U (B, p, T) (or U's Gram (B, T, T) given as
    ``u_gram``): the ghost norm, summed in float64 and NOT clamped (rounding may leave it below zero; the caller
    adds the bound of :func:`_gram_error`); and the Grams' diagonals, ``||g_t||^2`` and ``||u_t||^2`` (B, T)."""
    u_gram = _gram(u) if u_gram is None else u_gram
    g_gram = _gram(g)
    estimate = (g_gram * u_gram).sum(dim=(1, 2), dtype=torch.float64)
    return estimate, g_gram.diagonal(dim1=1, dim2=2), u_gram.diagonal(dim1=1, dim2=2)


def _root_upper(squares: Tensor, terms: int, dtype: torch.dtype, eps: float) -> Tensor:
    """Upper bounds of norms (float64) from their squares, Gram diagonals computed as ``terms``-long dot products in
    ``dtype``, floored at sqrt(3 terms tiny / eps): with ``eps`` the Gram bound's relative factor, eps m^2 then also
    covers the absolute underflow of the Gram entries, 2 tiny (d_out (sum_t ||u_t||)^2 + p (sum_t ||g_t||)^2 +
    T^2 d_out p tiny), which honest values never come near."""
    floor = terms * _tiny(dtype) * (1 + 3 / eps)
    return squares.double().mul_(1 + gamma(terms + 2, unit_roundoff(dtype))).add_(floor).sqrt_()


#: an example one of whose layer inputs (patches) has a norm above this is computed apart in float64 (bookkeeping's
#: ``exact``): its output gradient times a small clip factor may fall below float32's normal range, where it is rounded
#: by up to 2^-126 absolutely (a CPU flushes it; 2^-150 otherwise), which times such an input is no longer negligible
#: (below it: at most 2^-62 sqrt(d_out) T, absolutely)
HUGE_INPUT = 2.0**64


def _huge_inputs(norms: Tensor) -> Tensor:
    """Per example, whether any of its per-token (per-position, per-group) input norm bounds exceeds
    :data:`HUGE_INPUT` (or is not finite): ``norms`` (B, ...)."""
    rows = norms.flatten(1)
    if rows.shape[1] == 0:  # no token (an empty sequence): no input
        return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    return ~(rows.amax(dim=1) <= HUGE_INPUT)
