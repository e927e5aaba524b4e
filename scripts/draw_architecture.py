"""Draws docs/architecture.svg: the layers and what they import, and the path of one eager op.

    python scripts/draw_architecture.py [--out docs/architecture.svg]

The picture is data below (boxes and arrows, in axis units), so keeping it true to the code is an
edit here and a re-run; docs/ARCHITECTURE.md shows the result.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

# (key, x, y, width, height, title, detail, colour): x/y is the lower-left corner
LAYERS = [
    ("route", 0.2, 8.6, 4.2, 1.1, "route/", "router, picker, scorers, simulator\nno torch, no jax", "#f4e1c1"),
    ("serve", 0.2, 6.6, 2.0, 1.3, "serve/", "engine, API,\nmodels", "#d9ead3"),
    ("train", 2.4, 6.6, 2.0, 1.3, "train/", "trainer", "#d9ead3"),
    ("kernels", 0.2, 4.6, 2.0, 1.3, "kernels/", "JAX/Pallas\nas torch ops", "#cfe2f3"),
    ("distributed", 2.4, 4.6, 2.0, 1.3, "distributed/", "c10d backend,\ncollectives", "#cfe2f3"),
    ("compile", 0.2, 2.8, 4.2, 1.1, "compile/", "torch.compile(backend=\"tpu\")", "#d0e0e3"),
    ("device", 0.2, 0.6, 4.2, 1.5, "device/", "the device \"tpu\": registration, fallback,\n"
                                             "dispatch, buffer table, lowerings/", "#e6e0f0"),
]
LAYER_ARROWS = [  # (from, to, label): "from imports to"; a layer may import any layer below it
    ("serve", "kernels", ""), ("train", "distributed", ""), ("kernels", "compile", ""), ("distributed", "compile", ""),
    ("compile", "device", "imports"),
]

PATH = [  # one eager op, top to bottom
    ("op", 6.0, 9.0, 4.6, 0.8, "x + y on tpu tensors", "PyTorch dispatcher: PrivateUse1 key", "#ffffff"),
    ("fast", 6.0, 7.4, 4.6, 1.0, "native.fast_call (C++)", "csrc/fast_path.cpp: the call's key,\none pass over the arguments",
     "#e6e0f0"),
    ("hit", 6.0, 5.1, 2.2, 1.5, "cached program", "a FastEntry: its\njitted program, run\non the buffers",
     "#d9ead3"),
    ("slow", 8.5, 5.1, 2.9, 1.5, "Python fallback", "fallback.py: direct\nhandlers, dispatch.run\n(the same key),\n"
     "decompositions, CPU", "#fce5cd"),
    ("lower", 8.5, 3.3, 2.9, 1.3, "lowering table", "lowerings/: ATen op -> JAX fn;\nmeta kernel for outputs;\n"
     "one jax.jit per key", "#cfe2f3"),
    ("xla", 6.0, 1.2, 5.4, 1.0, "XLA executable (PJRT: TPU, GPU, CPU)", "results swap into the buffer table "
     "(runtime.STATE.table)", "#d0e0e3"),
]
PATH_ARROWS = [
    ("op", "fast", ""), ("fast", "hit", "key known"), ("fast", "slow", "first call,\nCPU tensors, ..."),
    ("slow", "lower", ""), ("lower", "xla", "compile once"), ("hit", "xla", "run"), ("slow", "hit", "remember"),
]


def _box(ax, x: float, y: float, w: float, h: float, title: str, detail: str, colour: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.12", fc=colour, ec="#444444",
                                lw=1.0))
    ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=10, fontweight="bold", family="monospace")
    ax.text(x + w / 2, y + h - 0.55, detail, ha="center", va="top", fontsize=8, linespacing=1.25)


def _arrow(ax, boxes: dict, a: str, b: str, label: str) -> None:
    xa, ya, wa, ha = boxes[a]
    xb, yb, wb, hb = boxes[b]
    if yb + hb < ya:  # b below a: bottom edge to top edge
        start, end = (xa + wa / 2, ya), (xb + wb / 2, yb + hb)
    elif xb > xa + wa:  # b right of a
        start, end = (xa + wa, ya + ha / 2), (xb, yb + hb / 2)
    else:  # b left of a
        start, end = (xa, ya + ha / 2), (xb + wb, yb + hb / 2)
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, lw=1.1, color="#333333",
                                 shrinkA=2, shrinkB=2))
    if label:
        dx = end[0] - start[0]
        x, y, ha = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2, "left"
        if start[1] == end[1]:  # horizontal: the label above the arrow
            y, ha = y + 0.15, "center"
        elif abs(dx) > 0.5:  # diagonal: beside it, on the side it leans to
            x, ha = x + (0.3 if dx > 0 else -0.3), "left" if dx > 0 else "right"
        else:
            x += 0.08
        ax.text(x, y, label, fontsize=7.5, color="#333333", ha=ha, va="center", style="italic")


def draw(out: Path) -> None:
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: a small, searchable file
    plt.rcParams["svg.hashsalt"] = "torchbridge"  # fixed element ids: a re-run gives the same file
    fig, ax = plt.subplots(figsize=(11.5, 7.4))
    ax.set_xlim(0, 11.6)
    ax.set_ylim(0, 10.4)
    ax.axis("off")
    for items, arrows, heading, x in ((LAYERS, LAYER_ARROWS, "Layers: imports point down only", 2.3),
                                      (PATH, PATH_ARROWS, "An eager op's path", 8.7)):
        boxes = {k: (bx, by, w, h) for k, bx, by, w, h, *_ in items}
        for _, bx, by, w, h, title, detail, colour in items:
            _box(ax, bx, by, w, h, title, detail, colour)
        for a, b, label in arrows:
            _arrow(ax, boxes, a, b, label)
        ax.text(x, 10.15, heading, ha="center", fontsize=12, fontweight="bold")
    ax.text(2.3, 8.3, "speaks HTTP to serve (or any OpenAI server); imports no layer", ha="center", fontsize=7.5,
            style="italic", color="#333333")
    ax.text(2.3, 9.88, "each layer may import any layer below it", ha="center", fontsize=7.5, style="italic",
            color="#333333")
    ax.text(2.3, 0.2, "device registers through torch's backend autoload entry point (_register.py)", ha="center",
            fontsize=7.5, style="italic", color="#333333")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", metadata={"Date": None})  # no timestamp: re-runs give the same file
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "architecture.svg"))
    draw(Path(ap.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
