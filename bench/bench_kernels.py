"""Custom kernels (`torchbridge.kernel`): what calling one costs, in eager mode and in compiled graphs.

    python bench/bench_kernels.py [--rounds 5] [--iters 200] [--write docs/benchmarks/kernels.md]
    python bench/bench_kernels.py --engine [--engine-rounds 2] [--write docs/benchmarks/kernels-engine.md]

1. Eager call overhead: a user kernel computing x * 2 (jnp) against the built-in `x * 2` of the
   same size on the device (same XLA work: the difference is the call path), and each shipped
   kernel against one built-in op of its output size and against the PyTorch ops it replaces.
2. Compiled graphs: a graph around each shipped kernel against the same graph with the PyTorch ops.
3. Pallas interpret mode against the jnp reference, both jitted on JAX's CPU (the simulator's cost).
4. --engine (instead of 1-3): the engine on the device (compiled steps, the bundled model) with the
   kernels on and off, in alternating subprocesses: tokens/s, and greedy tokens against Hugging Face.
Arms alternate within every round; per arm the median over a round's repeats; ratios are given as
the range over rounds. Device results are synchronised once per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchbridge  # noqa: E402

DEV = torchbridge.device_name()


@torchbridge.kernel("bench::double")
def double(x: jax.Array) -> jax.Array:
    return x * 2.0


def _sync(_: object = None) -> None:
    getattr(torch, DEV).synchronize()


def _rounds(arms: dict[str, Callable[[], object]], sync: Callable[[object], None], iters: int, rounds: int,
            repeats: int = 3) -> dict[str, list[float]]:
    """Microseconds per call for each arm, one median per round; arms alternate within a round."""
    for fn in arms.values():
        for _ in range(max(3, iters // 10)):
            r = fn()
        sync(r)
    out: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        samples: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(repeats):
            for name, fn in arms.items():
                start = time.perf_counter()
                for _ in range(iters):
                    r = fn()
                sync(r)
                samples[name].append((time.perf_counter() - start) / iters * 1e6)
        for name in arms:
            out[name].append(statistics.median(samples[name]))
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio_range(a: list[float], b: list[float]) -> str:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return f"{min(r):.2f}-{max(r):.2f}x"


def _diff_range(a: list[float], b: list[float]) -> str:
    d = [x - y for x, y in zip(a, b, strict=True)]
    return f"{min(d):+.1f}..{max(d):+.1f}"


def _pair_row(name: str, a: list[float], b: list[float]) -> str:
    return f"| {name} | {_med(a):.1f} | {_med(b):.1f} | {_ratio_range(a, b)} |"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _cases() -> list[tuple]:
    """(name, inputs on CPU, kernel(*inputs), torch ops(*inputs), pallas fn, reference fn) at the
    bundled model's decode sizes (32 tokens, hidden 256, 4 heads over 2 KV heads of 64, blocks of 16)."""
    from torchbridge.kernels import paged_attention as pa
    from torchbridge.kernels import rms_norm as rn
    from torchbridge.kernels import rotary as ro
    from torchbridge.kernels import swiglu as sw

    g = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    def rms_torch(x, w):
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    def paged_torch(q, kc, vc, t, n):
        k = kc.index_select(0, t.flatten()).view(q.shape[0], -1, 2, 64).transpose(1, 2).repeat_interleave(2, 1)
        v = vc.index_select(0, t.flatten()).view(q.shape[0], -1, 2, 64).transpose(1, 2).repeat_interleave(2, 1)
        mask = (torch.arange(k.shape[2], device=q.device) < n[:, None])[:, None, None]
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=0.125)[:, :, 0]

    tables = torch.arange(8 * 16, dtype=torch.int32).reshape(8, 16) % 120
    lens = torch.tensor([200, 17, 64, 255, 1, 90, 128, 33], dtype=torch.int32)
    return [
        ("rms_norm", (r(32, 256), r(256)), lambda x, w: rn.rms_norm(x, w, eps=1e-5), rms_torch,
         lambda x, w: rn.rms_norm_pallas(x, w, eps=1e-5), lambda x, w: rn.rms_norm_reference(x, w, 1e-5)),
        ("add_rms_norm", (r(32, 256), r(32, 256), r(256)), lambda x, h, w: rn.add_rms_norm(x, h, w, eps=1e-5),
         lambda x, h, w: (rms_torch(x + h, w), x + h),
         lambda x, h, w: rn.add_rms_norm_pallas(x, h, w, eps=1e-5), lambda x, h, w: rn.add_rms_norm_reference(x, h, w, 1e-5)),
        ("rotary", (r(32, 4, 64), r(32, 2, 64), r(32, 64), r(32, 64)), ro.rotary,
         lambda q, k, c, s: (q * c[:, None] + _rotate_half(q) * s[:, None], k * c[:, None] + _rotate_half(k) * s[:, None]),
         ro.rotary_pallas, ro.rotary_reference),
        ("swiglu", (r(32, 768), r(32, 768)), sw.swiglu, lambda a, b: F.silu(a) * b, sw.swiglu_pallas, sw.swiglu_reference),
        ("paged_attention", (r(8, 4, 64), r(121, 16, 2, 64), r(121, 16, 2, 64), tables, lens),
         lambda q, kc, vc, t, n: pa.paged_attention(q, kc, vc, t, n, 0.125), paged_torch,
         lambda q, kc, vc, t, n: pa.paged_attention_pallas(q, kc, vc, t, n, scale=0.125),
         lambda q, kc, vc, t, n: pa.paged_attention_reference(q, kc, vc, t, n, 0.125)),
    ]


def _first(x: object) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def eager_overhead(args: argparse.Namespace) -> str:
    lines = ["| call (device, eager) | kernel (us) | built-in op (us) | kernel - built-in (us, range over rounds) |",
             "|---|---:|---:|---:|"]
    for n in (16, 256):
        x = torch.randn(n, n, device=DEV)
        t = _rounds({"k": lambda x=x: double(x), "a": lambda x=x: x * 2.0}, _sync, args.iters, args.rounds)
        lines.append(f"| user kernel x*2 vs `x * 2`, {n}x{n} | {_med(t['k']):.1f} | {_med(t['a']):.1f} | "
                     f"{_diff_range(t['k'], t['a'])} |")
    lines += ["", "| shipped kernel (device, eager, impl=auto) | kernel (us) | one `add` of its output size (us) | "
              "PyTorch ops it replaces (us) | kernel - add (us) | kernel / PyTorch ops |", "|---|---:|---:|---:|---:|---:|"]
    for name, inputs, kern, ref, _, _ in _cases():
        dev = [t.to(DEV) for t in inputs]
        out = _first(kern(*dev))
        t = _rounds({"k": lambda k=kern, d=dev: k(*d), "add": lambda o=out: o + o, "torch": lambda r=ref, d=dev: r(*d)},
                    _sync, args.iters, args.rounds)
        lines.append(f"| {name} | {_med(t['k']):.1f} | {_med(t['add']):.1f} | {_med(t['torch']):.1f} | "
                     f"{_diff_range(t['k'], t['add'])} | {_ratio_range(t['k'], t['torch'])} |")
    return "\n".join(lines)


def compiled_graphs(args: argparse.Namespace) -> str:
    lines = ["| graph (compiled, device) | with kernel (us) | with PyTorch ops (us) | kernel / PyTorch ops |",
             "|---|---:|---:|---:|"]
    for name, inputs, kern, ref, _, _ in _cases():
        dev = [t.to(DEV) for t in inputs]

        def graph(fn: Callable, *a: torch.Tensor) -> torch.Tensor:
            a = [t * 0.5 if t.is_floating_point() else t for t in a]
            return _first(fn(*a)).tanh() + 1

        ck = torch.compile(lambda *a, k=kern: graph(k, *a), backend=DEV)
        cr = torch.compile(lambda *a, r=ref: graph(r, *a), backend=DEV)
        t = _rounds({"k": lambda d=dev, c=ck: c(*d), "torch": lambda d=dev, c=cr: c(*d)}, _sync, args.iters // 2,
                    args.rounds)
        lines.append(_pair_row(f"{name} (x*0.5 -> op -> tanh + 1)", t["k"], t["torch"]))
    return "\n".join(lines)


def interpret_cost(args: argparse.Namespace) -> str:
    from torchbridge.kernels.jax_op import interpret_mode

    lines = ["| kernel (JAX on CPU, jitted) | Pallas interpret (us) | jnp reference (us) | interpret / jnp |",
             "|---|---:|---:|---:|"]
    for name, inputs, _, _, pallas, reference in _cases():
        arrays = [jnp.asarray(t.numpy()) for t in inputs]
        with interpret_mode(True):
            jp = jax.jit(pallas).lower(*arrays).compile()
        jr = jax.jit(reference).lower(*arrays).compile()
        t = _rounds({"p": lambda a=arrays, f=jp: f(*a), "r": lambda a=arrays, f=jr: f(*a)}, jax.block_until_ready,
                    max(5, args.iters // 10), args.rounds)
        lines.append(_pair_row(name, t["p"], t["r"]))
    return "\n".join(lines)


_MODEL = Path(torchbridge.__file__).parent / "assets" / "default-model"
_PROMPTS = [f"def f{i}(x):\n    return" for i in range(16)]
_NEW = 64


def engine_worker(kernels: str) -> None:
    from torchbridge.serve import LLM, SamplingParams

    os.environ["TORCHBRIDGE_SERVE_KERNELS"] = kernels
    llm = LLM(str(_MODEL), device=DEV, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)
    llm.engine.runner.warmup(8, 128, progress=False)
    prompts = _PROMPTS
    params = SamplingParams(temperature=0, max_tokens=_NEW, ignore_eos=True)
    llm.generate(prompts[:8], params)
    rates = []
    for _ in range(3):  # a few seconds each: the median of three steadies a shared machine's noise
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    print(json.dumps({"tok_s": statistics.median(rates), "tokens": [o.outputs[0].token_ids for o in outs]}))


def _hf_greedy() -> list[list[int]]:
    """The float32 reference: Hugging Face generate on the CPU, greedy, the same prompts and lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_MODEL)
    model = AutoModelForCausalLM.from_pretrained(_MODEL, dtype=torch.float32).eval()
    out = []
    for p in _PROMPTS:
        ids = torch.tensor([tok(p)["input_ids"]])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=_NEW, min_new_tokens=_NEW,
                             do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _agreement(tokens: list[list[int]], ref: list[list[int]]) -> str:
    prefix = [next((i for i, (a, b) in enumerate(zip(t, r, strict=False)) if a != b), len(r)) for t, r in
              zip(tokens, ref, strict=True)]
    return f"{sum(p == len(r) for p, r in zip(prefix, ref, strict=True))}/{len(ref)} identical, mean agreeing prefix {statistics.mean(prefix):.1f}"


def engine(args: argparse.Namespace) -> str:
    runs: dict[str, list[float]] = {"on": [], "off": []}
    tokens: dict[str, list] = {}
    for _ in range(args.engine_rounds):
        for arm, value in (("on", "rms_norm,rotary,swiglu,paged_attention"), ("off", "0")):
            out = subprocess.run([sys.executable, __file__, "--engine-worker", value], capture_output=True, text=True,
                                 check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[arm].append(res["tok_s"])
            tokens.setdefault(arm, res["tokens"])
    ref = _hf_greedy()
    return ("| engine on the device (compiled steps, bundled model, 16 requests x 64 tokens, batch 8) | kernels on | "
            "kernels off | on / off |\n|---|---:|---:|---:|\n"
            f"| tokens/s (median over runs; each run the median of 3 passes) | {_med(runs['on']):.0f} | "
            f"{_med(runs['off']):.0f} | {_ratio_range(runs['on'], runs['off'])} |\n\n"
            f"\nRuns (tok/s): on {[round(x) for x in runs['on']]}, off {[round(x) for x in runs['off']]}.\n\n"
            f"Greedy tokens ({_NEW} per request, the engine in the checkpoint's bfloat16) against Hugging Face in float32 on "
            f"the CPU: kernels on {_agreement(tokens['on'], ref)}; kernels off {_agreement(tokens['off'], ref)}; "
            f"on vs off {_agreement(tokens['on'], tokens['off'])}.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--engine", action="store_true", help="only the engine with kernels on/off (minutes)")
    ap.add_argument("--engine-rounds", type=int, default=2)
    ap.add_argument("--engine-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--write", default=None)
    args = ap.parse_args(argv)
    if args.engine_worker is not None:
        engine_worker(args.engine_worker)
        return 0
    load_before = os.getloadavg()
    if args.engine:
        sections = [("The engine with the shipped kernels", engine(args))]
    else:
        sections = [("Eager call overhead", eager_overhead(args)), ("Compiled graphs", compiled_graphs(args)),
                    ("Pallas interpret mode vs jnp on this CPU", interpret_cost(args))]
    load_after = os.getloadavg()
    body = "\n\n".join(f"## {title}\n\n{table}" for title, table in sections)
    print(body)
    if args.write:
        cmd = " ".join(["python bench/bench_kernels.py", *(argv if argv is not None else sys.argv[1:])])
        env = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"jax {jax.__version__}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
               "(the machine is shared)")
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        method = (f"The two arms alternate, {args.engine_rounds} runs each, every run a fresh process." if args.engine else
                  f"{args.rounds} rounds, arms alternating within each round (3 repeats of {args.iters} calls per arm"
                  " and round).")
        Path(args.write).write_text(f"# Custom kernels\n\nCommand: `{cmd}`\n\nMachine: {env}. {method}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
