"""torch.compile's DEFAULT backend, and FlexAttention, on the device's tensors.

Code written for CUDA calls `torch.compile(fn)` without naming a backend: TorchTitan compiles
`flex_attention` and `create_block_mask` that way, and its `--compile.enable` compiles every block with
backend "inductor". PyTorch 2.13's Inductor claims a device "tpu" itself, generating Pallas code for a
TorchTPU runtime that does not exist here, so such a graph on this device would fail. `install()` makes
Inductor's entry (`torch._TorchCompileInductorWrapper.__call__`, what both spellings reach) hand exactly
the graphs that touch the device (an input, or a value computed inside) to the bridge's backend; every
other graph goes to Inductor unchanged. Inductor's options (max_autotune, ...) do not apply to the
bridge's backend and are ignored. `TORCHBRIDGE_ROUTE_INDUCTOR=0` leaves Inductor alone.

FlexAttention's entry point also checks the device type against a fixed list ("TODO: Remove once non
cuda/cpu devices support is added", torch/nn/attention/flex_attention.py, `_validate_device`), so the
device is let through there and every other device still gets PyTorch's own check. Its higher-order
ops then run eagerly through PyTorch's dense implementation on device ops, and compiled through
compile/flex.py.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_ROUTED = "_torchbridge_routes"


def enabled() -> bool:
    return os.environ.get("TORCHBRIDGE_ROUTE_INDUCTOR", "1") != "0"


def touches(gm: torch.fx.GraphModule, inputs: list, device_type: str) -> bool:
    """Whether a graph Dynamo captured reads or makes a tensor of `device_type`."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.device.type == device_type:
            return True
    for node in gm.graph.nodes:
        for key in ("example_value", "val"):
            value = node.meta.get(key)
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, torch.Tensor) and v.device.type == device_type for v in values):
                return True
    return False


def install(device_type: str) -> None:
    """Route Inductor's graphs on `device_type` to the bridge's backend (idempotent)."""
    wrapper = torch._TorchCompileInductorWrapper
    inductor_call = wrapper.__call__
    if getattr(inductor_call, _ROUTED, None) is not None:
        return

    def __call__(self: Any, model_: torch.fx.GraphModule, inputs_: list, *, config_patches: dict | None = None) -> Any:
        if enabled() and touches(model_, inputs_, device_type):
            from torchbridge.compile import backend

            backend.compile_counter["routed_from_inductor"] += 1
            return backend.tpu_backend(model_, inputs_)
        return inductor_call(self, model_, inputs_, config_patches=config_patches)

    setattr(__call__, _ROUTED, device_type)
    __call__.__doc__ = inductor_call.__doc__
    wrapper.__call__ = __call__
    _allow_flex_attention(device_type)


def _allow_flex_attention(device_type: str) -> None:
    from torch.nn.attention import flex_attention as fa

    check = fa._validate_device
    if getattr(check, _ROUTED, None) is not None:
        return

    def _validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != device_type:
            check(query, key, value)

    setattr(_validate_device, _ROUTED, device_type)
    fa._validate_device = _validate_device
