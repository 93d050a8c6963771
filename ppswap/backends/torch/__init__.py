"""The torch backend. Importing this package imports torch."""

from ppswap.backends.torch.backend import SwapWrapperModule, TorchBackend

__all__ = ["BACKEND", "SwapWrapperModule", "TorchBackend"]

BACKEND = TorchBackend()
