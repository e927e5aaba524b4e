"""`python -m torchbridge serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

WARMUP_MODES = ("idle", "all", "off")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchbridge serve", description="OpenAI-compatible LLM server on any torch device.")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the bundled model)")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: the directory name)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, tpu, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget per step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: room for every sequence)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0, help="cap of the default --num-blocks")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative decoding config, e.g. {"method": "draft_model", "model": DIR, '
                        '"num_speculative_tokens": 4} or {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 3}')
    p.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                   help='n-gram lookup drafts of K tokens (= --speculative-config \'{"method": "ngram", '
                        '"num_speculative_tokens": K}\')')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N processes, one per chip (rank r computes on <device>:r); "
                        "N must divide the model's attention and key/value heads")
    p.add_argument("--shape-buckets", action=argparse.BooleanOptionalAction, default=None,
                   help="pad every step to static shape buckets (default: on for devices other than cpu/cuda)")
    p.add_argument("--compile", dest="compile_model", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each shape bucket's whole step as one graph (default: on for the bridge's device)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and prepare the next step while the current one runs (default: on for the "
                        "bridge's device without speculation or tensor parallelism)")
    p.add_argument("--warmup", choices=WARMUP_MODES, default=None,
                   help="run the shape buckets once before serving: 'idle' (default with --shape-buckets) the "
                        "first of each kind before the server is healthy and the rest while the engine is idle, "
                        "'all' every one before it is healthy, 'off' none")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const="off", help="--warmup off")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="larger request bodies are refused with 413 before they are read (default 16 MiB)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="parse tool calls out of outputs in this format (vLLM's flag; needed for tool_choice auto)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice \"auto\" (the model decides whether to call a tool)")
    p.add_argument("--no-kv-events", action="store_true", help="do not publish /v1/kv_events")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, the HTTP server in this one (vLLM's engine-core "
                        "split; default); --no-engine-process steps it on a thread of the server's process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from torchbridge.serve import default_model_dir

    model = args.model or str(default_model_dir())
    if not (Path(model) / "config.json").is_file():
        hint = "" if args.model else " (the bundled default model is not there yet; pass --model DIR)"
        print(f"torchbridge serve: no Hugging Face checkpoint at {model}{hint}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper())
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("torchbridge serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    launched = None
    if args.engine_process:
        from torchbridge.serve.engine_core import launch

        launched = launch(args.device)  # it imports the engine while this process builds the config
    try:
        config = _engine_config(args, model)
    except ValueError as e:  # a setting this model or device cannot take: say which, no traceback
        if launched is not None:  # the engine process is still importing: nothing of it to keep
            launched[0].kill()
            launched[0].wait(timeout=60)
            launched[1].close()
        print(f"torchbridge serve: {e}", file=sys.stderr)
        return 2
    warmup = args.warmup or ("idle" if config.shape_buckets else "off")
    try:
        async_engine = _start_engine(config, warmup, launched)
    except RuntimeError as e:  # the engine process could not load the model: say why, no traceback
        print(f"torchbridge serve: {e}", file=sys.stderr)
        return 1
    import uvicorn

    from torchbridge.serve.server import create_app

    app = create_app(async_engine, args.api_key, args.max_request_bytes, args.tool_call_parser,
                     args.enable_auto_tool_choice)
    # uvicorn exits gracefully on SIGTERM, then raises the signal again, which would end the process before
    # the engine (and its tensor-parallel workers) shut down: let it raise SystemExit instead.
    signal.signal(signal.SIGTERM, _exit)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
    return 0


def _start_engine(config, warmup: str, launched):  # noqa: ANN001, ANN202 - EngineConfig -> EngineClient
    if launched is not None:  # the engine in its own process, started already
        from torchbridge.serve.engine_process import EngineProcess

        client = EngineProcess(config, warmup)
        client.start(wait=False, launched=launched)
        try:
            # the HTTP side's imports (FastAPI, uvicorn) run while the engine process loads the model
            import torchbridge.serve.server  # noqa: F401

            client.wait_ready()
        except BaseException:
            client.shutdown()
            raise
        return client
    from torchbridge.serve.async_engine import AsyncEngine
    from torchbridge.serve.engine import LLMEngine

    engine = LLMEngine(config)
    if warmup != "off":
        engine.warmup(everything=warmup == "all")
    client = AsyncEngine(engine)
    client.start()
    return client


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _engine_config(args: argparse.Namespace, model: str):  # noqa: ANN202 - an EngineConfig
    from torchbridge.serve.config import EngineConfig

    return EngineConfig(
        model=model, device=args.device, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, speculative_ngram=args.speculative_ngram,
        speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
        shape_buckets=args.shape_buckets, compile_model=args.compile_model, async_scheduling=args.async_scheduling,
        served_model_name=args.served_model_name, seed=args.seed,
        kv_events=not args.no_kv_events,
    )
