"""Traced programs on disk: a compiled graph's JAX program, serialized with `jax.export`, so that a later
process skips tracing the graph into JAX and lowering it.

XLA's persistent cache (device/registration.py) already skips the XLA compile of a program seen before,
but not the work in front of it: interpreting the FX graph through the lowerings (~0.3 s for one engine
step of the bundled model) and lowering the result to StableHLO (~0.15 s), per shape bucket. Here the
StableHLO itself is kept, keyed by everything the trace reads: the graph (its code and every node's
shape, stride and dtype), the call's input layout, the program's variant (which buffers it donates),
and the environment (torchbridge's sources, the torch, JAX and jaxlib versions, the platform, XLA_FLAGS
and the TORCHBRIDGE_* switches). A key that changes only misses; nothing stale is ever loaded.

A donating program (the engine's step writing its KV cache, an optimizer step) is also kept compiled
(`load_compiled`/`store_compiled`: JAX's executable serialization, for the devices it ran on), with the
verdict on whether its donation pays: loading it skips lowering the StableHLO, XLA's cache lookup (which
hashes the whole module) and the HLO read that judges the donation, ~0.16 -> ~0.07 s per engine bucket.
Only an executable XLA compiled in this process is kept (`compile`): one XLA:CPU loaded from its own
persistent cache serializes without some of its functions ("Function convert_bitcast_fusion.15 not
found" when the next process ran it; tests/compile/test_program_cache.py).

It lives beside XLA's cache and follows its switches (TORCHBRIDGE_COMPILE_CACHE=0 turns both off,
TORCHBRIDGE_COMPILE_CACHE_DIR moves both). A program that cannot be exported (collectives over a mesh)
is traced as before.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import torch

log = logging.getLogger(__name__)
# hits, misses, stored, unexportable (traced programs); executable_hits, executable_misses, executables_stored
stats: Counter[str] = Counter()
SUBDIR = "torchbridge-programs"
_SOURCE_SUFFIXES = (".py", ".cpp", ".cc", ".h")


def directory() -> Path | None:
    """Where programs are kept: beside XLA's persistent cache; None when that cache is off."""
    base = jax.config.jax_compilation_cache_dir
    return Path(base) / SUBDIR if base else None


@functools.cache
def environment() -> str:
    """What every traced program also depends on, hashed once per process."""
    import torchbridge

    h = hashlib.sha256()
    root = Path(torchbridge.__file__).parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    switches = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith("TORCHBRIDGE_") and not k.startswith("TORCHBRIDGE_COMPILE_CACHE"))
    h.update(repr((torch.__version__, jax.__version__, jax.lib.__version__, sys.version_info[:2],
                   os.environ.get("XLA_FLAGS", ""), switches)).encode())
    return h.hexdigest()


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """The graph as the trace reads it: its code, and every node's value's shape, stride and dtype
    (symbolic sizes by their expressions); FX subgraphs (FlexAttention's functions) by their code."""
    h = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        h.update(_describe(node.meta.get("val")).encode())
    for name, sub in gm.named_children():
        if isinstance(sub, torch.fx.GraphModule):
            h.update(name.encode())
            h.update(graph_fingerprint(sub).encode())
    return h.hexdigest()


def _describe(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"T{tuple(val.shape)}{tuple(val.stride())}{val.storage_offset()}{val.dtype}{val.device.type}"
    if isinstance(val, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in val) + ")"
    return type(val).__name__ + str(val)


def key(graph: str, call: Any, variant: Any) -> str:
    """The file name of one program: graph fingerprint, the call's layout key, the variant, and the JAX
    settings a trace reads that may change while the process runs (torchbridge.set_matmul_precision)."""
    settings = (jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64)
    return hashlib.sha256(repr((environment(), settings, graph, call, variant)).encode()).hexdigest()


def _read(name: str, misses: str) -> bytes | None:
    d = directory()
    if d is None:
        return None
    try:
        return (d / name).read_bytes()
    except OSError:
        stats[misses] += 1
        return None


def load(name: str) -> jax.export.Exported | None:
    blob = _read(name, "misses")
    if blob is None:
        return None
    try:
        exported = jax.export.deserialize(bytearray(blob))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file is a miss, never an error
        log.warning("torchbridge.compile: ignoring unreadable cached program %s (%s)", name, e)
        stats["misses"] += 1
        return None
    stats["hits"] += 1
    return exported


def store(name: str, exported: jax.export.Exported) -> None:
    try:
        blob = exported.serialize()
    except ImportError as e:  # jax.export serializes with flatbuffers
        log.warning("torchbridge.compile: could not cache a program (%s)", e)
        return
    if _write(name, blob):
        stats["stored"] += 1


def _write(name: str, blob: bytes) -> bool:
    d = directory()
    if d is None:
        return False
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, d / name)  # atomic: a reader in another process sees all of it or nothing
    except OSError as e:
        log.warning("torchbridge.compile: could not cache a program in %s (%s)", d, e)
        return False
    return True


def export(fn: Any, args: tuple, custom_calls: tuple[str, ...]) -> jax.export.Exported | None:
    """`fn` traced and lowered for `args` (what jax.jit would do), as an Exported; None where JAX cannot
    export it. `custom_calls`: the FFI targets the program may call (ours, registered in every process)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in custom_calls]
    try:
        return jax.export.export(jax.jit(fn, keep_unused=True), disabled_checks=checks)(*args)
    except Exception as e:  # noqa: BLE001 - e.g. an effect export refuses; the caller jits `fn` itself
        stats["unexportable"] += 1
        log.info("torchbridge.compile: program not cached (%s: %s)", type(e).__name__, e)
        return None


def compiled_key(name: str, args: Any) -> str:
    """The file name of `name`'s compiled program for `args` (an executable is built for its devices)."""
    devices = sorted({d.id for x in jax.tree.leaves(args) if isinstance(x, jax.Array) for d in x.devices()})
    return hashlib.sha256(repr((name, devices)).encode()).hexdigest() + ".x"


def load_compiled(name: str) -> tuple[bool, Any]:
    """(found, program): a kept compiled program (a jax.stages.Compiled), or None where it was judged not
    worth running (its donation did not pay); (False, None) on a miss."""
    from jax.experimental import serialize_executable

    blob = _read(name, "executable_misses")
    if blob is None:
        return False, None
    try:  # (a file of this user's own cache, as trusted as XLA's persistent cache beside it)
        kept = pickle.loads(blob)
        program = None
        if kept is not None:
            platform, ids, serialized = kept
            by_id = {d.id: d for d in jax.devices(platform)}
            program = serialize_executable.deserialize_and_load(
                *serialized, backend=by_id[ids[0]].client, execution_devices=[by_id[i] for i in ids])
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file is a miss, never an error
        log.warning("torchbridge.compile: ignoring unreadable cached executable %s (%s)", name, e)
        stats["executable_misses"] += 1
        return False, None
    stats["executable_hits"] += 1
    return True, program


def store_compiled(name: str, program: Any) -> None:
    """Keep `program` (a jax.stages.Compiled that `compile` compiled here, or None: the verdict that it is
    not worth running)."""
    from jax.experimental import serialize_executable

    if directory() is None:
        return
    try:
        kept = None
        if program is not None:  # with the devices it runs on (by default JAX would load it for all of them)
            devices = jax.tree.leaves(program.input_shardings)[0]._device_assignment
            kept = (devices[0].platform, [d.id for d in devices], serialize_executable.serialize(program))
        blob = pickle.dumps(kept)
    except Exception as e:  # noqa: BLE001 - an executable that cannot be serialized is just not kept
        log.info("torchbridge.compile: executable not cached (%s: %s)", type(e).__name__, e)
        return
    if _write(name, blob):
        stats["executables_stored"] += 1


_xla_cache_hits = 0  # programs XLA's persistent cache has answered in this process
_listening = False


def _count_xla_cache_hit(event: str, **kwargs: Any) -> None:
    global _xla_cache_hits
    if event == "/jax/compilation_cache/cache_hits":
        _xla_cache_hits += 1


def compile(lowered: Any) -> tuple[Any, bool]:  # noqa: A001 - the module's verb, as jax's Lowered.compile
    """`lowered.compile()`, and whether XLA compiled it here (False: loaded from XLA's persistent cache, or
    another thread's was meanwhile; such an executable is not kept, see the module's docstring)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_xla_cache_hit)
        _listening = True
    before = _xla_cache_hits
    compiled = lowered.compile()
    return compiled, _xla_cache_hits == before
