"""The router imports neither torch nor jax (it speaks HTTP to any replica; issue 19's contract)."""

from __future__ import annotations

import subprocess
import sys

# A meta-path finder that refuses torch and jax, then the imports to check.
# Attempts are recorded too: the package root catches a failed device registration and carries on.
BLOCK = """
import sys
ATTEMPTS = []
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "jax", "jaxlib"):
            ATTEMPTS.append(name)
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
"""
ROUTE_MODULES = ["torchbridge.route", "torchbridge.route.cli", "torchbridge.route.proxy", "torchbridge.route.picker",
                 "torchbridge.route.replicas", "torchbridge.route.simulator", "torchbridge.route.calibrate",
                 "torchbridge.route.supervisor", "torchbridge.route.scorers", "torchbridge.block_hash"]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_route_imports_no_torch_or_jax() -> None:
    root = _run("import torchbridge\nassert not ATTEMPTS, ATTEMPTS")
    assert root.returncode == 0, root.stderr  # the package root registers nothing (torch's autoload does)
    out = _run("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in ROUTE_MODULES)
               + "assert not ATTEMPTS, ATTEMPTS\n")
    assert out.returncode == 0, out.stderr


def test_route_cli_help_without_torch() -> None:
    """`python -m torchbridge route --help` on a machine without torch: the router's CLI needs neither."""
    out = _run("import sys, runpy\nsys.argv = ['torchbridge', 'route', '--help']\n"
               "try:\n    runpy.run_module('torchbridge', run_name='__main__')\nexcept SystemExit as e:\n"
               "    assert not e.code, e.code\nassert not ATTEMPTS, ATTEMPTS\n")
    assert out.returncode == 0, out.stderr
    assert "--replica" in out.stdout


def test_the_blocker_catches_a_torch_import() -> None:
    """The check above can fail: a module that imports torch is refused under the blocker."""
    out = _run("import torchbridge.serve.sampler")
    assert out.returncode != 0 and "blocked: torch" in out.stderr
