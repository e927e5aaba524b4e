"""torchbridge: PyTorch on XLA through JAX, an LLM engine, and a cache-aware router.

`import torchbridge` registers the device backend (default name `tpu`, renamed with
TORCHBRIDGE_DEVICE_NAME). The engine (`torchbridge.serve`) and the router (`torchbridge.route`) do not
need the backend; if it cannot load (no compiler, no jax) they still work and the error is kept for
the first use of the device.
"""

from __future__ import annotations

__version__ = "0.1.0"

from torchbridge._register import device_name, registration_error  # noqa: E402

__all__ = ["__version__", "device_name", "registration_error"]
