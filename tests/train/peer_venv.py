"""A peer project (TorchTitan) in a virtual environment of its own, never in the project's.

`ensure(...)` creates ~/.cache/torchbridge/peers/<name>-<version> once: torch==2.13.0 (the CPU build
on local disk, as the Makefile pins it), the device's own runtime dependencies at the versions this
interpreter has (so the peer runs the same JAX), the peer at its pinned release with its
dependencies, and this checkout of torchbridge installed editable without dependencies (its
entry points register the device and the `tpu` compile backend in the peer's interpreter too). A
later call only re-points the editable install when another checkout asks.

The peer's environment is layered on this interpreter's: a .pth file puts this interpreter's
site-packages after the peer's own, so pip finds the shared pins (torch, JAX, triton) already
satisfied and installs only what the peer adds or pins differently, into the peer's own directory
(where they take precedence). Copying torch, JAX and triton again took 80 s and 1.6 GB per fresh
environment, a CI run's worth of time. Every failure is a
`PeerUnavailable` whose message says which step failed (tests skip with it: no registry, no disk).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("TORCHBRIDGE_PEERS", Path.home() / ".cache" / "torchbridge" / "peers"))
TORCH = "torch==2.13.0"
# what the device itself imports at run time (pyproject's list minus the engine's and the router's)
DEVICE_DEPS = ("jax", "jaxlib", "numpy", "ninja")


class PeerUnavailable(RuntimeError):
    pass


def pin(dist: str) -> str:
    """`dist==<the version this interpreter has>` (unpinned when it has none)."""
    try:
        return f"{dist}=={importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return dist


def _run(cmd: list[str], what: str, timeout: float) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{what}: no result in {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise PeerUnavailable(f"{what} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return proc.stdout


def _editable_location(python: Path) -> str | None:
    code = ("import importlib.metadata as m, json\n"
            "try: print(m.distribution('torchbridge').read_text('direct_url.json') or '')\n"
            "except m.PackageNotFoundError: print('')")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()
    return json.loads(out).get("url") if out else None


def _layer_on_this_interpreter(python: Path) -> None:
    """A .pth file in the peer's site-packages adding this interpreter's after the peer's own, as a site
    directory (so its own .pth files, editable installs among them, work there too)."""
    paths = sysconfig.get_paths()
    mine = dict.fromkeys([paths["purelib"], paths["platlib"]])
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(python), "-c", code], f"reading {python}'s site-packages", 60).strip())
    (site / "_torchbridge_base.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in mine))


def ensure(name: str, version: str, extra: tuple[str, ...] = (), timeout: float = 1800) -> Path:
    """The peer's interpreter, with `name==version` (and `extra` requirements), torch 2.13.0 and this
    checkout's torchbridge."""
    venv = PEERS / f"{name}-{version}"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    wanted = [TORCH, *(pin(d) for d in DEVICE_DEPS), f"{name}=={version}", *extra]
    # the base is part of the stamp: an environment made over another interpreter's packages is redone
    base = f"base={sysconfig.get_paths()['purelib']}"
    if not stamp.exists() or stamp.read_text().split() != [*wanted, base]:
        PEERS.mkdir(parents=True, exist_ok=True)
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(venv)], f"creating {venv}", 300)
        _layer_on_this_interpreter(python)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # torch first and pinned: an unpinned one would pull a CUDA build (Makefile's reasoning)
        _run([*pip, TORCH], f"installing {TORCH} into {venv}", timeout)
        _run([*pip, *wanted], f"installing {name}=={version} into {venv}", timeout)
        stamp.write_text(" ".join([*wanted, base]) + "\n")
    if _editable_location(python) != REPO.as_uri():
        _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
              "-e", str(REPO)], f"installing torchbridge ({REPO}) into {venv}", 600)
    return python
