"""torchbridge: PyTorch on XLA through JAX, an LLM engine, and a cache-aware router.

The device backend (default name `tpu`, renamed with TORCHBRIDGE_DEVICE_NAME) registers itself when
`import torch` runs, through PyTorch's `torch.backends` autoload entry point (see _register.py);
importing this package imports neither torch nor jax. The engine (`torchbridge.serve`) and the router
(`torchbridge.route`) do not need the backend; if it cannot load (no compiler, no jax) they still
work and the error is kept for the first use of the device (`torchbridge.registration_error()`).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from torchbridge._register import device_name, register, registration_error  # noqa: E402


def metrics() -> dict[str, Any]:
    """Eager-mode counters: compiled programs in the cache, compiles (total and per op), CPU fallbacks."""
    from torchbridge.device import metrics as device_metrics

    return device_metrics.metrics()


def set_cpu_fallback(enabled: bool) -> None:
    """Run ops that have no device lowering on the CPU (off by default; warns once per op)."""
    from torchbridge.device import fallback

    fallback.set_cpu_fallback(enabled)


def set_eager_mode(mode: str) -> None:
    """'eager': one cached executable per op (default). 'fused': ops are recorded and each recorded
    sequence runs as one cached executable, flushed when a value is read (.item(), .cpu(), print),
    on synchronize(), and at a size bound (TORCHBRIDGE_FUSED_MAX_OPS). Also TORCHBRIDGE_EAGER_MODE."""
    from torchbridge.device import eager_mode

    eager_mode.set_mode(mode)


def set_matmul_precision(precision: str) -> None:
    """float32 matmul/conv precision on the device, like TorchTPU's switch.

    "default": the platform's fastest (on TPU, bfloat16 passes; on CPU and GPU, full float32);
    "high": three bfloat16 passes on TPU; "highest": full float32 everywhere. Programs compiled before
    the switch are dropped so the next call recompiles at the new precision.
    """
    import jax

    from torchbridge.device import dispatch

    if precision not in ("default", "high", "highest"):
        raise ValueError(f"torchbridge: precision must be 'default', 'high' or 'highest', not {precision!r}")
    jax.config.update("jax_default_matmul_precision", None if precision == "default" else precision)
    dispatch.clear_cache()


def __getattr__(name: str) -> Any:
    # `torchbridge.kernel` imports the kernels package (and so JAX and the lowering table) on first use only.
    if name in ("kernel", "kernels"):
        import torchbridge.kernels as kernels

        return kernels.kernel if name == "kernel" else kernels
    raise AttributeError(f"module 'torchbridge' has no attribute '{name}'")


__all__ = ["__version__", "device_name", "metrics", "register", "registration_error", "set_cpu_fallback", "set_eager_mode",
           "set_matmul_precision"]
