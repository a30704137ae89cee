"""The Python faces of the C++ ops scorch::kernel, scorch::region and scorch::masked_attention (README.md)."""
