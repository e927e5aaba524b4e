"""What TorchTitan needs to train its llama3 debug model offline, and its launch command on the device.

TorchTitan's debug recipe reads a tokenizer from `hf_assets_path` (tokenizer.json and
tokenizer_config.json, Hugging Face format) and the "c4_test" dataset from a directory
`datasets.load_dataset` opens (JSON lines with a "text" field). Neither may come from a hub here, so
`write_assets` builds both from the offline corpus `torchbridge train` uses (the interpreter's
standard library): a byte-level BPE tokenizer of at most the debug model's 2,048 entries, and a
dataset of `copies` identical documents, each the same stretch of the corpus.

Why identical copies: TorchTitan gives each data-parallel rank its own slice of the documents
(`split_dataset_by_node`), so a 2-rank job normally trains on different batches than a 1-rank job.
With one document per data-parallel rank, all equal, every rank reads the token stream a single rank
reads, and a job with dp ranks of local batch b sees, step by step, the same per-sequence losses as
one rank with local batch b (the global mean over equal halves is the half's mean): FSDP2 can then be
compared with one rank curve against curve. The stretch is long enough that no window repeats within
the steps run (`documents_tokens` / seq_len windows per rank).

The launch (TorchTitan's own entry point, `torchrun -m torchtitan.train`, no patch to its code) is
`command(...)`; the flags it adds to TorchTitan's defaults are listed in `overrides(...)` with why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEBUG_VOCAB = 2048  # the llama3 debug model's embedding rows (torchtitan/models/llama3/__init__.py)
RELEASE = "0.3.0"  # the TorchTitan release pinned for torch 2.13 (the newest on the registry)


def write_assets(out: Path, copies: int = 1, max_bytes: int = 600_000, vocab_size: int = DEBUG_VOCAB) -> Path:
    """Write OUT/tokenizer and OUT/dataset (OUT/dataset/data.json); returns `out`. Reused when present."""
    from torchbridge.train import data

    stamp = out / "assets.json"
    spec = {"copies": copies, "max_bytes": max_bytes, "vocab_size": vocab_size}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    docs = data.read_split("train", max_bytes)
    text = "\n\n".join(t for _, t in docs)
    tokenizer = data.train_tokenizer([t for _, t in docs], vocab_size)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    (out / "dataset").mkdir(parents=True, exist_ok=True)
    with open(out / "dataset" / "data.json", "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.write(json.dumps({"text": text}) + "\n")
    stamp.write_text(json.dumps(spec))
    return out


def overrides(assets: Path, out: Path, steps: int, seq_len: int, local_batch: int, dp_shard: int = 1, tp: int = 1,
              seed: int = 42, compile_model: bool = False) -> list[str]:
    """TorchTitan command-line overrides for a run on this machine's emulated chips."""
    flags = [
        "--module", "llama3", "--config", "llama3_debugmodel",
        # offline assets instead of ./tests/assets (TorchTitan's source tree, not in its wheel)
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(assets / "dataset"),
        "--dump_folder", str(out),
        # CPU-sized: the recipe's 8 x 2048 tokens per rank would take minutes per step on emulated chips
        "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local_batch),
        # fp32 parameters under FSDP2 too (its default casts them to bf16), so 1 rank and N ranks
        # compute the same thing and their curves can be compared
        "--training.mixed_precision_param", "float32",
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        # DTensor for the model-parallel axes and FSDP2's own data-parallel sharding (PyTorch 2.13's
        # fully_shard); the default "spmd_types" backend wants every parameter distributed on the full
        # mesh first, which this release's model code does not do on PyTorch 2.13
        "--parallelism.spmd_backend", "partial_dtensor",
        "--debug.seed", str(seed),
        "--metrics.log_freq", "1",
    ]
    if compile_model:
        flags += ["--compile.enable"]
    return flags


def command(nproc: int, port: int, flags: list[str], python: str = sys.executable) -> list[str]:
    """TorchTitan's own launch: torchrun running its `torchtitan.train` entry point."""
    return [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
            "-m", "torchtitan.train", *flags]


def losses(log: str) -> dict[int, float]:
    """Step -> loss from TorchTitan's metric lines (`step:  3  loss:  7.1234 ...`), rank 0's."""
    import re

    found: dict[int, float] = {}
    for m in re.finditer(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaif]+)", re.sub(r"\x1b\[[0-9;]*m", "", log)):
        found.setdefault(int(m.group(1)), float(m.group(2)))
    return found
