"""The device package's modules import each other without circles, and each one imports on its own.

The import graph is read from the source (every import, module level or inside a function: a lazy
import still makes a circle, it only hides it until the function runs); importing a module also
imports its parent packages. Then each module is imported as the first of the package in a process
without the device (TORCHBRIDGE_NO_DEVICE=1: what the module itself needs), and one as the first
import of a process with it (torch's autoload registers the device in the middle of that import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_import_contract import SRC, imports

PACKAGE = "torchbridge.device"


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((src / "torchbridge" / "device").rglob("*.py")):
        out[".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def _graph(src: Path) -> dict[str, set[str]]:
    modules = _modules(src)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for _, name in imports(path, module):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                # a.b.c runs a.b's __init__ first (unless a.b is this module's own package, already running)
                if target in modules and target != module and (i == len(parts) or target not in ancestors):
                    graph[module].add(target)
    return graph


def cycles(src: Path) -> list[list[str]]:
    """Every import circle among the package's modules (one path each, by depth-first search)."""
    graph, found, state = _graph(src), [], {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_import_circles_in_the_device_package():
    assert cycles(SRC) == []


def test_the_check_finds_a_circle(tmp_path):
    import shutil

    shutil.copytree(SRC / "torchbridge", tmp_path / "torchbridge", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    views = tmp_path / "torchbridge" / "device" / "views.py"  # views <- storage <- runtime: make it a circle
    views.write_text(views.read_text() + "\n\ndef _bad():\n    from torchbridge.device.runtime import STATE\n")
    assert any(c[0] == c[-1] and "torchbridge.device.views" in c for c in cycles(tmp_path)), cycles(tmp_path)


_EACH_ALONE = """
import importlib, sys
import torch, jax  # third-party modules stay loaded; every module of ours is imported first in turn
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "torchbridge" or m.startswith("torchbridge.")]:
        del sys.modules[m]
    importlib.import_module(name)
print("ok")
"""


def test_each_device_module_imports_first_on_its_own():
    modules = [m for m in _modules(SRC) if m != PACKAGE]
    env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
    out = subprocess.run([sys.executable, "-c", _EACH_ALONE, *modules], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_device_module_as_a_process_first_import_registers_the_device():
    """`import torchbridge.device.dispatch` first: the package imports torch before the module runs, so
    the device registers completely (before, registering met a half-imported dispatch)."""
    code = ("import torchbridge.device.dispatch, torchbridge, torch; assert torchbridge.registration_error() is None; "
            "print((torch.ones(2, device=torchbridge.device_name()) * 3).cpu().tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[3.0, 3.0]", out.stderr[-3000:]


def test_old_module_names_forward_to_the_new_ones_with_a_warning():
    import pytest

    from torchbridge.device import backend, buffers, fallback, ops, registration, runtime, state

    with pytest.warns(DeprecationWarning, match=r"torchbridge\.device\.fallback\.set_cpu_fallback"):
        assert ops.set_cpu_fallback is fallback.set_cpu_fallback
    with pytest.warns(DeprecationWarning, match=r"torchbridge\.device\.buffers\.to_host"):
        assert ops.to_host is buffers.to_host
    with pytest.warns(DeprecationWarning, match=r"torchbridge\.device\.registration\.skip_dynamo"):
        assert backend.skip_dynamo is registration.skip_dynamo
    with pytest.warns(DeprecationWarning, match=r"torchbridge\.device\.runtime\.STATE"):
        assert state.STATE is runtime.STATE
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = ops.nothing


def test_torchruns_launcher_does_not_register_the_device_but_a_plain_process_does():
    """torchrun's launcher only starts workers (fresh interpreters that register the device themselves);
    registering in it too put JAX's and the lowerings' import (~2.4 s) on every job's critical path."""
    code = ("import sys\n{argv}import torch\n"
            "print('torchbridge.device.registration' in sys.modules, hasattr(torch, 'tpu'))")
    env = {**os.environ, "TORCHBRIDGE_DEVICE_NAME": "tpu"}
    seen = {}
    for name, argv in (("plain", ""),
                       ("python -m torch.distributed.run", "sys.orig_argv = [sys.executable, '-m', "
                        "'torch.distributed.run', '--nproc-per-node=2', 'train.py']\n"),
                       ("torchrun", "sys.orig_argv = [sys.executable, '/venv/bin/torchrun', 'train.py']\n")):
        out = subprocess.run([sys.executable, "-c", code.format(argv=argv)], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[name] = out.stdout.split()
    assert seen == {"plain": ["True", "True"], "python -m torch.distributed.run": ["False", "False"],
                    "torchrun": ["False", "False"]}, seen
