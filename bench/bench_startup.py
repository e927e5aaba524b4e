"""Start-up of `serve` to a healthy /health: on the bridge's device with a warm and a cold XLA cache,
on the CPU, and (with --arms vllm) `vllm serve` of vLLM's CPU build on the same model, arms alternated.

What a user waits for after typing the command: the process starts, loads the model, warms up (on the
bridge's device: every shape bucket's step compiled, the engine's default there) and answers /health.
Each start is then checked with one completion (the server really serves) and stopped.

- tpu-warm: the persistent XLA cache (TORCHBRIDGE_COMPILE_CACHE_DIR) holds every program from an
  untimed first start: a restart of the same server;
- tpu-cold: a new, empty cache directory for every start: the first start on a machine;
- cpu: the default device (no shape buckets, nothing to compile);
- vllm: `vllm serve` (peer_vllm.py's environment), for scale;
- with `--baseline REV`, each tpu arm again as `<arm>@REV`: the same command from a git worktree of
  that revision (its own warm cache), alternated with this checkout's: an A/B of a change.

    python bench/bench_startup.py --rounds 3 [--model bundled|bench] [--arms tpu-warm,tpu-cold,cpu,vllm]
                                  [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_model, wait_healthy  # noqa: E402

ARMS = ("tpu-warm", "tpu-cold", "cpu", "vllm")


def _launch(arm: str, model_dir: Path, port: int, max_num_seqs: int, max_model_len: int,
            env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The arm's command and environment (`env`: ours, with its XLA cache directory)."""
    if arm == "vllm":
        import peer_vllm

        # its compute threads on the cores our engine process gets (all but one)
        return (peer_vllm.serve_command(peer_vllm.ensure_vllm(), model_dir, port, max_num_seqs, "float32", max_model_len),
                peer_vllm.vllm_env(max(1, (os.cpu_count() or 2) - 1)))
    device = "cpu" if arm == "cpu" else "tpu"
    return ([sys.executable, "-m", "torchbridge", "serve", "--model", str(model_dir), "--port", str(port),
             "--device", device, "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
             "--served-model-name", "bench", "--log-level", "warning"], env)


def start_once(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, float]:
    """Seconds from launch to a 200 from /health, and to every shape bucket warm (ours warms buckets after
    the first of each kind while idle, `--warmup idle`: its /metrics counts them down; other servers are
    warm when healthy); then one completion must succeed."""
    port = cmd[cmd.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
        try:
            wait_healthy(proc, base, t0 + timeout, log, cmd)
            seconds = time.monotonic() - t0
            while _pending_buckets(base) and time.monotonic() < t0 + timeout:
                time.sleep(0.05)
            warm = time.monotonic() - t0
            r = httpx.post(base + "/v1/completions", timeout=120,
                           json={"model": "bench", "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            if choice.get("finish_reason") != "length":  # four tokens, or the start served nothing
                raise RuntimeError(f"the started server did not complete: {choice}")
            return seconds, warm
        finally:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=60)


def _pending_buckets(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("torchbridge:warmup_pending_buckets{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def _worktree(rev: str | None, path: Path) -> Iterator[Path | None]:
    """A detached git worktree of `rev` at `path` for the run (None without a revision)."""
    if rev is None:
        yield None
        return
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], check=False,
                       capture_output=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="tpu-warm,tpu-cold,cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="bundled", help="bundled, bench (bench_serve.py's model) or a directory")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--baseline", help="a git revision: its tpu arms run too, alternated with this checkout's")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if bad := [a for a in arms if a not in ARMS]:
        p.error(f"unknown arms {bad}; choose from {ARMS}")
    if args.baseline:
        arms += [f"{a}@{args.baseline}" for a in arms if a.startswith("tpu")]

    with tempfile.TemporaryDirectory() as tmp, _worktree(args.baseline, Path(tmp) / "baseline") as baseline:
        tmp_path = Path(tmp)
        if args.model == "bundled":
            from torchbridge.serve import default_model_dir

            model_dir = Path(default_model_dir())
        elif args.model == "bench":
            model_dir = tmp_path / "model"
            make_model(model_dir)
        else:
            model_dir = Path(args.model)
        def env_for(arm: str, r: int | None = None) -> dict[str, str]:
            """Its XLA cache (the warm one per source tree; a new one per cold start), and for a baseline
            arm the worktree's sources ahead of this checkout's."""
            kind, _, rev = arm.partition("@")
            cache = tmp_path / (f"xla-cold-{r}-{rev}" if kind == "tpu-cold" else f"xla-warm-{rev}")
            env = {**os.environ, "TORCHBRIDGE_COMPILE_CACHE_DIR": str(cache)}
            if rev:
                env["PYTHONPATH"] = os.pathsep.join([str(baseline / "src"), *filter(None, [env.get("PYTHONPATH")])])
            return env

        def run(arm: str, env: dict[str, str]) -> tuple[float, float]:
            return start_once(*_launch(arm.partition("@")[0], model_dir, free_port(), args.max_num_seqs,
                                       args.max_model_len, env), args.timeout)

        for arm in (a for a in arms if a.startswith("tpu-warm")):
            print(f"priming {arm}'s warm cache: {run(arm, env_for(arm))[1]:.1f} s (untimed)", flush=True)
        times: dict[str, list[float]] = {a: [] for a in arms}
        warm: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                healthy, all_warm = run(arm, env_for(arm, r))
                times[arm].append(healthy)
                warm[arm].append(all_warm)
                print(f"round {r + 1} {arm}: healthy {healthy:.1f} s, every bucket warm {all_warm:.1f} s", flush=True)

    print(f"\nStart-up to healthy, {args.model} model, --max-num-seqs {args.max_num_seqs} --max-model-len "
          f"{args.max_model_len}, {args.rounds} rounds alternated (`python bench/bench_startup.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`):\n")
    print("| arm | healthy: median s | min s | max s | every bucket warm: median s | min s | max s |\n"
          "|---|---|---|---|---|---|---|")
    for arm, ts in times.items():
        ws = warm[arm]
        print(f"| {arm} | {statistics.median(ts):.1f} | {min(ts):.1f} | {max(ts):.1f} | {statistics.median(ws):.1f} "
              f"| {min(ws):.1f} | {max(ws):.1f} |")
    for arm in (a for a in arms if "@" in a):  # per round: the baseline's time over this checkout's
        ratios = [b / n for b, n in zip(times[arm], times[arm.partition("@")[0]], strict=True)]
        print(f"\n{arm.partition('@')[0]}: {arm} / this checkout = {statistics.median(ratios):.2f}x "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
