"""The arithmetic of per-sample gradients once the backward pass is over: each recorded layer call's per-example
gradients (closed form, broadcast capture or replay) or book-keeping's norms, the per-example norms over all
parameters, and the sum of clipped gradients (:class:`~.gradients.PerSampleGradients` holds one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_privdec.privacy.dp_step import clip_factor
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample import bookkeeping, bookkeeping_embedding, shared
from lightning_privdec.privacy.per_sample.capture import Record, Recorder
from lightning_privdec.privacy.per_sample.replay import (
    replay_grad_samples,
    rule_grad_samples,
    rule_inputs,
)
from lightning_privdec.tensors import KeptBuffers, round_into_grad
from lightning_privdec.privacy.rounding import (
    SUM_BLOCK,
    full_precision,
    gamma,
    norm_upper_bound,
    sum_rounding,
    unit_roundoff,
    weighted_row_sum,
)


@dataclass
class _Call:
    """One recorded layer call ready for the arithmetic: for rule layers its batch-first input ``a`` and output
    gradient ``g`` (per-example loss gradients: times B for a mean loss), for replay layers the record alone."""

    record: Record
    module: nn.Module
    kind: str
    params: list[nn.Parameter]
    activations: list[Tensor]
    backprops: Tensor | None
    batch_size: int
    scale: float = 1.0  # replay: what the output gradients are multiplied by (B for a mean loss)


def _has_bookkeeping(call: _Call) -> bool:
    """Whether ``call`` gets book-keeping's norms and clipped sums (:mod:`.bookkeeping`): nn.Linear and
    convolutions."""
    return call.kind == "rule" and bookkeeping.has_bookkeeping(call.module, call.backprops)


class _PerSampleArithmetic:
    """Per-sample gradients, norms and clipped sums from the :class:`Recorder`'s records, after the backward pass."""

    def __init__(self, recorder: Recorder, *, loss_reduction: str, batch_first: bool, functorch: bool) -> None:
        self.recorder = recorder
        self.loss_reduction = loss_reduction
        self.batch_first = batch_first
        self.functorch = functorch
        self.loss_scale = 1.0  # what the backward pass's loss was multiplied by (a float16 GradScaler's scale)
        #: and by :func:`mean_loss_multiplier` (half-precision autocast), per forward pass (micro-batches differ)
        self.mean_loss_multipliers: dict[int, float] = {}
        self.drop_nonfinite = False  # float16: zero an example's non-finite inputs/output gradients per layer call
        # the clipped sums' kept buffers (_sum_buffer) and their storages' use counts while only the buffer holds them
        self._sum_buffers = KeptBuffers()
        self.nonfinite_examples = 0  # examples with something zeroed, over the passes counted since the last take
        self._counted: set[int] = set()  # the passes already counted (passes() may run several times per pass)
        self.last_pass_nonfinite = 0  # examples with something zeroed in the last pass passes() built

    def passes(self) -> list[list[_Call]]:
        """The records of each backward pass as calls; for a mean loss the output gradients are multiplied by the
        pass's batch size B (the largest call's), so that they are per-example loss gradients (Opacus's
        ``rearrange_grad_samples`` does the same per layer); all are divided by :attr:`loss_scale`, so clipping
        sees unscaled gradients. With :attr:`drop_nonfinite`, an example's non-finite rows of a call's input or
        output gradient (a float16 overflow) are zeroed: its gradient there is 0, and what remains is clipped as
        usual, so one example still moves the sum by at most C."""
        out = []
        for records in self.recorder.passes():
            calls = []
            for r in records:
                if r.kind == "rule":
                    activations, backprops = rule_inputs(r, self.batch_first)
                    params = _own_trainable(r.module)
                    calls.append(_Call(r, r.module, "rule", params, activations, backprops, int(backprops.shape[0])))
                else:
                    params = [p for p in r.module.parameters(recurse=r.kind == "replay") if p.requires_grad]
                    calls.append(_Call(r, r.module, r.kind, params, [], None, r.batch_size))
            sizes = [c.batch_size for c in calls]
            batch = max(sizes, key=lambda n: (sizes.count(n), n))  # the size most calls saw: the examples'
            for c in calls:
                if c.batch_size != batch:
                    raise PrivacyConfigError(
                        f"layer {c.record.name or '<root>'} ({type(c.module).__name__}) was called on {c.batch_size} "
                        f"examples of a batch of {batch} (the size the other layers saw): its per-sample gradients "
                        "cannot be attributed to the examples they come from (a layer applied to a slice of the batch, "
                        "or a table looked up once for all examples and broadcast over them), so one example could "
                        "move the privatized sum by more than max_grad_norm. Apply the layer to the whole batch "
                        "(expand its input along the batch dimension: `self.pos(positions.expand(batch, -1))`), or "
                        "hold a table shared by the examples as a parameter added to each of them (`x + "
                        "self.pos_embedding`, shape (1, T, D)), whose per-example gradients are taken where it meets "
                        "the batch"
                    )
            batch = max(sizes)
            multiplier = self.mean_loss_multipliers.get(records[0].forward_pass, 1.0)  # records of one pass
            scale = (batch if self.loss_reduction == "mean" else 1) / (self.loss_scale * multiplier)
            for c in calls:
                c.scale = scale
                if c.backprops is not None:  # half precision: unscaled and summed in float32 (exact promotion)
                    work = torch.promote_types(c.backprops.dtype, torch.float32)
                    c.backprops = c.backprops.to(work)
                    c.activations = [a.to(work) if a.is_floating_point() else a for a in c.activations]
                if c.backprops is not None and scale != 1:
                    c.backprops = c.backprops * scale
            if self.drop_nonfinite and batch > 0:
                dropped = self.last_pass_nonfinite = _zero_nonfinite_rows(calls, batch)
                if id(records[0]) not in self._counted:
                    self._counted.add(id(records[0]))
                    self.nonfinite_examples += dropped
            out.append(calls)
        return out

    def _grad_samples(self, calls: list[_Call]) -> dict[nn.Parameter, Tensor]:
        """Per-sample gradients of the parameters the calls touch (rule or replay), summed over a parameter's uses
        (tied weights, a layer called twice)."""
        out: dict[nn.Parameter, Tensor] = {}
        owned: set[nn.Parameter] = set()  # out[p] shares no memory with a call's tensors: later uses add in place
        batch = max((r.batch_size for r in calls), default=0)
        self.recorder.replaying = True  # functorch and replay run layers again: record nothing
        try:
            for r in calls:
                if r.kind == "rule":
                    samples = rule_grad_samples(r.module, r.activations, r.backprops, self.functorch)
                    if _has_bookkeeping(r) and samples:
                        samples = bookkeeping.exact_rows(r.module, r.activations[0], r.backprops, samples)
                elif r.kind == "shared":
                    samples = shared.grad_samples(r.record.shared, r.scale, self.drop_nonfinite)
                else:
                    samples = replay_grad_samples(r.record, r.scale, self.drop_nonfinite)
                inputs = {t.untyped_storage().data_ptr() for t in (r.backprops, *r.activations) if t is not None}
                for p, gs in samples.items():
                    if not p.requires_grad:
                        continue
                    if gs.shape[0] < batch:  # a call on a sub-batch: zero rows for the rest
                        gs = torch.cat([gs, gs.new_zeros((batch - gs.shape[0], *gs.shape[1:]))])
                    if p not in out:  # usually one use per parameter: no copy
                        out[p] = gs
                        if gs.untyped_storage().data_ptr() not in inputs and gs.is_contiguous():
                            owned.add(p)
                    elif p in owned and torch.promote_types(out[p].dtype, gs.dtype) == out[p].dtype:
                        out[p].add_(gs)  # tied weights (GPT-2's embedding and output layer): no third buffer
                    else:
                        out[p] = out[p] + gs
                        owned.add(p)
        finally:
            self.recorder.replaying = False
        return out

    def per_sample_grads(self, params: list[nn.Parameter]) -> list[Tensor]:
        """Materialised per-sample gradients (backward passes concatenated), for callers that need them."""
        passes = self.passes()
        out: list[list[Tensor]] = [[] for _ in params]
        for records in passes:
            samples, batch = self._grad_samples(records), max(r.batch_size for r in records)
            for k, p in enumerate(params):
                gs = samples.get(p)
                out[k].append(gs if gs is not None else torch.zeros((batch, *p.shape), dtype=p.dtype, device=p.device))
        return [
            torch.cat(gs) if gs else torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            for p, gs in zip(params, out)
        ]

    def batch_size(self) -> int:
        """Examples of the recorded backward passes together (the rows of :meth:`per_sample_grads`)."""
        return sum(max(r.batch_size for r in records) for records in self.passes())

    def per_sample_grads_into(self, params: list[nn.Parameter], out: Tensor) -> Tensor:
        """:meth:`per_sample_grads` flattened into ``out`` of shape ``(batch_size(), d)``, parameters in order. An
        nn.Linear on (B, d) inputs used once writes its outer products g_i a_i^T straight into ``out``; other layers
        go through their per-sample rule and are copied."""
        spans, offset = {}, 0
        for p in params:
            spans[p] = (offset, p.numel())
            offset += p.numel()
        if out.dim() != 2 or out.shape[1] != offset:
            raise RuntimeError(f"per-sample gradients of {offset} parameters do not fit a buffer of shape {tuple(out.shape)}")

        def columns(block: Tensor, p: nn.Parameter) -> Tensor:
            start, size = spans[p]
            return block[:, start : start + size]

        row = 0
        for records in self.passes():
            batch = max(r.batch_size for r in records)
            block = out[row : row + batch]
            row += batch
            uses = _uses(records)
            direct = [
                r for r in records
                if r.kind == "rule" and type(r.module) is nn.Linear and r.backprops.dim() == 2 and r.backprops.shape[0] == batch
                and all(uses[id(p)] == 1 for p in r.params)
            ]
            direct_ids = {id(r) for r in direct}
            written: set[int] = set()
            for r in direct:
                g, a = r.backprops, r.activations[0].to(r.backprops.dtype)
                weight, bias = r.module.weight, r.module.bias
                if weight.requires_grad and weight in spans:
                    torch.mul(g.unsqueeze(2), a.unsqueeze(1), out=columns(block, weight).view(batch, *weight.shape))
                    written.add(id(weight))
                if bias is not None and bias.requires_grad and bias in spans:
                    columns(block, bias).copy_(g)
                    written.add(id(bias))
            for p, gs in self._grad_samples([r for r in records if id(r) not in direct_ids]).items():
                if p in spans:  # a layer that saw fewer rows (packed sequences, a masked sub-batch): zeros after them
                    rows, target = min(int(gs.shape[0]), batch), columns(block, p)
                    target[:rows].copy_(gs.reshape(gs.shape[0], p.numel())[:rows])
                    target[rows:].zero_()
                    written.add(id(p))
            for p in params:
                if id(p) not in written:
                    columns(block, p).zero_()  # no example reached this parameter
        if row != out.shape[0]:
            raise RuntimeError(f"{row} per-sample gradients for a buffer of {out.shape[0]} rows")
        return out

    def clip_and_sum(self, params: list[nn.Parameter], max_grad_norm: float,
                     into_grads: bool = True) -> tuple[Tensor, list[Tensor]]:
        """The clipped sum ``sum_i min(1, C / (||g_i|| + 1e-6)) g_i`` of every parameter in float64 (in ``params``'
        order; what a mechanism adds its noise to), with ||g_i|| the norm over ALL parameters jointly; ``p.grad`` gets
        it rounded to p's dtype (``into_grads``). Also returns the norms (float32 or wider), one per example of every
        backward pass."""
        sums: dict[nn.Parameter, Tensor] = {}
        all_norms = []
        with full_precision():  # once for every layer's arithmetic (each also enters it; then it costs nothing)
            for records in self.passes():
                all_norms.append(self._clip_and_sum_pass(records, max_grad_norm, sums, self._sum_buffer))
        exact = []
        for p in params:
            summed = sums.get(p)
            if summed is None:
                summed = torch.zeros(p.shape, dtype=torch.float64, device=p.device)  # no example reached it
            exact.append(summed)
            if into_grads:
                round_into_grad(p, summed)
        if not all_norms:
            return torch.zeros(0, device=params[0].device), exact
        return torch.cat(all_norms), exact

    def batch_sum(self, calls: list[_Call], *, bookkeeping: bool) -> dict[nn.Parameter, Tensor]:
        """The unclipped sum of one pass's per-example gradients, by the arithmetic a mode clips with: book-keeping's
        (:meth:`_clip_and_sum_pass` with clip factor 1), or the materialised per-example gradients summed."""
        if bookkeeping:
            sums: dict[nn.Parameter, Tensor] = {}
            self._clip_and_sum_pass(calls, float("inf"), sums)
            return sums
        return {p: gs.sum(dim=0) for p, gs in self._grad_samples(calls).items()}

    def _sum_buffer(self, p: nn.Parameter) -> Tensor | None:
        """Where p's float64 clipped sum is written (bookkeeping.Into): on the host, a buffer kept across steps
        (:class:`~lightning_privdec.tensors.KeptBuffers`); on a device, None."""
        return self._sum_buffers.get(p, p.shape, torch.float64, p.device)

    def _clip_and_sum_pass(
        self, records: list[_Call], max_grad_norm: float, sums: dict[nn.Parameter, Tensor], into: bookkeeping.Into = None
    ) -> Tensor:
        uses = _uses(records)
        tied = _tied_embeddings(records, uses)
        tied_ids = {id(r) for group in tied for r in group}
        bookkept = [
            r for r in records
            if _has_bookkeeping(r) and (id(r) in tied_ids or all(uses[id(p)] == 1 for p in r.params))
        ]
        bookkept_ids = {id(r) for r in bookkept}
        materialised = self._grad_samples([r for r in records if id(r) not in bookkept_ids])
        batch = max(r.batch_size for r in records)
        reference = next((r.backprops for r in records if r.backprops is not None), None)
        if reference is None:
            reference = next(iter(materialised.values()))
        dtype = torch.promote_types(reference.dtype, torch.float32)
        # every per-example norm below is an upper bound of the norm of what the example adds to the sums, rounding
        # included (bookkeeping.NormBound; materialised gradients: the very rows that are summed, plus their sum's
        # rounding), accumulated in float64
        squared = torch.zeros(batch, dtype=torch.float64, device=reference.device)
        bounds = bookkeeping.norm_bounds([(r.module, r.activations[0], r.backprops) for r in bookkept])
        marked = [b.exact for b in bounds if b.exact is not None]
        if marked and bool(torch.cat(marked).any()):
            # ill-conditioned examples somewhere (one host synchronisation per pass): computed apart in float64
            bounds = [bookkeeping.compute_exact(r.module, r.activations[0], r.backprops, b) for r, b in zip(bookkept, bounds)]
        _add_squares(squared, _joint_uppers(bookkept, bounds, tied))
        stacked = _stacked_rows(materialised)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for _, rows in stacked:
            by_dtype.setdefault(_sum_dtype(rows), []).append(norm_upper_bound(rows, dim=1))
        for work, rows in by_dtype.items():
            _add_squares(squared, rows, 1 + sum_rounding(SUM_BLOCK, work))
        norms = squared.sqrt()
        factor = clip_factor(norms, max_grad_norm)
        # sum_i c_i grad_i: one weight-gradient computation per layer (layers of one shape batched)
        given: set[nn.Parameter] = set()

        def first_use(p: nn.Parameter) -> Tensor | None:  # a parameter's first sum of its first pass only
            if into is None or p in sums or p in given:
                return None
            given.add(p)
            return into(p)

        summed = bookkeeping.clipped_sums_of([
            (r.module, r.activations[0], r.backprops, factor[: r.backprops.shape[0]], bound)
            for r, bound in zip(bookkept, bounds)
        ], None if into is None else first_use)
        for layer_sums in summed:
            for p, value in layer_sums.items():
                _accumulate(sums, p, value)
        for params, rows in stacked:
            summed = weighted_row_sum(factor[: rows.shape[0]], rows)
            for p, value in zip(params, summed.split([p.numel() for p in params])):
                _accumulate(sums, p, value)
        return norms.to(dtype)


def mean_loss_multiplier(batch_size: int, expected_batch_size: float | None = None) -> float:
    """``B / 2^ceil(log2 E)``, with E the expected batch size (a constant of the run; B itself when not given): under
    half-precision autocast a mean loss is multiplied by it before the backward pass, so that the output gradients
    autograd rounds to bfloat16/float16 are the per-example loss gradients times the run's constant power of two,
    not times 1/B: removing one example then changes no other example's rounded gradient (a factor 1/B rounds every
    one of them anew, which moved the sum by 2.5% of C in bfloat16 at B = 24)."""
    if batch_size <= 0:
        return 1.0
    reference = max(float(expected_batch_size or batch_size), 1.0)
    return batch_size / 2.0 ** math.ceil(math.log2(reference))


def _add_squares(squared: Tensor, norms: list[Tensor], scale: float = 1.0) -> None:
    """``squared[:n] += (scale norms_k)^2`` for each float64 vector ``norms_k`` of n <= B entries, those of all B
    entries stacked and summed in one reduction (a handful of operations for every layer, not several per layer)."""
    full = [v for v in norms if v.shape[0] == squared.shape[0]]
    if full:
        stacked = torch.stack(full).to(torch.float64)  # (float64 already: no copy)
        squared += (stacked if scale == 1.0 else stacked.mul_(scale)).square_().sum(dim=0)
    for v in norms:
        if v.shape[0] != squared.shape[0]:
            squared[: v.shape[0]] += (v.to(torch.float64) * scale).square()


def _stacked_rows(materialised: dict[nn.Parameter, Tensor]) -> list[tuple[list[nn.Parameter], Tensor]]:
    """The materialised per-example gradients as ``(parameters, rows)``, ``rows`` (n, entries) their per-example
    gradients side by side: those of one dtype, device and number of examples together while they hold at most
    :func:`~.bookkeeping.stack_entries` entries (a LayerNorm's or an embedding's, usually), any other alone. A
    row's norm bound is then one bound of the whole row's norm, and the clipped sum one matrix-vector product: the
    same quantities, each entry's sum rounded as alone, in a few operations instead of a few per parameter."""
    out: list[tuple[list[nn.Parameter], Tensor]] = []
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p, gs in materialised.items():
        if gs.numel() > bookkeeping.stack_entries(gs.device):
            out.append(([p], gs.flatten(1)))
        else:
            groups.setdefault((gs.dtype, gs.device, gs.shape[0]), []).append(p)

    def side_by_side(group: list[nn.Parameter]) -> tuple[list[nn.Parameter], Tensor]:
        rows = [materialised[p].flatten(1) for p in group]
        return group, rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)

    for (_, device, _), params in groups.items():
        limit = bookkeeping.stack_entries(device)
        group: list[nn.Parameter] = []
        entries = 0
        for p in params:
            if group and entries + materialised[p].numel() > limit:
                out.append(side_by_side(group))
                group, entries = [], 0
            group.append(p)
            entries += materialised[p].numel()
        out.append(side_by_side(group))
    return out


def _sum_dtype(t: Tensor) -> torch.dtype:
    """Clipped sums are computed in float32 at least: a half-precision factor or sum would round an example's
    contribution above C."""
    return torch.promote_types(t.dtype, torch.float32)


def _nonfinite_rows(t: Tensor) -> Tensor:
    """Which rows (examples) of the batch-first ``t`` hold a non-finite value."""
    return ~torch.isfinite(t).flatten(1).all(dim=1)


def _zero_rows(t: Tensor, rows: Tensor) -> Tensor:
    return torch.where(rows.view(-1, *([1] * (t.dim() - 1))), 0, t)


def _zero_nonfinite_rows(calls: list[_Call], batch: int) -> int:
    """Zero, per rule call, the rows (examples) of its input and of its output gradient holding a non-finite
    value; returns how many examples had any row zeroed (one host synchronisation per pass)."""
    device = next((c.backprops.device for c in calls if c.backprops is not None), None)
    if device is None:
        return 0
    hit = torch.zeros(batch, dtype=torch.bool, device=device)
    marked = []
    for c in calls:
        if c.kind != "rule" or c.backprops is None:
            continue
        bad_backprops = _nonfinite_rows(c.backprops)
        bad_inputs = [_nonfinite_rows(a) if a.is_floating_point() else None for a in c.activations]
        hit[: c.batch_size] |= bad_backprops
        for bad in bad_inputs:
            if bad is not None:
                hit[: c.batch_size] |= bad
        marked.append((c, bad_backprops, bad_inputs))
    count = int(hit.sum())
    if count:
        for c, bad_backprops, bad_inputs in marked:
            c.backprops = _zero_rows(c.backprops, bad_backprops)
            c.activations = [a if bad is None else _zero_rows(a, bad) for a, bad in zip(c.activations, bad_inputs)]
    return count


def _own_trainable(module: nn.Module) -> list[nn.Parameter]:
    """``module.parameters(recurse=False)`` that require grad, read from the module's own table (no walk)."""
    return [p for p in dict.fromkeys(module._parameters.values()) if p is not None and p.requires_grad]


def _tied_embeddings(records: list[_Call], uses: dict[int, int]) -> list[list[_Call]]:
    """The calls that share a parameter with an nn.Embedding call (a tied input and output embedding: GPT-2's token
    table and its output layer), in groups of calls joined by shared parameters, where every call of the group has
    book-keeping; each group gets one per-example bound (:func:`_joint_uppers`)."""
    shared = [r for r in records if any(uses[id(p)] > 1 for p in r.params)]
    if not any(type(r.module) is nn.Embedding for r in shared):
        return []
    groups: list[list[_Call]] = []
    held: list[set[int]] = []
    for r in shared:
        own = {id(p) for p in r.params}
        joined = [k for k, ids in enumerate(held) if ids & own]
        merged, ids = [r], set(own)
        for k in reversed(joined):
            merged = groups.pop(k) + merged
            ids |= held.pop(k)
        groups.append(merged)
        held.append(ids)
    return [group for group in groups
            if any(type(r.module) is nn.Embedding for r in group) and all(_has_bookkeeping(r) for r in group)]


def _joint_uppers(calls: list[_Call], bounds: list[bookkeeping.NormBound], tied: list[list[_Call]]) -> list[Tensor]:
    """Per-example bounds of the calls' gradients, one per set of parameters whose squares add up to a bound of the
    whole gradient's squared norm: each call's bound alone, and one per group of ``tied`` calls (sharing
    parameters): the embedding calls on one table and the nn.Linear that holds it as its weight (a tied output
    layer) bounded together (:func:`~.bookkeeping_embedding.tied_bound`), any other group by the sum of its calls'
    bounds (the triangle inequality) times 1 + gamma_k for the k - 1 additions of their sums (in the parameters'
    dtype)."""
    position = {id(r): k for k, r in enumerate(calls)}
    grouped = {id(r) for group in tied for r in group}
    out = [bound.upper for r, bound in zip(calls, bounds) if id(r) not in grouped]
    for group in tied:
        embeddings = [r for r in group if type(r.module) is nn.Embedding]
        others = [r for r in group if type(r.module) is not nn.Embedding]
        table = embeddings[0].module.weight
        linear = others[0] if len(others) == 1 and type(others[0].module) is nn.Linear else None
        same_batch = len({r.batch_size for r in group}) == 1
        if (same_batch and all(r.module.weight is table for r in embeddings)
                and (not others or (linear is not None and linear.module.weight is table))):
            own = [bounds[position[id(r)]] for r in embeddings]
            out.append(bookkeeping_embedding.tied_bound(
                [(r.module, r.activations[0], r.backprops) for r in embeddings], [b.upper for b in own],
                [b.embedding for b in own],
                *((linear.module, linear.activations[0], linear.backprops, bounds[position[id(linear)]])
                  if linear is not None else ()),
            ))
            continue
        members = [bounds[position[id(r)]].upper for r in group]
        total = torch.zeros(max(len(m) for m in members), dtype=torch.float64, device=members[0].device)
        for member in members:  # (a call on fewer examples: its first rows)
            total[: len(member)] += member
        u = max(unit_roundoff(p.dtype) for r in group for p in r.params)  # (sums are added in the parameter's dtype)
        out.append(total * (1 + gamma(len(group), u)))
    return out


def _uses(records: list[_Call]) -> dict[int, int]:
    """How many of ``records`` touch each trainable parameter (by id): more than one for tied or recurrent weights."""
    uses: dict[int, int] = {}
    for r in records:
        for p in r.params:
            uses[id(p)] = uses.get(id(p), 0) + 1
    return uses


def _accumulate(sums: dict[nn.Parameter, Tensor], p: nn.Parameter, value: Tensor) -> None:
    """``sums[p] += value`` in float64 (the sum over examples is never rounded to float32: rounding.sum_by_blocks)."""
    value = value.to(torch.float64).view_as(p)
    sums[p] = value if p not in sums else sums[p] + value
