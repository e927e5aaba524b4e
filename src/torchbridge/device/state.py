"""Deprecated name of torchbridge.device.runtime (the process's device runtime, `STATE`)."""

from torchbridge.device._deprecated import forward

__getattr__ = forward(__name__, "torchbridge.device.runtime")
