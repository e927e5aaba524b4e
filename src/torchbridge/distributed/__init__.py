"""torch.distributed on the device: a c10d backend whose collectives are XLA collectives.

`import torch` registers it (see torchbridge/_register.py) as backend "torchbridge" for the device, so
under torchrun a plain `dist.init_process_group()` uses it for device tensors (and gloo for CPU
tensors), and `init_device_mesh("tpu", ...)`, DDP, FSDP2 and DTensor work as they do on CUDA.

  runtime.py        JAX's distributed runtime for the job (one process per chip)
  mesh.py           which chip each rank of a group computes on; the group's JAX mesh
  collectives.py    each collective a cached jitted shard_map program (psum, all_gather, ...)
  process_group.py  the c10d ProcessGroup: torch's collective API -> collectives.py
  lowerings.py      PyTorch's functional collectives inside compiled graphs (XLA collectives)
  spmd.py           the mesh a compiled graph with collectives runs on (one axis per process group)
"""

from __future__ import annotations

BACKEND = "torchbridge"
_registered = False


def register() -> None:
    """Make BACKEND a c10d backend and the device's default one (idempotent)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    from torchbridge.device.runtime import STATE
    from torchbridge.distributed import runtime

    if not dist.is_available():
        return
    from torchbridge.compile import spmd as compile_spmd
    from torchbridge.distributed import lowerings, spmd  # noqa: F401 - lowerings register themselves
    from torchbridge.distributed.process_group import create

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", STATE.name])
    if not hasattr(dist, "set_timeout"):
        # The public name later PyTorch releases give c10d's `_set_pg_timeout`; code written against them
        # (TorchTitan 0.3.0 calls it after its first step) finds it on 2.13 too. Only added, never replaced.
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    STATE.before_backend.append(runtime.on_backend_start)
    compile_spmd.set_planner(spmd.plan)
    _registered = True
