"""Data helpers: the bundled handwritten-digits task (quick start, tests, benchmarks) and non-IID partitions."""

from lightning_privdec.data.cycled import CycledLoader
from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule
from lightning_privdec.data.partition import DirichletPartitionSampler, dirichlet_partition, label_histograms

__all__ = [
    "CycledLoader",
    "DigitsClassifier",
    "DigitsDataModule",
    "DirichletPartitionSampler",
    "dirichlet_partition",
    "label_histograms",
]
