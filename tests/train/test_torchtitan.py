"""TorchTitan, unmodified, trains its llama3 debug model on the device through its own entry point.

TorchTitan 0.3.0 (the release for torch 2.13) lives in its own virtual environment
(tests/train/peer_venv.py: ~/.cache/torchbridge/peers/torchtitan-0.3.0); the tests skip, saying why,
when it cannot be created (no package registry). Its tokenizer and dataset are built offline
(torchbridge.train.titan.write_assets); the launch is `torchrun -m torchtitan.train --module llama3
--config llama3_debugmodel` with the overrides in titan.overrides (offline assets, CPU-sized batches,
fp32 parameters). It picks the device itself (torch._utils._get_available_device_type finds `tpu`),
uses the device's c10d backend, FSDP2's fully_shard, and compiles FlexAttention and create_block_mask
with torch.compile's default backend, which the bridge routes to its own.

Reference: the same job on one rank. The dataset's documents are identical per data-parallel rank
(see titan.py), so FSDP2 on 2 ranks with local batch 2 must give the 1-rank curve with local batch 2.
Tolerance: 1e-4 relative per step (fp32; FSDP2 reduce-scatters gradients in a different order than
one rank sums them, and AdamW carries the difference on; measured: equal in the 5 decimals TorchTitan
prints, 8.28862 / 7.88664 / 7.77895 for steps 1-3 on 1 and 2 ranks). The loss must also fall. Default run (CI's time budget): 1 rank, 3 steps. TB_SLOW=1: 10 steps, FSDP2 on 2 ranks, FSDP2 x TP (2 x 2
ranks; trains, but starts from a different initialisation, see its test) and the model compiled with
`--compile.enable` (TorchTitan's default backend "inductor").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from peer_venv import PeerUnavailable, ensure, pin

from distributed.launch import PORTS, run_bounded
from torchbridge.train import titan

SLOW = os.environ.get("TB_SLOW") == "1"
STEPS = 10 if SLOW else 3
SEQ_LEN, LOCAL_BATCH = 64, 2
RTOL = 1e-4


@pytest.fixture(scope="module")
def python() -> str:
    try:
        # TorchTitan imports triton at start-up (its expert-parallel kernels), which PyTorch's CPU build
        # does not install; the version this interpreter has
        return str(ensure("torchtitan", titan.RELEASE, extra=(pin("triton"),)))
    except PeerUnavailable as e:
        pytest.skip(f"TorchTitan's environment could not be created: {e}")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return titan.write_assets(tmp_path_factory.mktemp("titan-assets"), copies=2)


def _train(python: str, assets: Path, out: Path, nproc: int, port_offset: int, dp_shard: int = 1, tp: int = 1,
           compile_model: bool = False) -> tuple[dict[int, float], str]:
    flags = titan.overrides(assets, out, STEPS, SEQ_LEN, LOCAL_BATCH, dp_shard=dp_shard, tp=tp,
                            compile_model=compile_model)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={nproc}", "OMP_NUM_THREADS": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR", "TORCHBRIDGE_COMPILE_CACHE_MIN_SECS": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "hf-cache")}
    proc = run_bounded(titan.command(nproc, PORTS["torchtitan"] + port_offset, flags, python), env, 900,
                       f"torchtitan on {nproc} ranks", expect_ok=True)
    return titan.losses(proc.stdout), proc.stdout


def _assert_same_curve(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), (got, ref)
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)]),
                               torch.tensor([ref[k] for k in sorted(ref)]), rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def one_rank(python, assets, tmp_path_factory) -> dict[int, float]:
    losses, log = _train(python, assets, tmp_path_factory.mktemp("titan-1"), 1, 0)
    assert "tpu" in log.lower()  # TorchTitan picked the device itself
    return losses


def test_one_rank_trains(one_rank):
    assert sorted(one_rank) == list(range(1, STEPS + 1)), one_rank
    assert one_rank[STEPS] < one_rank[1] - (0.5 if SLOW else 0.1), one_rank


@pytest.mark.skipif(not SLOW, reason="CI's time budget: the 2-rank TorchTitan job (~40 s) runs with TB_SLOW=1; FSDP2 "
                    "itself is checked against CPU+gloo in tests/distributed")
def test_fsdp2_two_ranks_matches_one_rank(python, assets, one_rank, tmp_path):
    losses, _ = _train(python, assets, tmp_path, 2, 2, dp_shard=2)
    _assert_same_curve(losses, one_rank)


@pytest.mark.skipif(not SLOW, reason="4 ranks of TorchTitan take minutes on 2 cores (TB_SLOW=1)")
def test_fsdp2_with_tensor_parallel_on_four_ranks_trains(python, assets, one_rank, tmp_path):
    """FSDP2 x TP (2 x 2 ranks) trains. Not compared with one rank: its step-1 loss differs (measured
    8.15430 vs 8.28862) because TorchTitan initialises a tensor-parallel model differently (its own tests
    compare layouts from a seed checkpoint, --checkpoint.create_seed_checkpoint; not done here yet)."""
    losses, _ = _train(python, assets, tmp_path, 4, 4, dp_shard=2, tp=2)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1] - (0.3 if SLOW else 0.1), losses


@pytest.mark.skipif(not SLOW, reason="compiling the model adds minutes (TB_SLOW=1)")
def test_compiled_model_matches_one_rank(python, assets, one_rank, tmp_path):
    losses, _ = _train(python, assets, tmp_path, 2, 8, dp_shard=2, compile_model=True)
    _assert_same_curve(losses, one_rank)
