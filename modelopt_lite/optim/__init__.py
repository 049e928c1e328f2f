"""``modelopt_lite.optim`` (pytorch-quantization's ``pytorch_quantization.optim``): optimizer helpers for QAT."""

from . import helper

__all__ = ["helper"]
