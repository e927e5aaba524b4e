"""The shape sweep and the jagged DLRM workload of bench_compile.py (see its docstring for commands).

Both compare the bridge's compiled mode (backend "tpu") with Inductor on this CPU, the arms taking
turns within each iteration (so a slow moment of a shared machine lands on both), and record the
load average before and after.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import transformers

import torchbridge
from torchbridge.compile import metrics as compile_metrics
from torchbridge.compile import recompiles_expected

DEV = torchbridge.device_name()
VOCAB = 8192
# layers per hidden size: enough depth that the layers dominate the logits, small enough that the
# largest cell (batch 16, sequence 512, hidden 1024) trains in seconds on a few cores
LAYERS = {256: 2, 512: 2, 768: 4, 1024: 4}


def _sync() -> None:
    getattr(torch, DEV).synchronize()


def loadavg() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


@contextlib.contextmanager
def neighbour(on: bool) -> Iterator[None]:
    """A CPU-bound process (a busy loop) pinned to one core for the duration, both arms under it."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(proc.pid, {cores[-1]})
        yield
    finally:
        proc.kill()
        proc.wait()


# ---- the shape sweep --------------------------------------------------------------------------------

def sweep_config(hidden: int) -> transformers.LlamaConfig:
    """A Llama of `hidden`: heads of 64, grouped-query attention (4 query heads per key/value head),
    SwiGLU of ~8/3 hidden, LAYERS[hidden] layers, an 8192-token vocabulary."""
    heads = hidden // 64
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=-(-int(hidden * 8 / 3) // 64) * 64,
        num_hidden_layers=LAYERS[hidden], num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=512, tie_word_embeddings=False)


@dataclass
class Cell:
    hidden: int
    seq: int
    batch: int
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # workload -> arm -> median ms
    logits_err: float = math.nan   # max |bridge - inductor| / max |inductor|
    grad_err: float = math.nan     # the same over every parameter's gradient

    def speedup(self, workload: str) -> float:
        m = self.ms.get(workload, {})
        return m["inductor"] / m["bridge"] if "bridge" in m and "inductor" in m else math.nan


class _SweepArm:
    def __init__(self, name: str, model: nn.Module, device: str, backend: str) -> None:
        self.name, self.model, self.device = name, model, device
        self.fwd = torch.compile(model, backend=backend, dynamic=False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.step = torch.compile(self.opt.step, backend=backend, dynamic=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.fwd(input_ids=ids).logits

    def grads(self, ids: torch.Tensor) -> list[torch.Tensor]:
        self.opt.zero_grad()
        self.fwd(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in self.model.parameters()]

    def train(self, ids: torch.Tensor) -> None:
        self.grads(ids)
        self.step()

    def timed(self, fn: Callable[[], Any]) -> float:
        t = time.perf_counter()
        fn()
        if self.device != "cpu":
            _sync()
        return time.perf_counter() - t


def _rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = max(float((g.detach().cpu().float() - w.detach().float()).abs().max()) for g, w in zip(got, want, strict=True))
    den = max(float(w.detach().float().abs().max()) for w in want)
    return num / max(den, 1e-30)


def sweep_cell(base: nn.Module, hidden: int, seq: int, batch: int, warmup: int, iters: int) -> Cell:
    """One cell: both arms from the same weights, values compared, then forward and training step timed."""
    torch._dynamo.reset()
    gc.collect()
    cell = Cell(hidden, seq, batch)
    arms = [_SweepArm("bridge", copy.deepcopy(base).to(DEV), DEV, "tpu"),
            _SweepArm("inductor", copy.deepcopy(base), "cpu", "inductor")]
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(hidden + seq + batch))
    inputs = {"bridge": ids.to(DEV), "inductor": ids}
    b, i = arms
    cell.logits_err = _rel_err([b.forward(inputs["bridge"])], [i.forward(inputs["inductor"])])
    cell.grad_err = _rel_err(b.grads(inputs["bridge"]), i.grads(inputs["inductor"]))
    for workload, fn in (("forward", _SweepArm.forward), ("train", _SweepArm.train)):
        for arm in arms:
            for _ in range(warmup):
                arm.timed(lambda arm=arm, fn=fn: fn(arm, inputs[arm.name]))
        samples: dict[str, list[float]] = {a.name: [] for a in arms}
        for k in range(iters):  # alternate which arm goes first
            for arm in (arms if k % 2 == 0 else arms[::-1]):
                samples[arm.name].append(arm.timed(lambda arm=arm, fn=fn: fn(arm, inputs[arm.name])))
        cell.ms[workload] = {n: statistics.median(s) * 1e3 for n, s in samples.items()}
    return cell


SWEEP = {"batch": (1, 2, 4, 8, 16), "seq": (64, 128, 256, 512), "hidden": (256, 512, 768, 1024)}
QUICK_SWEEP = {"batch": (1, 2), "seq": (64,), "hidden": (256,)}
TOLERANCE = 1e-3  # relative (to the largest reference value) difference allowed between the arms


def run_sweep(quick: bool, warmup: int, iters: int, busy: bool, write: str | None, argv: list[str],
              only: dict[str, tuple[int, ...]] | None = None) -> list[Cell]:
    grid = {**(QUICK_SWEEP if quick else SWEEP), **(only or {})}
    load_before = loadavg()
    print(f"sweep: batch {grid['batch']} x sequence {grid['seq']} x hidden {grid['hidden']}; "
          f"neighbour {'on' if busy else 'off'}; load average {load_before}", flush=True)
    cells = []
    with neighbour(busy):
        for hidden in grid["hidden"]:
            torch.manual_seed(0)
            base = transformers.LlamaForCausalLM(sweep_config(hidden)).eval()
            for seq in grid["seq"]:
                for batch in grid["batch"]:
                    with recompiles_expected():  # every cell is a new shape on purpose
                        c = sweep_cell(base, hidden, seq, batch, warmup, iters)
                    cells.append(c)
                    flag = "" if max(c.logits_err, c.grad_err) <= TOLERANCE else f"  OVER TOLERANCE {TOLERANCE:g}"
                    print(f"h{hidden} s{seq} b{batch}: forward {c.ms['forward']['bridge']:.1f} vs "
                          f"{c.ms['forward']['inductor']:.1f} ms ({c.speedup('forward'):.2f}x), train "
                          f"{c.ms['train']['bridge']:.1f} vs {c.ms['train']['inductor']:.1f} ms "
                          f"({c.speedup('train'):.2f}x); logits {c.logits_err:.1e}, grads {c.grad_err:.1e} "
                          f"(tolerance {TOLERANCE:g}){flag}", flush=True)
            del base
    load_after = loadavg()
    summary = sweep_summary(cells)
    if write:
        _write_sweep(cells, summary, write, argv, busy, load_before, load_after, warmup, iters)
    print(f"load average before {load_before}, after {load_after}")
    print(summary, flush=True)  # last: geometric means and worst cells
    return cells


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def sweep_summary(cells: list[Cell]) -> str:
    lines = []
    for w in ("forward", "train"):
        worst = min(cells, key=lambda c: c.speedup(w))
        lines.append(f"{w}: geometric mean {_geomean([c.speedup(w) for c in cells]):.2f}x Inductor over "
                     f"{len(cells)} cells; worst {worst.speedup(w):.2f}x at hidden {worst.hidden}, sequence "
                     f"{worst.seq}, batch {worst.batch}")
    return "\n".join(lines)


def _heatmap(cells: list[Cell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    rows = sorted({(c.hidden, c.seq) for c in cells})
    cols = sorted({c.batch for c in cells})
    fig, axes = plt.subplots(1, 2, figsize=(9, 1.2 + 0.38 * len(rows)), constrained_layout=True)
    for ax, w in zip(axes, ("forward", "train"), strict=True):
        grid = [[next((c.speedup(w) for c in cells if (c.hidden, c.seq, c.batch) == (*r, b)), math.nan)
                 for b in cols] for r in rows]
        flat = [x for row in grid for x in row if not math.isnan(x)]
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(flat + [0.99]), vmax=max(flat + [1.01]))
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        ax.set_xticks(range(len(cols)), [str(b) for b in cols])
        ax.set_yticks(range(len(rows)), [f"h{h} s{s}" for h, s in rows])
        ax.set_xlabel("batch")
        ax.set_title(f"{w}: bridge speedup vs Inductor")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heatmap_from_tables(md: Path, png: Path) -> int:
    """Redraw the sweep heat map from every quiet-machine cell in `md`'s sweep tables (the sections
    before the busy-neighbour one), so cells measured in separate runs appear in one picture."""
    import re

    text = md.read_text().split("## Shape sweep with a busy neighbour")[0]
    row = re.compile(r"^\| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+x \| ([\d.]+) \| ([\d.]+) \| [\d.]+x \|",
                     re.M)
    cells: dict[tuple[int, int, int], Cell] = {}
    for h, s, b, fb, fi, tb, ti in row.findall(text):
        cells[(int(h), int(s), int(b))] = Cell(int(h), int(s), int(b), {
            "forward": {"bridge": float(fb), "inductor": float(fi)}, "train": {"bridge": float(tb), "inductor": float(ti)}})
    _heatmap(list(cells.values()), png, f"bridge compiled vs Inductor: the {len(cells)} cells in {md.name} "
                                        "(runs of several sessions, not always one machine: see its text)")
    return len(cells)


def replace_section(path: Path, name: str, body: str) -> None:
    """Put `body` between this section's markers in `path`, replacing an earlier run's (or append it)."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    text = path.read_text() if path.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def _write_sweep(cells: list[Cell], summary: str, write: str, argv: list[str], busy: bool, load_before: str,
                 load_after: str, warmup: int, iters: int) -> None:
    path = Path(write)
    png = path.with_name(path.stem + ("_sweep_neighbour.png" if busy else "_sweep.png"))
    _heatmap(cells, png, f"bridge compiled vs Inductor{' (busy neighbour)' if busy else ''}; load {load_before}")
    lines = ["| hidden | seq | batch | fwd bridge ms | fwd inductor ms | fwd speedup | train bridge ms | "
             "train inductor ms | train speedup | logits diff | grads diff |", "|" + "---:|" * 11]
    for c in cells:
        f, t = c.ms["forward"], c.ms["train"]
        lines.append(f"| {c.hidden} | {c.seq} | {c.batch} | {f['bridge']:.1f} | {f['inductor']:.1f} | "
                     f"{c.speedup('forward'):.2f}x | {t['bridge']:.1f} | {t['inductor']:.1f} | {c.speedup('train'):.2f}x"
                     f" | {c.logits_err:.1e} | {c.grad_err:.1e} |")
    name = "sweep-neighbour" if busy else "sweep"
    body = (f"## Shape sweep{' with a busy neighbour' if busy else ''}\n\n"
            f"Command: `python bench/bench_compile.py {' '.join(argv)}`; load average {load_before} before, "
            f"{load_after} after{'; a busy-loop process pinned to one core during both arms' if busy else ''}.\n\n"
            f"Llama per hidden size: heads of 64, 4 query heads per key/value head, {LAYERS} layers, vocabulary "
            f"{VOCAB}. Milliseconds, median of {iters} after {warmup} warm-up runs, the arms alternating; forward "
            f"under no_grad, training step = forward + backward + compiled AdamW step. `diff` columns: max |bridge -"
            f" inductor| / max |inductor| for the logits and over all gradients (same weights and batch; tolerance"
            f" {TOLERANCE:g}).\n\n![sweep heat map]({png.name})\n\n" + "\n".join(lines) + f"\n\n```\n{summary}\n```\n")
    replace_section(path, name, body)


# ---- the jagged DLRM workload ------------------------------------------------------------------------

class DLRM(nn.Module):
    """DLRM-style: bottom MLP over dense features, one EmbeddingBag (sum) per sparse feature over
    index lists whose length changes every batch, pairwise dot-product interaction, top MLP."""

    def __init__(self, tables: tuple[int, ...], dim: int, dense: int = 13) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 128), nn.ReLU(), nn.Linear(128, dim), nn.ReLU())
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in tables)
        f = len(tables) + 1
        li, lj = torch.tril_indices(f, f, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + f * (f - 1) // 2, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x] + [bag(i, o) for bag, i, o in zip(self.bags, indices, offsets, strict=True)], dim=1)
        z = torch.bmm(feats, feats.transpose(1, 2))
        return self.top(torch.cat([x, z[:, self.li, self.lj]], dim=1)).squeeze(1)


def dlrm_batches(n: int, tables: tuple[int, ...], batch: int, max_bag: int, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        dense = torch.randn(batch, 13, generator=gen)
        indices, offsets = [], []
        for rows in tables:
            sizes = torch.randint(0, max_bag + 1, (batch,), generator=gen)
            offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]]))
            indices.append(torch.randint(0, rows, (int(sizes.sum()),), generator=gen))
        out.append((dense, indices, offsets, torch.randint(0, 2, (batch,), generator=gen).float()))
    return out


class _DLRMArm:
    def __init__(self, name: str, base: nn.Module, device: str, backend: str) -> None:
        self.name, self.device = name, device
        self.model = copy.deepcopy(base).to(device)
        self.fwd = torch.compile(self.model, backend=backend)  # default settings (automatic dynamic shapes)
        self.opt = torch.optim.Adagrad(self.model.parameters(), lr=0.01)
        self.step = torch.compile(self.opt.step, backend=backend)
        self.losses: list[float] = []

    def run(self, batches: list[tuple]) -> float:
        """Seconds for these training steps (the last loss read back, so all of them have run)."""
        t = time.perf_counter()
        loss = None
        for dense, indices, offsets, labels in batches:
            d = self.device
            self.opt.zero_grad()
            out = self.fwd(dense.to(d), [i.to(d) for i in indices], [o.to(d) for o in offsets])
            loss = nn.functional.binary_cross_entropy_with_logits(out, labels.to(d))
            loss.backward()
            self.step()
            self.losses.append(loss.detach())
        float(loss.detach())
        return time.perf_counter() - t


def run_dlrm(quick: bool, steps: int, busy: bool, write: str | None, argv: list[str]) -> dict[str, Any]:
    tables, dim, batch, max_bag = ((1000, 800, 500), 16, 64, 10) if quick else ((200_000, 100_000, 50_000), 64, 512, 20)
    torch.manual_seed(0)
    base = DLRM(tables, dim)
    warm = dlrm_batches(10, tables, batch, max_bag, seed=1)
    batches = dlrm_batches(steps, tables, batch, max_bag, seed=2)
    load_before = loadavg()
    print(f"DLRM: tables {tables} x {dim}, batch {batch}, 0-{max_bag} indices per bag, {steps} steps; "
          f"neighbour {'on' if busy else 'off'}; load average {load_before}", flush=True)
    from torch._dynamo.utils import counters

    with neighbour(busy):
        arms = [_DLRMArm("bridge", base, DEV, "tpu"), _DLRMArm("inductor", base, "cpu", "inductor")]
        for a in arms:
            a.run(warm)  # the first shapes and the first recompile (sizes marked dynamic)
        compiled_before = compile_metrics()["graphs_compiled"]
        frames_before = counters["stats"]["unique_graphs"]
        secs = {a.name: 0.0 for a in arms}
        chunk = 10
        for k in range(0, steps, chunk):
            for a in (arms if (k // chunk) % 2 == 0 else arms[::-1]):
                secs[a.name] += a.run(batches[k:k + chunk])
        bridge_compiles = compile_metrics()["graphs_compiled"] - compiled_before
        dynamo_graphs = counters["stats"]["unique_graphs"] - frames_before
    load_after = loadavg()
    lengths = {tuple(len(i) for i in b[1]) for b in batches}
    diff = max(abs(float(x) - float(y)) for x, y in zip(arms[0].losses, arms[1].losses, strict=True))
    res = {"steps_per_s": {n: steps / s for n, s in secs.items()}, "bridge_programs_compiled": bridge_compiles,
           "dynamo_graphs_compiled": dynamo_graphs, "distinct_lengths": len(lengths), "max_loss_diff": diff,
           "load_before": load_before, "load_after": load_after}
    sp = res["steps_per_s"]
    summary = (f"DLRM jagged training: bridge {sp['bridge']:.1f} steps/s, Inductor {sp['inductor']:.1f} steps/s "
               f"({sp['bridge'] / sp['inductor']:.2f}x); over the {steps} timed steps ({len(lengths)} distinct "
               f"index-list lengths) the bridge compiled {bridge_compiles} programs and Dynamo {dynamo_graphs} graphs "
               f"(both arms); largest loss difference between the arms {diff:.1e}; load average {load_before} "
               f"before, {load_after} after")
    print(summary, flush=True)
    if write:
        title = "Jagged DLRM training, a busy neighbour on one core" if busy else "Jagged DLRM training"
        body = (f"## {title}\n\nCommand: `python bench/bench_compile.py {' '.join(argv)}`.\n\n"
                f"DLRM-style model (bench/compile_workloads.py): three EmbeddingBags ({tables} rows x {dim}),"
                f" batch {batch}, each bag 0-{max_bag} indices, so every table's index list has a new length at"
                f" every step; pairwise interaction; Adagrad, the step compiled too. Both arms with default"
                f" settings (Dynamo marks the changing sizes dynamic after one recompile; the bridge runs such"
                f" graphs as bounded programs, one per power-of-two bucket, compile/bounded.py). 10 warm-up"
                f" steps, then {steps} steps in chunks of 10, arms alternating.\n\n{summary}.\n")
        replace_section(Path(write), "dlrm-neighbour" if busy else "dlrm", body)
    return res
