"""The import contract: device <- compile <- (kernels, distributed) <- (serve, train); route stands apart.

Every `import` in src/torchbridge (module level and inside functions: a lazy import is still a
dependency) is checked against the rules below. The package root and its command-line glue (cli,
__main__, run, doctor, _register) may reach any layer; torch-free shared modules at the root
(block_hash, request_body) may be used by any layer, and so may the C++ build helper (cpp_build), which
may import torch but no layer. tests/route/test_layering.py checks the same
contract at run time for the router (no torch, no jax, even when blocked).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
RANK = {"device": 0, "compile": 1, "kernels": 2, "distributed": 2, "serve": 3, "train": 3}
GLUE = {"__init__", "__main__", "cli", "run", "doctor", "_register"}
SHARED = {"block_hash", "request_body"}
TOOLS = {"cpp_build"}  # torch allowed, no torchbridge layer
# what the lowering table may use: pure JAX plus the device's value helpers, never the dispatcher
LOWERING_MAY_USE = {"lowerings", "dtypes", "views", "host_calls", "runtime"}


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, relative ones resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def violations(src: Path) -> list[str]:
    out = []
    for path in sorted((src / "torchbridge").rglob("*.py")):
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        parts = module.split(".")
        layer = parts[1] if len(parts) > 1 else "__init__"
        if layer in GLUE and len(parts) <= 2:
            continue
        for line, name in imports(path, module):
            target = name.split(".")
            where = f"{path.relative_to(src)}:{line}: {module} imports {name}"
            if layer == "route" or layer in SHARED:
                if target[0] in ("torch", "jax", "jaxlib") or (target[0] == "torchbridge" and len(target) > 1 and
                                                                target[1] in RANK):
                    out.append(f"{where} (the router and shared modules import neither torch, jax nor a layer)")
                continue
            if layer in TOOLS:
                if target[0] == "torchbridge" and len(target) > 1:
                    out.append(f"{where} (a build tool imports no part of torchbridge)")
                continue
            if target[0] != "torchbridge" or len(target) < 2:
                continue
            other = target[1]
            if other == "route":
                out.append(f"{where} (nothing imports the router)")
            elif other in RANK and layer in RANK and other != layer and RANK[other] >= RANK[layer]:
                out.append(f"{where} ({layer} may import only layers below it)")
            elif other not in RANK and other not in SHARED and other not in TOOLS and other != layer and len(target) > 1 and \
                    (Path(src, "torchbridge", other).is_dir() or Path(src, "torchbridge", f"{other}.py").exists()):
                out.append(f"{where} ({layer} may not import the glue module {other})")
            if parts[1:3] == ["device", "lowerings"] and target[1:2] == ["device"] and len(target) > 2 and \
                    target[2] not in LOWERING_MAY_USE:
                out.append(f"{where} (lowerings are pure JAX: no dispatcher, no kernel registration)")
    return out


def test_imports_point_down_only():
    assert violations(SRC) == []


def test_the_contract_catches_an_upward_import(tmp_path):
    """A copy of the source tree with one deliberately added upward import fails the check."""
    import shutil

    shutil.copytree(SRC / "torchbridge", tmp_path / "torchbridge", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    views = tmp_path / "torchbridge" / "device" / "views.py"
    views.write_text(views.read_text() + "\n\ndef _bad():\n    from torchbridge.serve import engine  # upward\n")
    lowering = tmp_path / "torchbridge" / "device" / "lowerings" / "core.py"
    lowering.write_text(lowering.read_text() + "\nfrom torchbridge.device import dispatch  # the dispatcher\n")
    found = violations(tmp_path)
    assert any("views.py" in v and "only layers below" in v for v in found), found
    assert any("core.py" in v and "pure JAX" in v for v in found), found
