"""The C++ extension's build cache survives a build that was killed half-way."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_stale_build_lock_does_not_hang_the_next_import() -> None:
    """PyTorch's build lock is a file only its holder removes; a killed build used to leave it and every
    later `import torch` (the device registers at import) waited forever."""
    from torchbridge.device import native

    build = native._build_dir()
    native.load()  # built (or loaded) here first, so the child only loads
    (build / "lock").write_text("")  # what a SIGKILLed build leaves
    code = "import torch; print((torch.ones(2, device='tpu') + 1).cpu().tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[2.0, 2.0]"
    assert not (build / "lock").exists()


def test_the_build_compiles_copies_kept_in_the_cache() -> None:
    """Checkouts with the same sources share one build: its command line names the cache's copies, not a
    checkout's own files (from several checkouts ninja rebuilt whenever another had built last)."""
    from torchbridge.device import native

    build = native._build_dir()
    native.load()
    ninja = (build / "build.ninja").read_text()
    for src in native._SOURCES:
        assert str(build / "csrc" / src.name) in ninja
        assert str(src) not in ninja


def test_each_torch_installation_gets_its_own_build(monkeypatch, tmp_path) -> None:
    """The build's command line names torch's include and library directories: an environment with its
    own copy of torch (TorchTitan's peer venv had one) sharing the build directory made ninja rebuild
    (~55 s) every time the other environment had built last."""
    import torch

    from torchbridge.device import native

    build = native._build_dir()
    native.load()
    ninja = (build / "build.ninja").read_text()
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    assert torch_dir in ninja  # what makes the command line, and so the build, specific to this installation
    monkeypatch.setenv("TORCHBRIDGE_CACHE", str(tmp_path))  # the other installation's build dir goes here
    assert native._build_dir().name == build.name  # (same key in another cache root)
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert native._build_dir().name != build.name
