"""Importing this package fills the lowering table (see registry.py)."""

from torchbridge.device.lowerings import core  # noqa: F401
