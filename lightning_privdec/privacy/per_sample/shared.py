"""Per-example gradients of parameters used once for the whole batch, without replaying the layer.

A layer's own parameter that its forward combines with the batch, such as ViT's class token
(``self.class_token.expand(n, -1, -1)``, then concatenated to every example), a learned position embedding added to
every example (``x + self.pos_embedding``), or a relative-position bias table looked up with an index buffer that
has no batch dimension (``self.table[self.index]``, reshaped, then added to every example's attention logits), gets
its per-example gradient from the gradient of the BROADCAST RESULT: where the batch-free tensor ``P`` (computed from
the parameters alone) first meets the examples, it is replaced by the view ``P_b = P.expand(shape)`` of the batch's
shape (the same values, so the forward computes exactly what it did), and ``P_b``'s gradient, row i, summed over
the dimensions ``P`` was broadcast along, is example i's gradient of ``P``. The parameters' per-example gradients
are then the vector-Jacobian products of the batch-free computation ``P = f(params)`` (an index lookup, views), run
again on the parameters in float64 from the recorded operations, one batched product for all examples.

How it is seen: during the layer's forward a ``TorchFunctionMode`` (:class:`SharedCapture`) follows every torch
operation. Tensors derived from the layer call's inputs are the batch's; tensors computed from the layer's own
parameters and constants alone (buffers, ``torch.arange``) are batch-free and recorded. A batch-free tensor may meet
the batch only in a broadcasting elementwise operation (``+ - * /``, ``torch.where``), as the additive mask of
``F.scaled_dot_product_attention``, or, once expanded to the batch (``expand``/``expand_as``/``broadcast_to`` of a
tensor of size 1 in the batch dimension), in ``torch.cat`` along another dimension; its broadcast dimension 0 must
then be the batch's (the examples in dimension 0, ``batch_first``). Any other use (a matrix product with the
parameter, the parameter read by a child layer's code outside that child's forward, a random operation on it, a
batch-free output) makes that call fall back to replay (:mod:`.replay`), which is exact for anything: nothing is
guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
import itertools

_F = nn.functional
#: broadcasting elementwise operations: a batch-free operand may be replaced by its expansion to the result's shape
_ELEMENTWISE = {
    torch.add, torch.sub, torch.mul, torch.div, torch.where, torch.maximum, torch.minimum,
    Tensor.add, Tensor.sub, Tensor.mul, Tensor.div, Tensor.add_, Tensor.sub_, Tensor.mul_, Tensor.div_,
    Tensor.__add__, Tensor.__radd__, Tensor.__iadd__, Tensor.__sub__, Tensor.__rsub__, Tensor.__isub__,
    Tensor.__mul__, Tensor.__rmul__, Tensor.__imul__, Tensor.__truediv__, Tensor.__rtruediv__, Tensor.__itruediv__,
}  # fmt: skip
_CONCATENATE = {torch.cat, torch.concat, torch.concatenate}
#: operations that broadcast a batch-free tensor to the batch's size (then met in a concatenation)
_EXPAND = {Tensor.expand, Tensor.expand_as, torch.broadcast_to, Tensor.broadcast_to}
#: operations whose result a recomputation would not reproduce
_RANDOM = {
    _F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d, _F.alpha_dropout, _F.feature_alpha_dropout, torch.dropout,
    torch.bernoulli, Tensor.bernoulli, Tensor.bernoulli_, torch.rand_like, torch.randn_like, torch.randint_like,
    Tensor.uniform_, Tensor.normal_, torch.normal, torch.multinomial,
}  # fmt: skip
#: operations that read only the shape, dtype and device of a batch tensor: their results are constants
_FACTORIES = {
    Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_empty, Tensor.new_tensor, torch.zeros_like,
    torch.ones_like, torch.full_like, torch.empty_like,
}  # fmt: skip
_GENERATIONS = itertools.count(1)
#: read or set a tensor's metadata (the hooks' own ``requires_grad_`` on a layer's parameters included): not followed
_GETTERS = {
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.__len__, Tensor.is_floating_point, Tensor.data_ptr,
    Tensor.requires_grad_,
}  # fmt: skip


@dataclass
class _Capture:
    """One broadcast of a batch-free tensor ``source`` to the batch: the expanded view's gradient ``grad`` (B, ...),
    summed over ``reduce`` (the dimensions ``source`` was broadcast along, besides the batch's)."""

    source: Tensor
    shape: torch.Size  # the expanded view's shape
    grad: Tensor | None = None


@dataclass
class SharedCall:
    """One forward call of a layer whose own parameters are used for the whole batch."""

    name: str
    module: nn.Module
    batch: int
    params: list[nn.Parameter]
    captures: list[_Capture] = field(default_factory=list)
    #: the batch-free operations, in order: (func, args, kwargs, output leaves)
    tape: list[tuple[Any, tuple, dict, list[Tensor]]] = field(default_factory=list)
    failure: str | None = None  # why this call falls back to replay
    record: Any = None  # the Recorder's record of the call, once the forward is over

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``)."""
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__setitem__")
    return name.endswith("_")


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, Tensor))
    return out


def _replace(value: Any, swap: dict[int, Tensor]) -> Any:
    if isinstance(value, Tensor):
        return swap.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, swap) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, swap) for k, v in value.items()}
    return value


class SharedCapture(TorchFunctionMode):
    """Follows the torch operations of the shared layers' calls (module docstring); entered by the outermost
    active call, one per :class:`~lightning_privdec.privacy.per_sample.capture.Recorder`.

    ``owners`` maps each trainable parameter to the unit (layer) that owns it; ``active`` counts the units whose
    forward is running: a parameter of a child unit read while that child is not running is a use the child's hooks
    do not see."""

    def __init__(self, owners: dict[int, nn.Module], active: dict[int, int], on_grad: Any) -> None:
        super().__init__()
        self.owners = owners
        self.active = active
        self.on_grad = on_grad  # called with (call, capture) when a capture's gradient arrives
        self.calls: list[SharedCall] = []  # the running shared calls, innermost last
        #: tensors that depend on the batch carry ``_privdec_batch`` = this number (one per outermost call: a
        #: mark of an earlier call means nothing)
        self.generation = next(_GENERATIONS)
        self.free: dict[int, tuple[Tensor, SharedCall]] = {}  # batch-free tensors: id -> (tensor, owning call)
        self.expanded: dict[int, Tensor] = {}  # batch-free tensors expanded to the batch: id -> what was expanded

    def begin(self, call: SharedCall, args: tuple, kwargs: dict) -> None:
        if not self.calls:
            self.__enter__()
        self.calls.append(call)
        for t in tree_flatten((args, kwargs))[0]:  # the batch's inputs (a mask of another size is a constant)
            if isinstance(t, Tensor) and t.dim() and t.shape[0] == call.batch:
                t._privdec_batch = self.generation

    def end(self, call: SharedCall, output: Any) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, Tensor) and id(t) in self.free:
                call.fail("its output is computed from its parameters alone, without the batch")
        if self.calls and self.calls[-1] is call:
            self.calls.pop()
        if not self.calls:
            self.__exit__(None, None, None)
            self.generation = next(_GENERATIONS)
            self.free.clear()
            self.expanded.clear()

    # ---- the operations --------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GETTERS or getattr(func, "__name__", "") in ("__get__", "__set__"):
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        free = [t for t in tensors if id(t) in self.free]
        for t in tensors:  # the dictionary first: nn.Parameter's isinstance check is slow, and most tensors are not
            owner = self.owners.get(id(t))
            if owner is not None and isinstance(t, nn.Parameter) and id(t) not in self.free:
                call = next((c for c in reversed(self.calls) if c.module is owner), None)
                if call is not None:  # a shared layer's own parameter: a batch-free root
                    self.free[id(t)] = (t, call)
                    free.append(t)
                elif not self.active.get(id(owner), 0) and self.calls:
                    self.calls[-1].fail(f"it reads a parameter of {type(owner).__name__} outside that layer's forward")
        generation = self.generation
        batch = func not in _FACTORIES and any(getattr(t, "_privdec_batch", 0) == generation for t in tensors)
        if not free:
            out = func(*args, **kwargs)
            if batch:
                self._mark(out)
            return out
        call = self.free[id(free[0])][1]
        if any(self.free[id(t)][1] is not call for t in free):
            call.fail("it combines parameters of two layers before they meet the batch")
        if call.failure is not None:
            return self._plain(func, args, kwargs, batch, call)
        if not batch:
            return self._batch_free(func, args, kwargs, tensors, call)
        return self._broadcast(func, args, kwargs, tensors, free, call)

    def _batch(self, t: Tensor) -> bool:
        return getattr(t, "_privdec_batch", 0) == self.generation

    def _mark(self, out: Any) -> None:
        if isinstance(out, Tensor):
            out._privdec_batch = self.generation
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                t._privdec_batch = self.generation

    def _plain(self, func: Any, args: tuple, kwargs: dict, batch: bool, call: SharedCall) -> Any:
        """A failed call's operation: run as it is (the call is replayed), its result marked."""
        out = func(*args, **kwargs)
        if batch:
            self._mark(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.free[id(t)] = (t, call)
        return out

    def _batch_free(self, func: Any, args: tuple, kwargs: dict, tensors: list[Tensor], call: SharedCall) -> Any:
        if func in _RANDOM:
            call.fail(f"it draws random numbers on its parameters ({getattr(func, '__name__', func)})")
        elif any(t.requires_grad and id(t) not in self.free for t in tensors):
            call.fail("it combines its parameters with another trainable tensor before they meet the batch")
        elif _in_place(func) and isinstance(args[0], Tensor) and id(args[0]) in self.free:
            call.fail("it modifies a tensor computed from its parameters in place")
        out = func(*args, **kwargs)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        call.tape.append((func, args, kwargs, leaves))
        for t in leaves:
            self.free[id(t)] = (t, call)
        if func in _EXPAND and isinstance(out, Tensor) and out.dim() and out.shape[0] == call.batch:
            source = args[0]
            aligned = (1,) * (out.dim() - source.dim()) + tuple(source.shape)
            if aligned[0] == 1:
                self.expanded[id(out)] = source
        return out

    def _broadcast(
        self, func: Any, args: tuple, kwargs: dict, tensors: list[Tensor], free: list[Tensor], call: SharedCall
    ) -> Any:
        """A batch-free tensor meets the batch: each is replaced by a view of the batch's shape whose gradient is
        captured (module docstring)."""
        swap: dict[int, Tensor] = {}
        batch = [t for t in tensors if self._batch(t) and t.dim() and t.shape[0] == call.batch]
        if func in _ELEMENTWISE and not any(t.dim() == max(u.dim() for u in tensors) for t in batch):
            call.fail("a tensor computed from its parameters meets a tensor without the batch in dimension 0")
        elif func in _ELEMENTWISE:
            if _in_place(func) and id(args[0]) in self.free:
                call.fail("it adds the batch to a tensor computed from its parameters in place")
            else:
                shape = torch.broadcast_shapes(*(t.shape for t in tensors))
                for t in free:
                    swap[id(t)] = self._capture(t, shape, call)
        elif func is _F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if any(t is not mask for t in free) or not mask.is_floating_point() or q.shape[0] != call.batch:
                call.fail("its parameters reach the attention's queries, keys or values")
            else:
                shape = torch.broadcast_shapes(mask.shape, (*q.shape[:-1], k.shape[-2]))
                swap[id(mask)] = self._capture(mask, shape, call)
        elif func in _CONCATENATE:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim % max(free[0].dim(), 1) == 0 or not batch:
                call.fail("it concatenates its parameters along the batch dimension")
            for t in free:
                if id(t) not in self.expanded:
                    call.fail("it concatenates a tensor computed from its parameters with the batch")
                else:
                    swap[id(t)] = self._capture(t, t.shape, call)
        else:
            call.fail(f"it uses its parameters in {getattr(func, '__name__', func)} with the batch")
        if call.failure is not None:
            return self._plain(func, args, kwargs, True, call)
        out = func(*_replace(args, swap), **_replace(kwargs, swap))
        self._mark(out)
        return out

    def _capture(self, t: Tensor, shape: torch.Size, call: SharedCall) -> Tensor:
        """The view of ``t`` expanded to ``shape`` whose gradient is example by example ``t``'s (module docstring);
        ``t`` itself when its batch dimension is broadcast by this operation, or what an expansion to the batch
        expanded."""
        if call.failure is not None:
            return t
        source = self.expanded.get(id(t), t)
        aligned = (1,) * (len(shape) - source.dim()) + tuple(source.shape)
        if len(shape) == 0 or shape[0] != call.batch or aligned[0] != 1 or len(aligned) != len(shape):
            call.fail(
                f"a tensor of shape {tuple(source.shape)} computed from its parameters meets the batch in a result of "
                f"shape {tuple(shape)}, whose dimension 0 is not the {call.batch} examples"
            )
            return t
        view = t.expand(shape)
        capture = _Capture(source, view.shape)
        call.captures.append(capture)
        if view.requires_grad:
            view.register_hook(lambda grad: self.on_grad(call, capture, grad))
        return view


def grad_samples(call: SharedCall, scale: float, drop_nonfinite: bool = False) -> dict[nn.Parameter, Tensor]:
    """Per-example gradients (B, *p.shape) of the call's parameters, times ``scale`` (B for a mean loss), from its
    captures (module docstring): in float64, then in each parameter's dtype. ``drop_nonfinite`` (float16
    overflow): an example with a non-finite captured gradient gets zeros."""
    batch, params = call.batch, call.params
    device = params[0].device
    per_source: dict[int, tuple[Tensor, Tensor]] = {}
    bad = torch.zeros(batch, dtype=torch.bool, device=device)
    for c in call.captures:
        if c.grad is None:
            continue
        g = c.grad.double()
        aligned = (1,) * (len(c.shape) - c.source.dim()) + tuple(c.source.shape)
        dims = [d for d in range(1, len(c.shape)) if aligned[d] == 1 and c.shape[d] != 1]
        if dims:
            g = g.sum(dim=dims, keepdim=True)
        g = g.reshape(batch, *c.source.shape)
        if drop_nonfinite:
            bad |= ~torch.isfinite(g).flatten(1).all(dim=1)
        key = id(c.source)
        per_source[key] = (c.source, g if key not in per_source else per_source[key][1] + g)
    out: dict[nn.Parameter, Tensor] = {}
    by_id = {id(p): p for p in params}
    derived = [(s, g) for s, g in per_source.values() if id(s) not in by_id]
    for s, g in per_source.values():
        if id(s) in by_id:
            out[s] = g
    if derived:
        for p, g in _through_tape(call, derived).items():
            out[p] = out[p] + g if p in out else g
    result = {}
    for p in params:
        g = out.get(p)
        if g is None:
            result[p] = torch.zeros((batch, *p.shape), dtype=p.dtype, device=device)
            continue
        if drop_nonfinite:
            g = torch.where(bad.view(-1, *([1] * p.dim())), 0.0, g)
        result[p] = (g * scale).to(p.dtype)
    return result


def _through_tape(call: SharedCall, derived: list[tuple[Tensor, Tensor]]) -> dict[nn.Parameter, Tensor]:
    """The parameters' per-example gradients from those of batch-free tensors: the call's batch-free operations run
    again in float64 on the parameters, then one batched vector-Jacobian product per tensor."""
    leaves = {id(p): p.detach().double().requires_grad_(True) for p in call.params}
    again: dict[int, Tensor] = dict(leaves)
    with torch.enable_grad():
        for func, args, kwargs, outputs in call.tape:
            args, kwargs = _replace(args, again), _replace(kwargs, again)
            fresh = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, Tensor)]
            for old, new in zip(outputs, fresh):
                again[id(old)] = new
    params = call.params
    out: dict[nn.Parameter, Tensor] = {}
    for source, g in derived:
        value = again.get(id(source))
        if value is None or value.shape != source.shape or not torch.allclose(
            value.detach().to(source.dtype), source.detach(), rtol=1e-2 if source.element_size() < 4 else 1e-4,
            atol=1e-6 * (float(source.detach().abs().max()) if source.numel() else 0.0) + 1e-30,
        ):
            raise RuntimeError(
                f"layer {call.name or '<root>'} ({type(call.module).__name__}): recomputing a tensor from its "
                "parameters gave other values than the forward pass; its per-example gradients cannot be computed"
            )
        if not value.requires_grad:
            continue
        grads = torch.autograd.grad(
            value, [leaves[id(p)] for p in params], g.to(value.dtype), is_grads_batched=True, allow_unused=True,
            retain_graph=True,
        )
        for p, gs in zip(params, grads):
            if gs is not None:
                out[p] = out[p] + gs if p in out else gs
    return out
