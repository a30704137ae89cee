"""SparseTensor, formats, conversions, the eager einsum and its op table (README.md)."""
