"""Sparsity of tensors: measuring what is there (`measure`)."""

from .measure import Measurement, measure

__all__ = ["Measurement", "measure"]
