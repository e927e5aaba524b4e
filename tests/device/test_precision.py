"""The float32 matmul precision switch (TorchTPU-style): values against CPU, and recompilation."""

from __future__ import annotations

import jax
import pytest
import torch

import torchbridge

DEV = torchbridge.device_name()


@pytest.fixture
def restore_precision():
    yield
    torchbridge.set_matmul_precision("default")


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
def test_matmul_matches_cpu_at_each_precision(precision, restore_precision):
    torchbridge.set_matmul_precision(precision)
    a, b = torch.randn(32, 48, dtype=torch.float32), torch.randn(48, 16, dtype=torch.float32)
    # On CPU XLA every setting is full float32; on TPU "default" would be bfloat16 passes.
    tol = 1e-5 if precision == "highest" or jax.default_backend() == "cpu" else 1e-2
    torch.testing.assert_close((a.to(DEV) @ b.to(DEV)).cpu(), a @ b, atol=tol, rtol=tol)


def test_switch_recompiles_and_rejects_unknown_values(restore_precision):
    x = torch.randn(8, 8).to(DEV)
    (x @ x).cpu()
    before = torchbridge.metrics()["compiles"]
    torchbridge.set_matmul_precision("highest")
    assert jax.config.jax_default_matmul_precision == "highest"
    (x @ x).cpu()
    assert torchbridge.metrics()["compiles"] > before
    with pytest.raises(ValueError, match="precision must be"):
        torchbridge.set_matmul_precision("bf16")
