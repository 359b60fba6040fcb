"""Per-example gradients of one recorded layer call (:mod:`.capture`): a rule layer's closed form (Opacus's, or
vmap of ``torch.func.grad`` in the ``"functorch"`` mode), or the replay of any other layer, one vector-Jacobian
product per example."""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample.capture import (
    Record,
    _trainable,
    rule_for,
)


def rule_inputs(record: Record, batch_first: bool) -> tuple[list[Tensor], Tensor]:
    """A rule layer's ([input], output gradient), batch first (the record's batch dimension: 0, or 1 for
    ``batch_first=False``; the products :mod:`.recurrent` records are batch first whatever ``batch_first`` says)."""
    record.check_unchanged()
    a, g = record.args[0], record.grads[0]
    if g is None:
        g = torch.zeros_like(a if a.is_floating_point() else record.module.weight)
    dim = record.batch_dims[0] if record.batch_dims else (0 if batch_first else 1)
    if dim:
        a, g = a.movedim(dim, 0), g.movedim(dim, 0)
    return [a], g


def rule_grad_samples(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, functorch: bool
) -> dict[nn.Parameter, Tensor]:
    """Per-example gradients of a rule layer: Opacus's closed form, or vmap of ``torch.func.grad`` over the
    layer's per-example inputs when ``functorch``. The closed forms get contiguous inputs: Opacus's Conv2d rule
    unfolds its input with ``as_strided`` strides computed for the contiguous layout, and read a channels-last input
    (``memory_format=torch.channels_last``, ConvNeXt's downsampling after its permuted LayerNorm) as other numbers."""
    if not functorch:
        activations = [_row_major(a) for a in activations]
        samples = rule_for(layer)(layer, activations, _row_major(backprops))
        if isinstance(layer, nn.Embedding) and layer.padding_idx is not None and layer.weight in samples:
            samples[layer.weight][:, layer.padding_idx] = 0  # autograd gives the padding row no gradient
        return samples
    params = {n: p.detach() for n, p in layer.named_parameters() if p.requires_grad}
    # the layer is called again outside the forward's autocast: inputs and output gradients in the parameters' dtype
    # (float32 under "bf16-mixed", where autocast had cast them to bfloat16)
    dtype = next(iter(params.values())).dtype
    a = activations[0]
    if a.is_floating_point():
        a = a.to(dtype)
    backprops = backprops.to(dtype)

    def loss(values: dict, a_i: Tensor, g_i: Tensor) -> Tensor:
        return (functional_call(layer, values, (a_i.unsqueeze(0),)) * g_i.unsqueeze(0)).sum()

    named = dict(layer.named_parameters())
    return {named[n]: gs for n, gs in vmap(grad(loss), in_dims=(None, 0, 0))(params, a, backprops).items()}


def _row_major(t: Tensor) -> Tensor:
    """``t`` with the strides of a new row-major tensor: ``contiguous()`` keeps the strides of dimensions of size 1
    (a channels-last (B, C, 1, 1) map stays (C, 1, C, C)), which Opacus's ``as_strided`` unfold then reads wrongly."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.insert(0, step)
        step *= max(size, 1)
    return t if list(t.stride()) == expected else t.new_empty(t.shape).copy_(t)


def replay_grad_samples(record: Record, scale: float, drop_nonfinite: bool = False) -> dict[nn.Parameter, Tensor]:
    """Per-example gradients of every trainable parameter under a replay layer (module docstring), the output
    gradients multiplied by ``scale`` (B for a mean loss); call it with :attr:`Recorder.replaying` set, so that the
    replayed forward records nothing. ``drop_nonfinite`` (float16 overflow): non-finite input values are replayed
    as 0 and an example with a non-finite output gradient gets zeros; a non-finite value reaching another example's
    gradient inside the layer cannot be attributed and is refused."""
    record.check_unchanged()
    module, params = record.module, _trainable(record.module, recurse=True)
    grads = record.grads or []
    batch = record.batch_size
    for g, dim in zip(grads, record.batch_dims):
        if g is not None and (g.dim() <= dim or g.shape[dim] != batch):
            raise PrivacyConfigError(
                f"layer {record.name or '<root>'} ({type(module).__name__}) returned outputs whose batch dimensions "
                f"disagree (expected {batch} examples in dimension {dim} of an output of shape {tuple(g.shape)}); "
                "pass batch_first= to match the model, or give the layer a batch_first attribute"
            )
    if batch == 0:
        return {p: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for p in params}
    with ExitStack() as stack:
        cpu_state, device, cuda_state = record.rng
        stack.enter_context(torch.random.fork_rng(devices=[device] if cuda_state is not None else []))
        torch.random.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        device_type, enabled, dtype = record.autocast
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        stack.enter_context(torch.enable_grad())
        args, kwargs = record.args, record.kwargs
        if drop_nonfinite:
            args, kwargs = tree_map(_finite_values, (args, kwargs))
        output = module.forward(*args, **kwargs)
    leaves = tree_flatten(output)[0]
    outputs, cotangents = [], []
    bad_rows: Tensor | None = None  # drop_nonfinite: examples whose output gradient is not finite
    for k, g, dim in zip(record.positions, grads, record.batch_dims):
        if g is None:
            continue
        shape = [batch if d == dim else 1 for d in range(g.dim())]
        one_hot = torch.eye(batch, dtype=torch.bool, device=g.device).view(batch, *shape)
        outputs.append(leaves[k])
        # row i: g restricted to example i (exact zeros elsewhere, also where another example's g is not finite);
        # ``scale`` is applied to the results, in the parameters' precision (float16 would underflow B / S)
        cotangents.append(torch.where(one_hot, g.unsqueeze(0), 0))
        if drop_nonfinite:
            bad = ~torch.isfinite(g.movedim(dim, 0)).flatten(1).all(dim=1)
            bad_rows = bad if bad_rows is None else bad_rows | bad
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop because we have not yet implemented")
        cotangents = _external_cotangents(outputs, cotangents)
        samples = torch.autograd.grad(outputs, params, cotangents, is_grads_batched=True, allow_unused=True)
    out = {}
    for p, gs in zip(params, samples):
        if gs is None:
            out[p] = torch.zeros((batch, *p.shape), dtype=p.dtype, device=p.device)
        else:
            out[p] = gs if scale == 1 else gs * scale
    if drop_nonfinite and out:
        nonfinite = {p: ~torch.isfinite(gs).flatten(1).all(dim=1) for p, gs in out.items()}
        expected = bad_rows if bad_rows is not None else torch.zeros(batch, dtype=torch.bool)
        leaked = torch.stack([(rows & ~expected.to(rows.device)).any() for rows in nonfinite.values()]).any()
        if bool(leaked):  # one host synchronisation per replayed call
            raise FloatingPointError(
                f"layer {record.name or '<root>'} ({type(module).__name__}) overflowed inside its replay: one "
                "example's non-finite value reached other examples' per-example gradients, which then cannot be "
                "separated. Use precision='bf16-mixed', or a smaller GradScaler init_scale"
            )
        for p, rows in nonfinite.items():
            out[p] = torch.where(rows.view(-1, *([1] * (out[p].dim() - 1))), 0, out[p])
    return out


def _finite_values(value: Any) -> Any:
    """A floating tensor with its NaN and infinite values replaced by 0; anything else unchanged."""
    if isinstance(value, Tensor) and value.is_floating_point():
        return torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
    return value


def _external_cotangents(outputs: list[Tensor], cotangents: list[Tensor]) -> list[Tensor]:
    """The gradients that reached each output from OUTSIDE the layer. When the layer computes one output from
    another (nn.LSTMCell: h = o * tanh(c)), the hooks see c's whole gradient, h's path included, and a
    vector-Jacobian product from both would count that path twice. With F_kj the Jacobian of output k with respect to
    output j inside the layer, the recorded g_j = e_j + sum_k F_kj^T e_k; the external e solve it by substitution
    (the outputs form a DAG: as many passes as outputs). Layers whose outputs do not depend on each other return
    ``cotangents`` unchanged, without a pass."""
    nodes = [o.grad_fn for o in outputs]
    if not any(_reaches(a, b) for a in nodes for b in nodes if a is not b and a is not None and b is not None):
        return cotangents
    external = list(cotangents)
    for _ in range(len(outputs)):
        through = torch.autograd.grad(
            outputs, outputs, external, retain_graph=True, allow_unused=True, is_grads_batched=True
        )  # e_j + sum_k F_kj^T e_k
        external = [g if t is None else g - (t - e) for g, t, e in zip(cotangents, through, external)]
    return external


def _reaches(start: Any, target: Any) -> bool:
    """Whether autograd node ``target`` lies on a path from node ``start`` (a strict path: not itself)."""
    seen, stack = set(), [fn for fn, _ in start.next_functions if fn is not None]
    while stack:
        fn = stack.pop()
        if fn is target:
            return True
        if id(fn) not in seen:
            seen.add(id(fn))
            stack.extend(f for f, _ in fn.next_functions if f is not None)
    return False
