"""The MindSpore (PyNative) backend. Importing this package imports MindSpore."""

from ppswap.backends.mindspore.backend import MindSporeBackend, SwapWrapperCell

__all__ = ["BACKEND", "MindSporeBackend", "SwapWrapperCell"]

BACKEND = MindSporeBackend()
