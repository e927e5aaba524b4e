"""The device's c10d backend: a `torch.distributed.ProcessGroup` whose collectives on device tensors
are XLA collectives (collectives.py) over the group's mesh (mesh.py), and on CPU tensors gloo's.

c10d hands a Python ProcessGroup's methods the same arguments it hands a C++ backend (lists of
tensors and an options struct) and uses the returned Work. Device tensors are read as flat buffers
and written back through the buffer table (device/buffers.py), so a collective on a view (a DDP
bucket slice, an FSDP shard) is visible through every view of its storage. Every Work is complete
when returned: the result buffers are JAX futures, and any later op that reads them waits for them,
as a later kernel on CUDA's stream would. c10d's own errors for bad input (size mismatches, a rank
outside the group) are raised before any program runs, so a bad call never leaves peers waiting in a
collective program.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist

from torchbridge.device import buffers
from torchbridge.device.registration import skip_dynamo
from torchbridge.device.runtime import STATE
from torchbridge.distributed import collectives
from torchbridge.distributed.mesh import GroupDevices

C10D = torch._C._distributed_c10d
_world_devices: GroupDevices | None = None
_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PREMUL_SUM: "premul_sum",
    dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}


def _op(reduce_op: Any) -> tuple[str, float | None]:
    name = _OPS.get(reduce_op if isinstance(reduce_op, dist.ReduceOp.RedOpType) else reduce_op.op)
    if name is None:
        raise ValueError(f"torchbridge: unsupported reduce op {reduce_op}")
    factor = None
    if name == "premul_sum":
        factor = reduce_op.factor
        factor = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return name, factor


def _done(result: Any) -> Any:
    fut = torch.futures.Future()
    fut.set_result(result)
    return C10D._create_work_from_future(fut)


def _finished(work: Any, outputs: Any) -> Any:
    """A gloo collective on CPU tensors, waited for here: c10d's functional collectives read the outputs of
    a Python process group's Work without waiting on it (CPU all_gathers through them gave garbage). The
    finished Work carries `outputs`, as the device path's does: gloo's `result()` is missing for some."""
    work.wait()
    return _done(outputs)


def _on_device(tensors: list[torch.Tensor]) -> bool:
    kinds = {t.device.type for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"torchbridge: a collective's tensors must be on one device type, got {sorted(kinds)}")
    return kinds == {STATE.name}


class DeviceProcessGroup(dist.ProcessGroup):
    """c10d process group for the bridge device (and gloo for CPU tensors)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, group_ranks: list[int] | None) -> None:
        super().__init__(rank, size)
        from torchbridge.distributed import runtime

        runtime.start(store, rank, size, timeout)  # the first group is the world: JAX's runtime starts here
        global _world_devices
        # the group init_process_group creates (no default group exists yet) is the world: a process
        # may destroy its world and start another one (two in-process training runs)
        if _world_devices is None or not dist.is_initialized():
            _world_devices = self._devices = GroupDevices(store, rank, size)
        else:
            self._devices = GroupDevices(store, rank, size, _world_devices, dist.get_rank())
        self._gloo = _gloo_group(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._group_ranks = group_ranks
        self._name = ""
        self._p2p: list[tuple[int, int, torch.Tensor]] = []
        self._host = host_transport()

    # ---- identity ------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return "torchbridge"

    def name(self) -> str:
        return "torchbridge"

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def global_ranks(self) -> list[int]:
        return self._group_ranks if self._group_ranks is not None else list(range(self.size()))

    def claim(self, device: Any) -> GroupDevices:
        """This rank computes on `device` in this group; the group's device table."""
        self._devices.claim(device)
        return self._devices

    # ---- helpers -------------------------------------------------------------------------------
    def _mesh(self, tensors: list[torch.Tensor]) -> Any:
        if self._p2p:  # transfers queued before this collective go first, in program order
            self._flush_p2p()
        devices = {buffers.jax_device(t) for t in tensors}
        if len(devices) != 1:
            raise ValueError("torchbridge: a collective's device tensors must all be on one device")
        self._devices.claim(devices.pop())
        return self._devices.mesh()

    # ---- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if not _on_device(tensors):
            return _finished(self._gloo.allreduce(tensors, opts or dist.AllreduceOptions()), tensors)
        op, factor = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        mesh = self._mesh(tensors)
        for t in tensors:
            buffers.write_flat(t, collectives.all_reduce(mesh, buffers.flat_value(t), op, factor))
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if not _on_device(tensors):
            work = self._gloo.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())
            return _finished(work, tensors)
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if not _on_device(tensors):
            return _finished(self._gloo.reduce(tensors, opts), tensors)
        op, factor = _op(opts.reduceOp)
        mesh = self._mesh(tensors)
        for t in tensors:
            out = collectives.all_reduce(mesh, buffers.flat_value(t), op, factor)
            if self.rank() == opts.rootRank:
                buffers.write_flat(t, out)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if not _on_device(tensors):
            return _finished(self._gloo.broadcast(tensors, opts), tensors)
        mesh = self._mesh(tensors)
        for t in tensors:
            buffers.write_flat(t, collectives.broadcast(mesh, buffers.flat_value(t), opts.rootRank))
        return _done(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        if not _on_device(inputs + [t for outs in output_lists for t in outs]):
            work = self._gloo.allgather(output_lists, inputs, opts or dist.AllgatherOptions())
            return _finished(work, output_lists)
        mesh = self._mesh(inputs)
        for outs, t in zip(output_lists, inputs, strict=True):
            self._check_list(outs, t, "all_gather")
            gathered = collectives.all_gather(mesh, buffers.flat_value(t))
            n = t.numel()
            for i, o in enumerate(outs):
                buffers.write_flat(o, gathered[i * n:(i + 1) * n])
        return _done(output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if not _on_device([output, input]):
            return _finished(self._gloo._allgather_base(output, input, opts or dist.AllgatherOptions()), [output])
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"torchbridge: all_gather_into_tensor: output has {output.numel()} elements, expected "
                             f"{self.size()} x {input.numel()} (group size x input)")
        buffers.write_flat(output, collectives.all_gather(self._mesh([input]), buffers.flat_value(input)))
        return _done([output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs, strict=True):
            self._allgather_base(o, i, opts)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        if not _on_device(outputs + [t for ins in input_lists for t in ins]):
            return _finished(self._gloo.reduce_scatter(outputs, input_lists, opts), outputs)
        op, factor = _op(opts.reduceOp)
        mesh = self._mesh(outputs)
        for o, ins in zip(outputs, input_lists, strict=True):
            self._check_list(ins, o, "reduce_scatter")
            flat = jnp.concatenate([buffers.flat_value(t) for t in ins])
            buffers.write_flat(o, collectives.reduce_scatter(mesh, flat, op, factor))
        return _done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        if not _on_device([output, input]):
            return _finished(self._gloo._reduce_scatter_base(output, input, opts), [output])
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"torchbridge: reduce_scatter_tensor: input has {input.numel()} elements, expected "
                             f"{self.size()} x {output.numel()} (group size x output)")
        op, factor = _op(opts.reduceOp)
        out = collectives.reduce_scatter(self._mesh([input]), buffers.flat_value(input), op, factor)
        buffers.write_flat(output, out)
        return _done([output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Any:
        for o, i in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(o, i, opts)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any = None) -> Any:
        if not _on_device([output, input]):
            work = self._gloo.alltoall_base(output, input, output_splits, input_splits, opts or dist.AllToAllOptions())
            return _finished(work, [output])
        mesh = self._mesh([input])
        size = self.size()
        row = input.numel() // max(input.shape[0], 1) if input.dim() else 1
        if not input_splits and not output_splits:
            if input.numel() % size or output.numel() != input.numel():
                raise ValueError(f"torchbridge: all_to_all_single: {input.numel()} input elements do not split "
                                 f"evenly over {size} ranks into an output of {output.numel()}")
            buffers.write_flat(output, collectives.all_to_all(mesh, buffers.flat_value(input)))
            return _done([output])
        in_rows = list(input_splits) or [input.shape[0] // size] * size
        out_rows = list(output_splits) or [output.shape[0] // size] * size
        if sum(in_rows) != input.shape[0] or sum(out_rows) != output.shape[0] or len(in_rows) != size:
            raise ValueError(f"torchbridge: all_to_all_single: split sizes {in_rows} / {out_rows} do not match "
                             f"input rows {input.shape[0]} / output rows {output.shape[0]} over {size} ranks")
        # Uneven splits: every block padded to the largest block any rank sends (one small all_gather
        # of the split sizes first), one all_to_all, then each received block cut to its true length.
        sizes = jnp.asarray(in_rows, jnp.int64)
        all_rows = collectives.all_gather(mesh, jax.device_put(sizes, buffers.jax_device(input)))
        width = int(jnp.max(all_rows)) * row
        flat = buffers.flat_value(input)
        starts = [0]
        for r in in_rows:
            starts.append(starts[-1] + r * row)
        padded = jnp.concatenate([jnp.pad(flat[starts[j]:starts[j + 1]], (0, width - in_rows[j] * row))
                                  for j in range(size)]) if width else flat[:0]
        received = collectives.all_to_all(mesh, padded) if width else padded
        out = jnp.concatenate([received[i * width:i * width + out_rows[i] * row] for i in range(size)])
        buffers.write_flat(output, out)
        return _done([output])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        if not _on_device(inputs + outputs):
            return _finished(self._gloo.alltoall(outputs, inputs, opts or dist.AllToAllOptions()), outputs)
        mesh = self._mesh(inputs)
        numels = {t.numel() for t in inputs} | {t.numel() for t in outputs}
        if len(numels) == 1:
            out = collectives.all_to_all(mesh, jnp.concatenate([buffers.flat_value(t) for t in inputs]))
            n = numels.pop()
            for i, o in enumerate(outputs):
                buffers.write_flat(o, out[i * n:(i + 1) * n])
            return _done(outputs)
        # uneven blocks: the same padding scheme as all_to_all_single, over flat blocks
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype, device=outputs[0].device)
        self.alltoall_base(flat_out, flat_in, [o.numel() for o in outputs], [t.numel() for t in inputs], opts)
        for o, part in zip(outputs, flat_out.split([o.numel() for o in outputs]), strict=True):
            o.copy_(part.view(o.shape))
        return _done(outputs)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        if not _on_device(outputs + [t for ins in input_lists for t in ins]):
            return _finished(self._gloo.scatter(outputs, input_lists, opts), outputs)
        mesh = self._mesh(outputs)
        out = outputs[0]
        if self.rank() == opts.rootRank:
            self._check_list(input_lists[0], out, "scatter")
            flat = jnp.concatenate([buffers.flat_value(t) for t in input_lists[0]])
        else:
            flat = jnp.zeros((out.numel() * self.size(),), buffers.flat_value(out).dtype, device=buffers.jax_device(out))
        # block j of the root goes to rank j; everyone else sends zeros that are never kept
        got = collectives.all_to_all(mesh, flat)
        n = out.numel()
        buffers.write_flat(out, got[opts.rootRank * n:(opts.rootRank + 1) * n])
        return _done(outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        if not _on_device(inputs + [t for outs in output_lists for t in outs]):
            return _finished(self._gloo.gather(output_lists, inputs, opts), output_lists)
        mesh = self._mesh(inputs)
        t = inputs[0]
        gathered = collectives.all_gather(mesh, buffers.flat_value(t))
        if self.rank() == opts.rootRank:
            self._check_list(output_lists[0], t, "gather")
            n = t.numel()
            for i, o in enumerate(output_lists[0]):
                buffers.write_flat(o, gathered[i * n:(i + 1) * n])
        return _done(output_lists[0] if output_lists else [])

    # ---- point to point ----------------------------------------------------------------------
    # A transfer is a program both ends run (a ppermute over their two chips), and a chip runs its
    # collective programs in the order they were dispatched. isend/irecv are therefore queued and
    # dispatched when one of their Works is waited on (or before the group's next collective), in one
    # order every rank agrees on: by the (lower, higher) rank pair. Then the globally first pending
    # transfer always has both ends ready, so a ring of isend/irecv cannot deadlock.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        if not _on_device(tensors):
            return self._gloo.send(tensors, dst, tag)
        return self._queue_p2p(tensors, self.rank(), dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        if not _on_device(tensors):
            return self._gloo.recv(tensors, src, tag)
        return self._queue_p2p(tensors, src, self.rank())

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        if not _on_device(tensors):
            return self._gloo.recv_anysource(tensors, tag)
        raise RuntimeError("torchbridge: recv without a source rank is not supported on the device (XLA's "
                           "point-to-point transfers pair both ends statically); pass src=")

    def _queue_p2p(self, tensors: list[torch.Tensor], src: int, dst: int) -> Any:
        if src == dst:
            raise ValueError(f"torchbridge: rank {src} cannot send to itself")
        self._devices.claim(buffers.jax_device(tensors[0]))
        self._p2p.extend((src, dst, t) for t in tensors)
        return C10D.PythonCallbackWork(lambda timeout: self._flush_p2p() or True)

    def _flush_p2p(self) -> None:
        pending, self._p2p = self._p2p, []
        for src, dst, t in sorted(pending, key=lambda p: (min(p[0], p[1]), max(p[0], p[1]), p[0])):
            got = collectives.permute(self._devices.mesh((src, dst)), buffers.flat_value(t), ((0, 1),))
            if self.rank() == dst:
                buffers.write_flat(t, got)

    # c10d's coalescing manager with a device (batch_isend_irecv on NCCL-style backends) brackets
    # the ops with these; queued transfers go out at the end, collectives run as they come.
    def _start_coalescing(self, device: torch.device) -> None:
        self._flush_p2p()

    def _end_coalescing(self, device: torch.device) -> Any:
        self._flush_p2p()
        return _done([])

    # ---- synchronisation -----------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> Any:
        self._flush_p2p()
        return self._gloo.barrier(opts or dist.BarrierOptions())

    def _check_list(self, tensors: list[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(tensors) != self.size():
            raise ValueError(f"torchbridge: {what}: expected a list of {self.size()} tensors (the group size), "
                             f"got {len(tensors)}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(f"torchbridge: {what}: every tensor must match {tuple(like.shape)} {like.dtype}, "
                                 f"got {tuple(t.shape)} {t.dtype}")


def _gloo_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """gloo for CPU tensors, on the interface that reaches the other ranks (as JAX's transport is; c10d's
    default binds to the host name's address, which another host may not reach). GLOO_SOCKET_IFNAME,
    if set, decides as it does for c10d."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return C10D.ProcessGroupGloo(store, rank, size, timeout)
    from torchbridge.distributed import runtime

    opts = C10D.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [C10D.ProcessGroupGloo.create_device(hostname=runtime.local_address(store))]
    return C10D.ProcessGroupGloo(store, rank, size, opts)


def create(options: Any, backend_options: Any = None) -> DeviceProcessGroup:
    """c10d's creator function (extended API): one DeviceProcessGroup per group."""
    return DeviceProcessGroup(options.store, options.group_rank, options.group_size, options.timeout,
                              list(options.global_ranks_in_group))


# c10d calls these from C++, also in the eager part of a compiled region (DDP's reducer broadcasting
# buckets): Dynamo must run them, not trace them.
skip_dynamo(*(fn for fn in vars(DeviceProcessGroup).values() if callable(fn) and hasattr(fn, "__code__")))


# ---- TORCHBRIDGE_COLLECTIVES=host: device tensors through gloo on host copies -------------------------
# Not the default (the default is XLA collectives, which on TPU run over ICI): a switch for JAX's CPU
# platform, where XLA's gloo transport is slower than PyTorch's (docs/benchmarks/distributed.md). Each
# collective copies its device tensors to the host, runs PyTorch's gloo, and copies them back.
_GLOO_NAMES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
               "all_to_all_single": "alltoall_base"}
_HOSTED = ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
           "all_gather_single", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "alltoall_base",
           "all_to_all_single", "alltoall", "scatter", "gather", "send", "recv")


def host_transport() -> bool:
    return os.environ.get("TORCHBRIDGE_COLLECTIVES", "xla") == "host"


def _through_host(method: Any, name: str) -> Any:
    gloo_name = _GLOO_NAMES.get(name, name)

    def run(self: DeviceProcessGroup, *args: Any) -> Any:
        tensors = _tensors(args)
        if not self._host or not _on_device(tensors) or _needs_xla(name, args):
            return method(self, *args)
        self._mesh(tensors)  # the same one-device-per-rank check as the default transport
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_host(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.device.type == STATE.name:
                pairs.append((x, x.cpu()))
                return pairs[-1][1]
            return [to_host(v) for v in x] if isinstance(x, list) else x

        host_args = [to_host(a) for a in args]
        if not pairs:
            return method(self, *args)
        work = getattr(self._gloo, gloo_name)(*host_args)

        def finish(timeout: Any = None) -> bool:
            work.wait()
            with torch.no_grad():
                for dev, host in pairs:
                    dev.copy_(host)
            return True

        if name in ("send", "recv"):  # a transfer completes when both ends are posted: on wait()
            return C10D.PythonCallbackWork(finish)
        finish()
        return _done([dev for dev, _ in pairs])

    run.__name__ = run.__qualname__ = name
    return run


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


def _needs_xla(name: str, args: tuple) -> bool:
    """What PyTorch's gloo cannot do stays on XLA's collectives: PREMUL_SUM, all_to_all of uneven tensors."""
    op = getattr(args[-1], "reduceOp", None) if args else None
    if op is not None and (op if isinstance(op, dist.ReduceOp.RedOpType) else op.op) == dist.ReduceOp.PREMUL_SUM:
        return True
    return name == "alltoall" and len({t.numel() for t in _tensors(args)}) > 1


for _name in _HOSTED:
    setattr(DeviceProcessGroup, _name, _through_host(vars(DeviceProcessGroup)[_name], _name))
skip_dynamo(*(getattr(DeviceProcessGroup, n) for n in _HOSTED))
