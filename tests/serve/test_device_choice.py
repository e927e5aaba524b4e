"""The engine tells the bridge's device from others by asking torch, not by looking for our package."""

from __future__ import annotations

import torchbridge
from torchbridge.serve.config import _is_bridge_device

DEV = torchbridge.device_name()


def test_the_bridge_device_is_the_privateuse1_backend_with_our_device_module() -> None:
    assert _is_bridge_device(DEV) and _is_bridge_device(f"{DEV}:1")
    assert not _is_bridge_device("cpu") and not _is_bridge_device("meta") and not _is_bridge_device("cuda:0")
