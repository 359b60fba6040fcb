"""Mixed precision under per-example clipping: the private step's side of Lightning's precision plugin.

Lightning's ``MixedPrecision`` (``precision="bf16-mixed"``/``"16-mixed"``) runs the forward under autocast and, for
float16, scales the loss before backward and unscales every gradient before the optimizer step with a
``GradScaler``, which skips a step whose gradients overflowed and then lowers its scale. A private step must not
follow that: per-example clipping has to see unscaled gradients, and a skipped step would tell every neighbour
whether some example overflowed. :class:`PrivatePrecision` holds the plugin and adds, in its hooks' order:

    connect()          refuse "16-true"/"bf16-true" (noise in half precision); hold the GradScaler's scale
    backward()         a step's per-sample backward: the node learns the loss scale, the mean loss is multiplied
                       by a power of two; ghost clipping's backward (scaled here) or the plugin's; micro-batches kept
    backward_outside_step()  the same for a backward outside a step (PrivSGP-VR's table, the per-example probe)
    after_privatize()  the node's step then multiplies the unscaled privatized gradient by the scale, so that the
                       plugin's unscaling is exact (post_privatize; overflowed examples counted, report_overflows)
    closure_result()   never None under "16-mixed", so that the plugin never skips an (empty-batch) step

(docs/privacy.md, "precision=\"16-mixed\": loss scaling").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from torch import Tensor

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy import PrivacyConfigError

log = logging.getLogger("lightning.pytorch")  # Lightning's console handler: each node's own line


class PrivatePrecision:
    """Lightning's precision plugin as a private node's step needs it.

    Args:
        node: the node whose per-sample gradients are clipped (told the loss scale and the mean-loss multiplier).
        device: the node's device (the GradScaler's first scale is created there).
    """

    def __init__(self, node: PrivateNodeAlgorithm, device: torch.device) -> None:
        self.node, self.device = node, device
        self.plugin: Precision = Precision()
        #: examples whose overflowed float16 per-example gradient parts were zeroed, over this node's fits
        self.nonfinite_examples = 0

    @property
    def scaler(self) -> Any:
        """The float16 GradScaler of ``precision="16-mixed"``, or None."""
        return getattr(self.plugin, "scaler", None)

    def connect(self, plugin: Precision) -> None:
        """At setup: the Trainer's plugin. Half-precision parameters are refused; a GradScaler's scale is held at its
        initial value (no step ever overflows: an overflowed example is zeroed instead, so a growing scale would only
        grow until every example overflows) and created now, so that a first step without a backward pass (an empty
        Poisson batch) is unscaled like any other."""
        if isinstance(plugin, HalfPrecision):
            raise PrivacyConfigError(
                f"precision={plugin.precision!r} keeps parameters, gradients and noise in "
                f"{plugin._desired_input_dtype}: the clipped sum and the Gaussian noise would be rounded to 8 "
                "(bfloat16) or 11 (float16) significant bits and added in that precision, which is not the Gaussian "
                "mechanism the accountant prices (low-precision noise is open to floating-point attacks, Mironov "
                "2012). Use precision='bf16-mixed' (float32 parameters; clipping and noise in float32) or '32-true'."
            )
        self.plugin = plugin
        if self.scaler is not None:
            self.scaler.set_growth_factor(1.0)
            self.scaler.scale(torch.zeros((), device=self.device))

    def tell_loss_scale(self) -> None:
        """Before any backward pass: the node learns the scale the loss is multiplied by (clipping divides it out)."""
        if self.scaler is not None:
            self.node.clipping.set_loss_scale(self.scaler.get_scale())

    def pre_backward(self, loss: Tensor) -> Tensor:
        """Before a backward pass of the mean loss: :meth:`tell_loss_scale`, and the loss multiplied by
        :meth:`PerSampleClipping.mean_loss_multiplier` (in every precision), so that the output gradients autograd
        rounds do not depend on the batch size."""
        self.tell_loss_scale()
        multiplier = self.node.clipping.mean_loss_multiplier(self.node.expected_micro_batch_size)
        return loss * multiplier if multiplier != 1.0 else loss

    def backward(self, loss: Tensor, micro_batches: int, plugin_backward: Callable[[Tensor], Any]) -> None:
        """A training step's per-sample backward pass (``plugin_backward``: Lightning's, which scales the loss; ghost
        clipping's per-sample losses give the clipped sum without per-sample gradients). With ``micro_batches = k``
        (``accumulate_grad_batches``) each micro-batch of a logical Poisson batch is clipped here and kept: Lightning
        divides the loss by k, which is undone so that every example is clipped at its own gradient."""
        loss = self.pre_backward(loss * micro_batches if micro_batches > 1 else loss)
        if self.node.clipping.ghost is not None:
            self.node.clipping.ghost_backward(self.scale(loss), self.node.expected_micro_batch_size)
        else:
            plugin_backward(loss)
        if micro_batches > 1:
            self.node.clipping.accumulate_micro_batch()

    def backward_outside_step(self, loss: Tensor) -> None:
        """A backward pass outside a training step (PrivSGP-VR's table, the per-example probe), scaled as in a step;
        ghost clipping's per-sample losses are summed as in its step (:meth:`GhostClipping.loss_sum`)."""
        if self.node.clipping.ghost is not None:
            self.node.clipping.ghost.check_loss_shape(loss)
            self.tell_loss_scale()
            loss = self.node.clipping.ghost.loss_sum(loss, self.node.expected_micro_batch_size)
        else:
            loss = self.pre_backward(loss)
        self.scale(loss).backward()

    def scale(self, loss: Tensor) -> Tensor:
        """The loss as the plugin's backward would scale it (for a backward pass the plugin does not run)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def after_privatize(self, parameters: Iterable[Tensor]) -> Callable[[], None] | None:
        """What the node's step runs once the release is recorded (:meth:`post_privatize` on ``parameters``), or
        None without a GradScaler."""
        return None if self.scaler is None else partial(self.post_privatize, list(parameters))

    def post_privatize(self, parameters: Iterable[Tensor]) -> None:
        """``precision="16-mixed"``, after the release is recorded: the privatized gradient is unscaled (clipping saw
        unscaled per-example gradients), and the plugin divides every gradient by the scale before the optimizer
        step, so it is multiplied by the scale here (exact for the power-of-two scales GradScaler uses). It is
        finite (an overflowed example's part is zeroed, never the whole step skipped), so the GradScaler skips no
        step on any node and the ledger counts every step: a skip would release, without noise, whether some
        example overflowed."""
        self.nonfinite_examples += self.node.clipping.take_nonfinite_examples()
        scale = self.node.clipping.loss_scale  # the scale this step's backward passes were told
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)

    def closure_result(self, loss: Any) -> Any:
        """Under "16-mixed" never None (a step whose batch was empty): the plugin would then skip the optimizer step,
        and the node would gossip a model without its noise-only update."""
        if loss is None and self.scaler is not None:
            return torch.zeros((), device=self.device)
        return loss

    def report_overflows(self, name: str, rank: int) -> None:
        """At the end of a fit, on a node some of whose examples overflowed float16: how many (each node its own
        line: the count depends on its data and is never sent)."""
        if self.nonfinite_examples:
            log.info(
                f"{name}, node {rank}: {self.nonfinite_examples} examples overflowed float16 under precision='16-mixed'"
                " and contributed zero where they did; float16 stops at 65504: precision='bf16-mixed' avoids it (or, "
                "for backward overflows, a smaller GradScaler init_scale)"
            )
