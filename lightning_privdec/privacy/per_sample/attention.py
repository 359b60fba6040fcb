"""nn.MultiheadAttention's per-example gradients from its linear maps, without a per-example replay.

nn.MultiheadAttention passes its packed ``in_proj_weight`` (or ``q/k/v_proj_weight``) and ``out_proj.weight`` to
``F.multi_head_attention_forward`` directly, so no layer hook sees them used. While a
:class:`~lightning_privdec.privacy.per_sample.capture.Recorder` records, the module's forward is instead the
equivalent computation below, whose parameters are used only by :class:`nn.Linear` objects that hold the module's
own parameters (:class:`Projections`: the same Parameter objects, not children of the module, so its ``state_dict``
and ``parameters()`` are unchanged). Those linear maps on sequences (B, T, E) are recorded as any nn.Linear call
(input and output gradient), and every mode's closed form applies to them as it is: book-keeping's norms with their
floating-point upper bounds, Opacus's closed form, vmap of ``torch.func.grad``. Between them runs parameter-free
attention: heads, masks, dropout, softmax, ``F.scaled_dot_product_attention``.

The in-projection is ONE linear call on one sequence, so that its per-example gradient is one outer-product sum:

* self-attention (``query is key is value``): ``[q | k | v] = x W^T + b``, as torch computes it;
* cross-attention: the inputs concatenated along time, ``[x_q; x_k; x_v] W^T + b``, of which the block of each
  input's own third of W's rows is kept. The other blocks' output gradients are exactly zero, so the recorded
  per-example gradient ``sum_t g_t a_t^T`` is exactly ``[G_q^T X_q; G_k^T X_k; G_v^T X_v]`` (and the bias's), at
  the cost of computing the unused blocks (``key is value``: [x_q; x_k], 2 blocks of 3 unused).

Supported: packed weights (``kdim == vdim == embed_dim``) with or without bias; separate ``q/k/v_proj_weight``
without bias (one linear map each); ``batch_first`` either way; ``key_padding_mask``, ``attn_mask`` (2-D or 3-D, bool
or float) and the ``is_causal`` hint exactly as torch reads them; dropout; ``need_weights`` with
``average_attn_weights``; ``add_zero_attn``. Kept on the replay (:mod:`.replay`): ``add_bias_kv`` (``bias_k`` and
``bias_v`` are appended to every example's keys and values, which no linear map covers) and separate ``q/k/v``
weights with a bias (their bias is one packed Parameter over three maps). Unbatched (2-D) inputs are refused: a
per-example gradient needs the examples' dimension.
"""

from __future__ import annotations

import math
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample.bookkeeping import linear_holding


@dataclass
class Projections:
    """The linear maps of one nn.MultiheadAttention, as nn.Linear objects holding its Parameters: ``packed``
    (``in_proj_weight``, ``in_proj_bias``) or ``separate`` (``q/k/v_proj_weight``), and ``out``."""

    packed: nn.Linear | None
    separate: tuple[nn.Linear, nn.Linear, nn.Linear] | None
    out: nn.Linear

    def linears(self) -> list[tuple[str, nn.Linear]]:
        named = [("in_proj", self.packed)] if self.packed is not None else []
        if self.separate is not None:
            named += list(zip(("q_proj", "k_proj", "v_proj"), self.separate))
        return [*named, ("out_proj", self.out)]

    def current(self, module: nn.MultiheadAttention) -> bool:
        """Whether these still hold the module's Parameters (none was replaced since)."""
        if self.packed is not None:
            own = [(self.packed, module.in_proj_weight, module.in_proj_bias)]
        else:
            own = [(lin, w, None) for lin, w in zip(self.separate, _separate_weights(module))]
        own.append((self.out, module.out_proj.weight, module.out_proj.bias))
        return all(lin.weight is w and lin.bias is b for lin, w, b in own)


_PROJECTIONS: weakref.WeakKeyDictionary[nn.Module, Projections] = weakref.WeakKeyDictionary()
_HELPERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def unsupported(module: nn.Module) -> str | None:
    """Why ``module`` keeps the replay (None: it gets :func:`units`); only nn.MultiheadAttention is considered."""
    if not isinstance(module, nn.MultiheadAttention):
        return "not nn.MultiheadAttention"
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True"
    if not module._qkv_same_embed_dim and module.in_proj_bias is not None:
        return "separate q/k/v projection weights (kdim or vdim != embed_dim) with a bias"
    if type(module.out_proj).forward is not nn.Linear.forward:
        return "an out_proj that is not a linear map"
    return None


def projections(module: nn.MultiheadAttention) -> Projections:
    """The module's :class:`Projections` (made once per module, remade if a Parameter was replaced)."""
    found = _PROJECTIONS.get(module)
    if found is not None and found.current(module):
        return found
    packed = separate = None
    if module._qkv_same_embed_dim:
        packed = linear_holding(module.in_proj_weight, module.in_proj_bias)
    else:
        separate = tuple(linear_holding(w, None) for w in _separate_weights(module))
    made = Projections(packed, separate, linear_holding(module.out_proj.weight, module.out_proj.bias))
    for _, lin in made.linears():
        _HELPERS.add(lin)
    _PROJECTIONS[module] = made
    return made


def units(name: str, module: nn.Module) -> list[tuple[str, nn.Module, str]] | None:
    """``(name, layer, mechanism)`` units for a supported nn.MultiheadAttention with trainable parameters: the
    module itself (``"attention"``: its forward is replaced while recording, :func:`install`) and each of its linear
    maps with a trainable parameter (``"rule"``). None for any other module (the caller decides)."""
    if unsupported(module) is not None or not any(p.requires_grad for p in module.parameters()):
        return None
    linears = [(f"{name}.{suffix}" if name else suffix, lin, "rule") for suffix, lin in projections(module).linears()
               if any(p.requires_grad for p in lin.parameters())]  # fmt: skip
    return [(name, module, "attention"), *linears]


def is_projection(module: nn.Module) -> bool:
    """Whether ``module`` is one of the linear maps of :func:`projections` (not a layer of the model)."""
    return module in _HELPERS


def with_projections(module: nn.Module) -> Iterator[nn.Module]:
    """``module.modules()`` and the linear maps of every nn.MultiheadAttention among them."""
    for m in module.modules():
        yield m
        found = _PROJECTIONS.get(m)
        if found is not None:
            yield from (lin for _, lin in found.linears())


class _Installed:
    """The handle of :func:`install`: ``remove()`` gives the module its class's forward back."""

    def __init__(self, module: nn.Module, forward: types.MethodType) -> None:
        self.module, self.forward = module, forward

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self.forward:
            del self.module.forward


def install(module: nn.MultiheadAttention, recording: Callable[[nn.Module], bool], batch_first: bool) -> _Installed:
    """Make ``module``'s forward the computation of :func:`forward` whenever ``recording(module)`` (a training or
    probing call with gradients on, hooks enabled, not a replay), and its class's forward otherwise;
    ``batch_first``: the recorder's layout. A bound method of the module: ``copy.deepcopy`` binds the copy's to the
    copy, which runs its class's forward."""
    method = types.MethodType(partial(_forward_or_class, recording, batch_first), module)
    module.forward = method
    return _Installed(module, method)


def _forward_or_class(recording: Callable[[nn.Module], bool], batch_first: bool, module: nn.MultiheadAttention,
                      *args, **kwargs):  # fmt: skip
    """:func:`forward` for the module whose :class:`Projections` the recorder hooked, while they hold its
    Parameters; the class's forward for anything else: not recording, a copy (``copy.deepcopy`` copies the
    instance's forward, not the projections), parameters substituted (``torch.func.functional_call``)."""
    found = _PROJECTIONS.get(module)
    if found is None or not recording(module) or not found.current(module):
        return type(module).forward(module, *args, **kwargs)
    return forward(module, *args, records_batch_first=batch_first, **kwargs)


def forward(
    module: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    *,
    records_batch_first: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """What ``module(query, key, value, ...)`` computes (nn.MultiheadAttention.forward and
    F.multi_head_attention_forward, training path), its linear maps run as :func:`projections`' nn.Linear calls on
    inputs laid out as the recorder reads them (``records_batch_first``: batch first, else sequence first)."""
    heads, embed = module.num_heads, module.embed_dim
    if query.dim() != 3:
        raise PrivacyConfigError(
            f"nn.MultiheadAttention was called on an unbatched {query.dim()}-D query: per-example gradients need the "
            "examples' dimension; call it on (batch, time, features) inputs (batch_first=True) or (time, batch, "
            "features)"
        )
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask", target_type=query.dtype,
    )  # fmt: skip
    attn_mask = F._canonical_mask(
        mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
        check_other=False,
    )  # fmt: skip
    F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, heads)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # torch then trusts the hint: F.scaled_dot_product_attention(is_causal=True)
    else:
        is_causal = False  # the mask itself is used
    if query.shape[-1] != embed:
        raise AssertionError(f"was expecting embedding dimension of {embed}, but got {query.shape[-1]}")

    # batch first from here on: (B, L, E) and (B, S, E)
    self_attention, shared_kv = query is key and key is value, key is value
    first = (lambda t: t) if module.batch_first else (lambda t: t.transpose(0, 1))
    xq, xk, xv = first(query), first(key), first(value)
    batch, tgt_len, src_len = xq.shape[0], xq.shape[1], xk.shape[1]
    if xk.shape[:2] != xv.shape[:2] or xk.shape[0] != batch:
        raise AssertionError(f"key's sequence and batch dims {tuple(key.shape[:2])} do not match value's "
                             f"{tuple(value.shape[:2])} or the query's batch")  # fmt: skip
    into = (lambda t: t) if records_batch_first else (lambda t: t.transpose(0, 1))  # the recorder's layout and back
    found = projections(module)
    for _, lin in found.linears():
        lin.train(module.training)
    if found.packed is not None:
        if self_attention:
            q, k, v = into(found.packed(into(xq))).chunk(3, dim=-1)
        else:
            parts = [xq, xk] if shared_kv else [xq, xk, xv]
            y = into(found.packed(into(torch.cat(parts, dim=1))))
            q = y[:, :tgt_len, :embed]
            k = y[:, tgt_len : tgt_len + src_len, embed : 2 * embed]
            v = y[:, -src_len:, 2 * embed :]
    else:
        q, k, v = (into(lin(into(x))) for lin, x in zip(found.separate, (xq, xk, xv)))

    head_dim = embed // heads
    q, k, v = (t.reshape(batch, t.shape[1], heads, head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
    mask = _merged_mask(attn_mask, key_padding_mask, batch, heads, tgt_len, src_len, module.add_zero_attn)
    if module.add_zero_attn:
        zeros = q.new_zeros(batch, heads, 1, head_dim)
        k, v = torch.cat([k, zeros.to(k.dtype)], dim=2), torch.cat([v, zeros.to(v.dtype)], dim=2)
    dropout = module.dropout if module.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        if dropout > 0.0:
            probs = F.dropout(probs, p=dropout)
        out = torch.matmul(probs, v)
        weights = probs.mean(dim=1) if average_attn_weights else probs
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    out = out.transpose(1, 2).reshape(batch, tgt_len, embed)
    out = into(found.out(into(out)))
    return (out if module.batch_first else out.transpose(0, 1)), weights


def _merged_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, heads: int, tgt_len: int,
                 src_len: int, zero_attn: bool) -> Tensor | None:
    """The additive float mask, broadcastable to (B, H, L, S) (S + 1 with ``add_zero_attn``: the zero key is never
    masked), from torch's canonical masks: ``attn_mask`` (L, S) or (B * H, L, S), ``key_padding_mask`` (B, S)."""
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(tgt_len, src_len)}.")  # fmt: skip
            attn_mask = attn_mask.view(1, 1, tgt_len, src_len)
        else:
            if tuple(attn_mask.shape) != (batch * heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(batch * heads, tgt_len, src_len)}.")  # fmt: skip
            attn_mask = attn_mask.view(batch, heads, tgt_len, src_len)
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(batch, src_len)}, but got "
                                 f"{tuple(key_padding_mask.shape)}")  # fmt: skip
        key_padding_mask = key_padding_mask.view(batch, 1, 1, src_len)
    if zero_attn:
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    if attn_mask is None:
        return key_padding_mask
    return attn_mask if key_padding_mask is None else attn_mask + key_padding_mask


def _separate_weights(module: nn.MultiheadAttention) -> tuple[Tensor, Tensor, Tensor]:
    return module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
