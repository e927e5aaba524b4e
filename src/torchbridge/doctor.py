"""`python -m torchbridge doctor`: what this machine gives the backend."""

from __future__ import annotations

import platform


def main(argv: list[str] | None = None) -> int:
    import jax
    import torch

    import torchbridge

    name = torchbridge.device_name()
    print(f"python      {platform.python_version()}")
    print(f"torch       {torch.__version__}")
    print(f"jax         {jax.__version__} (default backend: {jax.default_backend()})")
    err = torchbridge.registration_error()
    if err is not None:
        print(f"device      NOT registered: {err}")
        return 1
    mod = getattr(torch, name)
    print(f"device      {name}: {mod.device_count()} x {mod.get_device_name(0)}")
    x = torch.arange(6.0).reshape(2, 3)
    ok = torch.equal((x.to(name) * 2).cpu(), x * 2)
    from torchbridge.device import host_calls

    if host_calls.enabled():  # JAX's CPU platform: which GEMM this machine's products take
        probe = host_calls.gemm_probe()
        choice = "PyTorch's" if host_calls.gemm_enabled() else "XLA's"
        print(f"products    {choice} GEMM (measured: PyTorch {probe['torch_ms']:.2f} ms, XLA {probe['xla_ms']:.2f} ms"
              f" for {'x'.join(map(str, host_calls.GEMM_PROBE))}; TORCHBRIDGE_HOST_GEMM=1/0 forces)")
    from torchbridge import host_allocator

    kept = host_allocator.state() == "keep"
    print(f"host memory {'freed blocks kept for reuse' if kept else 'glibc defaults'} (TORCHBRIDGE_HOST_ALLOCATOR="
          f"{host_allocator.state()}; 'keep' saves training steps their page faults, see host_allocator.py)")
    print(f"smoke test  {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1
