"""Deprecated name of torchbridge.device.registration (how the device registers with PyTorch)."""

from torchbridge.device._deprecated import forward

__getattr__ = forward(__name__, "torchbridge.device.registration")
