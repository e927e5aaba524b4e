"""Every c10d collective on device tensors equals the same call on CPU tensors over PyTorch's gloo,
on 2 and 4 ranks under torchrun (each rank one emulated chip); bad input raises PyTorch-style errors.

CI's time budget: the default run has 4 ranks (every case, and the ones that need a 2 x 2 mesh); the
same cases on 2 ranks and the host-copy transport run with TB_SLOW=1 (make test-all). 2 ranks stay in
CI through the parallel-training and tensor-parallel serving tests."""

from __future__ import annotations

import os

import pytest
from launch import PORTS, results, torchrun

NOT_SLOW = os.environ.get("TB_SLOW") != "1"
HOST_TRANSPORT = pytest.param(2, "host", marks=pytest.mark.skipif(NOT_SLOW, reason=(
    "CI's time budget: the host-copy transport (TORCHBRIDGE_COLLECTIVES=host, a non-default switch) runs with "
    "TB_SLOW=1 (make test-all); the default XLA transport runs here on 4 ranks")))
TWO_RANKS = pytest.param(2, "xla", marks=pytest.mark.skipif(NOT_SLOW, reason=(
    "CI's time budget: the same cases run here on 4 ranks; 2 ranks with TB_SLOW=1 (make test-all)")))


@pytest.mark.parametrize(("nproc", "transport"), [TWO_RANKS, (4, "xla"), HOST_TRANSPORT])
def test_collectives_match_gloo_on_cpu(tmp_path, nproc, transport):
    """transport "xla" (the default): XLA collectives; "host" (TORCHBRIDGE_COLLECTIVES=host): host copies
    through PyTorch's gloo, XLA's for what gloo cannot do (PREMUL_SUM, uneven all_to_all lists)."""
    torchrun("collectives.py", nproc, PORTS["collectives"] + nproc + (4 if transport == "host" else 0), tmp_path,
             timeout=400, env={"TORCHBRIDGE_COLLECTIVES": transport})
    per_rank = results(tmp_path, nproc)
    names = [c[0] for c in per_rank[0]["cases"]]
    # the worker covers every collective the issue lists, each op and several dtypes
    for needed in ("all_reduce SUM", "all_reduce AVG", "all_reduce PREMUL_SUM", "all_reduce PRODUCT", "all_reduce BXOR",
                   "broadcast", "all_gather ", "all_gather_into_tensor", "reduce_scatter ", "reduce_scatter_tensor",
                   "all_to_all_single even", "all_to_all_single uneven", "all_to_all lists", "scatter", "gather",
                   "reduce", "send/recv", "batch_isend_irecv", "coalesced", "async_op", "sub-groups", "CPU tensors",
                   "compiled functional collectives", "compiled collectives over two mesh dimensions",
                   *(("late peers", "large collectives") if transport == "xla" else ())):
        assert any(n.startswith(needed) or f" {needed}" in n for n in names), needed
    failed = [(r, c[0], c[2]) for r, d in enumerate(per_rank) for c in d["cases"] if not c[1]]
    assert not failed, "\n".join(f"rank {r}: {name}: {detail}" for r, name, detail in failed)
