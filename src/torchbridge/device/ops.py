"""Deprecated name of torchbridge.device.fallback (the PrivateUse1 fallback); values moved to
torchbridge.device.buffers and the counters to torchbridge.device.metrics."""

from torchbridge.device._deprecated import forward

__getattr__ = forward(__name__, "torchbridge.device.buffers", "torchbridge.device.metrics",
                      "torchbridge.device.fallback")
