"""Every collective on device tensors (the device's c10d backend) next to the same call on CPU tensors
through PyTorch's gloo (a second group with backend="gloo"): the reference. Writes one JSON per rank:
{"cases": [[name, ok, detail], ...]}. Run by tests/distributed/test_collectives.py under torchrun.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(sys.argv[1])
dist.init_process_group()  # no backend named: the device's c10d backend, gloo for CPU tensors
RANK, WORLD = dist.get_rank(), dist.get_world_size()
DEV = torch.device("tpu", int(os.environ["LOCAL_RANK"]))
ONLY = os.environ.get("TB_ONLY_CASES", "")
torch.tpu.set_device(DEV)
GLOO = dist.new_group(backend="gloo")
CASES: list[list] = []
R = dist.ReduceOp


def inputs(shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * RANK + salt)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    hi = 4 if dtype == torch.uint8 else 50
    return torch.randint(1, hi, shape, generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> tuple[bool, str]:
    a = a.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if exact or not a.dtype.is_floating_point:
        ok = torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                         b.view(torch.uint8) if b.dtype.is_floating_point else b) if a.dim() else torch.equal(a, b)
        return ok, "" if ok else f"{a.flatten()[:6].tolist()} vs {b.flatten()[:6].tolist()}"
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(a.dtype, 1e-5)
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return diff <= tol * (1 + b.double().abs().max().item() if b.numel() else 1), f"max diff {diff:.3g}"


def case(name: str, fn) -> None:
    if ONLY and ONLY not in name:  # TB_ONLY_CASES=substring runs a subset while debugging
        return
    try:
        ok, detail = fn()
    except Exception as e:  # noqa: BLE001 - a failing case is reported, the others still run
        ok, detail = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    CASES.append([name, bool(ok), detail])


# ---- all_reduce: every op, several dtypes ----------------------------------------------------------
OPS = {"SUM": R.SUM, "MAX": R.MAX, "MIN": R.MIN, "PRODUCT": R.PRODUCT, "BAND": R.BAND, "BOR": R.BOR,
       "BXOR": R.BXOR, "AVG": R.AVG, "PREMUL_SUM": dist._make_nccl_premul_sum(0.25)}
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.uint8)
for op_name, op in OPS.items():
    dtypes = INTS + (torch.bool,) if op_name in ("BAND", "BOR", "BXOR") else (
        FLOATS if op_name in ("AVG", "PREMUL_SUM") else FLOATS + INTS)
    for dt in dtypes:
        def run(op_name=op_name, op=op, dt=dt):
            x = inputs((5, 7), dt, salt=3)
            d = x.to(DEV)
            dist.all_reduce(d, op=op)
            ref = x.clone()
            if op_name == "AVG":  # gloo has no AVG: its SUM over the world size
                dist.all_reduce(ref, op=R.SUM, group=GLOO)
                ref = ref / WORLD
            elif op_name == "PREMUL_SUM":  # nor PREMUL_SUM: scale, then SUM
                ref = ref * 0.25
                dist.all_reduce(ref, op=R.SUM, group=GLOO)
            else:
                dist.all_reduce(ref, op=op, group=GLOO)
            return same(d, ref.to(dt), exact=op_name in ("MAX", "MIN"))
        case(f"all_reduce {op_name} {dt}", run)

# a 0-d tensor and a view (the write must land in the base's storage)
def run_views():
    base = inputs((4, 6), torch.float32, 5)
    d = base.to(DEV)
    dist.all_reduce(d[1:3, 2:5])
    ref = base.clone()
    part = ref[1:3, 2:5].contiguous()  # gloo reduces contiguous memory only
    dist.all_reduce(part, group=GLOO)
    ref[1:3, 2:5] = part
    return same(d, ref, exact=False)


case("all_reduce on a strided view", run_views)
case("all_reduce 0-d", lambda: (lambda d, r: (dist.all_reduce(d), dist.all_reduce(r, group=GLOO), same(d, r, False))[-1])(
    torch.tensor(float(RANK + 1)).to(DEV), torch.tensor(float(RANK + 1))))


def run_async():
    x = inputs((64,), torch.float32, 7)
    d = x.to(DEV)
    work = dist.all_reduce(d, async_op=True)
    work.wait()
    dist.all_reduce(x, group=GLOO)
    return same(d, x, exact=False)


case("all_reduce async_op", run_async)


def run_late_peers():
    """Rank 0 dispatches first and only then lets the other ranks start theirs (through the store): a
    collective that held its caller until every peer had arrived (XLA:CPU ran flop-free programs inline)
    leaves the others waiting for a key that never comes; after 15 s they join anyway (every rank runs
    the same sequence of collectives whatever happens) and the case fails."""
    store = dist.distributed_c10d._get_default_store()
    cases = (
        ("all_reduce", lambda d, o: dist.all_reduce(d), lambda x: (dist.all_reduce(x, group=GLOO), x)[1], 64),
        ("all_gather_into_tensor", lambda d, o: dist.all_gather_into_tensor(o, d),
         lambda x: (dist.all_gather_into_tensor(g := torch.empty(WORLD * 64), x, group=GLOO), g)[1], WORLD * 64),
        ("reduce_scatter_tensor", lambda d, o: dist.reduce_scatter_tensor(o, d),
         lambda x: (dist.reduce_scatter_tensor(g := torch.empty(64 // WORLD), x, group=GLOO), g)[1], 64 // WORLD))
    problems = []
    for k, (name, call, ref, out_numel) in enumerate(cases):
        x = inputs((64,), torch.float32, 20 + k)
        d, o = x.to(DEV), torch.empty(out_numel, device=DEV)
        # every rank compiles and runs this program once first: the timed-out wait must be the dispatch's
        call(d.clone(), o)
        torch.tpu.synchronize()
        dist.barrier()
        key = f"late-peers/{k}"
        if RANK == 0:
            call(d, o)
            store.set(key, "dispatched")  # reached only if the call returned before the peers joined
        else:
            try:
                store.wait([key], timedelta(seconds=15))
            except Exception as e:  # noqa: BLE001 - reported below, after joining the collective
                problems.append(f"{name}: rank 0's call did not return before this rank joined ({e})")
            call(d, o)
        ok, detail = same(o if name != "all_reduce" else d, ref(x.clone()), exact=False)
        if not ok:
            problems.append(f"{name}: {detail}")
    return not problems, "; ".join(problems)


if os.environ.get("TORCHBRIDGE_COLLECTIVES") != "host":  # host copies through gloo wait by design
    case("late peers: a collective returns before its peers arrive", run_late_peers)


def run_large_steady_state():
    """Large collectives called again and again (a training loop's gradient buckets): each result equals
    gloo's on CPU tensors, from the third call on it is written into the buffer its tensor held before
    (collectives.COUNTERS), and a 64 MiB all_reduce then maps no new memory. The kernel's fault counter is
    the reference: a fresh 64 MiB result is 16,384 first-touch faults (`getrusage`), whatever malloc does
    (above its mmap threshold every such block is new pages)."""
    import resource

    from torchbridge.distributed import collectives

    n = (64 << 20) // 4
    problems = []
    x = inputs((n,), torch.float32, 40) / 8
    d = x.to(DEV)
    ag_in = inputs((n // WORLD,), torch.float32, 41)
    ag_out, ag_ref = torch.empty(n, device=DEV), torch.empty(n)
    rs_in = inputs((n,), torch.float32, 42)
    rs_out, rs_ref = torch.empty(n // WORLD, device=DEV), torch.empty(n // WORLD)
    ag_d, rs_d = ag_in.to(DEV), rs_in.to(DEV)
    spares0 = collectives.COUNTERS["spare_results"]
    faults = []
    for i in range(4):
        torch.tpu.synchronize()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        dist.all_reduce(d, op=R.AVG)
        torch.tpu.synchronize()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        dist.all_reduce(x, group=GLOO)
        x /= WORLD
        dist.all_gather_into_tensor(ag_out, ag_d)
        dist.all_gather_into_tensor(ag_ref, ag_in, group=GLOO)
        dist.reduce_scatter_tensor(rs_out, rs_d)
        dist.reduce_scatter_tensor(rs_ref, rs_in, group=GLOO)
        for name, got, ref in (("all_reduce", d, x), ("all_gather_into_tensor", ag_out, ag_ref),
                               ("reduce_scatter_tensor", rs_out, rs_ref)):
            ok, detail = same(got, ref, exact=False)
            if not ok:
                problems.append(f"call {i}: {name}: {detail}")
    spares = collectives.COUNTERS["spare_results"] - spares0
    # calls 0 and 1 write fresh buffers (the first's tensor held none of the result's size yet); from the
    # third call of each of the three collectives on, a spare
    if spares < 3 * 2:
        problems.append(f"{spares} of 12 results written into spare buffers, expected at least 6")
    if max(faults[2:]) > 16384 // 4:
        problems.append(f"page faults per 64 MiB all_reduce {faults}: its result is fresh memory every call")
    return not problems, "; ".join(problems) or f"faults per all_reduce {faults}, {spares} spares used"


if os.environ.get("TORCHBRIDGE_COLLECTIVES") != "host":  # the host-copy transport writes through gloo
    case("large collectives in steady state reuse their buffers", run_large_steady_state)


def run_coalesced():
    xs = [inputs((3, 4), torch.float32, 11), inputs((6,), torch.float32, 12)]
    ds = [x.to(DEV) for x in xs]
    with dist._coalescing_manager():
        for d in ds:
            dist.all_reduce(d)
    for x in xs:
        dist.all_reduce(x, group=GLOO)
    return all(same(d, x, False)[0] for d, x in zip(ds, xs, strict=True)), ""


case("all_reduce coalesced", run_coalesced)


def run_batch_p2p():
    # a ring: every rank sends to the next and receives from the previous, in one batch
    x = inputs((4,), torch.float32, 13)
    got = torch.zeros(4, device=DEV)
    ops = [dist.P2POp(dist.isend, x.to(DEV), (RANK + 1) % WORLD), dist.P2POp(dist.irecv, got, (RANK - 1) % WORLD)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ref = torch.zeros(4)
    refs = [dist.P2POp(dist.isend, x, (RANK + 1) % WORLD, GLOO), dist.P2POp(dist.irecv, ref, (RANK - 1) % WORLD, GLOO)]
    for w in dist.batch_isend_irecv(refs):
        w.wait()
    return same(got, ref, exact=True)


case("batch_isend_irecv ring", run_batch_p2p)

# ---- broadcast: bits, not sums (-0.0 and NaN arrive as they left) ----------------------------------
for root in range(WORLD):
    for dt in (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.complex64):
        def run(root=root, dt=dt):
            if dt == torch.complex64:
                x = torch.complex(inputs((3, 4), torch.float32, 20), inputs((3, 4), torch.float32, 21))
            else:
                x = inputs((3, 4), dt, 20)
            if dt.is_floating_point:
                x[0, 0], x[0, 1] = -0.0, float("nan")
            d = x.to(DEV)
            dist.broadcast(d, src=root)
            ref = x.clone()
            dist.broadcast(ref, src=root, group=GLOO)
            return same(d, ref, exact=True)
        case(f"broadcast root={root} {dt}", run)

# ---- gathers and scatters ------------------------------------------------------------------------
for dt in (torch.float32, torch.int64, torch.bfloat16):
    def run_ag(dt=dt):
        x = inputs((3, 5), dt, 30)
        outs = [torch.empty(3, 5, dtype=dt, device=DEV) for _ in range(WORLD)]
        dist.all_gather(outs, x.to(DEV))
        refs = [torch.empty(3, 5, dtype=dt) for _ in range(WORLD)]
        dist.all_gather(refs, x, group=GLOO)
        return same(torch.stack([o.cpu() for o in outs]), torch.stack(refs), exact=True)

    def run_agt(dt=dt):
        x = inputs((3, 5), dt, 31)
        out = torch.empty(3 * WORLD, 5, dtype=dt, device=DEV)
        dist.all_gather_into_tensor(out, x.to(DEV))
        ref = torch.empty(3 * WORLD, 5, dtype=dt)
        dist.all_gather_into_tensor(ref, x, group=GLOO)
        return same(out, ref, exact=True)

    case(f"all_gather {dt}", run_ag)
    case(f"all_gather_into_tensor {dt}", run_agt)

for op_name in ("SUM", "MAX", "AVG"):
    def run_rst(op_name=op_name):
        x = inputs((2 * WORLD, 3), torch.float32, 40)
        out = torch.empty(2, 3, device=DEV)
        dist.reduce_scatter_tensor(out, x.to(DEV), op=OPS[op_name])
        ref = torch.empty(2, 3)
        dist.reduce_scatter_tensor(ref, x, op=R.SUM if op_name == "AVG" else OPS[op_name], group=GLOO)
        return same(out, ref / WORLD if op_name == "AVG" else ref, exact=op_name == "MAX")

    def run_rs(op_name=op_name):
        xs = [inputs((4,), torch.float32, 50 + i) for i in range(WORLD)]
        out = torch.empty(4, device=DEV)
        dist.reduce_scatter(out, [x.to(DEV) for x in xs], op=OPS[op_name])
        ref = torch.empty(4)
        dist.reduce_scatter(ref, xs, op=R.SUM if op_name == "AVG" else OPS[op_name], group=GLOO)
        return same(out, ref / WORLD if op_name == "AVG" else ref, exact=op_name == "MAX")

    case(f"reduce_scatter_tensor {op_name}", run_rst)
    case(f"reduce_scatter {op_name}", run_rs)


def run_a2a_even():
    x = inputs((2 * WORLD, 3), torch.float32, 60)
    out = torch.empty(2 * WORLD, 3, device=DEV)
    dist.all_to_all_single(out, x.to(DEV))
    ref = torch.empty(2 * WORLD, 3)
    dist.all_to_all_single(ref, x, group=GLOO)
    return same(out, ref, exact=True)


def run_a2a_uneven():
    # rank r sends (r + j) % 3 + 1 rows to rank j; so it receives (i + r) % 3 + 1 rows from rank i
    send = [(RANK + j) % 3 + 1 for j in range(WORLD)]
    recv = [(i + RANK) % 3 + 1 for i in range(WORLD)]
    x = inputs((sum(send), 2), torch.int64, 61)
    out = torch.empty(sum(recv), 2, dtype=torch.int64, device=DEV)
    dist.all_to_all_single(out, x.to(DEV), output_split_sizes=recv, input_split_sizes=send)
    ref = torch.empty(sum(recv), 2, dtype=torch.int64)
    dist.all_to_all_single(ref, x, output_split_sizes=recv, input_split_sizes=send, group=GLOO)
    return same(out, ref, exact=True)


def run_a2a_list():
    xs = [inputs((j + 1, 2), torch.float32, 70 + j) for j in range(WORLD)]
    outs = [torch.empty(RANK + 1, 2, device=DEV) for _ in range(WORLD)]
    dist.all_to_all(outs, [x.to(DEV) for x in xs])
    # gloo's all_to_all wants equal sizes: the same exchange as all_to_all_single with splits
    ref = torch.empty(WORLD * (RANK + 1), 2)
    dist.all_to_all_single(ref, torch.cat(xs), output_split_sizes=[RANK + 1] * WORLD,
                           input_split_sizes=[x.shape[0] for x in xs], group=GLOO)
    return same(torch.cat([o.cpu() for o in outs]), ref, exact=True)


case("all_to_all_single even", run_a2a_even)
case("all_to_all_single uneven splits", run_a2a_uneven)
case("all_to_all lists of uneven tensors", run_a2a_list)

ROOT = WORLD - 1


def run_scatter():
    chunks = [inputs((2, 3), torch.float32, 80 + i) for i in range(WORLD)]
    out = torch.empty(2, 3, device=DEV)
    dist.scatter(out, [c.to(DEV) for c in chunks] if RANK == ROOT else None, src=ROOT)
    ref = torch.empty(2, 3)
    dist.scatter(ref, chunks if RANK == ROOT else None, src=ROOT, group=GLOO)
    return same(out, ref, exact=True)


def run_gather():
    x = inputs((2, 3), torch.float32, 90)
    outs = [torch.empty(2, 3, device=DEV) for _ in range(WORLD)] if RANK == ROOT else None
    dist.gather(x.to(DEV), outs, dst=ROOT)
    refs = [torch.empty(2, 3) for _ in range(WORLD)] if RANK == ROOT else None
    dist.gather(x, refs, dst=ROOT, group=GLOO)
    if RANK != ROOT:
        return True, ""
    return same(torch.stack([o.cpu() for o in outs]), torch.stack(refs), exact=True)


def run_reduce():
    x = inputs((4, 4), torch.float32, 95)
    d = x.to(DEV)
    dist.reduce(d, dst=0)
    ref = x.clone()
    dist.reduce(ref, dst=0, group=GLOO)
    return same(d, ref, exact=False) if RANK == 0 else (True, "")  # non-roots' contents are unspecified


case("scatter", run_scatter)
case("gather", run_gather)
case("reduce", run_reduce)


# ---- point to point: pairs (0,1), (2,3), ...; odd world sizes leave the last rank out --------------
def run_p2p():
    peer = RANK ^ 1
    if peer >= WORLD:
        return True, "no peer"
    x = inputs((5,), torch.int64, 100)
    got = torch.zeros(5, dtype=torch.int64, device=DEV)
    ref = torch.zeros(5, dtype=torch.int64)
    if RANK % 2 == 0:
        dist.send(x.to(DEV), dst=peer)
        dist.recv(got, src=peer)
        dist.send(x, dst=peer, group=GLOO)
        dist.recv(ref, src=peer, group=GLOO)
    else:
        dist.recv(got, src=peer)
        dist.send(x.to(DEV), dst=peer)
        dist.recv(ref, src=peer, group=GLOO)
        dist.send(x, dst=peer, group=GLOO)
    return same(got, ref, exact=True)


case("send/recv", run_p2p)


# ---- sub-groups: halves of the world (every rank in one), reversed order -------------------------
def run_subgroups():
    halves = [list(range(WORLD // 2)), list(range(WORLD // 2, WORLD))]
    groups = [dist.new_group(h) for h in halves]
    refs = [dist.new_group(h, backend="gloo") for h in halves]
    mine = 0 if RANK in halves[0] else 1
    x = inputs((6,), torch.float32, 110)
    d = x.to(DEV)
    dist.all_reduce(d, group=groups[mine])
    dist.all_reduce(x, group=refs[mine])
    rev = dist.new_group(list(reversed(range(WORLD))))
    y = inputs((3,), torch.float32, 111)
    dy = y.to(DEV)
    dist.broadcast(dy, src=0, group=rev)  # global rank 0 is the last rank of `rev`
    dist.broadcast(y, src=0, group=GLOO)
    return same(d, x, False)[0] and same(dy, y, True)[0], ""


case("sub-groups", run_subgroups)


# ---- DTensor's random ops: a sharded random init equals the unsharded one -----------------------
def run_dtensor_random():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("tpu", (WORLD,))
    torch.manual_seed(11)
    whole = torch.empty(8 * WORLD, 6, device=DEV).normal_().cpu()
    torch.manual_seed(11)
    d = distribute_tensor(torch.empty(8 * WORLD, 6, device=DEV), mesh, [Shard(0)])
    d.normal_()
    return same(d.to_local(), whole[8 * RANK:8 * (RANK + 1)], exact=True)


case("DTensor sharded normal_ equals the unsharded draw", run_dtensor_random)


# ---- functional collectives inside compiled graphs: XLA collectives in the graph's program ---------
def run_compiled_functional():
    import torch.distributed._functional_collectives as funcol

    import torchbridge.compile

    def f(x, group):
        a = funcol.all_reduce(x, "sum", group)
        b = funcol.all_gather_tensor(x * 2, 0, group)
        c = funcol.reduce_scatter_tensor(x + 1, "sum", 0, group)
        d = funcol.all_to_all_single(x - 1, None, None, group)
        e = funcol.broadcast(x * 3, 0, group)
        return a * 1, b * 1, c * 1, d * 1, e * 1

    x = inputs((2 * WORLD, 3), torch.float32, 130)
    before = torchbridge.compile.metrics()["collectives"]
    got = torch.compile(f, backend="tpu", fullgraph=True)(x.to(DEV), dist.group.WORLD)
    ref = f(x, GLOO)  # the same calls on CPU tensors over gloo
    if torchbridge.compile.metrics()["collectives"] - before < 5:
        return False, f"collectives lowered into the graph: {torchbridge.compile.metrics()['collectives'] - before}"
    return all(same(g, r, False)[0] for g, r in zip(got, ref, strict=True)), ""


case("compiled functional collectives (one group)", run_compiled_functional)


def run_compiled_two_groups():
    """A graph with collectives over both dimensions of a 2-d mesh: one program, one mesh axis per group."""
    if WORLD < 4:
        return True, "needs 4 ranks"
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("tpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    ref_mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    rdp, rtp = ref_mesh.get_group("dp"), ref_mesh.get_group("tp")

    def g(x, dp, tp):
        y = funcol.all_reduce(x, "sum", dp)
        z = funcol.all_gather_tensor(y * 2, 0, tp)
        return funcol.all_reduce(z, "max", dp) * 1

    x = inputs((3, 2), torch.float32, 140)
    got = torch.compile(g, backend="tpu", fullgraph=True)(x.to(DEV), dp, tp)
    return same(got, g(x, rdp, rtp), False)


case("compiled collectives over two mesh dimensions", run_compiled_two_groups)


# ---- CPU tensors through the device's backend go to gloo ------------------------------------------
def run_cpu():
    """Every collective FSDP2/DDP call with CPU tensors on the default (device) group equals gloo's."""
    x = inputs((4 * WORLD,), torch.float32, 120)
    got, ref = [], []
    for group, out in ((None, got), (GLOO, ref)):
        a = x.clone()
        dist.all_reduce(a, group=group)
        g = torch.empty(4 * WORLD * WORLD)
        dist.all_gather_into_tensor(g, x, group=group)
        gl = [torch.empty(4 * WORLD) for _ in range(WORLD)]
        dist.all_gather(gl, x, group=group)
        rs = torch.empty(4)
        dist.reduce_scatter_tensor(rs, x, group=group)
        rl = torch.empty(4)
        dist.reduce_scatter(rl, list(x.chunk(WORLD)), group=group)
        aa = torch.empty(4 * WORLD)
        dist.all_to_all_single(aa, x, group=group)
        b = x.clone()
        dist.broadcast(b, src=0, group=group)
        work = dist.all_reduce(x.clone(), group=group, async_op=True)
        work.wait()
        out += [a, g, torch.cat(gl), rs, rl, aa, b]
    names = ["all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
             "all_to_all_single", "broadcast"]
    for name, p, q in zip(names, got, ref, strict=True):
        ok, why = same(p, q, exact=True)
        if not ok:
            return False, f"{name}: {why}"
    return True, ""


case("CPU tensors on the default group", run_cpu)


# ---- bad input: PyTorch's own errors, raised before any collective runs ---------------------------
def expect_error(fn, *needles: str):
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        msg = str(e)
        return all(n in msg for n in needles), msg[:200]
    return False, "no error"


case("error: all_gather_into_tensor output too small", lambda: expect_error(
    lambda: dist.all_gather_into_tensor(torch.empty(3, device=DEV), torch.ones(2, device=DEV))))
case("error: all_gather list of the wrong length", lambda: expect_error(
    lambda: dist.all_gather([torch.empty(2, device=DEV)], torch.ones(2, device=DEV)), "list"))
case("error: tensors on two device types", lambda: expect_error(
    lambda: dist.all_gather([torch.empty(2, device=DEV)] * (WORLD - 1) + [torch.empty(2)], torch.ones(2, device=DEV))))
case("error: BAND on floats", lambda: expect_error(
    lambda: dist.all_reduce(torch.ones(2, device=DEV), op=R.BAND), "BAND"))
case("error: another device of this rank", lambda: expect_error(
    lambda: dist.all_reduce(torch.ones(2, device=torch.device("tpu", (DEV.index + 1) % WORLD))), "computes on"))

dist.barrier()
(OUT / f"rank{RANK}.json").write_text(json.dumps({"cases": CASES}))
dist.destroy_process_group()
