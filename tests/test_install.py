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


def test_every_python_file_compiles_without_a_warning():
    """Python 3.12 prints a SyntaxWarning at import for an invalid escape such as ``"D \\ x"`` in a docstring: a
    warning the user can do nothing about."""
    import warnings
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [p for folder in ("lightning_privdec", "benchmarks", "examples", "tests") for p in (root / folder).rglob("*.py")]
    assert len(files) > 50
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")
