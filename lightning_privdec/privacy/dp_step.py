"""One node's DP-SGD clipping: per-sample gradients clipped to C and summed, and the statistics of a step.

Abadi et al. 2016, Algorithm 1, with Poisson sampling at rate q over the node's shard of J examples::

    g_i  <- g_i * min(1, C / ||g_i||)                 (flat clipping: the norm over ALL parameters jointly)
    g~   <- (sum_i g_i + N(0, sigma^2 C^2 I)) / (q J)  (noise on the sum; divide by the EXPECTED batch size)

This module holds the first line and the sum (:func:`clip_and_accumulate`, :func:`clip_rows_`, :func:`clip_factor`);
the noise and the division by q J are the node's Gaussian mechanism
(:func:`~lightning_privdec.privacy.local_dp.noise_clipped_sum`). Dividing by the expected batch size ``q J`` (not the
realised one) keeps each example's influence at most C / (qJ), which is what the accountant assumes; an empty Poisson
batch releases pure noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_privdec.privacy.rounding import SUM_BLOCK, norm_upper_bound, sum_rounding, weighted_row_sum

__all__ = ["DPStepStats", "clip_and_accumulate", "clip_factor", "clip_rows_"]


@dataclass(frozen=True)
class DPStepStats:
    """Diagnostics of one privatized step (NOT private themselves: log them only for debugging / monitoring).

    Norm statistics are 0-dim tensors on the gradients' device, so computing them never forces a host sync; call
    :meth:`to_dict` for Python floats.
    """

    batch_size: int
    mean_norm: Tensor
    max_norm: Tensor
    clipped_fraction: Tensor
    noise_std: float

    @classmethod
    def of(cls, norms: Tensor, max_grad_norm: float, noise_std: float) -> DPStepStats:
        """The statistics of a step from its examples' unclipped norms (none: an empty Poisson batch)."""
        mean_norm, max_norm, clipped = _norm_stats(norms, max_grad_norm, norms.device)
        return cls(batch_size=int(norms.numel()), mean_norm=mean_norm, max_norm=max_norm, clipped_fraction=clipped,
                   noise_std=noise_std)

    def to_dict(self) -> dict[str, float]:
        return {
            "batch_size": float(self.batch_size),
            "mean_norm": float(self.mean_norm),
            "max_norm": float(self.max_norm),
            "clipped_fraction": float(self.clipped_fraction),
            "noise_std": float(self.noise_std),
        }


def _norm_stats(norms: Tensor, max_grad_norm: float, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    if norms.numel() == 0:
        zero = torch.zeros((), device=device)
        return zero, zero, zero
    return norms.mean(), norms.max(), (norms > max_grad_norm).float().mean()


#: the relative margin of :func:`clip_factor`: the factor's cast to float32 and its multiplication each err by at most
#: float32's unit roundoff 2^-24; 2^-20 leaves room for both, so an example whose norm bound is n adds at most C
CLIP_MARGIN = 2.0**-20


#: clip factors below float32's smallest normal number are 0 (:func:`clip_factor`)
_FLOAT32_NORMAL = torch.finfo(torch.float32).tiny


@torch.no_grad()
def clip_factor(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C / (||g|| (1 + 2^-20) + 1e-6)) per norm, in float64: the scale that clips each gradient to C
    (Opacus's flat clipping), with a margin for the rounding of applying it in float32 (:data:`CLIP_MARGIN`). A factor
    below float32's normal range (a gradient of norm above C 2^126, near float32's largest values) is 0: the example
    adds nothing. Cast to float32 it would keep only a few of its digits (a CPU flushes it to 0, a GPU may not): a
    crafted example of norm 1e38 under C = 1e-4 moved a sum by 1.004 C."""
    norms = norms.to(torch.float64)
    factor = (max_grad_norm / (norms * (1 + CLIP_MARGIN) + 1e-6)).clamp(max=1.0)
    return factor.masked_fill(factor < _FLOAT32_NORMAL, 0.0)


def clip_rows_(rows: Tensor, max_norm: float) -> Tensor:
    """Each row (one flat per-sample gradient) clipped to C by :func:`clip_factor`, in place (no B x d temporary);
    returns the norms before clipping."""
    norms = norm_upper_bound(rows, dim=1)  # never below the true norm
    rows.mul_(clip_factor(norms, max_norm).to(rows.dtype).unsqueeze(1))
    return norms.to(torch.promote_types(rows.dtype, torch.float32))


def clip_and_accumulate(
    grad_samples: Sequence[Tensor], max_grad_norm: float, device: torch.device
) -> tuple[list[Tensor], Tensor]:
    """Abadi et al. 2016, Alg. 1, line 4 and the sum of line 5: ``(sum_i min(1, C / (||g_i|| + 1e-6)) g_i per
    parameter, the norms ||g_i||)``, with ||g_i|| over ALL parameters jointly (Opacus's flat clipping), the norms in
    float32 at least and the sums in float64 (:func:`~.rounding.weighted_row_sum`). ``grad_samples[k]`` has shape
    ``(B, *shape_k)``; B may be 0 (sums of zeros)."""
    batch_size = int(grad_samples[0].shape[0])
    norm_dtype = torch.promote_types(grad_samples[0].dtype, torch.float32)
    if batch_size > 0:  # upper bounds of the norms: rounding cannot clip an example to more than C
        per_param = torch.stack(
            [
                norm_upper_bound(g.reshape(batch_size, -1), dim=1).to(device)
                for g in grad_samples
            ],
            dim=1,
        )
        # the rows' sum is float64 (weighted_row_sum); the factor still charges float32's gamma_SUM_BLOCK, an
        # overestimate
        norms = torch.linalg.vector_norm(per_param, ord=2, dim=1) * (1 + sum_rounding(SUM_BLOCK, norm_dtype))
    else:
        norms = torch.zeros(0, dtype=torch.float64, device=device)
    factor = clip_factor(norms, max_grad_norm)
    sums = []
    for g in grad_samples:  # never a half-precision factor or sum
        sums.append(weighted_row_sum(factor, g))
    return sums, norms.to(norm_dtype)
