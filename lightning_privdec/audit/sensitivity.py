"""The clipping attack: crafted examples against the one inequality DP-SGD's guarantee rests on.

For a batch D and each example x, ``||S(D) - S(D \\ x)|| / C``, where S is the library's clipped per-sample sum
before noise (the float64 sums that :class:`~lightning_privdec.privacy.PerSampleGradients` or
:class:`~lightning_privdec.privacy.GhostClipping` hand to the noise, ``take_clipped_sums()``), must stay at most 1
(up to :data:`TOLERANCE`) whatever the examples are. The attacks below craft examples where floating point
makes that hard:

* ``gram_*``: one example's per-token (per-position) contributions cancel, ``g_1 = -g_2 = M e`` on two nearly
  equal inputs ``u`` and ``u + delta``; its true gradient ``M e delta^T`` is small, and a Gram-matrix norm
  ``<G^T G, U^T U>``, a difference of numbers of size ``M^2 |u|^2``, rounds to 0 or below the truth. One attack per
  norm method of nn.Linear and of convolutions (ghost, the input's position Gram, one example at a time), one in
  float64, one with 2,500 outputs (its Gram summed over blocks of 1,024, gram.GRAM_BLOCK), and two over 64 tokens of
  a 256 x 256 layer, whose clipped sum is the examples' own float32 products added in float64
  (``gram_linear_long``, and ``_kept`` with a milder cancellation that is not computed apart);
* ``batch_rounding``: 255 clipped examples adding about C each in one direction and one small one: summed over
  examples in float32, removing x rounds the others' terms anew (1.0009 C on an Intel Xeon's BLAS with two
  threads); the sums are float64. ``batch_rounding_long``: the same over 64 tokens of a 256 x 256 layer with a bias;
  ``overflow_example_products``: an example whose float32 product over its 64 tokens overflows though its bound and
  clip factor are finite, beside copies whose float32 products err one way (it must be computed apart, alone);
* ``half_precision``: a batch of large, aligned gradients (every example clipped) under bfloat16 and float16
  autocast: a clip factor or a sum computed in half precision adds more than C;
* ``underflow``: tiny inputs and huge output gradients (what a LayerNorm after a layer does to a tiny input), whose
  float32 Gram entries underflow or overflow;
* ``attention_*``: nn.MultiheadAttention (its projections' book-keeping, privacy/per_sample/attention.py) on an
  example whose tokens are all equal but one, nearly: its attention outputs are then nearly equal at every position,
  and output gradients +M e and -M e at two positions cancel in the out-projection and, through the attention, in
  the in-projection; self-attention batch first, and cross-attention sequence first with padding and causal masks.
  This example's gradient through the attention's backward pass is rounding noise of size ~u M: with a mean loss's
  factor 1/B (not a power of two) it would move with B by more than TOLERANCE C (1.0047 C in float32), which the
  strategies' :func:`~lightning_privdec.privacy.per_sample.mean_loss_multiplier` prevents in every precision.
* ``recurrent_lstm``, ``recurrent_gru``: a 2-layer bidirectional nn.LSTM / nn.GRU over 12 steps (their weights'
  per-example gradients are sums over time, privacy/per_sample/recurrent.py) with an example of large, nearly
  constant inputs and output gradients alternating in sign over time, its near-duplicate, and one of tiny inputs;
* ``mean_rounding_*``: near-cancelling recurrent examples under a float32 mean loss, whose 1/B would round every
  example's output gradients differently for D and D \\ x (the mean loss multiplier keeps them exact).

Each attack runs every per-sample mode and precision it applies to and reports the largest ratio over the batch.
``broken_norms()`` swaps in the unguarded Gram norm (no rounding bound), the attack's positive control.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from lightning_privdec.privacy import GhostClipping, PerSampleGradients
from lightning_privdec.privacy.per_sample import bookkeeping, bookkeeping_conv, mean_loss_multiplier

__all__ = ["ATTACKS", "PRECISIONS", "TOLERANCE", "AttackResult", "broken_norms", "run_attacks", "sensitivity"]

#: what the tests and the audit allow above C, as a fraction of C: the float64 rounding of the other examples' terms,
#: summed in another order when x is removed, which no per-example bound covers (below gamma64_R of their mass);
#: docs/privacy.md, "What clipping guarantees"
TOLERANCE = 1e-5
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
MODES = ("bookkeeping", "hooks", "functorch", "ghost")
_LOSS_SCALE = 2.0**8  # "16-mixed": a GradScaler scale that honest examples do not overflow

Batch = tuple[Tensor, ...]
Losses = Callable[[nn.Module, Batch], Tensor]


@dataclass(frozen=True)
class AttackResult:
    """The largest ``||S(D) - S(D \\ x)|| / C`` over the examples x of the attack's batch."""

    attack: str
    mode: str
    precision: str
    ratio: float

    @property
    def holds(self) -> bool:
        return self.ratio <= 1 + TOLERANCE

    def to_dict(self) -> dict:
        return {**asdict(self), "holds": self.holds}


def _autocast(precision: str, device_type: str):  # noqa: ANN202
    if precision == "32-true":
        return nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float16)


def _clipped_sum(clipper: PerSampleGradients | GhostClipping, model: nn.Module, batch: Batch, losses: Losses,
                 clip: float, precision: str, expected: int) -> Tensor:
    """S(batch): the library's sum of clipped per-sample gradients, flat, float64; ``expected``: the run's expected
    batch size (the private strategies' power-of-two mean under half precision)."""
    scale = _LOSS_SCALE if precision == "16-mixed" else 1.0
    for p in model.parameters():
        p.grad = None
    if scale != 1.0:
        clipper.set_loss_scale(scale)
    with _autocast(precision, batch[0].device.type):
        per_example = losses(model, batch)
    if isinstance(clipper, GhostClipping):
        clipper.max_grad_norm = clip
        clipper.backward(per_example.float() * scale, expected)
    else:  # as the private strategies' backward: a mean loss, times B 2^-ceil(log2 E) in every precision
        multiplier = mean_loss_multiplier(per_example.shape[0], expected)
        clipper.set_mean_loss_multiplier(multiplier)
        (per_example.float().mean() * (scale * multiplier)).backward()
        clipper.clip_and_sum(clip)
        clipper.clear()
    # the float64 sums the noise is added to (p.grad holds them rounded: not what the mechanism releases)
    return torch.cat([summed.flatten() for summed in clipper.take_clipped_sums()])


def sensitivity(model: nn.Module, batch: Batch, losses: Losses, *, clip: float, mode: str = "bookkeeping",
                precision: str = "32-true", warm_up: Batch | None = None) -> Tensor:
    """``||S(D) - S(D \\ x)|| / C`` for every example x of ``batch`` (dimension 0 of each tensor), in ``mode`` and
    ``precision``. ``warm_up`` (an honest batch) runs first: the first step's check that per-example gradients add
    up to autograd's compares against autograd's own float32 sum, which crafted examples make inaccurate."""
    model.train()
    if mode == "ghost":
        clipper: PerSampleGradients | GhostClipping = GhostClipping(model, clip)
    else:
        clipper = PerSampleGradients(model, mode=mode, strict=False)
    try:
        if warm_up is not None:
            _clipped_sum(clipper, model, warm_up, losses, clip, precision, warm_up[0].shape[0])
        size = batch[0].shape[0]
        full = _clipped_sum(clipper, model, batch, losses, clip, precision, size)
        ratios = []
        for x in range(size):
            keep = torch.tensor([i for i in range(size) if i != x], device=batch[0].device)
            without = _clipped_sum(clipper, model, tuple(t.index_select(0, keep) for t in batch), losses, clip,
                                   precision, size)  # fmt: skip
            ratios.append(float(torch.linalg.vector_norm(full - without)) / clip)
        return torch.tensor(ratios, dtype=torch.float64)
    finally:
        clipper.detach()


# ---- the crafted batches --------------------------------------------------------------------------------------------
def _token_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Per example: sum over tokens/positions of <output, target>; the output gradient is the target itself."""
    x, target = batch
    out = model(x)
    return (out * target.to(out.dtype)).flatten(1).sum(dim=1)


def _cancelling_linear(dtype: torch.dtype, d_in: int, d_out: int, steps: int, relative_delta: float,
                       magnitude: float, batch: int = 6) -> tuple[nn.Module, Batch, Batch]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Linear(d_in, d_out, bias=False).to(dtype)
    x = torch.randn(batch, steps, d_in, generator=gen, dtype=dtype)
    target = torch.randn(batch, steps, d_out, generator=gen, dtype=dtype)
    u = torch.randn(d_in, generator=gen, dtype=dtype)
    u = 10 * u / u.norm()
    delta = torch.randn(d_in, generator=gen, dtype=dtype)
    delta = relative_delta * 10 * delta / delta.norm()
    e = torch.randn(d_out, generator=gen, dtype=dtype)
    e = e / e.norm()
    x[0, 0], x[0, 1], target[0] = u, u + delta, 0
    target[0, 0], target[0, 1] = magnitude * e, -magnitude * e
    return model, (x, target), (x[1:], target[1:])


def _cancelling_conv(channels: int, out_channels: int, size: int, kernel: int, stride: int, padding: int,
                     magnitude: float, batch: int = 5) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: a constant image (10 everywhere) but one pixel, and output gradients +M e and -M e at two
    neighbouring positions whose patches (no padding) differ only by that pixel."""
    gen = torch.Generator().manual_seed(1)
    model = nn.Conv2d(channels, out_channels, kernel, stride=stride, padding=padding, bias=False)
    x = torch.randn(batch, channels, size, size, generator=gen)
    out_size = model(x[:1]).shape[-1]
    target = torch.randn(batch, out_channels, out_size, out_size, generator=gen)
    x[0] = 10.0
    centre = (out_size - 1) // 2  # positions (centre, centre) and (centre, centre + 1) read no padding
    corner = centre * stride - padding
    x[0, :, corner, corner] += 3e-3  # the top-left pixel of the first patch only
    e = torch.randn(out_channels, generator=gen)
    e = magnitude * e / e.norm()
    target[0] = 0
    target[0, :, centre, centre], target[0, :, centre, centre + 1] = e, -e
    return model, (x, target), (x[1:], target[1:])


def _long_map_conv(magnitude: float, difference: float, batch: int = 4) -> tuple[nn.Module, Batch, Batch]:
    """A Conv1d over 16,384 positions, whose per-example gradients are summed by blocks of positions added in
    float64 and kept for the clipped sum (bookkeeping_conv._blocked_weight_grads). Example 0: a constant signal (10)
    but one value, ``difference`` more, and output gradients +M e and -M e at the two positions on either side of the
    first blocks' boundary, whose patches differ only by that value: each block's gradient is about 39 M, their sum
    ``difference`` M. With 3e-3 the example is ill-conditioned and computed apart; with 2 its bound is the blocks'
    (neither computed apart nor loose)."""
    from lightning_privdec.privacy.per_sample.bookkeeping_conv import POSITION_BLOCK

    gen = torch.Generator().manual_seed(3)
    model = nn.Conv1d(3, 4, 5, padding=2, bias=False)
    length = 16 * POSITION_BLOCK
    x, target = torch.randn(batch, 3, length, generator=gen), torch.randn(batch, 4, length, generator=gen)
    x[0] = 10.0
    left = POSITION_BLOCK - 1  # positions left and left + 1 lie in two blocks
    x[0, 0, left - 2] += difference  # the first value of position left's patch (positions left - 2 to left + 2) only
    e = torch.randn(4, generator=gen)
    e = magnitude * e / e.norm()
    target[0] = 0
    target[0, :, left], target[0, :, left + 1] = e, -e
    return model, (x, target), (x[1:], target[1:])


def _batch_rounding(batch: int = 256, small: float = 0.37) -> tuple[nn.Module, Batch, Batch]:
    """Every example but the last clipped, all adding about C in one direction (the sum's norm about B C), and the
    last one small and unclipped: it sets where the sum falls between float32 values. Summed over examples in
    float32, removing x rounds every other example's terms anew, by up to half a float32 unit of the whole sum
    (1.0009 C for 256 examples of this nn.Linear(1, 1); 1.00014 C from the one final rounding of 4,000); the
    clipped sums are therefore float64 until the noise is added (rounding.sum_by_blocks)."""
    model = nn.Linear(1, 1, bias=False)
    x = torch.ones(batch, 1, 1)
    target = torch.full((batch, 1, 1), 100.0)
    target[-1] = small
    return model, (x, target), (x[:8], target[:8])


def _batch_rounding_long(batch: int = 32, steps: int = 64, width: int = 256) -> tuple[nn.Module, Batch, Batch]:
    """:func:`_batch_rounding` over sequences: an nn.Linear(256, 256) with a bias over 64 tokens, whose clipped sum
    is its examples' own float32 products added in float64 (bookkeeping._sum_of_example_products); every example
    but the last clipped, their gradients nearly equal (the sum's norm about B C), the last one small."""
    gen = torch.Generator().manual_seed(4)
    model = nn.Linear(width, width)
    x = 3 * torch.randn(1, steps, width, generator=gen) + 0.01 * torch.randn(batch, steps, width, generator=gen)
    target = 3 * torch.randn(1, steps, width, generator=gen).expand(batch, steps, width).clone()
    target[-1] *= 1e-4
    return model, (x, target), (x[:4], target[:4].flip(1))


def _overflowing_example_products(copies: int = 31, clip: float = 10.0) -> tuple[nn.Module, Batch, Batch]:
    """Example 0 of an nn.Linear(128, 1040) over 64 tokens: 64 terms of about 2e38 (each token's norms finite), so
    that its float32 product overflows while its bound (a ghost norm over 1,040 outputs, summed in float64) and its
    clip factor stay finite; and ``copies`` identical examples whose 64 terms of about 1e5 cancel at one weight entry,
    where their float32 products err in the direction of example 0's. Were a layer's sum to change method because of
    example 0 (the float64 product for D, the examples' float32 products for D \\ x), the copies' float32 errors would
    move S(D) - S(D \\ x) (1.00012 C; a review's batch): example 0 is computed apart instead
    (bookkeeping.PRODUCT_MASS_LIMIT)."""
    from lightning_privdec.privacy.per_sample.bookkeeping import _sum_of_example_products

    steps, width, outputs = 64, 128, 1040
    gen, search = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    model = nn.Linear(width, outputs, bias=False)
    signs = torch.cat([torch.ones(steps // 2), -torch.ones(steps // 2)])
    copy_x = 3.0 * torch.randn(steps, width, generator=gen) / width**0.5
    copy_g = torch.zeros(steps, outputs)
    copy_g[:, 0] = 1e4 * signs
    worst, column = 0.0, None  # the input column whose float32 product (the library's) errs most at entry (0, 0)
    for trial in range(400):
        candidate = 10.0 + torch.rand(steps, generator=search) * float(torch.rand(1, generator=search)) * 3
        if trial % 3 == 1:
            candidate = 10.0 + (torch.randint(0, 8, (steps,), generator=search).float() + 0.49) * 2.0**-20 * float(
                torch.randint(1, 64, (1,), generator=search))
        copy_x[:, 0] = candidate
        got = _sum_of_example_products(model, copy_x[None], copy_g[None], torch.ones(1, dtype=torch.float64))
        error = float(got[0, 0]) - float((copy_g[:, 0].double() * candidate.double()).sum())
        if abs(error) > abs(worst):
            worst, column = error, candidate.clone()
    copy_x[:, 0] = column
    huge = min(1.5e19, 1.0e18 * clip**0.5)
    x, target = torch.zeros(copies + 1, steps, width), torch.zeros(copies + 1, steps, outputs)
    x[0, :, 0] = huge
    target[0, :, 0] = huge if worst < 0 else -huge
    x[1:], target[1:] = copy_x, copy_g
    warm_up = (torch.randn(4, steps, width, generator=gen), torch.randn(4, steps, outputs, generator=gen))
    return model, (x, target), warm_up


def _aligned_mlp(batch: int = 24) -> tuple[nn.Module, Batch, Batch]:
    """Large gradients pointing the same way (every example clipped, the sum's norm about B C)."""
    gen = torch.Generator().manual_seed(2)
    model = nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 10))
    x = 50 * torch.randn(1, 24, generator=gen) + 0.1 * torch.randn(batch, 24, generator=gen)
    target = 30 * torch.randn(1, 10, generator=gen).expand(batch, 10).clone()
    return model, (x, target), (x[1:], target[1:])


def _underflow() -> tuple[nn.Module, Batch, Batch]:
    """Example 0: inputs of size 1e-23 and output gradients of size 1e21 (float32's squares underflow and
    overflow); its true gradient has norm about 100 C."""
    model, batch, warm_up = _cancelling_linear(torch.float32, 16, 8, 3, 1.0, 1.0)
    x, target = batch
    x[0] = 1e-23 * torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    target[0] = 1e21 * torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    return model, (x, target), warm_up


def _overflowing_conv(bias: bool, batch: int = 5) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: inputs and output gradients of 1e19, finite in float32, whose per-example weight gradient
    overflows (its terms are 1e38 and 64 of them are summed): its kept row (a convolution whose norms are computed
    one example at a time) is infinite, and it is computed apart in float64 (:data:`ATTACK_MODES`)."""
    gen = torch.Generator().manual_seed(1)
    model = nn.Conv2d(3, 4, 3, padding=1, bias=bias)
    x, target = torch.randn(batch, 3, 8, 8, generator=gen), torch.randn(batch, 4, 8, 8, generator=gen)
    x[0], target[0] = 1e19, 1e19
    return model, (x, target), (x[1:], target[1:])


def _one_position_conv(magnitude: float, batch: int = 6) -> tuple[nn.Module, Batch, Batch]:
    """Convolutions whose output has one position, whose weight gradients are one matrix product per group: a
    grouped 3 x 3 kernel reading a 2 x 2 map with stride 2 (4 live taps of 9), as the model's input. Example 0: an
    input and an output gradient of ``magnitude`` (a gradient of ``magnitude^2``, clipped by about its inverse);
    example 1: a near-copy of it, whose terms the batch's sum adds to example 0's."""
    gen = torch.Generator().manual_seed(6)
    model = nn.Conv2d(8, 12, 3, stride=2, padding=1, groups=2, bias=False)
    x, target = torch.randn(batch, 8, 2, 2, generator=gen), torch.randn(batch, 12, 1, 1, generator=gen)
    x[0], target[0] = magnitude * x[0], magnitude * target[0]
    x[1] = x[0] * (1 + 1e-6 * torch.randn(8, 2, 2, generator=gen))
    target[1] = -target[0]
    return model, (x, target), (x[2:], target[2:])


def _huge_example(depthwise: bool, magnitude: float = 1.3e19 / 1.01,
                  batch: int = 3) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: inputs and output gradients of about ``magnitude`` (a gradient norm near 1e38, finite in float32),
    clipped with C = 1e-4: its clip factor, about 1e-42, is no normal float32 (dp_step.clip_factor makes it 0). An
    nn.Linear, or a depthwise 3 x 3 convolution of 64 channels on 1 x 1 maps (one position, 64 groups)."""
    gen = torch.Generator().manual_seed(0)
    if depthwise:
        model = nn.Conv2d(64, 64, 3, padding=1, groups=64, bias=False)
        x, target = torch.randn(batch, 64, 1, 1, generator=gen), torch.randn(batch, 64, 1, 1, generator=gen)
        x[0] = magnitude * torch.sign(torch.randn(64, 1, 1, generator=gen))
        target[0] = magnitude
    else:
        model = nn.Linear(8, 8, bias=False)
        x, target = torch.randn(batch, 8, generator=gen), torch.randn(batch, 8, generator=gen)
        x[0], target[0] = magnitude / 3, magnitude / 3
    return model, (x, target), (x[1:], target[1:])


def _huge_input(batch: int = 3) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: an input of 1.42e37 into an nn.Linear from 1 to 8 features, under output gradients of about 1e-20,
    clipped with C = 1e-4: its output gradients times its clip factor fall below float32's normal range, where they
    are rounded absolutely, and the input multiplies that rounding (per_sample.gram.HUGE_INPUT)."""
    gen = torch.Generator().manual_seed(6)
    model = nn.Linear(1, 8, bias=False)
    x, target = torch.randn(batch, 1, generator=gen), torch.randn(batch, 8, generator=gen)
    x[0], target[0] = 1.42e37, target[0] * 1e-20
    return model, (x, target), (x[1:], target[1:])


class _SharedParameters(nn.Module):
    """A class token concatenated to every example, a position embedding added to every example, and a
    relative-position bias table looked up with an index buffer as attention's additive mask: parameters used once
    for the whole batch (privacy/per_sample/shared.py)."""

    def __init__(self, steps: int = 4, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.embed, self.qkv, self.heads = nn.Linear(dim, dim), nn.Linear(dim, 3 * dim), heads
        self.class_token = nn.Parameter(torch.randn(1, 1, dim, generator=gen))
        self.position = nn.Parameter(torch.randn(1, steps + 1, dim, generator=gen))
        self.table = nn.Parameter(torch.randn(2 * steps + 1, heads, generator=gen))
        self.register_buffer("index", torch.arange(steps + 1)[:, None] - torch.arange(steps + 1)[None, :] + steps)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = torch.cat([self.class_token.expand(b, -1, -1), self.embed(x)], dim=1) + self.position
        q, k, v = self.qkv(h).view(b, t + 1, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index].permute(2, 0, 1).unsqueeze(0)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out.transpose(1, 2).reshape(b, t + 1, d)


def _shared_parameters(batch: int = 5) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: inputs times 1e3 and output gradients of size 1e6, cancelling between the positions that share
    a relative offset (the table's per-example sums); example 1 a near-duplicate of it."""
    gen = torch.Generator().manual_seed(6)
    model = _SharedParameters()
    x = torch.randn(batch, 4, 8, generator=gen)
    target = torch.randn(batch, 5, 8, generator=gen)
    x[0] *= 1e3
    target[0] = 1e6 * torch.randn(1, 8, generator=gen) * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]).view(5, 1)
    x[1], target[1] = x[0] * (1 + 1e-6), target[0]
    return model, (x, target), (x[2:], target[2:])


def _embedding_repeats(batch: int = 5, magnitude: float = 1e6) -> tuple[nn.Module, Batch, Batch]:
    """An nn.Embedding whose example 0 holds one token at four positions with output gradients +M e, -M e, +M e,
    -M e (1 + 1e-7): the row sum of its gradient is rounding noise of size ~u M, whatever the order of addition;
    example 1 a near-duplicate of it."""
    gen = torch.Generator().manual_seed(7)
    model = nn.Embedding(8192, 8)  # (a table book-keeping covers: bookkeeping_embedding.MIN_ENTRIES)
    ids = torch.randint(0, 16, (batch, 6), generator=gen)
    target = torch.randn(batch, 6, 8, generator=gen)
    e = torch.randn(8, generator=gen)
    e = e / e.norm()
    ids[0, :4] = 3
    target[0, :4] = magnitude * e * torch.tensor([1.0, -1.0, 1.0, -1.0 - 1e-7]).view(4, 1)
    ids[1], target[1] = ids[0], target[0] * (1 + 1e-6)
    return model, (ids, target), (ids[2:], target[2:])


class _TiedEmbedding(nn.Module):
    """Token table W, a frozen antisymmetric map K, and the output layer tied to W: logits W K W[id]. For the output
    gradient M e_id at a position, the output layer's gradient M e_id (K W[id])^T and the table's M e_id (K^T
    W[id])^T cancel exactly."""

    def __init__(self, vocab: int = 8192, dim: int = 8) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(8)
        self.embed, self.mix = nn.Embedding(vocab, dim), nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)
        skew = torch.randn(dim, dim, generator=gen)
        self.mix.weight.data.copy_(skew - skew.T)
        self.mix.weight.requires_grad_(False)
        self.out.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.mix(self.embed(ids)))


def _tied_embedding(batch: int = 5, magnitude: float = 1e6) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: output gradients M e_id at every position (:class:`_TiedEmbedding`), so that the table's two
    gradients cancel to rounding noise in the clipped sum; example 1 a near-duplicate of it."""
    gen = torch.Generator().manual_seed(9)
    model = _TiedEmbedding()
    vocab = model.embed.num_embeddings
    ids = torch.randint(0, 12, (batch, 5), generator=gen)
    target = torch.randn(batch, 5, vocab, generator=gen)
    target[0] = magnitude * nn.functional.one_hot(ids[0], vocab).float()
    ids[1], target[1] = ids[0], target[0] * (1 + 1e-6)
    return model, (ids, target), (ids[2:], target[2:])


class _Attention(nn.Module):
    """nn.MultiheadAttention on batch-first (B, T, d) inputs, returning batch-first outputs: self-attention, or
    (``cross``) sequence-first cross-attention of the first half of the tokens (queries, causal mask) to the second
    half (keys and values, the last key padded for example 1)."""

    def __init__(self, dim: int = 8, heads: int = 2, cross: bool = False) -> None:
        super().__init__()
        self.cross = cross
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=not cross)

    def forward(self, x: Tensor) -> Tensor:
        if not self.cross:
            return self.attention(x, x, x, need_weights=False)[0]
        half = x.shape[1] // 2
        query, memory = x[:, :half].transpose(0, 1), x[:, half:].transpose(0, 1)
        causal = torch.ones(half, memory.shape[0], dtype=torch.bool, device=x.device).triu(1)
        padding = torch.zeros(x.shape[0], memory.shape[0], dtype=torch.bool, device=x.device)
        padding[1:2, -1] = True
        out, _ = self.attention(query, memory, memory, attn_mask=causal, key_padding_mask=padding)
        return out.transpose(0, 1)


def _cancelling_attention(cross: bool, magnitude: float = 1e4, batch: int = 5) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: every token u (norm 10) but the first, u + delta (|delta| 3e-5); output gradients +M e and -M e
    at the first two output positions; example 1 a near-duplicate of it."""
    gen = torch.Generator().manual_seed(7)
    model = _Attention(cross=cross)
    steps, dim = 8, 8
    x = torch.randn(batch, steps, dim, generator=gen)
    u = torch.randn(dim, generator=gen)
    x[0] = 10 * u / u.norm()
    x[0, 0] += 3e-5 * torch.randn(dim, generator=gen)
    out_steps = steps // 2 if cross else steps
    target = torch.randn(batch, out_steps, dim, generator=gen)
    e = torch.randn(dim, generator=gen)
    target[0] = 0
    target[0, 0], target[0, 1] = magnitude * e / e.norm(), -magnitude * e / e.norm()
    x[1], target[1] = x[0] * (1 + 1e-6), target[0]
    return model, (x, target), (x[2:], target[2:])


class _Recurrent(nn.Module):
    """A recurrent layer's output sequence (B, T, 2 H)."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0]


def _recurrent(cls: type[nn.Module], batch: int = 5, steps: int = 12) -> tuple[nn.Module, Batch, Batch]:
    """Example 0: inputs 30 (u + 1e-6 noise) at every step and output gradients of size 1e5 alternating in sign
    over time (its per-step terms of the weights' sums cancel); example 1 a near-duplicate of it; example 2 with
    inputs of size 1e-20."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    model = _Recurrent(cls(6, 8, num_layers=2, bidirectional=True, batch_first=True))
    x = torch.randn(batch, steps, 6, generator=gen)
    target = torch.randn(batch, steps, 16, generator=gen)
    x[0] = 30 * (torch.randn(1, 6, generator=gen) + 1e-6 * torch.randn(steps, 6, generator=gen))
    signs = torch.tensor([(-1.0) ** t for t in range(steps)]).view(steps, 1)
    target[0] = 1e5 * torch.randn(1, 16, generator=gen) * signs
    x[1], target[1] = x[0] * (1 + 1e-6), target[0]
    x[2] = 1e-20 * x[2]
    return model, (x, target), (x[3:], target[3:])


def _mean_rounding(cls: type[nn.Module], batch: int = 5, steps: int = 13) -> tuple[nn.Module, Batch, Batch]:
    """A one-layer nn.LSTM / nn.GRU whose state forgets nothing (forget / update gate's input bias -30, W_hh = 0), so
    that example 0's per-step terms, inputs u + 1e-6 noise and output gradients 0 then +-1e6 w alternating in sign,
    cancel to a small gradient, and a near-duplicate example 1: removing an example changes a mean loss's 1/B,
    which would round every other example's output gradients anew; the strategies' power-of-two multiplier
    (:func:`~lightning_privdec.privacy.per_sample.mean_loss_multiplier`) keeps them exact."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    rnn = cls(6, 8, batch_first=True)
    with torch.no_grad():
        rnn.weight_hh_l0.zero_()
        rnn.bias_ih_l0[8:16] = -30.0  # LSTM (i, f, g, o) and GRU (r, z, n): the second gate
    model = _Recurrent(rnn)
    x = torch.randn(batch, steps, 6, generator=gen)
    target = torch.randn(batch, steps, 8, generator=gen)
    x[0] = torch.randn(1, 6, generator=gen) + 1e-6 * torch.randn(steps, 6, generator=gen)
    signs = torch.tensor([0.0] + [(-1.0) ** t for t in range(1, steps)]).view(steps, 1)
    target[0] = 1e6 * torch.randn(1, 8, generator=gen) * signs
    x[1], target[1] = x[0] * (1 + 1e-6), target[0]
    return model, (x, target), (x[2:], target[2:])


#: name -> (builder of (model, crafted batch, honest warm-up batch), clip C, precisions)
ATTACKS: dict[str, tuple[Callable[[], tuple[nn.Module, Batch, Batch]], float, tuple[str, ...]]] = {
    "gram_linear": (lambda: _cancelling_linear(torch.float32, 16, 8, 2, 3e-6, 1e6), 1.0, PRECISIONS),
    "gram_linear_large": (lambda: _cancelling_linear(torch.float32, 16, 8, 2, 3e-4, 1e7), 1.0, ("32-true",)),
    "gram_linear_float64": (lambda: _cancelling_linear(torch.float64, 16, 8, 2, 1e-10, 1e11), 1.0, ("32-true",)),
    "gram_linear_wide": (lambda: _cancelling_linear(torch.float32, 16, 2500, 2, 3e-6, 1e6), 1.0, ("32-true",)),
    "gram_linear_long": (lambda: _cancelling_linear(torch.float32, 256, 256, 64, 3e-6, 1e6), 1.0, PRECISIONS),
    "gram_linear_long_kept": (lambda: _cancelling_linear(torch.float32, 256, 256, 64, 3e-2, 1e4), 1.0, PRECISIONS),
    "gram_linear_per_example": (lambda: _cancelling_linear(torch.float32, 4, 3, 9, 1e-7, 1e4), 1.0, ("32-true",)),
    "gram_conv_input_gram": (lambda: _cancelling_conv(16, 64, 5, 3, 1, 1, 1e4), 1.0, PRECISIONS),
    "gram_conv_ghost": (lambda: _cancelling_conv(16, 24, 6, 3, 2, 1, 1e4), 1.0, ("32-true",)),
    "gram_conv_per_example": (lambda: _cancelling_conv(3, 4, 8, 3, 1, 1, 1e4), 1.0, ("32-true",)),
    "long_map_conv": (lambda: _long_map_conv(1e4, 3e-3), 1.0, PRECISIONS),
    "long_map_conv_kept": (lambda: _long_map_conv(1e4, 2.0), 1.0, PRECISIONS),
    "half_precision": (_aligned_mlp, 1.0, PRECISIONS),
    "batch_rounding": (_batch_rounding, 1.0001, PRECISIONS),
    "batch_rounding_long": (_batch_rounding_long, 1.0, PRECISIONS),
    "overflow_example_products": (_overflowing_example_products, 10.0, ("32-true",)),
    "underflow": (_underflow, 1.0, ("32-true",)),
    "overflow_conv": (lambda: _overflowing_conv(bias=False), 1.0, ("32-true", "bf16-mixed")),
    "overflow_conv_bias": (lambda: _overflowing_conv(bias=True), 1.0, ("32-true",)),
    "one_position_conv": (lambda: _one_position_conv(1e4), 1.0, PRECISIONS),
    "overflow_one_position_conv": (lambda: _one_position_conv(1e19), 1.0, ("32-true",)),
    "huge_example_small_clip": (lambda: _huge_example(depthwise=False), 1e-4, ("32-true",)),
    "huge_example_small_clip_depthwise": (lambda: _huge_example(depthwise=True), 1e-4, ("32-true",)),
    "huge_input_small_clip": (_huge_input, 1e-4, ("32-true",)),
    "shared_parameters": (_shared_parameters, 1.0, PRECISIONS),
    "embedding_repeated_tokens": (_embedding_repeats, 1.0, PRECISIONS),
    "tied_embedding": (_tied_embedding, 1.0, PRECISIONS),
    "attention_self": (lambda: _cancelling_attention(cross=False), 1.0, PRECISIONS),
    "attention_cross": (lambda: _cancelling_attention(cross=True), 1.0, PRECISIONS),
    # no float16 CPU kernel for nn.LSTM/GRU outside the private step (torch): 32-true and bf16
    "recurrent_lstm": (lambda: _recurrent(nn.LSTM), 1.0, ("32-true", "bf16-mixed")),
    "recurrent_gru": (lambda: _recurrent(nn.GRU), 1.0, ("32-true", "bf16-mixed")),
    "mean_rounding_lstm": (lambda: _mean_rounding(nn.LSTM), 1.0, ("32-true",)),
    "mean_rounding_gru": (lambda: _mean_rounding(nn.GRU), 1.0, ("32-true",)),
}


#: attacks that apply to some per-sample modes only (the rest: every mode of MODES). An example whose float32
#: per-example gradient overflows is computed apart in float64 by book-keeping (and ghost clipping, which uses its
#: norms); the materialising modes ("hooks", "functorch") compute it in float32, get infinity, and their step is not
#: finite: the node stops there (NodeRunner.check_finite), nothing is released
ATTACK_MODES: dict[str, tuple[str, ...]] = {
    "overflow_conv": ("bookkeeping", "ghost"),
    "overflow_conv_bias": ("bookkeeping", "ghost"),
    "overflow_one_position_conv": ("bookkeeping", "ghost"),
    "overflow_example_products": ("bookkeeping", "ghost"),
}


def run_attacks(names: tuple[str, ...] | None = None, modes: tuple[str, ...] = MODES,
                device: str | torch.device = "cpu") -> list[AttackResult]:
    """Every attack (or ``names``) in every mode and in each precision it applies to, on ``device`` (the crafted
    batches are built on the CPU, then moved)."""
    results = []
    for name in names or tuple(ATTACKS):
        build, clip, precisions = ATTACKS[name]
        for precision in precisions:
            for mode in (m for m in modes if m in ATTACK_MODES.get(name, MODES)):
                torch.manual_seed(0)
                model, batch, warm_up = build()
                model.to(device)
                batch = tuple(t.to(device) for t in batch)
                warm_up = None if warm_up is None else tuple(t.to(device) for t in warm_up)
                ratios = sensitivity(model, batch, _token_loss, clip=clip, mode=mode, precision=precision,
                                     warm_up=warm_up)  # fmt: skip
                results.append(AttackResult(name, mode, precision, float(ratios.max())))
    return results


@contextmanager
def broken_norms() -> Iterator[None]:
    """A deliberately broken norm (the attack's positive control): book-keeping's per-example norms become the
    Gram-matrix estimates without their rounding bound and never fall back to float64, as an unguarded ghost norm
    would."""
    original = bookkeeping.norm_bound

    def unguarded(
        module: nn.Module, a: Tensor, g: Tensor, method: str | None = None, *, defer_exact: bool = False,
        keep_rows: bool = False,
    ) -> bookkeeping.NormBound:
        work = torch.promote_types(g.dtype, torch.float32)
        a, g = (a.to(work) if a.is_floating_point() else a), g.to(work)
        if bookkeeping._is_linear(module) and g.dim() == 3:
            squared = bookkeeping._gram_inner_products(g.transpose(1, 2), a.transpose(1, 2))[0].clamp_min(0)
        elif not bookkeeping._is_linear(module) and g.dim() == 4:
            squared = bookkeeping_conv._conv_ghost_norms(module, a, g)[0].sum(dim=1).clamp_min(0)
        else:
            return original(module, a, g, method, defer_exact=defer_exact, keep_rows=keep_rows)
        if module.bias is not None and module.bias.requires_grad:
            squared = squared + torch.linalg.vector_norm(g.flatten(2).sum(dim=2) if g.dim() == 4 else g.sum(dim=1),
                                                         dim=1, dtype=torch.float64).square()  # fmt: skip
        return bookkeeping.NormBound(squared.sqrt())

    bookkeeping.norm_bound = unguarded
    try:
        yield
    finally:
        bookkeeping.norm_bound = original
