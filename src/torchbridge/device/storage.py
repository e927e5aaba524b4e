"""The buffer table: storage address -> immutable flat JAX array.

The C++ allocator hands every storage a unique fake address. This table maps that address to the
storage's current contents. In-place ops never mutate an XLA buffer: they compute a new one and swap
the entry, so every view of the storage (which reads through the table) sees the write, exactly as
on CPU. A storage without an entry has never been written and reads as zeros.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter, OrderedDict, deque
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torchbridge.device import fused, native
from torchbridge.device.views import bitcast_flat

_FREE, _RESIZE = 0, 1


class BufferTable:
    def __init__(self) -> None:
        self._buffers: dict[int, jax.Array] = {}
        self._native = native.load()

    def __len__(self) -> int:
        return len(self._buffers)

    def drain(self) -> None:
        """Apply queued frees and resizes from the allocator, oldest first."""
        events = self._native.drain_events()
        if not events:
            return
        for kind, a, b, nbytes in events:
            if kind == _FREE:
                buf = self._buffers.pop(a, None)
                _offer_spare(buf)
                buf = None
            elif kind == _RESIZE:
                # Only bytes that were written and survive the resize are carried over; a storage
                # grown from nothing needs no entry (it reads as zeros), which is FSDP2's case: it
                # frees each unsharded parameter with resize_(0) and regrows it before every all-gather.
                old = self.get(a)
                if old is None or not nbytes or not old.nbytes:
                    continue
                self._buffers[b] = old if old.nbytes == nbytes else _resize_bytes(old, nbytes)

    def flush(self) -> None:
        """Run what fused eager mode has recorded and put the concrete buffers in the table."""
        if fused.RECORDER.records:
            fused.RECORDER.flush(self._buffers)
        else:
            fused.RECORDER.restart()

    def get(self, key: int) -> jax.Array | None:
        buf = self._buffers.get(key)
        if isinstance(buf, fused.Pending):
            self.flush()
            buf = self._buffers.get(key)
        elif not fused.RECORDER.records:
            fused.RECORDER.restart()  # a read with nothing recorded (fused mode's size bound starts over)
        return buf

    def get_or_zeros(self, key: int, nbytes: int, dtype: jnp.dtype, device: jax.Device) -> jax.Array:
        buf = self.get(key)
        if buf is None:
            return self.get_or_zeros_lazy(key, nbytes, dtype, device)
        return buf

    def get_or_zeros_lazy(self, key: int, nbytes: int, dtype: jnp.dtype, device: jax.Device) -> Any:
        """Like get_or_zeros, but may return a fused-mode Pending (only dispatch.run records those)."""
        buf = self._buffers.get(key)
        if buf is None:
            itemsize = jnp.dtype(dtype).itemsize
            buf = zeros(nbytes // itemsize, dtype, device)
            self._buffers[key] = buf
        return buf

    def set(self, key: int, buf: jax.Array) -> None:
        self._buffers[key] = buf

    def replace(self, key: int, buf: jax.Array) -> None:
        """Set `key`'s buffer, the one it replaces kept as a spare if nothing else holds it (a collective
        written into its tensor in place: the next call of its shape writes into the old buffer)."""
        old = self._buffers.get(key)
        self._buffers[key] = buf
        _offer_spare(old)


_zero_cache: OrderedDict[tuple, jax.Array] = OrderedDict()
# Zero buffers up to ZERO_CACHE_MAX bytes each are kept, least recently used out past ZERO_CACHE_BYTES:
# creating one costs an allocation and a fill (~10 ms for the 32 MB zero gradient autograd gives a
# model's unused logits output, every training step). Larger ones (a KV pool) are made each time.
ZERO_CACHE_BYTES = 256 << 20
ZERO_CACHE_MAX = 64 << 20


def zeros(count: int, dtype: jnp.dtype, device: jax.Device) -> jax.Array:
    # Immutable, so one zero buffer per (size, dtype, device) can back any number of fresh storages
    # (and a cached one is never donated: the cache holds a reference).
    key = (count, jnp.dtype(dtype), device)
    buf = _zero_cache.get(key)
    if buf is not None:
        _zero_cache.move_to_end(key)
        return buf
    buf = jax.device_put(np.zeros((count,), dtype=dtype), device)
    if buf.nbytes <= ZERO_CACHE_MAX:
        _zero_cache[key] = buf
        total = sum(b.nbytes for b in _zero_cache.values())
        while total > ZERO_CACHE_BYTES:
            _, old = _zero_cache.popitem(last=False)
            total -= old.nbytes
    return buf


def clear_zero_cache() -> None:
    _zero_cache.clear()


@jax.jit(static_argnums=(1,))
def _resize_bytes_jit(buf: jax.Array, nbytes: int) -> jax.Array:
    return bitcast_flat(buf, jnp.uint8, nbytes)


def _resize_bytes(buf: jax.Array, nbytes: int) -> jax.Array:
    return _resize_bytes_jit(buf, nbytes)


# ---- spare buffers -------------------------------------------------------------------------------
# On JAX's CPU platform every program output is fresh memory from the C allocator, which maps a large
# block anew each time and pays a page fault per 4 KiB page on first write (a 51 MB embedding gradient:
# ~10-20 ms, more than the arithmetic; a caching allocator such as CUDA's avoids this). Freed large
# buffers that nothing else holds are kept here instead, and programs take them as donated inputs that
# XLA writes their fresh outputs of the same shape into (device/recycling.py: eager ops and compiled
# graphs; distributed/collectives.py). The pool is
# bounded; torch.<device>.empty_cache() drops it; TORCHBRIDGE_SPARE_BUFFERS=0 turns it off.
SPARE_MIN_BYTES = 4 << 20


def _pool_bound() -> int:
    """TORCHBRIDGE_SPARE_POOL_BYTES, else a quarter of physical memory (at least 1 GiB). A training
    step frees its saved activations after the backward and the next forward writes the same shapes
    again: the pool has to hold them all (a hidden-768 Llama at 16 x 512 tokens saves 2.4 GiB) or the
    forward pays page faults for the rest. It only keeps what programs can take (SparePool.want),
    so it adds little to the peak: those buffers were live during the forward."""
    env = os.environ.get("TORCHBRIDGE_SPARE_POOL_BYTES")
    if env:
        return int(env)
    try:
        return max(1 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)
    except (ValueError, OSError):
        return 1 << 30


SPARE_POOL_BYTES = _pool_bound()


def spares_enabled(device: Any) -> bool:
    """For buffers on this jax device: JAX's CPU platform only (other platforms' allocators cache)."""
    return device.platform == "cpu" and os.environ.get("TORCHBRIDGE_SPARE_BUFFERS", "1") != "0"


class SparePool:
    """Freed large buffers by (shape, dtype, device). Eager ops of the backward run on autograd's device
    thread while the main thread may free or take buffers too: every method holds the pool's lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._free: dict[tuple, list[jax.Array]] = {}
        self._order: deque[tuple[tuple, jax.Array]] = deque()  # oldest first, for eviction
        self._wanted: Counter[tuple] = Counter()  # per key, how many outputs of it programs write
        self.nbytes = 0

    def want(self, keys: list[tuple]) -> None:
        """A program (eager, compiled or a collective) writes large outputs of these keys (repeats included):
        keep up to that many more spares of each. Buffers of other shapes are freed as before: held, they
        only kept the C allocator from reusing their memory (with every freed buffer kept up to a quarter
        of memory, eager and fused training steps ran 1.3x and 1.9x slower, measured)."""
        with self._lock:
            self._wanted.update(keys)

    @staticmethod
    def key(shape: tuple, dtype: Any, device: Any) -> tuple:
        return tuple(shape), jnp.dtype(dtype), device

    def put(self, buf: jax.Array) -> None:
        device = next(iter(buf.devices()))
        if not spares_enabled(device) or buf.is_deleted() or buf.nbytes > SPARE_POOL_BYTES:
            return
        key = self.key(buf.shape, buf.dtype, device)
        with self._lock:
            self._put(key, buf)

    def _put(self, key: tuple, buf: jax.Array) -> None:
        if len(self._free.get(key, ())) >= self._wanted[key]:
            return
        self._free.setdefault(key, []).append(buf)
        self._order.append((key, buf))
        self.nbytes += buf.nbytes
        while self.nbytes > SPARE_POOL_BYTES:
            old_key, old = self._order.popleft()
            self._free[old_key].remove(old)
            self.nbytes -= old.nbytes

    def available(self, keys: list[tuple]) -> tuple:
        """The keys among `keys` (in their order, repeats included) that a spare is there for."""
        with self._lock:
            left = {k: len(v) for k, v in self._free.items()}
        out = []
        for k in keys:
            if left.get(k, 0):
                left[k] -= 1
                out.append(k)
        return tuple(out)

    def take(self, keys: list[tuple]) -> list[jax.Array] | None:
        """One spare per key (keys may repeat), or None (nothing taken) where another thread took one of
        those `available` returned."""
        with self._lock:
            if self.available(keys) != tuple(keys):
                return None
            out = []
            for k in keys:
                buf = self._free[k].pop()
                for i, (_, b) in enumerate(self._order):
                    if b is buf:
                        del self._order[i]
                        break
                self.nbytes -= buf.nbytes
                out.append(buf)
            return out

    def bytes_on(self, device: Any) -> int:
        with self._lock:
            return sum(b.nbytes for (_, _, d), bufs in self._free.items() if d == device for b in bufs)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._order.clear()
            self.nbytes = 0


SPARES = SparePool()


def _offer_spare(buf: Any) -> None:
    """Keep `buf` as a spare when it is large and its caller's reference is the only one left (the table
    no longer holds it: a freed storage's buffer, or one a whole-tensor write replaced)."""
    # references: the caller's, this parameter and getrefcount's argument
    if isinstance(buf, jax.Array) and buf.nbytes >= SPARE_MIN_BYTES and sys.getrefcount(buf) <= 3:
        SPARES.put(buf)
