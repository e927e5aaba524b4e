"""Custom kernels as PyTorch ops: `torchbridge.kernel` (JAX or Pallas functions) and the shipped kernels.

See docs/kernels.md. `kernel` is the decorator; the shipped kernels (fused RMSNorm + residual,
rotary embedding, SwiGLU, paged-attention decode) live one per module here, each with its jnp
reference, and the engine calls them on the bridge device.
"""

from torchbridge.kernels.jax_op import KernelError
from torchbridge.kernels.kernel import Kernel, kernel

__all__ = ["Kernel", "KernelError", "kernel"]
