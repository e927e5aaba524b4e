"""Our model implementations against Hugging Face Transformers: logits within 1e-4 in fp32, through the
paged KV cache (a chunked prefill followed by single-token decode steps), padded and unpadded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serve_support import DEVICES, hf_logits, save_model

from torchbridge.serve.block_manager import BlockManager
from torchbridge.serve.config import EngineConfig, ModelConfig
from torchbridge.serve.model_runner import ModelRunner
from torchbridge.serve.sampling_params import SamplingParams
from torchbridge.serve.scheduler import Batch, ScheduledSeq
from torchbridge.serve.sequence import Sequence

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


DECODES = {"kernel": {}, "workspace": {"cpu_kernels": False}}  # how cpu decode steps read the cache


def engine_logits(model_dir: Path, prompts: list[list[int]], chunk: int, device: str, pad: bool,
                  **overrides: object) -> list[torch.Tensor]:
    """Logits at every position of every prompt: the first `chunk` tokens of all prompts in one step,
    then one token per step; all prompts in the same batch."""
    cfg = EngineConfig(model=str(model_dir), device=device, block_size=4, num_blocks=64, max_model_len=128,
                       **overrides)
    runner = ModelRunner(cfg)
    bm = BlockManager(cfg.num_blocks, cfg.block_size)
    seqs = []
    for ids in prompts:
        s = Sequence("r", 0, ids, SamplingParams())
        assert bm.allocate(s, len(ids))
        seqs.append(s)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = [min(chunk, len(ids)) for ids in prompts]
    while any(s.num_computed_tokens < len(s.token_ids) for s in seqs):
        items, owners = [], []
        for i, s in enumerate(seqs):
            if s.num_computed_tokens < len(s.token_ids):
                # Make every fed token "the last one" so the runner returns its logits row.
                n = step[i] if s.num_computed_tokens == 0 else 1
                s.token_ids = prompts[i][: s.num_computed_tokens + n]
                items.append(ScheduledSeq(s, n))
                owners.append(i)
        logits, rows = runner.run(Batch(items), pad=pad)
        for it, i, (row, count) in zip(items, owners, rows, strict=True):
            assert count == 1
            out[i].append(logits[row])
            it.seq.num_computed_tokens += it.num_tokens
            it.seq.token_ids = prompts[i][: it.seq.num_computed_tokens + 1]
    return [torch.stack(rows) for rows in out]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", list(DECODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch: str, decode: str, device: str, tmp_path: Path) -> None:
    model_dir = save_model(tmp_path, arch, None, seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (21, 9, 30)]
    chunk = 6
    # The padded path once per family would only repeat test_padded_equals_unpadded; llama covers it here.
    for pad in (False, True) if arch == "llama" and decode == "kernel" else (False,):
        ours = engine_logits(model_dir, prompts, chunk, device, pad, **DECODES[decode])
        for ids, got in zip(prompts, ours, strict=True):
            ref = hf_logits(model_dir, ids)
            # We only see logits at the chunk's last position, then at every later position.
            ref = ref[min(chunk, len(ids)) - 1 :]
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_padded_equals_unpadded(tmp_path: Path) -> None:
    model_dir = save_model(tmp_path, "qwen3", None, seed=5)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 75))]
    plain = engine_logits(model_dir, prompts, 5, "cpu", pad=False)
    padded = engine_logits(model_dir, prompts, 5, "cpu", pad=True)
    for a, b in zip(plain, padded, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_config_reads_rope_and_moe_fields(tmp_path: Path) -> None:
    save_model(tmp_path, "qwen3_moe", None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.num_experts == 4
    assert cfg.rope_theta == 5000.0 and cfg.moe_layers == [0, 1]


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    model_dir = save_model(tmp_path, "llama", None, seed=7, rope_parameters=scaling)
    ids = list(range(3, 40))
    ours = engine_logits(model_dir, [ids], len(ids), "cpu", pad=False)[0]
    torch.testing.assert_close(ours[-1], hf_logits(model_dir, ids)[-1], atol=1e-4, rtol=0)
