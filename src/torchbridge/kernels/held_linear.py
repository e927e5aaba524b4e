"""A linear layer by a weight the serving engine's kernel library holds, as a torch op on the device.

The engine on the bridge's device over JAX's CPU platform hands each 16-bit linear's weight, pre-packed
for oneDNN, to its kernel library (serve/cpu_kernels.py `hold_packed_weight`) and calls this op with the
key it got back: inside the compiled step the product is a custom call into oneDNN's 16-bit GEMM
(device/host_calls.py `held_linear`) instead of XLA:CPU's dot, which multiplies 16-bit floats in float32.
The key is a static argument: a program names its weights by it, and a key is derived from the weight's
bytes, so a program from the persistent compile cache finds the same layer in a new process.
"""

from __future__ import annotations

import jax

from torchbridge.device import host_calls
from torchbridge.kernels.kernel import kernel


@kernel("torchbridge::held_linear", static_argnames=("key", "out_features"))
def held_linear(x: jax.Array, key: int, out_features: int) -> jax.Array:
    """x [..., in] @ W.T + b for the weight held under `key`; [..., out_features]."""
    rows = x.reshape(-1, x.shape[-1])
    return host_calls.held_linear(rows, key, out_features).reshape(*x.shape[:-1], out_features)
