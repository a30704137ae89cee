"""The torch.compile backend, its passes and TorchScript rewriting (README.md)."""
