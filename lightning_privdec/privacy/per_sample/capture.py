"""What per-sample gradients need, captured without wrapping any layer's output.

Every layer gets a forward hook that keeps its (detached) inputs and registers one gradient hook on its outputs
(a tensor hook on a single output, ``register_multi_grad_hook`` on several), which sees the output's gradient even
when later code modifies that output in place (``ReLU(inplace=True)``, ``out += identity``), where Opacus's
``register_full_backward_hook`` views fail. A layer
call's inputs ``a`` and output gradients ``g`` become per-example gradients by:

* ``"rule"`` - a closed form per layer type: Opacus's ``GRAD_SAMPLERS`` (Linear, Conv, Embedding, LayerNorm,
  GroupNorm, RMSNorm, InstanceNorm), plus, in book-keeping, norms and clipped sums without materialisation;
  ``"unrolled"`` (nn.LSTM/GRU/RNN, :mod:`.recurrent`) and ``"attention"`` (nn.MultiheadAttention, :mod:`.attention`)
  run, while recording, as the same computation with their products as nn.Linear calls that these rules cover.
* ``"replay"`` - any other layer holding trainable parameters (the configurations :mod:`.attention` and
  :mod:`.recurrent` leave out, recurrent cells, a Hugging Face layer, a model's own parameter used other than by
  broadcasting) covers its whole sub-tree: its forward is run again on the saved inputs with the random-number state
  and autocast of the original call, and one vector-Jacobian product per example (``is_grads_batched=True``), ``g``
  masked to that example, gives its gradient. Exact for every layer that treats the examples independently.

A recurrent layer passed a hidden state it returned in an earlier step (truncated backpropagation through time) is
refused (:data:`CARRIED_STATE_ERROR`): one example's data would reach later steps' gradients, beyond any clipping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_map

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample import attention, bookkeeping, recurrent
from lightning_privdec.privacy.per_sample.shared import SharedCall, SharedCapture

#: Opacus's per-layer closed forms, by exact type: (layer, [input], output gradient) -> {parameter: (B, *shape)}
RULES = GradSampleHooks.GRAD_SAMPLERS
CARRIED_STATE_ERROR = (
    "layer {name} ({type}) was passed a hidden state carried over from an earlier training step (truncated "
    "backpropagation through time), which per-example privacy cannot allow: Poisson sampling changes a batch's "
    "members every step, and a carried state lets one example's data reach later steps' gradients, beyond what each "
    "step's clipping bounds. Reset the state for every batch (`self.hidden = None` at the start of training_step, "
    "or `hidden = model.init_hidden(batch_size)`); each sequence is then the privacy unit"
)
_RECURRENT = (nn.RNNBase, nn.RNNCellBase)
#: layers whose parameters their own code uses in products with the batch: replayed as a whole
REPLAYED = (nn.RNNBase, nn.RNNCellBase, nn.MultiheadAttention)


def rule_for(module: nn.Module):
    """The closed-form per-example rule of ``module`` (Opacus's, or ours for Hugging Face's Conv1D), or None."""
    if bookkeeping.is_transposed_linear(module):
        return bookkeeping.transposed_linear_grad_samples
    return RULES.get(type(module))


GRAD_ACCUMULATION_ERROR = ("Poisson sampling is not compatible with grad accumulation: a second backward pass "
                           "before clear(). Take one optimizer step per sampled batch.")


def _trainable(module: nn.Module, recurse: bool) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=recurse) if p.requires_grad]


def layer_units(root: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, layer, mechanism)`` for every layer that owns trainable parameters, top-down: a layer with a rule
    covers its own parameters; nn.MultiheadAttention is ``"attention"`` followed by its linear maps' rule units
    (:func:`.attention.units`); nn.LSTM/GRU/RNN are ``"unrolled"`` (:mod:`.recurrent`); the recurrent layers and
    attention those leave out cover their whole sub-tree by replay (their children are used through functional code,
    as nn.MultiheadAttention uses ``out_proj.weight``), and their children get no hooks; any other layer's own
    parameters are ``"shared"`` (:mod:`.shared`: captured where they meet the batch, the call replayed as a whole when
    they are used otherwise) and its children are visited."""
    units: list[tuple[str, nn.Module, str]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        closed = attention.units(name, module)  # a supported nn.MultiheadAttention and its linear maps
        if closed is not None:
            units.extend(closed)
            return
        if _trainable(module, recurse=False):
            if rule_for(module) is not None:
                units.append((name, module, "rule"))
            elif recurrent.unrolls(module):
                units.append((name, module, "unrolled"))
                return
            elif not isinstance(module, REPLAYED):
                units.append((name, module, "shared"))
            else:
                units.append((name, module, "replay"))
                return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    return units


@dataclass
class Record:
    """One call of one layer: its inputs, the gradients of its outputs (``None`` until the backward pass reaches
    it), and for replay the random-number and autocast state the call ran with."""

    name: str
    module: nn.Module
    kind: str
    args: tuple
    kwargs: dict
    versions: list[tuple[Tensor, int]]
    positions: list[int]  # which leaves of the output carry gradients
    forward_pass: int
    rng: tuple | None = None
    autocast: tuple | None = None
    grads: list[Tensor | None] | None = None
    batch_dims: list[int] = field(default_factory=list)
    shared: SharedCall | None = None  # kind "shared": the call's captures (:mod:`.shared`)
    #: the gradient hook on the outputs; removed by :meth:`Recorder.forget`. The hook lives on the outputs' autograd
    #: nodes and holds them in its closure: a cycle through C++ that Python's collector cannot free, which kept every
    #: step's records (the layer, its inputs) alive until the hook is removed
    grad_hook: Any = None
    unit: nn.Module | None = None  # the layer whose own code made the record, when not ``module`` (:mod:`.recurrent`)

    @property
    def batch_size(self) -> int:
        for g, dim in zip(self.grads or [], self.batch_dims):
            if g is not None:
                return int(g.shape[dim])
        return 0

    def check_unchanged(self) -> None:
        for t, version in self.versions:
            if t._version != version:
                raise RuntimeError(
                    f"an input of layer {self.name or '<root>'} ({type(self.module).__name__}) was modified in place "
                    "after the layer used it, so its per-sample gradients cannot be computed; make that operation "
                    "out of place"
                )


def _output_batch_dims(module: nn.Module, count: int, batch_first: bool) -> list[int]:
    """The batch dimension of each output leaf: recurrent hidden states are (layers, B, H) whatever ``batch_first``
    says; nn.MultiheadAttention's weights are batch first; other outputs follow the layer's own ``batch_first``
    attribute, else the ``batch_first`` given to :class:`PerSampleGradients`."""
    own = getattr(module, "batch_first", batch_first)
    first = 0 if (own if isinstance(own, bool) else batch_first) else 1
    if isinstance(module, nn.RNNBase):
        return [first] + [1] * (count - 1)
    if isinstance(module, nn.MultiheadAttention):
        return [first] + [0] * (count - 1)
    return [first] * count


class Recorder:
    """Forward hooks on every unit of :func:`layer_units`, gradient hooks on their outputs, and the records."""

    def __init__(self, root: nn.Module, units: list[tuple[str, nn.Module, str]], *, batch_first: bool) -> None:
        self.batch_first = batch_first
        self.records: list[Record] = []
        self.enabled = True
        self.replaying = False
        #: record also in eval mode (the batch-dimension probe of :meth:`PerSampleGradients.check_examples` runs the
        #: model in eval mode, dropout off, so that two passes over the same examples compute the same thing)
        self.probing = False
        self.grad_accumulation_allowed = True
        self._forward_pass = 0
        self._backward_seen = False  # a backward pass ran since the last recorded forward call
        self._backward_passes: set[int] = set()
        self._pending: dict[int, list[tuple]] = {}
        self._handles = []
        self._pass_batch: int | None = None  # examples in the current forward pass (its first recorded call)
        # storages of the hidden states recurrent layers returned this step and in the step before, held (small
        # tensors) so that their memory cannot be reused and a fresh state mistaken for a carried one
        self._hidden_now: list[torch.UntypedStorage] = []
        self._hidden_before: list[torch.UntypedStorage] = []
        #: set by the per-sample object once autograd's own parameter gradients are no longer used (the clipped sum
        #: replaces them): rule layers' parameters then stop requiring grad during their call, so the backward pass
        #: computes only the gradients that flow to earlier layers, not each layer's batch weight gradient
        self.skip_parameter_grads = False
        self._frozen: list[nn.Parameter] = []
        for name, module in root.named_modules():  # every recurrent layer, also inside a replayed one
            if isinstance(module, _RECURRENT):
                self._handles.append(
                    module.register_forward_pre_hook(partial(self._refuse_carried_state, name), with_kwargs=True)
                )
                self._handles.append(module.register_forward_hook(self._keep_hidden_state))
        #: the unit owning each trainable parameter, and how many calls of each unit are running (:mod:`.shared`)
        owners = {id(p): m for _, m, kind in units if kind != "attention"
                  for p in m.parameters(recurse=kind == "replay") if p.requires_grad}  # fmt: skip
        self._active: dict[int, int] = {}
        self._shared = SharedCapture(owners, self._active, self._shared_grad)
        self._shared_pending: dict[int, list[tuple]] = {}
        has_shared = any(kind == "shared" for _, _, kind in units)
        for name, module, kind in units:
            if has_shared:
                self._handles.append(module.register_forward_pre_hook(partial(self._count_unit, 1)))
                self._handles.append(module.register_forward_hook(partial(self._count_unit, -1), always_call=True))
            if kind == "attention":
                self._handles.append(attention.install(module, self._recording, batch_first))
                continue
            if kind == "shared":
                self._handles.append(
                    module.register_forward_pre_hook(partial(self._before_shared, name), with_kwargs=True)
                )
                self._handles.append(
                    module.register_forward_hook(partial(self._after_shared, name), with_kwargs=True, always_call=True)
                )
                continue
            if kind == "rule":
                self._handles.append(module.register_forward_pre_hook(self._freeze_parameters))
                # always_call: also when the forward raises, or a non-reentrant checkpoint's recompute stops early
                self._handles.append(
                    module.register_forward_hook(lambda *_: self.unfreeze_parameters(), always_call=True)
                )
            if kind == "unrolled":
                self._handles.append(recurrent.unroll(module, name, partial(self._recording, module), self))
                continue
            if kind == "replay":
                self._handles.append(module.register_forward_pre_hook(self._before_replay_unit))
            if isinstance(module, nn.Embedding):
                self._handles.append(module.register_forward_pre_hook(self._per_example_positions))
            self._handles.append(
                module.register_forward_hook(partial(self._after_forward, name, kind), with_kwargs=True)
            )

    @property
    def forward_pass(self) -> int:
        """The index of the forward pass recorded last (a backward pass ends it)."""
        return self._forward_pass

    def _recording(self, module: nn.Module) -> bool:
        return self.enabled and not self.replaying and (module.training or self.probing) and torch.is_grad_enabled()

    def _before_replay_unit(self, module: nn.Module, args: tuple) -> None:
        if not self._recording(module):
            return
        device = next(iter(module.parameters())).device
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        rng = (torch.random.get_rng_state(), device, cuda)
        autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        self._pending.setdefault(id(module), []).append((rng, autocast))

    def _freeze_parameters(self, module: nn.Module, args: tuple) -> None:
        """See :attr:`skip_parameter_grads`; only when the input requires grad, so that the output still does (its
        gradient is what the rule needs). A forward hook that always runs restores them after the call."""
        if not self.skip_parameter_grads or not self._recording(module):
            return
        if not args or not isinstance(args[0], Tensor) or not args[0].requires_grad:
            return
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.requires_grad_(False)
                self._frozen.append(p)

    def unfreeze_parameters(self) -> None:
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    def _refuse_carried_state(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._hidden_before or not self._recording(module):
            return
        hx = kwargs.get("hx", args[1] if len(args) > 1 else None)
        before = {s.data_ptr() for s in self._hidden_before}
        for t in tree_flatten(hx)[0]:  # a detached state shares the storage of the output it came from
            if isinstance(t, Tensor) and t.numel() and t.untyped_storage().data_ptr() in before:
                raise PrivacyConfigError(CARRIED_STATE_ERROR.format(name=name or "<root>", type=type(module).__name__))

    def _keep_hidden_state(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._recording(module):
            hidden = output[1] if isinstance(module, nn.RNNBase) else output  # cells return the state itself
            leaves = tree_flatten(hidden)[0]
            self._hidden_now += [t.untyped_storage() for t in leaves if isinstance(t, Tensor) and t.numel()]

    def _per_example_positions(self, module: nn.Module, args: tuple) -> tuple | None:
        """An embedding looked up once for the whole batch (Hugging Face's position ids of shape (1, T), broadcast
        over the examples afterwards) is looked up per example instead, so that each example's share of its
        gradient is known: same values, B rows instead of 1."""
        if not self._recording(module) or not self.batch_first or not args or self._pass_batch in (None, 1):
            return None
        ids = args[0]
        if isinstance(ids, Tensor) and ids.dim() >= 2 and ids.shape[0] == 1:
            return (ids.expand(self._pass_batch, *ids.shape[1:]), *args[1:])
        return None

    def _after_forward(self, name: str, kind: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._recording(module):
            return
        state = self._pending[id(module)].pop() if kind == "replay" else (None, None)
        leaves = [output] if type(output) is Tensor else tree_flatten(output)[0]  # (the common case, without pytree)
        if any(isinstance(leaf, PackedSequence) for leaf in leaves) or isinstance(output, PackedSequence):
            raise PrivacyConfigError(
                recurrent.PACKED_SEQUENCE_ERROR.format(name=name or "<root>", type=type(module).__name__)
            )
        positions = [k for k, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.requires_grad]
        if not positions:
            return
        if self._backward_seen:  # the first forward call after a backward pass starts a new pass
            self._forward_pass += 1
            self._backward_seen = False
            self._pass_batch = None
        if kind == "rule":
            args, kwargs = (args[0].detach(),), {}
        else:
            args, kwargs = tree_map(_detach, (args, kwargs))
        inputs = list(args) if kind == "rule" else [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        record = Record(
            name, module, kind, args, kwargs, [(t, t._version) for t in inputs], positions, self._forward_pass,
            rng=state[0], autocast=state[1],
            batch_dims=_output_batch_dims(module, len(positions), self.batch_first),
        )
        if self._pass_batch is None:
            first = leaves[positions[0]]
            if first.dim() > record.batch_dims[0]:
                self._pass_batch = int(first.shape[record.batch_dims[0]])
        self.records.append(record)
        record.grad_hook = _on_gradients([leaves[k] for k in positions], partial(self._after_backward, record))

    def record_projection(
        self, name: str, layer: nn.Module, a: Tensor, output: Tensor | list[Tensor],
        gradient: Callable[[Tensor], Tensor] | None = None, *, unit: nn.Module,
    ) -> None:
        """A rule layer's product computed by a unit's own code (:mod:`.recurrent`): ``layer`` (an nn.Linear holding
        the unit's parameters) mapped the batch-first input ``a`` (B, T, d) to ``output`` (B, T, d_out), or to one
        (B, d_out) tensor per position t (their gradients stacked along dimension 1); ``gradient`` maps the
        gradient of ``output`` to the product's when ``output`` is another tensor that the product's output
        gradient is computed from; ``unit``: the layer whose code computed it."""
        outputs = output if isinstance(output, list) else [output]
        live = [o for o in outputs if o.requires_grad]
        if not live:
            return
        if self._backward_seen:
            self._forward_pass += 1
            self._backward_seen = False
            self._pass_batch = None
        record = Record(name, layer, "rule", (a.detach(),), {}, [], [0], self._forward_pass, batch_dims=[0], unit=unit)
        if self._pass_batch is None:
            self._pass_batch = int(a.shape[0])
        self.records.append(record)

        def arrived(grads: tuple) -> None:
            if isinstance(output, list):
                given = iter(grads)
                steps = [next(given) if o.requires_grad else None for o in outputs]
                grads = (torch.stack([torch.zeros_like(o) if g is None else g for o, g in zip(outputs, steps)], 1),)
            if gradient is not None and grads[0] is not None:
                grads = (gradient(grads[0]),)
            self._after_backward(record, grads)

        record.grad_hook = _on_gradients(live, arrived)

    def _count_unit(self, delta: int, module: nn.Module, *_: Any) -> None:
        self._active[id(module)] = self._active.get(id(module), 0) + delta

    def _before_shared(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A shared unit's call (:mod:`.shared`): its operations followed, and what a replay would need kept."""
        stack = self._shared_pending.setdefault(id(module), [])
        if not self._recording(module):
            stack.append(None)
            return
        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.dim()), None)
        call = SharedCall(name, module, int(first.shape[0]) if first is not None else 0, _trainable(module, False))
        if not self.batch_first or first is None:
            call.fail("its inputs are not batch first")
        self._before_replay_unit(module, args)  # the random-number state, for a replay
        buffers = [(n, b, b._version) for n, b in module.named_buffers()]
        self._shared.begin(call, args, kwargs)
        stack.append((call, self._pending[id(module)].pop(), len(self.records), buffers))

    def _after_shared(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        pending = self._shared_pending[id(module)].pop()
        if pending is None:
            return
        call, state, start, buffers = pending
        self._shared.end(call, output)
        for buffer_name, buffer, version in buffers:
            if buffer._version != version:
                raise PrivacyConfigError(
                    f"layer {name or '<root>'} ({type(module).__name__}) updates its buffer {buffer_name} in the "
                    "forward pass (a statistic of the batch): every example's output then depends on the others, "
                    "which per-example clipping cannot bound. Compute it per example, or keep it fixed in training"
                )
        if call.failure is not None:  # replayed as a whole: its sub-tree's records of this call are dropped
            inside = {id(m) for m in attention.with_projections(module)}
            for r in self.records[start:]:
                if id(r.unit or r.module) in inside and r.grad_hook is not None:
                    r.grad_hook.remove()
            self.records[start:] = [r for r in self.records[start:] if id(r.unit or r.module) not in inside]
            self._pending.setdefault(id(module), []).append(state)
            self._after_forward(name, "replay", module, args, kwargs, output)
            return
        if not call.captures:
            return
        if self._backward_seen:
            self._forward_pass += 1
            self._backward_seen = False
            self._pass_batch = None
        if self._pass_batch is None:
            self._pass_batch = call.batch
        call.record = Record(name, module, "shared", (), {}, [], [], self._forward_pass, shared=call,
                             batch_dims=[0] * len(call.captures))
        self.records.append(call.record)

    def _shared_grad(self, call: SharedCall, capture: Any, grad: Tensor) -> None:
        """A capture's gradient (:mod:`.shared`) has arrived."""
        if not self.enabled or self.replaying or call.record is None:
            return
        grad = grad.detach()
        capture.grad = grad if capture.grad is None else capture.grad + grad
        self._backward_reached(call.record)
        call.record.grads = [c.grad for c in call.captures]  # each checked by the batch-dimension probe

    def _backward_reached(self, record: Record) -> None:
        self._backward_seen = True
        if record.forward_pass not in self._backward_passes:
            if self._backward_passes and not self.grad_accumulation_allowed:
                raise ValueError(GRAD_ACCUMULATION_ERROR)
            self._backward_passes.add(record.forward_pass)

    def _after_backward(self, record: Record, grads: tuple) -> None:
        if not self.enabled:
            return
        self._backward_reached(record)
        fresh = [None if g is None else g.detach() for g in grads]
        if record.grads is None:
            record.grads = fresh
        else:  # a second backward through a retained graph: gradients add up
            record.grads = [a if b is None else b if a is None else a + b for a, b in zip(record.grads, fresh)]

    def disable_hooks(self) -> None:
        """Record nothing until :meth:`enable_hooks` (forward and backward passes run as without hooks)."""
        self.enabled = False

    def enable_hooks(self) -> None:
        self.enabled = True

    def passes(self) -> list[list[Record]]:
        """The records that got gradients, grouped by backward pass, in order."""
        grouped: dict[int, list[Record]] = {}
        for r in self.records:
            if r.grads is not None and any(g is not None for g in r.grads):
                grouped.setdefault(r.forward_pass, []).append(r)
        return [grouped[k] for k in sorted(grouped)]

    def forget(self) -> None:
        """Drop the step's records (the end of a step: its hidden states become the earlier step's)."""
        self.unfreeze_parameters()  # (the forward hook already did; cheap)
        if self._hidden_now:
            self._hidden_before, self._hidden_now = self._hidden_now, []
        for record in self.records:
            if record.grad_hook is not None:
                record.grad_hook.remove()
        self.records = []
        self._pending.clear()
        self._shared_pending.clear()
        self._forward_pass = 0
        self._backward_seen = False
        self._backward_passes.clear()
        self._pass_batch = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.forget()
        self._hidden_now, self._hidden_before = [], []


def _on_gradients(tensors: list[Tensor], fn: Callable[[tuple], None]) -> Any:
    """Call ``fn`` with the gradients of ``tensors`` once the backward pass has computed all of them
    (``register_multi_grad_hook``); one tensor (most layers) gets its own tensor hook, which is the same hook
    without the multi-tensor bookkeeping (~20 us per layer call)."""
    if len(tensors) == 1:
        return tensors[0].register_hook(partial(_single_gradient, fn))
    return register_multi_grad_hook(tensors, fn, mode="all")


def _single_gradient(fn: Callable[[tuple], None], grad: Tensor) -> None:
    fn((grad,))


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value
