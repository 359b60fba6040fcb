"""Book-keeping's per-layer arithmetic: each example's squared gradient norm and the sum of CLIPPED gradients of one
layer call, from its inputs ``a`` and output gradients ``g`` alone (Bu, Wang, Zha, Karypis 2023), never holding the
per-sample gradients of the whole batch.

A layer whose output is a product ``s = W u`` over positions t = 1..T (nn.Linear on (B, T, d): u = a; a convolution:
u = the unfolded input patches, T = output positions) has per-example weight gradient ``G_i U_i^T`` with
``G_i`` of shape (d_out, T) and ``U_i`` of shape (p, T). Its squared norm is computed the cheaper of two ways:

* ghost norm (Li, Tramer, Liang, Hashimoto 2022, Sec. 4): ``||G_i U_i^T||^2 = <G_i^T G_i, U_i^T U_i>``, two T x T
  Gram matrices, cost ~ B T^2 (p + d_out); for T = 1 it is ``||g_i||^2 ||a_i||^2`` (Goodfellow 2015);
* one example at a time: its weight gradient (a batch-of-one weight-gradient call), its norm, then dropped;
  cost ~ B T p d_out, the weight gradient's own cost, memory one example's gradient.

Ghost is used when ``T (p + d_out) < p d_out`` (deep convolutions with small maps, sequences shorter than the
width). The clipped sum ``sum_i c_i G_i U_i^T`` is then ONE weight-gradient computation with the output gradients
scaled by ``c_i`` (a matrix product for nn.Linear, ``convolution_backward`` for convolutions).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


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
    """Whether ``module``'s type gets this arithmetic: nn.Linear (or Hugging Face's transposed ``Conv1D``), or a
    zero-padded convolution with numeric padding."""
    if _is_linear(module):
        return True
    return type(module) in _CONVOLUTIONS and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def has_bookkeeping(module: nn.Module, backprops: Tensor) -> bool:
    """Whether a rule layer's call gets this arithmetic: a covered layer on (B, d) or (B, T, d) (nn.Linear) or on
    batch-first (B, C, *spatial) inputs (convolutions)."""
    if not covers(module):
        return False
    return backprops.dim() in (2, 3) if _is_linear(module) else backprops.dim() == module.weight.dim()


def squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    """``||grad_i||^2`` of ``module``'s trainable parameters for every example i, shape (B,), in ``dtype``."""
    if _is_linear(module):
        return _linear_squared_norms(module, a.to(g.dtype), g, dtype)
    return _conv_squared_norms(module, *_conv_inputs(module, a, g), dtype)


def clipped_sums(module: nn.Module, a: Tensor, g: Tensor, factor: Tensor) -> dict[nn.Parameter, Tensor]:
    """``sum_i factor_i grad_i`` for each trainable parameter of ``module``: one weight-gradient computation."""
    weight, bias = module.weight, module.bias
    out: dict[nn.Parameter, Tensor] = {}
    if _is_linear(module):
        a = a.to(g.dtype).reshape(-1, a.shape[-1])
        weighted = (g * factor.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))).reshape(-1, g.shape[-1])
        if weight.requires_grad:
            out[weight] = a.t() @ weighted if is_transposed_linear(module) else weighted.t() @ a
        if bias is not None and bias.requires_grad:
            out[bias] = weighted.sum(dim=0)
        return out
    a, g = _conv_inputs(module, a, g)
    weighted = g * factor.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
    if weight.requires_grad:
        out[weight] = _conv_weight_grad(module, weighted, a)
    if bias is not None and bias.requires_grad:
        out[bias] = weighted.sum(dim=[0, *range(2, g.dim())])
    return out


def uses_ghost_norm(module: nn.Module, g: Tensor) -> bool:
    """The cost rule of the module docstring: ghost norm when T (p + d_out) < p d_out."""
    if _is_linear(module):
        steps, p, d_out = (1 if g.dim() == 2 else g.shape[1]), *module.weight.shape
    else:
        if type(module) is nn.Conv3d:
            return False  # no unfold for 3-d inputs: one example at a time
        steps = math.prod(g.shape[2:])
        p, d_out = module.weight[0].numel(), module.out_channels // module.groups
    return steps == 1 or steps * (p + d_out) < p * d_out


# ---- nn.Linear, Conv1D ----------------------------------------------------------------------------------------------
def _linear_squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    squared = torch.zeros(g.shape[0], dtype=dtype, device=g.device)
    if g.dim() == 2:
        g2 = torch.linalg.vector_norm(g, dim=1, dtype=dtype).square()
        if module.weight.requires_grad:
            squared += g2 * torch.linalg.vector_norm(a, dim=1, dtype=dtype).square()
        if module.bias is not None and module.bias.requires_grad:
            squared += g2
        return squared
    if module.weight.requires_grad:
        if uses_ghost_norm(module, g):
            squared += _gram_inner_products(g.transpose(1, 2), a.transpose(1, 2), dtype)
        else:
            for i in range(g.shape[0]):  # one example's weight gradient at a time
                squared[i] = torch.linalg.vector_norm(g[i].t() @ a[i], dtype=dtype).square()
    if module.bias is not None and module.bias.requires_grad:
        squared += torch.linalg.vector_norm(g.sum(dim=1), dim=1, dtype=dtype).square()
    return squared


def _gram_inner_products(g: Tensor, u: Tensor, dtype: torch.dtype) -> Tensor:
    """``<G_i^T G_i, U_i^T U_i>`` for batches G (B, d_out, T) and U (B, p, T): the ghost norm."""
    products = (torch.bmm(g.transpose(1, 2), g) * torch.bmm(u.transpose(1, 2), u)).sum(dim=(1, 2), dtype=dtype)
    return products.clamp_min(0)  # a squared norm; rounding can leave a vanishing one slightly below zero


# ---- convolutions ---------------------------------------------------------------------------------------------------
def _conv_inputs(module: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Input and output gradient in the weight's dtype (autocast ran the layer in lower precision)."""
    dtype = module.weight.dtype
    return a.to(dtype), g.to(dtype)


def _conv_weight_grad(module: nn.Module, g: Tensor, a: Tensor) -> Tensor:
    """The weight gradient of ``module``'s convolution for input ``a`` and output gradient ``g`` (summed over the
    batch), by the same kernel autograd uses."""
    dims = module.weight.dim() - 2
    return torch.ops.aten.convolution_backward(
        g, a, module.weight, None, list(module.stride), list(module.padding), list(module.dilation), False,
        [0] * dims, module.groups, [False, True, False],
    )[1]


def _conv_squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    batch = g.shape[0]
    squared = torch.zeros(batch, dtype=dtype, device=g.device)
    if batch == 0:  # an empty Poisson batch
        return squared
    if module.bias is not None and module.bias.requires_grad:
        squared += torch.linalg.vector_norm(g.flatten(2).sum(dim=2), dim=1, dtype=dtype).square()
    if not module.weight.requires_grad:
        return squared
    if uses_ghost_norm(module, g):
        squared += _conv_ghost_norms(module, a, g, dtype)
    else:
        for i in range(batch):  # one example's weight gradient at a time
            one = _conv_weight_grad(module, g[i : i + 1], a[i : i + 1])
            squared[i] += torch.linalg.vector_norm(one, dtype=dtype).square()
    return squared


def _conv_ghost_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    """Ghost norms of a Conv1d/Conv2d: unfold the input into patches U (B, p * groups, T), then per group."""
    if type(module) is nn.Conv1d:  # as a Conv2d of height 1
        a, g = a.unsqueeze(2), g.unsqueeze(2)
        kernel, dilation, stride = [(1, *getattr(module, n)) for n in ("kernel_size", "dilation", "stride")]
        padding = (0, *module.padding)
    else:
        kernel, dilation, padding, stride = module.kernel_size, module.dilation, module.padding, module.stride
    patches = nn.functional.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
    batch, groups, steps = g.shape[0], module.groups, patches.shape[-1]
    u = patches.view(batch * groups, -1, steps)
    grads = g.reshape(batch * groups, -1, steps)
    return _gram_inner_products(grads, u, dtype).view(batch, groups).sum(dim=1)
