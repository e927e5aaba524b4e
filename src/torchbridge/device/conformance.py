"""OpInfo conformance: run PyTorch's own OpInfo samples on the CPU and on the device and compare.

    python -m torchbridge.device.conformance [--all] [--ops a,b,...] [--write docs/ops.md] [--jobs N]

For every OpInfo in `op_db` (or the selected ones) three variants are checked:

* `f32`: float32 forward, device output vs CPU output (`torch.testing.assert_close`);
* `i64`: int64 forward (exact), when the op supports int64 on the CPU;
* `bwd`: float32 backward, gradients of the sum of the float outputs w.r.t. every float input that
  requires grad, when the op supports autograd.

Random ops (OpInfo's `has_nondeterministic_output`, or CPU outputs that change with the seed) are
only compared on shape and dtype, and are counted apart: the headline forward pass rate is over
non-random ops. Every op runs in a worker subprocess with a wall-clock cap, so a hang or a crash in
one op costs that op, never the sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

VARIANTS = ("f32", "i64", "bwd")
DEVICE = "tpu"

# Tolerances. torch.testing's float32 defaults are atol=1e-5, rtol=1.3e-6 (about 10 ulp). XLA's CPU
# and TPU backends use their own polynomial approximations for transcendental functions (a few ulp
# apart from PyTorch's SLEEF/libm ones) and reassociate reductions/matmuls (tree vs. sequential
# accumulation), so we allow 10x the defaults in the forward. Gradients chain several such ops
# (e.g. a softmax backward is exp, sum, mul, sub), so they get another factor ~10 in rtol.
TOL = {
    "f32": {"atol": 1e-4, "rtol": 1.3e-5},
    "bwd": {"atol": 1e-4, "rtol": 1e-4},
    "i64": {"atol": 0, "rtol": 0},
}

# Ops whose outputs are uninitialised memory: only shape/dtype mean anything.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


@dataclasses.dataclass
class Result:
    status: str  # pass | fail | skip | rand (random op: shape/dtype agree) | timeout | crash
    note: str = ""
    samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def op_key(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def all_ops() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


# ---- moving and comparing values -------------------------------------------------------------

class _Skip(Exception):
    pass


def _to_device(value: Any, leaves: dict[int, Any] | None = None) -> Any:
    """Copy a sample's structure to the device; float leaves that require grad stay leaves there."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise _Skip(f"sparse/non-strided input ({value.layout})")
        if value.is_complex():
            raise _Skip("complex input")
        t = value.detach().to(DEVICE)
        if value.requires_grad:
            t.requires_grad_(True)
            if leaves is not None:
                leaves[id(value)] = t
        return t
    if (isinstance(value, torch.device) and value.type == "cpu") or (isinstance(value, str) and value == "cpu"):
        return torch.device(DEVICE)  # e.g. x.to("cpu", torch.float64): the device run asks for the device
    if isinstance(value, list):
        return [_to_device(v, leaves) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, leaves) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, leaves) for k, v in value.items()}
    return value


def _with_storage(value: Any, leaves: dict[int, Any]) -> Any:
    """The input moved with its whole storage and the same view of it: as_strided reads storage outside
    the view (a plain .to() copies only the view's elements)."""
    import torch

    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_complex():
        return _to_device(value, leaves)
    flat = torch.empty(0, dtype=value.dtype)
    flat.set_(value.detach().untyped_storage(), 0, (value.untyped_storage().nbytes() // value.element_size(),))
    t = flat.to(DEVICE).as_strided(value.size(), value.stride(), value.storage_offset()).detach()
    if value.requires_grad:
        t.requires_grad_(True)
        leaves[id(value)] = t
    return t


# Positional arguments that PyTorch requires on the CPU whatever the device (CUDA raises too).
_HOST_ARGS = {"tensor_split": (0,)}


def _kwargs_to_device(kwargs: dict[str, Any], leaves: dict[int, Any] | None) -> dict[str, Any]:
    out = {}
    for k, v in kwargs.items():
        if k == "device" and (v == "cpu" or getattr(v, "type", None) == "cpu"):
            v = DEVICE
        out[k] = _to_device(v, leaves)
    return out


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_flat(v))
        return out
    return [value]


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def _compare(expected: Any, actual: Any, tol: dict[str, float], shape_only: bool, on_device: bool = True) -> None:
    import torch

    exp_l, act_l = _flat(expected), _flat(actual)
    if len(exp_l) != len(act_l):
        raise AssertionError(f"output count {len(act_l)} != {len(exp_l)}")
    for e, a in zip(exp_l, act_l, strict=True):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(f"expected a tensor, got {type(a).__name__}")
            if on_device and a.device.type != DEVICE and e.device.type == "cpu":
                raise AssertionError(f"output on {a.device}, expected on {DEVICE}")
            a = _to_cpu(a)
            if shape_only:
                if a.shape != e.shape or a.dtype != e.dtype:
                    raise AssertionError(f"shape/dtype {tuple(a.shape)}/{a.dtype} != {tuple(e.shape)}/{e.dtype}")
                continue
            single = e.dtype in (torch.float32, torch.complex64)  # complex outputs of real ops (fft)
            t = (tol if tol["atol"] else TOL["f32"]) if single else {}
            torch.testing.assert_close(a, e, equal_nan=True, check_device=False, check_stride=False, **t)
        elif isinstance(e, float) and isinstance(a, float) and not shape_only:
            torch.testing.assert_close(a, e, equal_nan=True, **tol)
        elif e is not None and not shape_only and e != a:
            raise AssertionError(f"{a!r} != {e!r}")


def _max_diff(msg: str) -> str:
    for line in msg.splitlines():
        if "Greatest absolute difference" in line:
            return line.strip()
    return ""


def _short(exc: BaseException) -> str:
    msg = str(exc).strip()
    first = msg.splitlines()[0] if msg else ""
    diff = _max_diff(msg)
    text = f"{type(exc).__name__}: {first}" + (f" ({diff})" if diff and diff not in first else "")
    return text[:300]


# ---- one op, one variant ---------------------------------------------------------------------

class _SampleTimeout(BaseException):  # not an Exception: the sample code's handlers must not swallow it
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _SampleTimeout()


def _clone(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value) if type(value) in (list, tuple) else [_clone(v) for v in value]
    return value


def _calls_seeded_op(op: Any, s: Any) -> bool:
    """Whether the op draws random numbers: some OpInfos wrap a random op in a fixed seed
    (`wrapper_set_seed`), so comparing two seeds cannot see it; the aten ops it calls can."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        seeded = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                Spy.seeded = True
            return func(*args, **(kwargs or {}))

    try:
        with Spy():
            op(_clone(s.input), *_clone(list(s.args)), **{k: _clone(v) for k, v in s.kwargs.items()})
    except Exception:
        return False
    return Spy.seeded


def _is_random(op: Any, samples: list[Any]) -> bool:
    import torch

    if getattr(op, "has_nondeterministic_output", False) or op.name in UNINITIALISED:
        return True
    if not samples:
        return False
    s = samples[0]
    if any(_calls_seeded_op(op, x) for x in samples):
        return True
    try:
        # Fresh copies of the inputs and snapshots of the outputs: an in-place op mutates its input.
        torch.manual_seed(0)
        a = _clone(op(_clone(s.input), *_clone(list(s.args)), **{k: _clone(v) for k, v in s.kwargs.items()}))
        torch.manual_seed(1)
        b = _clone(op(_clone(s.input), *_clone(list(s.args)), **{k: _clone(v) for k, v in s.kwargs.items()}))
        _compare(a, b, {"atol": 0, "rtol": 0}, shape_only=False, on_device=False)
    except _Skip:
        return False
    except AssertionError:
        return True
    except Exception:
        return False
    return False


def check(op: Any, variant: str, max_samples: int = 8, budget_s: float = 60.0, sample_s: int = 30) -> Result:
    """Compare `op` on the device with the CPU for one variant. Never raises."""
    import torch

    try:
        return _check(op, variant, max_samples, budget_s, sample_s)
    except _Skip as e:
        return Result("skip", str(e))
    except _SampleTimeout:
        return Result("timeout", f"a sample ran over {sample_s}s")
    except Exception as e:  # sample generation itself failing must not stop the sweep
        return Result("skip", f"sample generation failed: {_short(e)}")
    finally:
        torch.set_grad_enabled(True)


def _check(op: Any, variant: str, max_samples: int, budget_s: float, sample_s: int) -> Result:
    import torch

    dtype = torch.int64 if variant == "i64" else torch.float32
    if not op.supports_dtype(dtype, "cpu"):
        if variant == "f32" and not op.supports_dtype(torch.int64, "cpu") and any(
                op.supports_dtype(d, "cpu") for d in (torch.complex64, torch.complex128)):
            return Result("skip", "complex-only op")
        return Result("skip", f"{dtype} not supported on CPU")
    if variant == "bwd":
        if not op.supports_autograd:
            return Result("skip", "no autograd support")
        if dtype not in op.supported_backward_dtypes("cpu"):
            return Result("skip", "float32 backward not supported")
    grad = variant == "bwd"
    torch.manual_seed(0)
    samples = []
    for s in op.sample_inputs("cpu", dtype, requires_grad=grad):
        samples.append(s)
        if len(samples) >= max_samples:
            break
    if not samples:
        return Result("skip", "no samples")
    random = _is_random(op, samples)
    if random and grad:
        return Result("skip", "random op: gradients not comparable")
    tol = TOL[variant]
    start = time.monotonic()
    done = 0
    skipped: list[str] = []
    old = signal.signal(signal.SIGALRM, _alarm) if hasattr(signal, "SIGALRM") else None
    try:
        for i, s in enumerate(samples):
            if done and time.monotonic() - start > budget_s:
                break
            if hasattr(signal, "SIGALRM"):
                signal.alarm(sample_s)
            try:
                err = _run_sample(op, s, tol, grad, random)
            finally:
                if hasattr(signal, "SIGALRM"):
                    signal.alarm(0)
            if err is None:
                done += 1
            elif err.startswith("skip:"):
                skipped.append(err[5:])
            else:
                return Result("fail", f"sample {i}: {err}", done)
    finally:
        if old is not None:
            signal.signal(signal.SIGALRM, old)
    if not done:
        return Result("skip", skipped[0] if skipped else "no samples ran")
    note = "random: shape/dtype only" if random else ""
    if done < len(samples) - len(skipped):
        note = (note + "; " if note else "") + f"{done}/{len(samples)} samples within {budget_s:.0f}s"
    return Result("rand" if random else "pass", note, done)


def _run_sample(op: Any, s: Any, tol: dict[str, float], grad: bool, random: bool) -> str | None:
    """None if the sample agrees, 'skip:<why>' if it cannot be compared, else the error."""
    import torch

    # Copy to the device first: an in-place op mutates the CPU sample.
    leaves: dict[int, Any] = {}
    try:
        d_input = _with_storage(s.input, leaves) if op.name.startswith("as_strided") else _to_device(s.input, leaves)
        d_args = _to_device(s.args, leaves)
        for i in _HOST_ARGS.get(op.name, ()):
            if i < len(s.args):  # an argument the op requires on the CPU (as on CUDA)
                d_args = d_args[:i] + (s.args[i],) + d_args[i + 1:]
        d_kwargs = _kwargs_to_device(s.kwargs, leaves)
    except _Skip as e:
        return f"skip:{e}"
    try:
        torch.manual_seed(0)
        expected = op(s.input, *s.args, **s.kwargs)
    except Exception as e:
        return f"skip:CPU raises ({_short(e)})"
    try:
        torch.manual_seed(0)
        actual = op(d_input, *d_args, **d_kwargs)
        _compare(expected, actual, tol, shape_only=random)
    except _Skip as e:
        return f"skip:{e}"
    except _SampleTimeout:
        raise
    except AssertionError as e:
        if grad or random or not _closer_to_float64(op, s, actual, tol):
            return _short(e)
    except Exception as e:
        return _short(e)
    if not grad:
        return None
    # Backward: d(sum of float outputs)/d(inputs), CPU vs device.
    cpu_leaves = [t for t in _flat([s.input, list(s.args), list(s.kwargs.values())])
                  if isinstance(t, torch.Tensor) and t.requires_grad and id(t) in leaves]
    exp_outs = [o for o in _flat(expected) if isinstance(o, torch.Tensor) and o.requires_grad
                and o.dtype.is_floating_point]
    if not cpu_leaves or not exp_outs:
        return "skip:no differentiable outputs"
    dev_leaves = [leaves[id(t)] for t in cpu_leaves]
    dev_outs = [o for o in _flat(actual) if isinstance(o, torch.Tensor) and o.requires_grad
                and o.dtype.is_floating_point]
    if len(dev_outs) != len(exp_outs):
        return f"{len(dev_outs)} differentiable outputs, expected {len(exp_outs)}"
    try:
        exp_g = torch.autograd.grad(sum(o.sum() for o in exp_outs), cpu_leaves, allow_unused=True)
    except Exception as e:
        return f"skip:CPU backward raises ({_short(e)})"
    try:
        act_g = torch.autograd.grad(sum(o.sum() for o in dev_outs), dev_leaves, allow_unused=True)
        _compare(list(exp_g), list(act_g), tol, shape_only=False)
    except _Skip as e:
        return f"skip:{e}"
    except _SampleTimeout:
        raise
    except Exception as e:
        return "backward: " + _short(e)
    return None


def _closer_to_float64(op: Any, s: Any, actual: Any, tol: dict[str, float]) -> bool:
    """Whether a float32 device result that misses the CPU float32 result matches the CPU float64
    result (rounded to float32) instead: the device is then the more accurate one (e.g. polygamma
    near its poles), which is not a conformance failure."""
    import torch

    def up(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().double() if v.dtype == torch.float32 else v
        if isinstance(v, (list, tuple)):
            return type(v)(up(x) for x in v)
        return v

    try:
        ref = op(up(s.input), *up(s.args), **{k: up(v) for k, v in s.kwargs.items()})
        ref = [r.float() if isinstance(r, torch.Tensor) and r.dtype == torch.float64 else r for r in _flat(ref)]
        _compare(ref, _flat(actual), tol, shape_only=False)
    except Exception:
        return False
    return True


def check_op(op: Any, variants: Iterable[str] = VARIANTS, **kw: Any) -> dict[str, Result]:
    return {v: check(op, v, **kw) for v in variants}


# ---- worker subprocesses -------------------------------------------------------------------------

_MARK = "@@conformance@@ "


def _worker(max_samples: int, budget_s: float) -> None:
    """Read op keys from stdin, write one JSON result line per op (marked, other output is noise)."""
    import torch  # noqa: F401

    import torchbridge  # noqa: F401 - registers the device

    ops = {op_key(o): o for o in all_ops()}
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever ops print goes to stderr, not into the protocol
    out.write(_MARK + json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        key = line.strip()
        if not key:
            continue
        res = check_op(ops[key], max_samples=max_samples, budget_s=budget_s)
        out.write(_MARK + json.dumps({"op": key, "res": {v: r.as_dict() for v, r in res.items()}}) + "\n")


class _Worker:
    def __init__(self, args: argparse.Namespace, log: Any) -> None:
        cmd = [sys.executable, "-m", "torchbridge.device.conformance", "--worker",
               "--max-samples", str(args.max_samples), "--budget", str(args.budget)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     start_new_session=True)
        self.buf = b""
        self.op: str | None = None
        self.since = 0.0
        self.ready = False

    def send(self, key: str) -> None:
        self.op = key
        self.since = time.monotonic()
        assert self.proc.stdin is not None
        self.proc.stdin.write((key + "\n").encode())
        self.proc.stdin.flush()

    def feed(self) -> list[dict[str, Any]] | None:
        """New protocol messages, or None when the worker has died."""
        assert self.proc.stdout is not None
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return None
        self.buf += chunk
        msgs = []
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith(_MARK):
                msgs.append(json.loads(text[len(_MARK):]))
        return msgs

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def sweep(keys: list[str], args: argparse.Namespace) -> dict[str, dict[str, Result]]:
    results: dict[str, dict[str, Result]] = {}
    pending = list(keys)
    log = open(args.log, "ab") if args.log else subprocess.DEVNULL  # noqa: SIM115
    sel = selectors.DefaultSelector()
    workers: list[_Worker] = []
    startup_s = 300.0

    def spawn() -> None:
        w = _Worker(args, log)
        w.since = time.monotonic()
        assert w.proc.stdout is not None
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        workers.append(w)

    def retire(w: _Worker, status: str, note: str) -> None:
        sel.unregister(w.proc.stdout)
        w.kill()
        workers.remove(w)
        if w.op is not None:
            results[w.op] = {v: Result(status, note) for v in VARIANTS}
            _progress(w.op, results[w.op], len(results), len(keys))
        if pending or any(x.op for x in workers):
            spawn()

    def dispatch_next(w: _Worker) -> None:
        w.op = None
        if pending:
            w.send(pending.pop(0))

    for _ in range(min(args.jobs, len(keys))):
        spawn()
    while pending or any(w.op for w in workers):
        events = sel.select(timeout=5)
        for sk, _ in events:
            w = sk.data
            msgs = w.feed()
            if msgs is None:
                retire(w, "crash", "worker process died (crash or out of memory) in this op")
                continue
            for m in msgs:
                if m.get("ready"):
                    w.ready = True
                    dispatch_next(w)
                elif "op" in m:
                    res = {v: Result(**r) for v, r in m["res"].items()}
                    results[m["op"]] = res
                    _progress(m["op"], res, len(results), len(keys))
                    if args.json and len(results) % 10 == 0:  # a killed sweep keeps what it has done
                        save_json(args.json, results)
                    dispatch_next(w)
        now = time.monotonic()
        for w in list(workers):
            if w.op is not None and now - w.since > args.op_timeout:
                retire(w, "timeout", f"op ran over {args.op_timeout:.0f}s (all variants together)")
            elif not w.ready and now - w.since > startup_s:
                raise RuntimeError("conformance worker did not start; run with --log to see why")
        if not workers and (pending or any(w.op for w in workers)):
            spawn()
    for w in workers:
        sel.unregister(w.proc.stdout)
        w.kill()
    return results


def save_json(path: str, results: dict[str, dict[str, Result]]) -> dict[str, dict[str, Result]]:
    """Merge `results` into the JSON file at `path`; returns the merged results."""
    raw = {}
    if os.path.exists(path):
        with open(path) as f:
            raw = json.load(f)
    raw.update({k: {v: r.as_dict() for v, r in res.items()} for k, res in results.items()})
    with open(path + ".tmp", "w") as f:
        json.dump(raw, f, indent=0, sort_keys=True)
    os.replace(path + ".tmp", path)
    return {k: {v: Result(**r) for v, r in res.items()} for k, res in raw.items()}


def _progress(key: str, res: dict[str, Result], n: int, total: int) -> None:
    cells = " ".join(f"{v}={r.status}" for v, r in res.items())
    notes = "; ".join(f"{v}: {r.note}" for v, r in res.items() if r.status in ("fail", "timeout", "crash"))
    print(f"[{n}/{total}] {key}: {cells}" + (f"  ({notes[:200]})" if notes else ""), flush=True)


# ---- the report ----------------------------------------------------------------------------------

def summarize(results: dict[str, dict[str, Result]]) -> dict[str, tuple[int, int]]:
    """Per variant: (passed, counted). f32 counts non-random ops only; skips are not counted."""
    out = {}
    for v in VARIANTS:
        counted = [r[v] for r in results.values() if r[v].status not in ("skip", "rand")]
        out[v] = (sum(r.status == "pass" for r in counted), len(counted))
    return out


def _cell(r: Result) -> str:
    return {"pass": "pass", "fail": "**fail**", "skip": "skip", "rand": "rand-ok", "timeout": "**timeout**",
            "crash": "**crash**"}[r.status]


def render(results: dict[str, dict[str, Result]], all_keys: list[str], command: str) -> str:
    summ = summarize(results)
    lines = ["# Op conformance vs CPU (OpInfo)", "",
             f"Generated by `{command}` (torch {_torch_version()}). Every OpInfo in PyTorch's `op_db` is "
             "listed. Each op's samples come from its OpInfo `sample_inputs` (at most "
             f"{_ARGS.max_samples if _ARGS else '?'} per variant); each is run on the CPU and, moved, on the "
             "`tpu` device, and the outputs are compared with `torch.testing.assert_close` "
             f"(float32 forward atol={TOL['f32']['atol']}, rtol={TOL['f32']['rtol']}; backward "
             f"atol={TOL['bwd']['atol']}, rtol={TOL['bwd']['rtol']}; int64 exact). A float32 forward "
             "sample that misses the CPU float32 result but matches the CPU float64 result (rounded to "
             "float32) passes: the device is then the more accurate of the two.",
             "",
             "* **f32 fwd**: float32 forward. **i64 fwd**: int64 forward. **f32 bwd**: gradients of the sum "
             "of the float outputs w.r.t. the float inputs.",
             "* `rand-ok`: a random op (nondeterministic output); only shape and dtype are compared, and it is "
             "left out of the pass rates. `skip`: not applicable (reason in the note). `fail`/`timeout`/`crash` "
             "count as failures.", "",
             "## Summary", "",
             "| variant | passed | counted | pass rate |", "| --- | ---: | ---: | ---: |"]
    names = {"f32": "forward float32 (non-random ops)", "i64": "forward int64", "bwd": "backward float32"}
    for v in VARIANTS:
        p, n = summ[v]
        lines.append(f"| {names[v]} | {p} | {n} | {100 * p / n if n else 0:.1f}% |")
    n_rand = sum(r["f32"].status == "rand" for r in results.values())
    missing = [k for k in all_keys if k not in results]
    lines += ["", f"Ops in op_db: {len(all_keys)}; checked: {len(results)}; random ops (shape/dtype only): "
              f"{n_rand}." + (f" Not run in this sweep: {len(missing)} (listed as `not run`)." if missing else ""),
              "", "## Per op", "", "| op | f32 fwd | i64 fwd | f32 bwd | note |", "| --- | --- | --- | --- | --- |"]
    for k in all_keys:
        r = results.get(k)
        if r is None:
            lines.append(f"| `{k}` | not run | not run | not run | |")
            continue
        notes = []
        for v in VARIANTS:
            if r[v].note and (r[v].status != "skip" or v == "f32" or r[v].note != r["f32"].note):
                notes.append(f"{v}: {r[v].note}")
        note = "; ".join(notes).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{k}` | {_cell(r['f32'])} | {_cell(r['i64'])} | {_cell(r['bwd'])} | {note[:400]} |")
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    import torch

    return torch.__version__


_ARGS: argparse.Namespace | None = None


def main(argv: list[str] | None = None) -> int:
    global _ARGS
    p = argparse.ArgumentParser(prog="python -m torchbridge.device.conformance", description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", help="every OpInfo in op_db")
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (name or name.variant)")
    p.add_argument("--write", default="", help="write the markdown report here")
    p.add_argument("--json", default="", help="also write raw results as JSON here (merged if it exists)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--max-samples", type=int, default=8)
    p.add_argument("--budget", type=float, default=60.0, help="seconds of samples per variant (soft)")
    p.add_argument("--op-timeout", type=float, default=300.0, help="hard cap per op, all variants (s)")
    p.add_argument("--log", default="", help="worker stderr goes here")
    p.add_argument("--render", default="", metavar="CMD",
                   help="run nothing: re-render --write from the --json results, citing CMD as the command")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _ARGS = args
    if args.worker:
        _worker(args.max_samples, args.budget)
        return 0
    ops = all_ops()
    all_keys = [op_key(o) for o in ops]
    if args.all:
        keys = list(all_keys)
    else:
        want = {k for k in args.ops.split(",") if k}  # an OpInfo name selects all its variants
        keys = [op_key(o) for o in ops if op_key(o) in want or o.name in want]
        unknown = sorted(w for w in want if not any(op_key(o) == w or o.name == w for o in ops))
        if unknown:
            print(f"unknown OpInfo names: {', '.join(unknown)}", file=sys.stderr)
            return 2
    if args.render:
        with open(args.json) as f:
            results = {k: {v: Result(**r) for v, r in res.items()} for k, res in json.load(f).items()}
        with open(args.write, "w") as f:
            f.write(render(results, all_keys, args.render))
        return 0
    if not keys:
        p.error("nothing to run: pass --all or --ops")
    results = sweep(keys, args)
    if args.json:
        results = save_json(args.json, results)
    for v, (passed, n) in summarize(results).items():
        print(f"{v}: {passed}/{n} passed ({100 * passed / n if n else 0:.1f}%)")
    if args.write:
        cmd = "python -m torchbridge.device.conformance " + " ".join(a for a in (argv or sys.argv[1:]))
        with open(args.write, "w") as f:
            f.write(render(results, all_keys, cmd.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
