"""Data helpers: the bundled handwritten-digits task used by the quick start, tests and benchmarks."""

from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule

__all__ = ["DigitsClassifier", "DigitsDataModule"]
