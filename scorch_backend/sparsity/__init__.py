"""Sparsity of tensors: measuring what is there (`measure`) and the attributes the backend propagates."""

from .attrs import DENSE, SparsityAttr, Support
from .measure import Measurement, measure

__all__ = ["DENSE", "Measurement", "SparsityAttr", "Support", "measure"]
