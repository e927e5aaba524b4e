"""Replaying a compiled call with new host inputs, without Dynamo's guards or the backend's argument walk.

A serving engine calls its compiled step thousands of times per shape bucket with the same weights and
KV caches (device tensors) and new index tensors from the host. Each call through `torch.compile`
evaluates Dynamo's guards, runs AOTAutograd's wrapper, and walks every argument to find its buffer and
layout (a single-user decode step of the bundled model on the CPU platform: ~1.5 ms of host work before
a ~0.35 ms executable call, in a ~4.5 ms step). A `Replay`, captured from one such call, keeps what the
walk found and repeats the call: the device tensors' current buffers (re-read from the buffer table
every time: the KV caches are written, and donated, by every step), the new host inputs, the same
executable and donation, the outputs made device tensors as the backend makes them. The role of CUDA
graph replay in vLLM's GPU runner, and of vLLM's custom dispatcher that skips Dynamo's guards on TPU.

What it does not re-check is what Dynamo's guards would: the caller answers for calling it only where
the captured call is still the right one (the engine keys replays by its step's shape bucket and keeps
its model and caches for its lifetime). Each replay does check what is cheap and would otherwise give
wrong results: every host input's shape and dtype, every device buffer's dtype and size, and the host
calls' switches the program was built for; on any difference it returns None (the caller then takes the
full path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchbridge.compile import backend
from torchbridge.device import dtypes, host_calls
from torchbridge.device.runtime import STATE


class Capture:
    """The compiled graph calls made inside `capture()`."""

    def __init__(self) -> None:
        self.calls: list[backend.Call] = []

    def replay(self, sources: Sequence[torch.Tensor]) -> Replay | None:
        """A Replay of the captured call, taking its host inputs from `sources` (the caller's host
        tensors, in the caller's order; each host argument of the call must be exactly one of them), or
        None where the capture cannot be replayed: not one graph call (a graph break), collectives,
        random numbers, padded sizes, a write to a host tensor, a host argument not among `sources`."""
        if len(self.calls) != 1 or not self.calls[0].plain:
            return None
        return Replay.of(self.calls[0], sources)


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """Record the compiled graph calls made inside the block (they run as usual)."""
    cap = Capture()
    token = backend._CAPTURE.set(cap.calls)
    try:
        yield cap
    finally:
        backend._CAPTURE.reset(token)


class Replay:
    """One compiled graph call, repeatable with new host inputs (see the module's docstring)."""

    def __init__(self, call: backend.Call, device_args: list[tuple[int, int, Any, Any, Any, int]],
                 host_args: list[tuple[int, tuple[int, ...], torch.dtype]]) -> None:
        self._call = call
        self._device_args = device_args  # per device buffer: (storage key, bytes, dtype, jax device, buffer dtype, size)
        self._host_args = host_args  # per host argument, in call order: (index in sources, shape, dtype)
        self.replays = 0
        self._picks: list[int] | None = None  # the buffers that may be donated (GraphProgram._donation_picks)

    @staticmethod
    def of(call: backend.Call, sources: Sequence[torch.Tensor]) -> Replay | None:
        program = call.program
        if any(i not in call.slot for i in program.writes):
            return None  # (a host tensor written by the graph: copied back by the full path only)
        if any(m is not None and m[0] in ("arg", "alias", "sym") for m in call.out_meta):
            return None  # (outputs that are views of inputs, or sizes: not a step's, left to the full path)
        by_address: dict[int, list[int]] = {}
        for j, t in enumerate(sources):
            by_address.setdefault(t.data_ptr(), []).append(j)
        device_args, host_args = [], []
        for a, desc in zip(call.args, call.descs, strict=True):
            if desc[0] == "d":
                storage = a.untyped_storage()
                _, _, jdt, buf_dtype, size, nbytes = desc
                device_args.append((storage.data_ptr(), nbytes, jdt, STATE.jax_device(a.device.index or 0),
                                    buf_dtype, size))
            elif desc[0] == "h":
                found = [j for j in by_address.get(a.data_ptr(), ()) if sources[j].shape == a.shape
                         and sources[j].dtype == a.dtype and sources[j].stride() == a.stride()]
                if len(found) != 1:
                    return None  # not one of the caller's inputs, or not only one
                host_args.append((found[0], tuple(a.shape), a.dtype))
        return Replay(call, device_args, host_args)

    def __call__(self, sources: Sequence[torch.Tensor], host_outputs: bool = False) -> list | None:
        """The graph's outputs for the host inputs `sources` (same order as at capture), or None where
        the captured call no longer fits (nothing has run then). `host_outputs`: its tensor outputs as CPU
        tensors (waiting for the program), for a caller that would copy them to the host at once: the
        device tensors and the copy back through the device's copy op cost ~0.3 ms per engine step."""
        if host_outputs:
            launched = self.launch(sources)
            return None if launched is None else launched.result()
        flat_out = self._dispatch(sources)
        if flat_out is None:
            return None
        call = self._call
        return call.program._results(flat_out, call.out_meta, call.args, call.device, call.true)

    def launch(self, sources: Sequence[torch.Tensor]) -> Launched | None:
        """Start the call without waiting for it (JAX dispatches asynchronously): the caller does host work
        while the program runs and takes the outputs, as CPU tensors, from `result()`. None where the
        captured call no longer fits (nothing has run then)."""
        staged = self.stage(sources)
        return None if staged is None else staged.launch()

    def stage(self, sources: Sequence[torch.Tensor]) -> Staged | None:
        """Everything of a launch but the executable's call: the checks, the host inputs as arrays that
        share the sources' memory (the caller may still write them in place until `launch()`, and must not
        after), the device buffers as they are now (those of calls launched before: the device runs calls
        in order). None where the captured call no longer fits."""
        return self._stage(sources, copy=False)

    def _dispatch(self, sources: Sequence[torch.Tensor]) -> Any:
        staged = self._stage(sources, copy=True)
        return None if staged is None else staged.run()

    def _stage(self, sources: Sequence[torch.Tensor], copy: bool) -> Staged | None:
        call = self._call
        if host_calls.switches() != call.switches:
            return None
        hosts = []
        for j, shape, dtype in self._host_args:
            t = sources[j]
            if t.shape != shape or t.dtype != dtype or t.device.type != "cpu":
                return None
            hosts.append(dtypes.host_to_numpy(t, copy))
        table = STATE.table
        table.drain()
        bufs = []
        for key, nbytes, jdt, jdev, buf_dtype, size in self._device_args:
            buf = table.get_or_zeros(key, nbytes, jdt, jdev)
            if buf.dtype != buf_dtype or buf.shape[0] != size:
                return None
            bufs.append(buf)
        if call.program.writes and self._picks is None:
            # (by sizes and dtypes, which every replay has checked are the captured ones)
            self._picks = call.program._donation_picks(call.args, bufs, call.slot)
        return Staged(self, hosts, bufs, sources)


class Staged:
    """A replay checked and gathered, not yet called (`Replay.stage`)."""

    def __init__(self, replay: Replay, hosts: list, bufs: list, sources: Sequence[torch.Tensor]) -> None:
        self._replay, self._hosts, self._bufs, self._sources = replay, hosts, bufs, sources

    def launch(self) -> Launched:
        return Launched(self.run(), self._replay._call.out_meta, self._sources)

    def run(self) -> Any:
        rep, call = self._replay, self._replay._call
        # (donation counts the references to each buffer: this object lets go of its list first)
        bufs, hosts, self._bufs, self._hosts = self._bufs, self._hosts, None, None
        program, dev = call.program, call.device.index or 0
        if program.writes:
            flat_out = program._call_writing(call.fn, call.args, bufs, call.slot, hosts, call.consts, None, dev, None,
                                             rep._picks)
        else:
            flat_out = backend._call_recycling(call.fn, (tuple(bufs), tuple(hosts), tuple(call.consts), None))
            STATE.last_results[dev] = flat_out
        rep.replays += 1
        backend.compile_counter["replayed_calls"] += 1
        return flat_out


class Launched:
    """A replayed call in flight; `result()` waits for it (once)."""

    def __init__(self, flat_out: Any, out_meta: list, sources: Sequence[torch.Tensor]) -> None:
        self._flat_out = flat_out
        self._out_meta = out_meta
        self._sources = sources  # (the host inputs stay alive until the program has read them)

    def result(self) -> list:
        out = _host_results(self._flat_out, self._out_meta)
        self._flat_out = self._sources = None
        return out


def _host_results(flat_out: Any, out_meta: list) -> list:
    """The program's tensor outputs as CPU tensors (each a copy), constants as they are."""
    results: list[Any] = []
    it = iter(flat_out)
    for m in out_meta:
        if m is None or m[0] != "t":
            results.append(None if m is None else m[1])  # (a "const"; Replay.of refused views and sizes)
            continue
        _, shape, stride, dt, _ = m
        flat = np.asarray(next(it))  # JAX's CPU buffers are host memory: waits for the program, no copy
        view = np.lib.stride_tricks.as_strided(flat, shape=shape, strides=tuple(s * flat.dtype.itemsize for s in stride))
        results.append(dtypes.numpy_to_host(view, dt))
    return results
