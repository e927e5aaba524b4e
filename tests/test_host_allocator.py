"""The host allocator policy (host_allocator.py): with TORCHBRIDGE_HOST_ALLOCATOR=keep, a block allocated
after a larger one was freed reuses its pages; without it (the default) glibc's own behaviour stays (a
fresh mmap per large block, one page fault per 4 KiB). The kernel's fault counter is the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchbridge import host_allocator

_PROBE = """
import json, resource, torch, torchbridge.host_allocator as h
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(4):
    x = torch.empty(16 << 20).fill_(1.0)  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
    del x
    f0 = faults()
    y = torch.empty(12 << 20).fill_(2.0)  # 48 MiB (12,288 pages): fits in the block just freed
    counts.append(faults() - f0)
    del y
print(json.dumps({"state": h.state(), "faults": counts}))
"""


pytestmark = pytest.mark.skipif(host_allocator.glibc() is None, reason="the policy sets glibc's malloc options; this C library is not glibc")


def _probe(policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHBRIDGE_HOST_ALLOCATOR"}
    if policy is not None:
        env["TORCHBRIDGE_HOST_ALLOCATOR"] = policy
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def test_keep_reuses_freed_memory_without_page_faults() -> None:
    kept = _probe("keep")
    assert kept["state"] == "keep"
    # the freed block's pages are resident already: touching them again faults on none (a few from Python)
    assert max(kept["faults"]) < 200, kept


@pytest.mark.parametrize("policy", [None, "default", "bogus"])
def test_without_keep_glibc_is_left_alone(policy: str | None) -> None:
    default = _probe(policy)  # unset: nothing process-wide changes behind a user's back; bogus: a warning
    assert default["state"] == "default"
    assert ("must be 'keep' or 'default'" in default["stderr"]) == (policy == "bogus")
    # glibc maps each block afresh and unmaps it on free: every page faults again (the test's premise)
    assert min(default["faults"]) > 12000, default


_CLI_PROBE = """
import sys, types
import torchbridge.cli as cli
probe = types.ModuleType("probe")
def report(argv):
    import torch  # noqa: F401 - the autoload runs here, as in the real subcommand
    from torchbridge import host_allocator
    print("POLICY", host_allocator.state())
    return 0
probe.report = report
sys.modules["probe"] = probe
cli._COMMANDS = {name: ("probe", "report", "") for name in cli._COMMANDS}
sys.exit(cli.main([sys.argv[1]]))
"""


@pytest.mark.parametrize(("command", "policy"), [("train", "keep"), ("serve", "default")])
def test_train_command_keeps_memory_and_others_do_not(command: str, policy: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHBRIDGE_HOST_ALLOCATOR"}
    out = subprocess.run([sys.executable, "-c", _CLI_PROBE, command], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert f"POLICY {policy}" in out.stdout, out.stdout + out.stderr
