"""The Dynamo backend: FX graph -> the eager lowering table -> one jax.jit per graph.

AOTAutograd captures forward and backward as functional core-ATen graphs (input mutations are
applied by its runtime wrapper, so our graphs are pure). Each graph is interpreted once, at trace
time, through the SAME lowerings the eager mode uses; the result is one XLA executable per graph
and per input layout. Inputs are read straight from their storage buffers inside the executable, so
parameters are never copied per call; outputs become device tensors by swapping in new buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import operator
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.symbolic_shapes import guard_scalar
from torch.fx.node import map_arg

from torchbridge.compile import bounded, flex, functionalized, patterns, program_cache, rng_state, spmd
from torchbridge.device import donation, dtypes, host_calls, recycling, views
from torchbridge.device.lowerings import registry
from torchbridge.device.runtime import STATE, run_collective

log = logging.getLogger(__name__)
compile_counter: Counter[str] = Counter()
# The values of the graph's size symbols while one of its programs is traced (bounded graphs: the
# padded sizes; None: the sizes Dynamo traced with). Read by _shape.
_BINDINGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("bindings", default=None)
# the graph inputs (placeholder indices) the program being traced donates (_Executable.donating)
_DONATED: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("donated", default=frozenset())
# compiled graph calls recorded while compile/replay.py captures one (None: not capturing)
_CAPTURE: contextvars.ContextVar[list | None] = contextvars.ContextVar("capture", default=None)


class Call(NamedTuple):
    """One GraphProgram call, as compile/replay.py needs it to repeat the call without the argument walk."""

    program: GraphProgram
    args: tuple
    fn: Any  # the _Executable that ran
    out_meta: list
    slot: dict[int, int]  # argument index -> position among the device buffers
    descs: tuple  # per argument: ("d", view, ...) device, ("h", shape, dtype) host, ("c", value) constant
    consts: list
    device: torch.device
    switches: Any  # host_calls.switches() the program was built for
    true: Any  # the call's size bindings (exact symbolic sizes), for size outputs
    plain: bool  # no collectives, no random numbers, no padded (bounded) sizes


def _shape(val: torch.Tensor) -> tuple[int, ...]:
    return bounded.ints(val.shape, _BINDINGS.get())


class GraphProgram:
    """A callable standing in for one FX graph; compiles once per input layout."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, mutated_inputs: frozenset[int] | None = frozenset(),
                 exact: bool = False) -> None:
        self.gm = gm
        self.name = name
        # inputs AOTAutograd's runtime mutates after the call (an output must not be a view of them);
        # None when unknown: then no output is made a view of an input
        self.mutated_inputs = mutated_inputs
        self.nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in self.nodes if n.op == "output")
        # symbolic sizes: bounded programs, one program per exact size (`exact`: sizes given by the
        # inputs at each call), or specialised by Dynamo's guards
        self.dims = bounded.Dims.of(self.placeholders, not exact)
        if self.dims is not None and not exact and bounded.unsupported(gm.graph) is not None:
            self.dims.bounded = False  # (tpu_backend specialised it: Dynamo guards each size)
        self.bounded = self.dims is not None and self.dims.bounded
        self.exact = self.dims is not None and exact
        # random nodes draw at consecutive offsets of the graph's one (seed, offset), as they would eagerly
        self._rng_offsets: dict[torch.fx.Node, int] = {}
        drawn = 0
        for n in self.nodes:
            if _is_random(n):
                self._rng_offsets[n] = drawn
                drawn += (max([1] + [bounded.concrete(t.numel(), None) for t in _tensor_leaves(n.meta.get("val"))])
                          + 3) // 4 * 4
        self.random = drawn
        self.fenced = _broadcast_transcendentals(self.nodes)
        self.patterns = patterns.find(self.nodes)
        self.absorbed = frozenset(n for m in self.patterns.values() for n in m.absorbed)
        compile_counter["patterns"] += len(self.patterns)
        # input mutations AOTAutograd kept in the graph: copy_(placeholder, value), applied by us
        self._written: dict[int, torch.fx.Node] = {}
        index = {n: i for i, n in enumerate(self.placeholders)}
        for n in self.nodes:
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
                dst, src = n.args[0], n.args[1]
                if dst not in index:
                    raise NotImplementedError(f"torchbridge.compile: {name} copies into a non-input ({dst})")
                self._written[index[dst]] = src
        self.writes = sorted(self._written)
        # Adam/AdamW parameter updates among the writes: each computed in one pass (patterns.AdamWrite)
        self.adam = patterns.find_adam_writes(self.placeholders, self._written)
        self.adagrad = patterns.find_adagrad_writes(self.placeholders, self._written)  # likewise
        compile_counter["patterns"] += len(self.adam) + len(self.adagrad)
        self._programs: dict[Any, tuple[Any, list]] = {}
        self._last_key: Any = None
        attrs = {n.target: _attr(gm, n.target) for n in self.nodes if n.op == "get_attr"}
        # FX subgraphs (FlexAttention's score and mask functions) are code, not inputs of the program
        self._subgraphs = {k: v for k, v in attrs.items() if flex.is_subgraph(v)}
        self._constants = {k: v for k, v in attrs.items() if k not in self._subgraphs}
        # process groups whose collectives the graph calls: it then runs as one program on all their ranks
        self.groups = _collective_groups(self.nodes)
        self._axes: dict[str, Any] = {}
        if self.groups:
            compile_counter["collective_graphs"] += 1
            compile_counter["collectives"] += sum(1 for n in self.nodes if n.op == "call_function" and isinstance(
                n.target, torch._ops.OpOverload) and n.target.namespace == spmd.COLLECTIVE_NAMESPACE and
                n.target._schema.name != f"{spmd.COLLECTIVE_NAMESPACE}::wait_tensor")

    # -- call ------------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        from torchbridge.device import buffers

        STATE.table.drain()
        descs, bufs, hosts, device = [], [], [], None
        slot: dict[int, int] = {}  # argument index -> its buffer's position in `bufs` (device tensors)
        true = padded = None
        if self.dims is not None:
            true, padded = self.dims.bind(args)
        buf = None
        for i, a in enumerate(args):
            pad = self._padded_spec(i, padded) if self.bounded and i in self.dims.symbolic_inputs else None
            if isinstance(a, torch.Tensor) and a.device.type == STATE.name:
                device = device or a.device
                slot[i] = len(bufs)
                storage = a.untyped_storage()
                jdt = dtypes.to_jax(a.dtype)
                buf = STATE.table.get_or_zeros(storage.data_ptr(), storage.nbytes(), jdt, STATE.jax_device(a.device.index or 0))
                spec = views.ViewSpec(tuple(a.shape), tuple(a.stride()), a.storage_offset())
                if pad is not None:
                    # one buffer just holding the padded view, whoever made the tensor: a storage that
                    # already is one (a bounded program's output) is read in place, others are padded on
                    # the host (numpy: no program per size); both give the program the same input
                    count = pad.offset + views.storage_numel(pad.shape, pad.strides)
                    if not (_holds(pad, spec, storage.nbytes() // a.element_size()) and buf.dtype == jdt
                            and buf.shape[0] == count):
                        buf = jax.device_put(_padded_buffer(_device_numpy(buf, jdt, spec), pad, count),
                                             STATE.jax_device(a.device.index or 0))
                    descs.append(("d", pad, jdt, buf.dtype, count, count * a.element_size()))
                    bufs.append(buf)
                    continue
                descs.append(("d", spec, jdt, buf.dtype, buf.shape[0], storage.nbytes()))
                bufs.append(buf)
            elif isinstance(a, torch.Tensor):
                shape = pad.shape if pad is not None else tuple(a.shape)
                descs.append(("h", shape, a.dtype))
                hosts.append(bounded.pad_host(dtypes.host_to_numpy(a), shape))  # jit moves numpy arguments in one batch
            elif self.bounded and isinstance(self.placeholders[i].meta.get("val"), torch.SymInt):
                descs.append(("c", bounded.concrete(self.placeholders[i].meta["val"], padded)))  # a size: padded
            else:
                descs.append(("c", a))
        if self.bounded:
            hosts.append(self.dims.lengths(true))  # the true sizes, for the ops that mask the padding
        buf = None  # a live local would count as a holder of the last buffer (donation checks refcounts)
        consts = []
        for t in self._constants.values():
            consts.append(buffers.value(t) if t.device.type == STATE.name else jnp.asarray(dtypes.host_to_numpy(t)))
        device = device or torch.device(STATE.name, STATE.current_device)
        plan = spmd.plan(self.groups, STATE.jax_device(device.index or 0)) if self.groups else None
        key = (tuple(descs), tuple((c.shape, c.dtype) for c in consts), host_calls.switches(),
               plan.key() if plan else None)
        entry = self._programs.get(key)
        if entry is None:
            if self._programs:
                # (a graph with exact symbolic sizes compiles per size by design)
                log.log(logging.INFO if self.exact or _recompiles_expected.get() else logging.WARNING,
                        "torchbridge.compile: recompiling %s for new inputs (%s)", self.name, _diff(self._last_key, key))
            entry = self._build(descs, [c.shape for c in consts], plan,
                                padded if self.bounded else true if self.exact else None, key)
            self._programs[key] = entry
            compile_counter[self.name] += 1
        self._last_key = key
        fn, out_meta = entry
        rng = STATE.next_rng(device.index or 0, self.random) if self.random else None
        if plan is not None:  # every input becomes this rank's shard of a mesh-wide array
            glob = plan.to_global
            bufs = [glob(b) for b in bufs]
            hosts, consts = [glob(h) for h in hosts], [glob(c) for c in consts]
            rng = None if rng is None else glob(np.array(rng, dtype=np.uint64))
        if self.writes:  # (it records what synchronize() waits on: the written buffers too)
            flat_out = self._call_writing(fn, args, bufs, slot, hosts, consts, rng, device.index or 0, plan)
        else:
            call = (tuple(bufs), tuple(hosts), tuple(consts), rng)
            if plan is not None:
                flat_out = run_collective(plan.device.id, lambda: jax.tree.map(spmd.local, fn(*call)))
            else:
                flat_out = _call_recycling(fn, call)
            STATE.last_results[device.index or 0] = flat_out  # what torch.tpu.synchronize() waits on
        calls = _CAPTURE.get()
        if calls is not None:
            calls.append(Call(self, args, fn, out_meta, slot, tuple(descs), consts, device, key[2], true,
                              plan is None and rng is None and not self.bounded))
        return self._results(flat_out, out_meta, args, device, true)

    def _results(self, flat_out: Any, out_meta: list, args: tuple, device: torch.device, true: Any) -> list:
        """The graph's outputs as device tensors: new storages holding the program's output buffers, sizes,
        constants, and views of inputs or of other outputs."""
        results: list[Any] = [None] * len(out_meta)
        it = iter(flat_out)
        for i, m in enumerate(out_meta):
            if m is None:
                continue
            if m[0] == "const":
                results[i] = m[1]
            elif m[0] == "sym":  # a size the backward needs: its true value in this call
                results[i] = bounded.concrete(m[1], true if self.bounded or self.exact else None)
            elif m[0] == "t":
                _, shape, stride, dt, sym = m
                t = torch.empty_strided(shape, stride, dtype=dt, device=device)
                STATE.table.set(t.untyped_storage().data_ptr(), next(it))
                # a padded output: its true size, a view into the padded buffer
                results[i] = t if sym is None else _reinterpret(t, bounded.ints(sym, true), stride, 0)
        for i, m in enumerate(out_meta):  # outputs that alias an input or another output: views, no data
            if m is not None and m[0] in ("arg", "alias"):
                kind, j, shape, stride, rel = m
                base = args[j] if kind == "arg" else results[j]
                results[i] = _reinterpret(base, shape, stride, base.storage_offset() + rel)
        return results

    def _donation_picks(self, args: tuple, bufs: list, slot: dict[int, int]) -> list[int]:
        """Buffer positions that may be donated, by size and dtype: large storages this graph writes (XLA
        then updates them in place: a KV cache's few new rows, an optimizer step's parameters and state;
        Adam's one-pass custom call then aliases its results to its operands), in the order the new
        values come out (donation.donating_jit)."""
        # a buffer of another width than its tensor's dtype (a byte storage FSDP2 all-gathers into, written
        # as float32) cannot take the new value, which comes out in the tensor's dtype
        return [slot[i] for i in self.writes
                if i in slot and bufs[slot[i]].nbytes >= donation.DONATE_BYTES
                and views.same_width(bufs[slot[i]].dtype, dtypes.to_jax(args[i].dtype))]

    def _donatable(self, args: tuple, bufs: list, slot: dict[int, int], dev: int,
                   picks: list[int] | None = None) -> tuple[int, ...]:
        """Of `picks` (default: `_donation_picks`), the buffers held by nothing but the table (and `bufs`),
        each passed once: those are donated."""
        picks = self._donation_picks(args, bufs, slot) if picks is None else picks
        if not picks:
            return ()
        ids = [id(b) for b in bufs]
        once = [k for k in picks if ids.count(ids[k]) == 1]
        return tuple(donation.sole_holders(bufs, once, dev))

    def _call_writing(self, fn: Any, args: tuple, bufs: list, slot: dict[int, int], hosts: list, consts: list,
                      rng: Any, dev: int, plan: spmd.Plan | None, picks: list[int] | None = None) -> Any:
        """Run a graph that mutates some of its inputs: AOTAutograd keeps an inference graph's input
        mutations as trailing `copy_` nodes (the optimizer step writing parameters and state), so
        the new values come out of this one executable and go straight into the buffer table,
        instead of one eager `copy_` per tensor afterwards. Large written buffers nothing else holds
        are donated (XLA then writes over them instead of into fresh memory: an Adagrad step of 25M
        parameters 34 -> 23 ms) unless XLA answers the donation with copies (`_Executable.donating`)."""
        donate = self._donatable(args, bufs, slot, dev, picks) if plan is None else ()
        run = None
        if donate:
            donated = tuple(bufs[k] for k in donate)
            others = tuple(b for k, b in enumerate(bufs) if k not in donate)
            call = (donated, others, tuple(hosts), tuple(consts), rng)
            run = fn.donating(donate, call, slot)
        if run is not None:
            compile_counter["donated_calls"] += 1
            bufs.clear()
            new_dev, outs, new_host = run(*call)
        elif plan is not None:
            new_dev, outs, new_host = run_collective(
                plan.device.id, lambda: jax.tree.map(spmd.local, fn(tuple(bufs), tuple(hosts), tuple(consts), rng)))
        else:
            new_dev, outs, new_host = fn(tuple(bufs), tuple(hosts), tuple(consts), rng)
        if plan is not None:
            new_host = tuple(h.reshape(np.shape(args[i])) for i, h in zip((i for i in self.writes if i not in slot),
                                                                            new_host, strict=True))
        # what torch.tpu.synchronize() waits on: the outputs and the written buffers (an optimizer step
        # returns nothing else: waiting on its outputs alone did not wait for the step)
        STATE.last_results[dev] = (new_dev, outs)
        for i, new in zip((i for i in self.writes if i in slot), new_dev, strict=True):
            STATE.table.set(args[i].untyped_storage().data_ptr(), new)
        for i, new in zip((i for i in self.writes if i not in slot), new_host, strict=True):
            with torch.no_grad():
                args[i].copy_(dtypes.numpy_to_host(np.array(new), args[i].dtype).view(args[i].shape))
        return outs

    # -- trace -----------------------------------------------------------------------------------
    @functools.cached_property
    def fingerprint(self) -> str:
        return program_cache.graph_fingerprint(self.gm)

    def _build(self, descs: list, const_shapes: list, plan: spmd.Plan | None = None,
               bindings: dict | None = None, cache_key: Any = None) -> tuple[Any, list]:
        out_vals = self.output_node.args[0]
        out_meta: list[Any] = []
        for v in out_vals:
            if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor):
                val = v.meta["val"]
                sym = tuple(val.shape) if self.bounded and bounded.free_symbols(val) else None
                out_meta.append(("t", bounded.ints(val.shape, bindings), bounded.ints(val.stride(), bindings),
                                 val.dtype, sym))
            elif isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.SymInt):
                out_meta.append(("sym", v.meta["val"]))
            elif isinstance(v, torch.fx.Node):
                out_meta.append(None if v.meta.get("val") is None else ("const", v.meta.get("val")))
            else:
                out_meta.append(None if v is None else ("const", v))
        _alias_outputs(out_vals, out_meta, self.placeholders, descs, self.mutated_inputs)

        for i in self.writes:
            if descs[i][0] == "c":
                raise NotImplementedError(f"torchbridge.compile: {self.name} writes a non-tensor input")

        def program(bufs, hosts, consts, rng):
            token = _BINDINGS.set(bindings)
            try:
                return traced(bufs, hosts, consts, rng)
            finally:
                _BINDINGS.reset(token)

        def traced(bufs, hosts, consts, rng):
            # the true sizes of the symbols (bounded graphs): the last host input
            lens = dict(zip(self.dims.symbols, hosts[-1], strict=True)) if self.bounded else None
            env: dict[torch.fx.Node, Any] = {}
            flats: dict[torch.fx.Node, Any] = {}  # the inputs' flat buffers, for writes into them
            # inputs that are transposed views (a saved t(weight)): their un-transposed reads, for the GEMM
            untransposed: dict[torch.fx.Node, Any] = {}
            bi, hi = 0, 0
            for node, d in zip(self.placeholders, descs, strict=True):
                if d[0] == "d":
                    _, spec, jdt, _, _, nbytes = d
                    flat = views.bitcast_flat(bufs[bi], jdt, nbytes // jnp.dtype(jdt).itemsize)
                    flats[node] = flat
                    env[node] = views.read(flat, spec)
                    base = views.swapped_last_two(spec)
                    if base is not None:
                        untransposed[node] = views.read(flat, base)
                    bi += 1
                elif d[0] == "h":
                    env[node] = hosts[hi]
                    hi += 1
                else:
                    env[node] = d[1]
            const_vals = dict(zip(self._constants, consts, strict=True))
            for node in self.nodes:
                if node.op == "get_attr":
                    env[node] = self._subgraphs.get(node.target, const_vals.get(node.target))
                elif node in self.absorbed:
                    continue  # computed by the pattern that absorbed it
                elif node in self.patterns:
                    env[node] = _run_pattern(node, self.patterns[node], env)
                elif node.op == "call_function":
                    at = self._rng_offsets.get(node)
                    node_rng = None if at is None else (rng[0], jnp.asarray(rng[1], jnp.uint64) + jnp.uint64(at))
                    env[node] = self._run_node(node, env, node_rng, untransposed, lens)
                    if node in self.fenced:
                        env[node] = host_calls.fence(env[node])
            outs = []
            for v, m in zip(out_vals, out_meta, strict=True):
                if m is None or m[0] != "t":
                    continue
                _, shape, stride, dt, _ = m
                x = jnp.broadcast_to(views.cast(env[v], dtypes.to_jax(dt)), shape)
                outs.append(views.layout(x, views.ViewSpec(shape, stride, 0), views.storage_numel(shape, stride)))
            if not self.writes:
                return tuple(outs)
            written = {i: env[self._written[i]] for i in self.writes}
            donated = _DONATED.get()
            for a in self.adam:
                in_place = all(i in donated for i in (a.param, a.exp_avg, a.exp_avg_sq))
                written[a.param], written[a.exp_avg], written[a.exp_avg_sq] = _adam_update(a, env, in_place)
            for a in self.adagrad:
                in_place = a.param in donated and a.state_sum in donated
                written[a.param], written[a.state_sum] = _adagrad_update(a, env, in_place)
            new_dev, new_host = [], []
            for i in self.writes:
                node, d = self.placeholders[i], descs[i]
                val = written[i]
                if d[0] == "d":
                    _, spec, jdt, buf_dtype, count, _ = d
                    new = views.write(flats[node], spec, jnp.broadcast_to(views.cast(val, jdt), spec.shape))
                    if views.same_width(buf_dtype, jdt):  # the buffer keeps its dtype (a bf16 tensor over uint16 storage)
                        new = views.bitcast_flat(new, buf_dtype, count)
                    new_dev.append(new)
                else:
                    new_host.append(views.cast(val, dtypes.to_jax(d[2])))
            return tuple(new_dev), tuple(outs), tuple(new_host)

        if plan is None:
            # (the size mode too: a bounded program takes the true sizes as an extra input)
            mode = "bounded" if self.bounded else "exact" if self.exact else "static"
            cached = None if cache_key is None or program_cache.directory() is None else (
                self.fingerprint, repr((mode, cache_key, bindings)))
            return _Executable(program, cached), out_meta
        self._axes = {**plan.axes, "_sizes": plan.sizes}
        host_shapes = [d[1] for d in descs if d[0] == "h"]

        def unflatten(args: tuple) -> tuple:
            # inputs that to_global gave a leading axis (0-d ones) get their own shape back
            bufs, hosts, consts, rng = args
            hosts = tuple(h.reshape(s) for h, s in zip(hosts, host_shapes, strict=True))
            consts = tuple(c.reshape(s) for c, s in zip(consts, const_shapes, strict=True))
            return bufs, hosts, consts, None if rng is None else (rng[0], rng[1])

        def leading(x: Any) -> Any:
            return x.reshape(1) if x.ndim == 0 else x

        def spmd_program(bufs, hosts, consts, rng):
            return jax.tree.map(leading, program(*unflatten((bufs, hosts, consts, rng))))

        return _Executable(plan.wrap(spmd_program)), out_meta

    def hlo_texts(self) -> list[str]:
        """The optimised HLO of each program this graph compiled (one per input layout)."""
        return [fn.hlo_text() for fn, _ in self._programs.values()]

    def _padded_spec(self, i: int, padded: dict) -> views.ViewSpec | None:
        """Input `i`'s view with its symbolic sizes padded (None: not a tensor)."""
        val = self.placeholders[i].meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        return views.ViewSpec(bounded.ints(val.shape, padded), bounded.ints(val.stride(), padded),
                              bounded.concrete(val.storage_offset(), padded))

    def _run_node(self, node: torch.fx.Node, env: dict, key: Any, untransposed: dict, lens: dict | None = None) -> Any:
        target = node.target
        args = map_arg(node.args, lambda n: env[n])
        if target in bounded.SIZE_ARITHMETIC:  # sizes: the padded ones in a bounded program
            if target is torch.ops.aten.sym_size.int:
                return args[0].shape[args[1]]
            if target is torch.ops.aten.sym_stride.int:
                return int(np.prod(args[0].shape[args[1] + 1:]))
            if target is torch.ops.aten.sym_numel.default:
                return int(np.prod(args[0].shape))
            return target(*args)
        if target in bounded.SIZE_COMPARISONS:  # (exact sizes only: bounded.unsupported rejects them)
            return target(*args)
        if target in bounded.SIZE_CHECKS:  # a check on sizes, which are this program's own numbers
            if target is torch.ops.aten._assert_scalar.default and not args[0]:
                raise RuntimeError(f"torchbridge.compile: {self.name}: {args[1]}")
            return None
        gemm = host_calls.GEMM_OPERANDS.get(target._schema.name) if isinstance(target, torch._ops.OpOverload) else None
        if gemm:  # a transposed operand goes to the GEMM as is, with a flag
            args = tuple(_gemm_operand(a, env, untransposed) if i in gemm else v
                         for i, (a, v) in enumerate(zip(node.args, args, strict=True)))
        kwargs = map_arg(node.kwargs, lambda n: env[n])
        if target is operator.getitem:
            return args[0][args[1]]
        if target is torch.ops.aten.copy_.default:  # an input mutation: applied after the graph
            return _cast_like(args[1], node.meta.get("val"))
        if target in flex.HOPS:  # FlexAttention forward/backward, its score and mask subgraphs in `args`
            compile_counter["flex_attention_lowered"] += 1
            return _cast_like(flex.run(node, args, _traced), node.meta.get("val"))
        if target in functionalized.HOPS:  # a custom op (torchbridge.kernel) writing its arguments
            return _cast_like(_traced(node, functionalized.run, (node, args[0], kwargs), {}), node.meta.get("val"))
        if target is rng_state.RUN_AND_SAVE:  # a random op in a checkpointed region: run it, keep its state
            res = self._run_op(node, args[0], args[1:], kwargs, rng_state.result_meta(node, 1), key, lens)
            return rng_state.pack(key, node), res
        if target is rng_state.RUN_WITH:  # ... and its recomputation from that state
            return self._run_op(node, args[1], args[2:], kwargs, rng_state.result_meta(node, 2),
                                rng_state.unpack(args[0]), lens)
        if not isinstance(target, torch._ops.OpOverload):
            raise NotImplementedError(f"torchbridge.compile: unsupported graph call {target} in {node.format_node()}")
        return self._run_op(node, target, args, kwargs, node.meta.get("val"), key, lens)

    def _run_op(self, node: torch.fx.Node, target: Any, args: tuple, kwargs: dict, val: Any, key: Any,
                lens: dict | None) -> Any:
        lowering = registry.find(target)
        if lowering is None:
            raise NotImplementedError(
                f"torchbridge.compile: operator '{target}' has no lowering for the '{STATE.name}' device"
            )
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        if lens is not None and target in bounded.MASKED:  # an op that would read the padding
            args, kwargs = bounded.MASKED[target][0](node, args, kwargs, lens)
        res = _traced(node, lowering.fn, args, kwargs, key, self._axes, val)
        return _cast_like(res[0] if lowering.mutates else res, val)


def _pattern_scalar(pair: tuple, env: dict) -> Any:
    """A matched pattern's per-parameter scalar, (number or node, element or None), as a value."""
    x, i = pair
    x = env[x] if isinstance(x, torch.fx.Node) else x
    return x if i is None else x[i]


def _adam_update(a: patterns.AdamWrite, env: dict, in_place: bool) -> tuple[Any, Any, Any]:
    """(p', m', v') of one matched Adam/AdamW update, in one pass over the arrays (over the old ones
    where the program donates them: `in_place`)."""
    s = a.scalars
    p, g, m, v = (env[a.nodes[k]] for k in ("p", "g", "m", "v"))
    return host_calls.adam_update(p, g, m, v, decay=s["decay"], l2=s["l2"], w1=s["w1"], beta2=s["beta2"], w2=s["w2"],
                                  step_size=-_pattern_scalar(s["step_value"], env),
                                  bc2_sqrt=_pattern_scalar(s["bc2_sqrt"], env), eps=s["eps"], gscale=s["gscale"],
                                  in_place=in_place)


def _adagrad_update(a: patterns.AdagradWrite, env: dict, in_place: bool) -> tuple[Any, Any]:
    """(p', s') of one matched Adagrad update, in one pass (over the old arrays: `in_place`)."""
    s = a.scalars
    return host_calls.adagrad_update(env[a.nodes["p"]], env[a.nodes["g"]], env[a.nodes["s"]],
                                     clr=_pattern_scalar(s["clr"], env), eps=s["eps"], l2=s["l2"],
                                     gscale=s["gscale"], in_place=in_place)


def _traced(node: torch.fx.Node, fn: Any, args: Any, kwargs: dict, key: Any = None, axes: dict | None = None,
            val: Any = None) -> Any:
    """fn(*args, **kwargs) traced with `node`'s output shapes and dtypes, or `val`'s (what lowerings may ask)."""
    leaves = _tensor_leaves(node.meta.get("val") if val is None else val)
    ctx = registry.TraceContext(
        out_shapes=[_shape(t) for t in leaves], out_dtypes=[dtypes.to_jax(t.dtype) for t in leaves], rng=key,
        axes=axes or {},
    )
    with registry.tracing(ctx):
        return fn(*args, **kwargs)


def _run_pattern(node: torch.fx.Node, match: patterns.Match, env: dict) -> Any:
    res = _traced(node, match.fn, map_arg(match.inputs, lambda n: env[n]), {})
    return _cast_like(res, node.meta.get("val"))


def _storage_key(val: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - tensors without a storage cannot alias anything
        return None


def _extent(val: torch.Tensor) -> tuple[int, int]:
    lo = val.storage_offset()
    return lo, lo + views.storage_numel(tuple(val.shape), tuple(val.stride()))


def _dense(val: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill [offset, offset + extent) exactly."""
    dims = sorted((s, n) for n, s in zip(val.shape, val.stride(), strict=True) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return val.numel() > 0


def _alias_outputs(out_vals: Any, out_meta: list, placeholders: list, descs: list, mutated: frozenset[int] | None) -> None:
    """Outputs that are views of an input or of another output (AOTAutograd's forward saves the
    parameters themselves, `t(weight)`, `detach(x)`, `view(y)` for the backward) become views of
    that tensor instead of copies: XLA would otherwise write every such output as a fresh buffer
    (a transposed copy of each weight per step). Their FakeTensor values share a storage exactly
    when the eager tensors would; a view is only taken of a base that is dense and covers it."""
    bases: dict[Any, tuple[str, int, torch.Tensor]] = {}
    for i, (node, d) in enumerate(zip(placeholders, descs, strict=True)):
        val = node.meta.get("val")
        if mutated is None or i in mutated or bounded.free_symbols(val):
            continue
        if d[0] == "d" and isinstance(val, torch.Tensor) and _dense(val):
            key = _storage_key(val)
            if key is not None:
                bases.setdefault(key, ("arg", i, val))
    # per storage, the widest dense materialised output becomes the base of the others
    for i, (v, m) in enumerate(zip(out_vals, out_meta, strict=True)):
        if m is None or m[0] != "t" or bounded.free_symbols(v.meta["val"]) or not _dense(v.meta["val"]):
            continue
        val = v.meta["val"]
        key = _storage_key(val)
        if key is None:
            continue
        cur = bases.get(key)
        if cur is None or (cur[0] == "out" and val.numel() > cur[2].numel()):
            bases[key] = ("out", i, val)
    for i, (v, m) in enumerate(zip(out_vals, out_meta, strict=True)):
        if m is None or m[0] != "t" or bounded.free_symbols(v.meta["val"]):
            continue
        val = v.meta["val"]
        base = bases.get(_storage_key(val))
        if base is None or (base[0] == "out" and base[1] == i) or base[2].dtype != val.dtype:
            continue
        (lo, hi), (blo, bhi) = _extent(val), _extent(base[2])
        if val.numel() and blo <= lo and hi <= bhi:
            kind = "arg" if base[0] == "arg" else "alias"
            out_meta[i] = (kind, base[1], tuple(val.shape), tuple(val.stride()), lo - blo)


def _holds(pad: views.ViewSpec, spec: views.ViewSpec, numel: int) -> bool:
    """A tensor's storage (`numel` elements) already holds its padded view `pad`: same strides and
    offset, and room for the padded extent (an output of a bounded program, read back in place)."""
    return (pad.strides == spec.strides and pad.offset == spec.offset
            and pad.offset + views.storage_numel(pad.shape, pad.strides) <= numel)


def _padded_buffer(values: np.ndarray, pad: views.ViewSpec, count: int) -> np.ndarray:
    """A flat array of `count` elements holding `values`, zero-padded to pad.shape, at pad's positions."""
    flat = np.zeros((count,), values.dtype)
    bounded.strided_numpy(flat, pad.shape, pad.strides, pad.offset)[...] = bounded.pad_host(values, pad.shape)
    return flat


def _device_numpy(buf: jax.Array, jdt: Any, spec: views.ViewSpec) -> np.ndarray:
    """A device tensor's values on the host, through numpy only (no program per size)."""
    flat = np.asarray(buf)
    if flat.dtype != np.dtype(jdt):
        flat = flat.view(np.dtype(jdt))
    return bounded.strided_numpy(flat, spec.shape, spec.strides, spec.offset)


def _reinterpret(base: torch.Tensor, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """A view of `base`'s storage that autograd does not track (what inductor returns for aliases)."""
    return torch._C._dynamo.guards._reinterpret_tensor(base, shape, stride, offset)


_VIEW_OPS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
             torch.ops.aten.alias.default, torch.ops.aten.as_strided.default, torch.ops.aten.slice.Tensor,
             torch.ops.aten.select.int, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
             torch.ops.aten.permute.default}


def _gemm_operand(node: Any, env: dict, untransposed: dict) -> Any:
    """A GEMM operand with its transposes folded into a flag: t(x) and t(t(x)) cost no copy, nor
    does an input that is itself a transposed view (the t(weight) a forward saves for backward)."""
    trans = False
    while _swaps_last_two(node):
        node, trans = node.args[0], not trans
    if node in untransposed:
        return untransposed[node] if trans else host_calls.Transposed(untransposed[node])
    return host_calls.Transposed(env[node]) if trans else env[node]


def _swaps_last_two(node: Any) -> bool:
    """`node` is a transpose of its input's last two axes (t, transpose, permute)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim < 2:
        return False
    nd = val.ndim
    if node.target is torch.ops.aten.t.default:
        return nd == 2
    if node.target is torch.ops.aten.transpose.int:
        return sorted(d % nd for d in node.args[1:3]) == [nd - 2, nd - 1]
    if node.target is torch.ops.aten.permute.default:
        return [d % nd for d in node.args[1]] == [*range(nd - 2), nd - 1, nd - 2]
    return False


_BROADCAST_VIEWS = _VIEW_OPS | {torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
                                torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
                                torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}
_TRANSCENDENTAL = {getattr(torch.ops.aten, n).default for n in (
    "cos", "sin", "tan", "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "erf", "erfinv",
    "rsqrt", "sqrt", "atan", "acos", "asin")} | {torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.pow.Tensor_Tensor}
_ELEMENTWISE = _TRANSCENDENTAL | _BROADCAST_VIEWS | {
    torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.add.Tensor, torch.ops.aten.neg.default,
    torch.ops.aten.div.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.cat.default}


def _numel(node: torch.fx.Node) -> int:
    """Elements of a node's value; 0 when not a tensor or its size is symbolic (never guarded on)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or bounded.free_symbols(val):
        return 0
    return int(val.numel())


def _broadcast_transcendentals(nodes: list) -> frozenset:
    """Values to compute into their own buffer (host_calls.fence): small tensors made with
    transcendentals (a rotary embedding's cos/sin tables) that a consumer broadcasts to at least 4x
    their size. Unfenced, XLA:CPU fuses cos/sin into each consumer and evaluates them once per
    consumer element: 48x per layer for Llama's rotary at batch 8."""
    costly: set = set()  # nodes whose elementwise producer cone holds a transcendental
    for n in nodes:
        if n.op == "call_function" and n.target in _ELEMENTWISE and (
                n.target in _TRANSCENDENTAL or any(a in costly for a in n.all_input_nodes)):
            costly.add(n)
    picks = set()
    for n in costly:
        if n.target in _BROADCAST_VIEWS or not _numel(n):
            continue
        frontier = [u for u in n.users if u.op == "call_function"]
        while frontier:  # through views to the ops that read the values
            u = frontier.pop()
            if u.target in _BROADCAST_VIEWS:
                frontier.extend(v for v in u.users if v.op == "call_function")
            elif _numel(u) >= 4 * _numel(n):
                picks.add(n)
                break
    return frozenset(picks)


class _Executable:
    """One graph's jitted program, plus variants that donate chosen input buffers. `cached`: the graph's
    fingerprint and this program's call key, under which each variant's trace is kept on disk
    (compile/program_cache.py); None: traced in this process only."""

    def __init__(self, raw: Any, cached: tuple[str, str] | None = None) -> None:
        self.raw = raw
        self.cached = cached
        self._jitted: Any = None
        self._donating: dict[tuple[int, ...], Any] = {}
        self._avals: Any = None  # the first call's argument shapes, for hlo_text and copied_bytes
        self.spare_keys: list[tuple] | None = None  # its large outputs' (shape, dtype, device), after a call
        # variants writing some of them into donated spares, by the spares' keys; None: XLA would copy
        self._recycling: dict[tuple, Any] = {}
        self._copied: int | None = None  # copied_bytes(), once

    def __call__(self, *args: Any) -> Any:
        self._remember(args)
        return self.jitted(*args)

    @property
    def jitted(self) -> Any:
        if self._jitted is None:  # placed by its inputs' devices, used or not
            self._jitted = self._jit(self.raw, self._avals, "plain")
        return self._jitted

    def _jit(self, fn: Any, args: tuple, variant: Any, donate: tuple[int, ...] = ()) -> Any:
        """jax.jit(fn), its trace for `args` (arrays or their shapes) read from the program cache when
        a process traced it before, else traced once and kept there."""
        if self.cached is None:
            return jax.jit(fn, donate_argnums=donate, keep_unused=True)
        name = program_cache.key(*self.cached, variant)
        exported = program_cache.load(name)
        if exported is None:
            exported = program_cache.export(fn, args, host_calls.TARGETS)
            if exported is None:
                return jax.jit(fn, donate_argnums=donate, keep_unused=True)
            program_cache.store(name, exported)
        return jax.jit(exported.call, donate_argnums=donate, keep_unused=True)

    def _compiled(self, fn: Any, args: tuple, variant: Any, donate: tuple[int, ...], judge: Any) -> Any:
        """`fn` compiled for `args` (arrays) and judged (`judge`: the program, or None where running it does
        not pay); where the graph is cached, the judged program is kept compiled for the next process."""
        name = None
        if self.cached is not None:
            name = program_cache.compiled_key(program_cache.key(*self.cached, variant), args)
            found, program = program_cache.load_compiled(name)
            if found:
                return program
        compiled, fresh = program_cache.compile(self._jit(fn, args, variant, donate).lower(*args))
        program = judge(compiled)
        if name is not None and (fresh or program is None):  # (a verdict alone is always safe to keep)
            program_cache.store_compiled(name, program)
        return program

    def _remember(self, args: tuple) -> None:
        if self._avals is None:
            self._avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)

    def hlo_text(self) -> str:
        """The optimised HLO XLA compiled for this program (after its first call): which fusions and
        custom calls it runs."""
        return self.jitted.lower(*self._avals).compile().as_text()

    def copied_bytes(self, args: tuple) -> int:
        """The bytes the program (not donating) moves with `copy` instructions, for `args` (its call's
        arguments): the baseline a donating variant's copies are compared with."""
        if self._copied is None:
            self._remember(args)  # a writing program may donate from its first call on
            self._copied = donation.copied_bytes(self.hlo_text())
        return self._copied

    def recycling(self, call: tuple, keys: tuple, spares: list) -> Any:
        """The program taking `spares` (their pool `keys`, each the shape of one or more large outputs) as a
        first, donated argument: JAX pairs each with an output of its shape, which XLA writes into it.
        None where XLA would copy a quarter or more of their bytes."""
        if keys not in self._recycling:
            raw = self.raw
            self._recycling[keys] = self._compiled(
                lambda _spares, *args: raw(*args), (tuple(spares), *call), ("recycling", keys), (0,),
                lambda compiled: donation.unless_copying(compiled, sum(b.nbytes for b in spares),
                                                         lambda: self.copied_bytes(call)))
        return self._recycling[keys]

    def recycling_keys(self, available: tuple) -> tuple:
        """Which of the `available` spare keys to use: a compiled variant's keys if the spares cover one
        (the largest such), else all of them, compiling a new variant, while there are fewer than
        MAX_RECYCLING_VARIANTS (each is a full compile of the program; a pool that fills up over the
        first steps, or a steady state short of one output's spare, settles on one)."""
        def nbytes(keys: tuple) -> int:
            return sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in keys)
        if not available or available in self._recycling:
            return available
        have = Counter(available)
        fits = [k for k, run in self._recycling.items() if run is not None and not Counter(k) - have]
        if fits:
            return max(fits, key=nbytes)
        return available if len(self._recycling) < MAX_RECYCLING_VARIANTS else ()

    def donating(self, positions: tuple[int, ...], args: tuple, slot: dict[int, int]) -> Any:
        """The program donating the buffers at `positions`, compiled for `args` (its call's arguments;
        `slot`: graph input -> buffer position), or None where donation does not pay
        (donation.unless_copying)."""
        if positions not in self._donating:
            at = set(positions)
            token = _DONATED.set(frozenset(i for i, k in slot.items() if k in at))  # read while tracing
            try:
                self._donating[positions] = self._compiled(
                    donation.split_donated(self.raw, positions), args, ("donating", positions), (0,),
                    lambda compiled: donation.unless_copying(
                        compiled, sum(b.nbytes for b in args[0]),
                        lambda: self.copied_bytes((donation.merged(positions, *args[:2]), *args[2:]))))
            finally:
                _DONATED.reset(token)
        return self._donating[positions]


MAX_RECYCLING_VARIANTS = 3


def _call_recycling(fn: _Executable, call: tuple) -> Any:
    """Run a program that writes no input, its large fresh outputs written into spare buffers of their
    shape (storage.SPARES: freed buffers kept instead of new memory, which the CPU platform page-faults
    in on every write) for as many of them as the pool has a spare for and XLA adds no copies."""
    return recycling.run(fn, fn, call, compile_counter)


def _collective_groups(nodes: list[torch.fx.Node]) -> tuple[str, ...]:
    """The process group names of the graph's functional collectives, in first-use order."""
    names: list[str] = []
    for n in nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
                n.target.namespace == spmd.COLLECTIVE_NAMESPACE:
            schema = [a.name for a in n.target._schema.arguments]
            if "group_name" in schema:
                i = schema.index("group_name")
                name = n.kwargs.get("group_name", n.args[i] if i < len(n.args) else None)
                name = name if isinstance(name, str) else getattr(name, "group_name", None)
                if isinstance(name, str) and name not in names:
                    names.append(name)
    return tuple(names)


def _is_random(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.args[0] if node.target is rng_state.RUN_AND_SAVE else node.target  # the op it wraps
    if not isinstance(target, torch._ops.OpOverload):
        return False
    lowering = registry.find(target)
    return bool(lowering and lowering.random)


def _random_on_symbolic_sizes(graph: torch.fx.Graph) -> str | None:
    """A random op whose size is symbolic: the graph's draws are laid out once, for fixed sizes."""
    for n in graph.nodes:
        if _is_random(n) and bounded.free_symbols(n.meta.get("val")):
            return f"random op {n.target} on a symbolic size"
    return None


def _tensor_leaves(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensor_leaves(v)]
    return []


def _cast_like(res: Any, val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        out = views.cast(res, dtypes.to_jax(val.dtype))
        shape = _shape(val)
        return jnp.broadcast_to(out, shape) if out.shape != shape else out
    if isinstance(val, (list, tuple)) and isinstance(res, (list, tuple)):
        return type(res)(_cast_like(r, v) for r, v in zip(res, val, strict=False))
    return res


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _diff(old: Any, new: Any) -> str:
    if old is None:
        return "first call"
    changes = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old[0], new[0], strict=False)) if a != b]
    if old[2] != new[2]:
        changes.append(f"host kernels (attention, GEMM): {old[2]} -> {new[2]}")
    return "; ".join(changes) or "constants changed"


_graph_ids = Counter()


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, forward: bool = False, exact: bool = False) -> Any:
    """An AOTAutograd fw/bw compiler: returns a boxed callable running the graph as one executable
    (`exact`: a graph with symbolic sizes compiles one program per size its inputs have)."""
    from functorch.compile import make_boxed_func

    _graph_ids["graph"] += 1
    mutated: frozenset[int] | None = frozenset()
    if forward:  # the runtime wrapper applies input mutations after a forward graph runs
        mutated = None
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None)
        n_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        if meta is not None and len(meta.input_info) == n_inputs:
            mutated = frozenset(i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata)
    program = GraphProgram(gm, f"graph{_graph_ids['graph']}", mutated, exact)
    boxed = make_boxed_func(program)
    boxed.program = program  # for inspection (GraphProgram.hlo_texts)
    return boxed


def compile_forward(gm: torch.fx.GraphModule, example_inputs: list, exact: bool = False) -> Any:
    return compile_graph(gm, example_inputs, forward=True, exact=exact)


def _decompositions() -> dict:
    """Decompose exactly the ops we cannot lower: core ATen's table plus any other known decomposition."""
    from torch._decomp import decomposition_table

    return _decompositions_for(len(registry.LOWERINGS), len(decomposition_table))


@functools.lru_cache(maxsize=1)
def _decompositions_for(num_lowerings: int, num_decompositions: int) -> dict:
    """The table, built once per state of the two tables it reads (both only grow, so their sizes name
    the state): 0.2 s per graph, which the engine's shape buckets paid ~70 times at start-up."""
    from torch._decomp import decomposition_table

    return {op: fn for op, fn in {**decomposition_table, **core_aten_decompositions()}.items()
            if isinstance(op, torch._ops.OpOverload) and registry.find(op) is None}


_seen_graphs: dict[Any, list] = {}
# Set by recompiles_expected(): a caller that compiles one shape bucket after another on purpose.
_recompiles_expected: contextvars.ContextVar[bool] = contextvars.ContextVar("recompiles_expected", default=False)


@contextlib.contextmanager
def recompiles_expected() -> Iterator[None]:
    """Compiles inside this block (this thread or task only) for new input shapes are counted in
    metrics()["recompiles"] but not logged: for callers that compile shape buckets on purpose (the
    engine's warm-up). Loggers stay the application's to configure."""
    token = _recompiles_expected.set(True)
    try:
        yield
    finally:
        _recompiles_expected.reset(token)


def _log_recompile(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """Same graph structure, new input shapes: that is a recompile; say which input changed. Returns
    the structure (what the graph calls, in order).

    Size symbols Dynamo passes as graph inputs (after its automatic dynamic shapes saw a size change)
    are left out of both, so the first and later compiles of one function compare alike."""
    symbols = {i for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if _is_symbol(n.meta.get("example_value"))}
    structure = tuple((n.op, str(n.target)) for n in gm.graph.nodes
                      if not (n.op == "placeholder" and _is_symbol(n.meta.get("example_value"))))
    # (a symbolic size as the value it has in this call: comparing the SymInt itself with an int would
    # add a guard to Dynamo's graph)
    shapes = [bounded.ints(t.shape, None) if isinstance(t, torch.Tensor) else t
              for i, t in enumerate(example_inputs) if i not in symbols]
    previous = _seen_graphs.get(structure)
    if previous is not None and previous != shapes:
        changed = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(previous, shapes, strict=False)) if a != b]
        compile_counter["recompiles"] += 1
        if not _recompiles_expected.get():
            log.warning("torchbridge.compile: recompiling for new input shapes (%s)", "; ".join(changed))
    _seen_graphs[structure] = shapes
    return structure


def _is_symbol(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _specialize(gm: torch.fx.GraphModule) -> None:
    """Make every symbolic size of the graph's inputs the value it has in this call.

    Shapes are static on this backend (dynamic shapes are not supported yet). Dynamo's automatic
    dynamic shapes, a process-wide setting that other backends in the process rely on, turn a size
    that changed between calls into a symbol; evaluating each such symbol here records a guard
    (`s0 == 5`) in Dynamo's shape environment, so the graph traced below is static and Dynamo
    compiles again for the next size, as with `torch.compile(..., dynamic=False)`."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for size in (*value.shape, *value.stride(), value.storage_offset()):
                if _is_symbol(size):
                    guard_scalar(size)
        elif _is_symbol(value):
            guard_scalar(value)


class _Specialise(Exception):
    """A graph with symbolic sizes that some op cannot run padded (compile/bounded.py)."""


def _aot(gm: torch.fx.GraphModule, example_inputs: list, sizes: str) -> Any:
    """AOTAutograd with our compilers. `sizes`: "static" (no symbols left), "bounded" or "exact" (see
    tpu_backend); raises _Specialise when the forward or the backward graph cannot run that way."""
    from torch._functorch.partitioners import default_partition

    def check(graph: torch.fx.Graph) -> None:
        why = (bounded.unsupported(graph) if sizes == "bounded" else
               bounded.not_exact(graph) or _random_on_symbolic_sizes(graph) if sizes == "exact" else None)
        if why:
            raise _Specialise(why)

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = default_partition(joint, joint_inputs, **kwargs)
        check(fw.graph)
        check(bw.graph)
        return fw, bw

    exact = sizes == "exact"

    def forward(fw: torch.fx.GraphModule, inputs: list) -> Any:
        check(fw.graph)  # an inference graph (no partition)
        return compile_forward(fw, inputs, exact)

    def backward(bw: torch.fx.GraphModule, inputs: list) -> Any:
        return compile_graph(bw, inputs, exact=exact)

    # (F.scaled_dot_product_attention becomes one fused op in the graphs: the device answers PyTorch's
    # SDPA backend choice with it, lowerings/attention.py)
    return aot_autograd(fw_compiler=forward, bw_compiler=backward, partition_fn=partition,
                        decompositions=_decompositions(), keep_inference_input_mutations=True)(gm, example_inputs)


SIZE_MODES = ("bounded", "exact")


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
                options: dict | None = None) -> Any:
    """The function registered as torch.compile's `backend="tpu"`.

    XLA programs are static. A graph whose sizes are symbolic (Dynamo's automatic dynamic shapes saw an
    input's size change, as for any backend, or `dynamic=True`) runs, with the default
    `options={"symbolic_sizes": "bounded"}`, as bounded programs, one per padded size bucket, where
    every op on those sizes can run padded (compile/bounded.py); otherwise it is specialised: each new
    size compiles a new static program (pad to buckets yourself with torchbridge.compile.pad_to_bucket).
    With `"symbolic_sizes": "exact"` (for callers that already pad, like the engine's shape buckets) the
    one traced graph compiles one static program per size its inputs have, without padding and without
    Dynamo tracing again for each size. Nothing process-wide is changed: other backends keep Dynamo's
    automatic dynamic shapes (see _specialize). `mode` is accepted and ignored (one compile mode).
    """
    unknown = set(options or {}) - {"symbolic_sizes"}
    sizes = (options or {}).get("symbolic_sizes", "bounded")
    if unknown or sizes not in SIZE_MODES:
        raise ValueError(f"torch.compile(backend={STATE.name!r}): options may set 'symbolic_sizes' to one of "
                         f"{SIZE_MODES}; got {options}")
    # which inputs have symbolic sizes, with the graph's structure: the key of a decision to specialise
    symbolic = tuple(i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
                     if bounded.free_symbols(n.meta.get("example_value")))
    structure = (_log_recompile(gm, example_inputs), symbolic, sizes)
    if symbolic and structure not in _specialised:
        try:
            return _aot(gm, example_inputs, sizes)
        except _Specialise as e:
            log.info("torchbridge.compile: one program per size, traced for each (%s)", e)
            _specialised[structure] = str(e)
    if symbolic:
        _specialize(gm)
    return _aot(gm, example_inputs, "static")


# Graph structures found unable to run padded: their later sizes are specialised without tracing the
# graph twice (the engine compiles one structure for each of its many shape buckets).
_specialised: dict[Any, str] = {}


def register(name: str) -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS:
        register_backend(compiler_fn=tpu_backend, name=name)


def metrics() -> dict[str, Any]:
    counters = ("recompiles", "donated_calls", "recycled_outputs", "patterns", "collective_graphs", "collectives",
                "routed_from_inductor", "flex_attention_lowered", "replayed_calls")
    graphs = {k: v for k, v in compile_counter.items() if k not in counters}
    return {"graphs_compiled": sum(graphs.values()), **{k: compile_counter[k] for k in counters}, "by_graph": graphs}


def bucket(n: int, buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)) -> int:
    """The smallest bucket >= n (or n rounded up to a multiple of the largest bucket)."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def pad_to_bucket(x: torch.Tensor, dim: int = -1, value: float = 0, buckets: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pad `x` along `dim` to its shape bucket so compiled programs see few distinct shapes."""
    n = x.shape[dim]
    target = bucket(n, buckets) if buckets else bucket(n)
    if target == n:
        return x
    pad = [0, 0] * (x.dim() - (dim % x.dim()) - 1) + [0, target - n]
    return torch.nn.functional.pad(x, pad, value=value)
