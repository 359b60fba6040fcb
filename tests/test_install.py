"""The install resolves a torch/torchvision pair that works together (a CPU-only torch wheel breaks torchvision)."""

from __future__ import annotations

import torch


def test_torchvision_imports_and_runs_with_the_installed_torch():
    import torchvision
    from torchvision.models import resnet18

    assert torchvision.__version__
    model = resnet18(num_classes=10, norm_layer=lambda channels: torch.nn.GroupNorm(8, channels))
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0]])
    assert torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5).tolist() == [0]  # a compiled torchvision op
