"""nn.LSTM, nn.GRU and nn.RNN without a per-example replay: the layer run step by step, its weights' products
recorded as nn.Linear calls over the whole sequence.

A weight shared across time has per-example gradient a sum over time of outer products: with ``x_t`` a layer's
input, ``h_{t-1}`` its previous hidden state and ``g_t``, ``g'_t`` the gradients of the input-to-hidden and
hidden-to-hidden products at step t,

    grad W_ih[b] = sum_t g_t[b] x_t[b]^T,   grad W_hh[b] = sum_t g'_t[b] h_{t-1}[b]^T,   grad b_ih[b] = sum_t g_t[b],

the form of an nn.Linear applied to a sequence (B, T, d). During the private step (the :class:`.capture.Recorder`
recording) the layer's own forward is replaced by an unrolled computation with the same parameters:

* ``W_ih x + b_ih`` is ONE product over the whole sequence of each layer and direction, recorded as an nn.Linear
  call on (B, T, d_in);
* ``W_hh h_{t-1} + b_hh`` is one product per step; its inputs ``h_{t-1}`` and its outputs' gradients are collected
  over the steps into one record (B, T, H) -> (B, T, G). Its gradient is taken where it leaves the product, so
  GRU's new gate ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))`` gets the hidden product's own gradient ``r * g``;
* with ``proj_size`` the projection ``h_t = W_hr m_t`` likewise, one record over the steps.

On the host an nn.LSTM of hidden size at most :data:`FUSED_HIDDEN_SIZE` without projection runs each layer's and
direction's steps in torch's fused kernel instead of Python (:func:`_fused_lstm`): the kernel gets ``W_ih x + b_ih``
as its input, with the identity as its input weight, so the gradient reaching the product is the gates' and the
previous hidden states are its outputs shifted by one step: the same records.

The per-example gradients, norms and clipped sums are then those of nn.Linear (:mod:`.bookkeeping`: Gram-matrix or
per-example norms with their floating-point upper bounds) in every mode. Each parameter is one record's, so
book-keeping never materialises them. Gate arithmetic is PyTorch's documented cell (the module's output to
rounding); dropout between layers draws its own mask, as a second forward of the module would.

Always unrolled (in the fused kernel for the small LSTMs above, by their shape alone), never chosen per call:
replaying was measured faster only for an nn.LSTM on a batch of one or two examples at hidden size 32 (oneDNN's
fused kernel, run B + 1 times, against T Python steps; benchmarks/RESULTS.md, 2026-11-27), and a choice by batch
size or sequence length would compute the other examples' gradients with different arithmetic in a batch and in the
same batch less one example (their rounding then moves the clipped sum, which no per-example bound covers).

Covered: every layer count, ``batch_first`` or not, bidirectional, ``bias=False``, ``proj_size``, dropout between
layers, a given initial state (one carried over from an earlier step is refused by :mod:`.capture`). Left on replay
(:mod:`.replay`): subclasses and parametrized layers (their type is not exactly nn.LSTM, nn.GRU or nn.RNN, so their
forward may differ), a layer whose ``forward`` was already replaced on the instance, and recurrent cells
(nn.LSTMCell and the like: one step per call, nothing to gather). Refused in the private step, as before: packed
sequences (:data:`PACKED_SEQUENCE_ERROR`) and unbatched (time, features) inputs. Outside the private step (eval,
``no_grad``, a replay of an enclosing layer) the module's own forward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample.bookkeeping import linear_holding

PACKED_SEQUENCE_ERROR = (
    "layer {name} ({type}) returned a PackedSequence: per-sample gradients need padded batches (batch, time, ...) "
    "with the padding masked in the loss"
)
UNBATCHED_ERROR = (
    "layer {name} ({type}) was called on an unbatched sequence of shape {shape}: per-sample gradients need the "
    "examples in a batch dimension, (batch, time, features) with batch_first=True or (time, batch, features)"
)
_TYPES = (nn.LSTM, nn.GRU, nn.RNN)


def unrolls(module: nn.Module) -> bool:
    """Whether ``module`` gets the unrolled form (module docstring) rather than a replay."""
    own = module.__dict__.get("forward")  # a forward set on the instance by other code: left alone
    return (
        type(module) in _TYPES
        and (own is None or isinstance(own, _Unrolled))
        and all(w.is_floating_point() for w in module._flat_weights if w is not None)
    )


class _Unrolled:
    """The instance's ``forward`` while hooks are attached: the unrolled form when ``recording()``, else the
    module's own forward. :meth:`remove` restores the class's."""

    def __init__(self, module: nn.Module, name: str, recording: Callable[[], bool], recorder: Any) -> None:
        self.module, self.name, self.recording, self.recorder = module, name, recording, recorder
        module.forward = self

    def __call__(self, input: Any, hx: Any = None) -> Any:
        module = self.module
        if not self.recording():
            return type(module).forward(module, input, hx)
        return _forward(module, self.name, self.recorder, input, hx)

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward


def unroll(module: nn.Module, name: str, recording: Callable[[], bool], recorder: Any) -> _Unrolled:
    """Replace ``module``'s forward by the unrolled form while ``recording()`` (a handle: ``.remove()``); its
    products are recorded with ``recorder.record_projection``."""
    return _Unrolled(module, name, recording, recorder)


def _forward(module: nn.RNNBase, name: str, recorder: Any, input: Any, hx: Any) -> Any:
    what = {"name": name or "<root>", "type": type(module).__name__}
    if isinstance(input, PackedSequence):
        raise PrivacyConfigError(PACKED_SEQUENCE_ERROR.format(**what))
    if not isinstance(input, Tensor) or input.dim() != 3:
        raise PrivacyConfigError(UNBATCHED_ERROR.format(shape=tuple(getattr(input, "shape", ())), **what))
    lstm = module.mode == "LSTM"
    directions = 2 if module.bidirectional else 1
    x = input if module.batch_first else input.transpose(0, 1)  # (B, T, d), batch first from here on
    batch = x.shape[0]
    out_size = module.proj_size or module.hidden_size
    if hx is None:
        h0 = x.new_zeros(module.num_layers * directions, batch, out_size)
        c0 = x.new_zeros(module.num_layers * directions, batch, module.hidden_size) if lstm else None
    else:
        module.check_forward_args(input, hx, None)  # the module's own messages for wrong shapes
        h0, c0 = hx if lstm else (hx, None)
    last_h, last_c = [], []
    for layer in range(module.num_layers):
        if layer and module.dropout and module.training:
            x = F.dropout(x, module.dropout, training=True)
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            out, h, c = _direction(module, name, recorder, f"_l{layer}{'_reverse' if direction else ''}", x, h0[k],
                                   c0[k] if lstm else None, reverse=direction == 1)  # fmt: skip
            outputs.append(out)
            last_h.append(h)
            last_c.append(c)
        x = outputs[0] if directions == 1 else torch.cat(outputs, dim=2)
    output = x if module.batch_first else x.transpose(0, 1).contiguous()
    h_n = torch.stack(last_h)
    return (output, (h_n, torch.stack(last_c))) if lstm else (output, h_n)


def _direction(
    module: nn.RNNBase, name: str, recorder: Any, suffix: str, x: Tensor, h: Tensor, c: Tensor | None, reverse: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer and direction over the sequence ``x`` (B, T, d) from state ``h`` (and ``c``): (outputs (B, T, H),
    last h, last c), its products recorded (module docstring)."""
    w_ih, w_hh = getattr(module, f"weight_ih{suffix}"), getattr(module, f"weight_hh{suffix}")
    b_ih = getattr(module, f"bias_ih{suffix}") if module.bias else None
    b_hh = getattr(module, f"bias_hh{suffix}") if module.bias else None
    w_hr = getattr(module, f"weight_hr{suffix}") if module.proj_size else None
    prefix = f"{name}." if name else ""
    # once the per-sample arithmetic replaces autograd's parameter gradients (Recorder.skip_parameter_grads), the
    # products use detached parameters and the backward pass skips the batch's weight gradients; the gradient of the
    # input product ``ih`` is what the records need, so it requires grad whatever its inputs
    skip = recorder.skip_parameter_grads
    ih = F.linear(x, *_maybe_detached((w_ih, b_ih), skip))
    if not ih.requires_grad:  # (a leaf then: its own gradient is the gates')
        ih.requires_grad_(True)
    recorder.record_projection(f"{prefix}weight_ih{suffix}", linear_holding(w_ih, b_ih), x, ih, unit=module)
    hidden = _maybe_detached((w_hh, b_hh), skip)
    gru = module.mode == "GRU"
    if _fuses(module) and ih.device.type == "cpu" and x.shape[0] and x.shape[1]:
        out, h, c, previous_seq = _fused_lstm(ih, hidden, h, c, reverse, module.training)
        recorder.record_projection(f"{prefix}weight_hh{suffix}", linear_holding(w_hh, b_hh), previous_seq, ih,
                                   unit=module)
        return out, h, c
    cell = _CELLS[module.mode]
    steps = ih.unbind(1)  # one backward node for all steps (indexing would write a full-size gradient per step)
    count = len(steps)
    previous, resets, outputs = [None] * count, [None] * count, [None] * count
    project_in, project_out = [], []
    for t in range(count - 1, -1, -1) if reverse else range(count):
        previous[t] = h
        h, c, reset = cell(steps[t], F.linear(h, *hidden), h, c)
        resets[t] = reset
        if w_hr is not None:
            project_in.append(h)
            h = F.linear(h, *_maybe_detached((w_hr,), skip and h.requires_grad))
            project_out.append(h)
        outputs[t] = h
    with torch.no_grad():
        previous_seq = torch.stack(previous, dim=1)
        reset_seq = torch.stack(resets, dim=1) if gru else None
        project_seq = torch.stack(project_in, dim=1) if w_hr is not None else None
    # the hidden product's output gradient at step t is the gates' (``ih``'s), for GRU's new gate times r
    recorder.record_projection(f"{prefix}weight_hh{suffix}", linear_holding(w_hh, b_hh), previous_seq, ih,
                               partial(_reset_gate_gradient, reset_seq) if gru else None, unit=module)  # fmt: skip
    if w_hr is not None:
        recorder.record_projection(f"{prefix}weight_hr{suffix}", linear_holding(w_hr, None), project_seq, project_out,
                                   unit=module)
    return torch.stack(outputs, dim=1), h, c


#: the largest hidden size whose nn.LSTM steps run in the fused kernel on the host (:func:`_fused_lstm`): the
#: identity's product costs 16 H^2 multiply-adds per example and step, against the stepped cells' fixed cost per
#: step. Measured (one thread, batch 16, 16 steps, 64 inputs, whole private step): H = 16 4.2 -> 2.8 ms, 32 4.0 ->
#: 3.1, 64 4.6 -> 4.4, 96 5.2 -> 6.6, 128 6.1 -> 12.1 ms; a layer's shape alone decides (module docstring)
FUSED_HIDDEN_SIZE = 32


def _fuses(module: nn.RNNBase) -> bool:
    """Whether ``module``'s layers run in :func:`_fused_lstm` on the host: an nn.LSTM without projection whose
    hidden size is at most :data:`FUSED_HIDDEN_SIZE` (its shape only, never the batch's)."""
    return module.mode == "LSTM" and not module.proj_size and module.hidden_size <= FUSED_HIDDEN_SIZE


def _fused_lstm(
    ih: Tensor, hidden: tuple, h: Tensor, c: Tensor, reverse: bool, training: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One nn.LSTM layer and direction (no projection) on the host by torch's fused kernel (oneDNN's), one call for
    the sequence, fed the input products ``ih`` (B, T, 4H) with the identity as its input weight and no input bias:
    ``I ih + 0 = ih`` exactly, and the gradient reaching ``ih`` is the gates' (``I^T g = g``), what the records
    need; the hidden product is the kernel's, with ``hidden`` = (W_hh, b_hh). Returns (outputs (B, T, H), last h,
    last c, the previous hidden states h_{t-1} (B, T, H), detached). 0.8 ms against 1.7 ms for the Python-stepped
    cells (hidden size 32, 16 steps, batch 16, forward and backward). In the parameters' precision, outside
    autocast. An input product that overflowed to +-inf is clamped to the largest finite value first: the identity's
    0 * inf would make every gate of that example NaN, where the stepped cells saturate (and the gradient through
    the clamp is 0 there, as the saturated gates' is). nn.GRU and nn.RNN keep the stepped cells: torch's host kernels
    for them step in C++ through the same operations, plus the identity's product, and were measured slower (GRU's
    reset gates would also have to be recomputed for its records)."""
    w_hh, b_hh = hidden
    dtype, gates, device = w_hh.dtype, ih.shape[-1], ih.device
    eye = torch.eye(gates, dtype=dtype, device=device)
    zeros = torch.zeros(gates, dtype=dtype, device=device)
    weights = [eye, w_hh] if b_hh is None else [eye, w_hh, zeros, b_hh]
    largest = torch.finfo(dtype).max
    sequence = (ih.flip(1) if reverse else ih).to(dtype).clamp(-largest, largest)  # the steps in the order taken
    with torch.autocast("cpu", enabled=False):
        out, h_n, c_n = torch._VF.lstm(sequence, (h.unsqueeze(0).to(dtype), c.unsqueeze(0).to(dtype)), weights,
                                       b_hh is not None, 1, 0.0, training, False, True)  # fmt: skip
    with torch.no_grad():
        previous = torch.cat([h.unsqueeze(1).to(dtype), out[:, :-1]], dim=1)
    if reverse:
        out, previous = out.flip(1), previous.flip(1)
    return out, h_n[0], c_n[0], previous


def _reset_gate_gradient(reset: Tensor, g: Tensor) -> Tensor:
    """GRU: the gradient of ``W_hh h + b_hh`` from the gates' gradient ``g`` (B, T, 3 H): r * g on the new gate."""
    size = reset.shape[-1]
    return torch.cat([g[..., : 2 * size], g[..., 2 * size :] * reset.to(g.dtype)], dim=-1)


def _maybe_detached(params: tuple, detach: bool) -> tuple:
    return tuple(p.detach() if detach and p is not None else p for p in params)


# (input product, hidden product, h, c) -> (h, c, GRU's reset gate r, detached), PyTorch's documented cells
def _lstm_cell(ih: Tensor, hh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, None]:
    i, f, g, o = (ih + hh).chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c, None


def _gru_cell(ih: Tensor, hh: Tensor, h: Tensor, c: None) -> tuple[Tensor, None, Tensor]:
    i_r, i_z, i_n = ih.chunk(3, dim=1)
    h_r, h_z, h_n = hh.chunk(3, dim=1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return n + z * (h - n), None, r.detach()  # (1 - z) n + z h


_CELLS = {
    "LSTM": _lstm_cell,
    "GRU": _gru_cell,
    "RNN_TANH": lambda ih, hh, h, c: (torch.tanh(ih + hh), None, None),
    "RNN_RELU": lambda ih, hh, h, c: (torch.relu(ih + hh), None, None),
}
