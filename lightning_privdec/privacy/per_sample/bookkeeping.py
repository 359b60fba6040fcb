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
matrix product for nn.Linear, ``convolution_backward`` for convolutions).
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


def squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype, method: str | None = None) -> Tensor:
    """``||grad_i||^2`` of ``module``'s trainable parameters for every example i, shape (B,), in ``dtype``; by
    ``method`` (default: :func:`norm_method`'s choice)."""
    if _is_linear(module):
        return _linear_squared_norms(module, a.to(g.dtype), g, dtype, method)
    return _conv_squared_norms(module, *_conv_inputs(module, a, g), dtype, method)


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


# ---- nn.Linear, Conv1D ----------------------------------------------------------------------------------------------
def _linear_squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype, method: str | None) -> Tensor:
    squared = torch.zeros(g.shape[0], dtype=dtype, device=g.device)
    if g.dim() == 2:
        g2 = torch.linalg.vector_norm(g, dim=1, dtype=dtype).square()
        if module.weight.requires_grad:
            squared += g2 * torch.linalg.vector_norm(a, dim=1, dtype=dtype).square()
        if module.bias is not None and module.bias.requires_grad:
            squared += g2
        return squared
    if module.weight.requires_grad:
        if (method or norm_method(module, a, g)) == "ghost":
            squared += _gram_inner_products(g.transpose(1, 2), a.transpose(1, 2), dtype)
        else:
            for i in range(g.shape[0]):  # one example's weight gradient at a time
                squared[i] = torch.linalg.vector_norm(g[i].t() @ a[i], dtype=dtype).square()
    if module.bias is not None and module.bias.requires_grad:
        squared += torch.linalg.vector_norm(g.sum(dim=1), dim=1, dtype=dtype).square()
    return squared


def _gram_inner_products(g: Tensor, u: Tensor, dtype: torch.dtype, u_gram: Tensor | None = None) -> Tensor:
    """``<G_i^T G_i, U_i^T U_i>`` for batches G (B, d_out, T) and U (B, p, T) (or U's Gram (B, T, T) given as
    ``u_gram``): the ghost norm."""
    u_gram = torch.bmm(u.transpose(1, 2), u) if u_gram is None else u_gram
    products = (torch.bmm(g.transpose(1, 2), g) * u_gram).sum(dim=(1, 2), dtype=dtype)
    return products.clamp_min(0)  # a squared norm; rounding can leave a vanishing one slightly below zero


# ---- convolutions ---------------------------------------------------------------------------------------------------
def _conv_inputs(module: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Input and output gradient in the weight's dtype (autocast ran the layer in lower precision)."""
    dtype = module.weight.dtype
    return a.to(dtype), g.to(dtype)


def _conv_weight_grad(module: nn.Module, g: Tensor, a: Tensor) -> Tensor:
    """The weight gradient of ``module``'s convolution for input ``a`` and output gradient ``g`` (summed over the
    batch), by the same kernel autograd uses. Kernel taps that read only zero padding at every output position
    (a 3x3 kernel on a 1x1 map keeps only its centre) get gradient 0 without being computed: the live taps' gradient
    is that of a cropped kernel on the explicitly padded input."""
    dims, weight = module.weight.dim() - 2, module.weight.detach()  # no autograd graph on the result
    live = _live_taps(module, a.shape[2:], g.shape[2:])
    if live is None:
        return torch.ops.aten.convolution_backward(
            g, a, weight, None, list(module.stride), list(module.padding), list(module.dilation), False,
            [0] * dims, module.groups, [False, True, False],
        )[1]
    pads: list[int] = []
    for (first, last), size, out, pad, stride, dilation in zip(
        live, a.shape[2:], g.shape[2:], module.padding, module.stride, module.dilation
    ):
        before = pad - first * dilation  # negative: crop
        after = (out - 1) * stride + (last - first) * dilation + 1 - size - before
        pads = [before, after, *pads]  # F.pad lists the last dimension first
    window = (..., *[slice(first, last + 1) for first, last in live])
    cropped = torch.ops.aten.convolution_backward(
        g, nn.functional.pad(a, pads), weight[window], None, list(module.stride), [0] * dims,
        list(module.dilation), False, [0] * dims, module.groups, [False, True, False],
    )[1]
    full = torch.zeros_like(weight, dtype=cropped.dtype)
    full[window] = cropped
    return full


def _live_taps(module: nn.Module, in_size: torch.Size, out_size: torch.Size) -> list[tuple[int, int]] | None:
    """Per spatial dimension, the first and last kernel tap that reads a real input position at some output
    position; None when every tap does (or the live taps are not contiguous)."""
    live = []
    for kernel, size, out, pad, stride, dilation in zip(
        module.kernel_size, in_size, out_size, module.padding, module.stride, module.dilation
    ):
        taps = [k for k in range(kernel) if any(0 <= o * stride + k * dilation - pad < size for o in range(out))]
        if not taps or taps != list(range(taps[0], taps[-1] + 1)):
            return None
        live.append((taps[0], taps[-1]))
    if all(last - first + 1 == kernel for (first, last), kernel in zip(live, module.kernel_size)):
        return None
    return live


def _conv_squared_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype, method: str | None) -> Tensor:
    batch = g.shape[0]
    squared = torch.zeros(batch, dtype=dtype, device=g.device)
    if batch == 0:  # an empty Poisson batch
        return squared
    if module.bias is not None and module.bias.requires_grad:
        squared += torch.linalg.vector_norm(g.flatten(2).sum(dim=2), dim=1, dtype=dtype).square()
    if not module.weight.requires_grad:
        return squared
    method = method or norm_method(module, a, g)
    if method == "ghost":
        squared += _conv_ghost_norms(module, a, g, dtype)
    elif method == "input_gram":
        squared += _conv_input_gram_norms(module, a, g, dtype)
    else:
        for i in range(batch):  # one example's weight gradient at a time
            one = _conv_weight_grad(module, g[i : i + 1], a[i : i + 1])
            squared[i] += torch.linalg.vector_norm(one, dtype=dtype).square()
    return squared


def _as_2d(module: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, tuple]:
    """A Conv1d's input and output gradient as a Conv2d's of height 1, and (kernel, dilation, padding, stride)."""
    if type(module) is nn.Conv1d:
        names = ("kernel_size", "dilation", "padding", "stride")
        return a.unsqueeze(2), g.unsqueeze(2), tuple((k, *getattr(module, n)) for k, n in zip((1, 1, 0, 1), names))
    return a, g, (module.kernel_size, module.dilation, module.padding, module.stride)


def _conv_ghost_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    """Ghost norms of a Conv1d/Conv2d: unfold the input into patches U (B, p * groups, T), then per group."""
    a, g, (kernel, dilation, padding, stride) = _as_2d(module, a, g)
    patches = nn.functional.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
    batch, groups, steps = g.shape[0], module.groups, patches.shape[-1]
    u = patches.view(batch * groups, -1, steps)
    grads = g.reshape(batch * groups, -1, steps)
    return _gram_inner_products(grads, u, dtype).view(batch, groups).sum(dim=1)


def _conv_input_gram_norms(module: nn.Module, a: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    """Ghost norms of a Conv1d/Conv2d with the patches' Gram ``U_i^T U_i`` summed from the padded input's position
    Gram ``S_i``: one (N x N) product per example and group instead of unfolding (module docstring)."""
    a, g, (kernel, dilation, padding, stride) = _as_2d(module, a, g)
    padded = nn.functional.pad(a, (padding[1], padding[1], padding[0], padding[0]))
    batch, groups, (height, width), (out_h, out_w) = g.shape[0], module.groups, padded.shape[2:], g.shape[2:]
    positions = padded.reshape(batch * groups, -1, height * width)
    s = torch.bmm(positions.transpose(1, 2), positions).view(-1, height, width, height, width)
    # sum over kernel rows, then columns (separable): rows/columns of patch t start at stride * t + dilation * k
    rows = [slice(k * dilation[0], k * dilation[0] + stride[0] * (out_h - 1) + 1, stride[0]) for k in range(kernel[0])]
    cols = [slice(k * dilation[1], k * dilation[1] + stride[1] * (out_w - 1) + 1, stride[1]) for k in range(kernel[1])]
    by_rows = sum(s[:, r, :, r, :] for r in rows)  # (B g, out_h, W, out_h, W)
    u_gram = sum(by_rows[:, :, c, :, c] for c in cols)  # (B g, out_h, out_w, out_h, out_w)
    steps = out_h * out_w
    grads = g.reshape(batch * groups, -1, steps)
    return _gram_inner_products(grads, None, dtype, u_gram.reshape(-1, steps, steps)).view(batch, groups).sum(dim=1)
