"""The engine on the bridge's `tpu` device, with each bucket's step compiled as one graph (the default)
and op by op: the same greedy tokens as Hugging Face on CPU, and no XLA recompiles once the shape
buckets are warm (counted by the bridge's compile counters)."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_support import hf_greedy, mixed_prompts
from torch._dynamo.utils import counters

from torchbridge.serve import LLM, SamplingParams

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
MAX_NEW = 8


def _compiles() -> tuple[int, int]:
    from torchbridge.compile import metrics

    return torchbridge.metrics()["compiles"], metrics()["graphs_compiled"]


@pytest.fixture(scope="module", params=[True, False], ids=["compiled-step", "op-by-op"])
def device_llm(llama_dir: Path, request: pytest.FixtureRequest) -> LLM:
    before = _compiles()[1]
    llm = LLM(str(llama_dir), device=DEV, block_size=16, num_blocks=24, max_model_len=48, max_num_seqs=4,
              max_num_batched_tokens=32, compile_model=request.param)
    assert llm.engine.config.compile_model is request.param
    frames = counters["stats"]["unique_graphs"]
    buckets = llm.engine.runner.warmup(4, 32, progress=False)
    assert buckets > 0
    # the compiled variant really runs graphs (one per warmed bucket); the other compiles none
    assert (_compiles()[1] > before) is request.param
    if request.param:  # Dynamo traced once per step structure (decode, prefill, fresh prompts on JAX's CPU
        # platform), not once per bucket: the bucket sizes are symbolic (none is 1, which Dynamo would
        # specialise), each compiled from that trace
        structures = 3 if llm.engine.runner.device_fresh_prefill else 2
        assert counters["stats"]["unique_graphs"] - frames <= structures < buckets
    return llm


def test_greedy_on_device_matches_hf_generate_on_cpu(device_llm: LLM, llama_dir: Path) -> None:
    prompts = mixed_prompts(3, hi=24)
    outs = device_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


def test_steady_state_serving_does_not_recompile(device_llm: LLM, llama_dir: Path) -> None:
    prompts = mixed_prompts(3, hi=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    device_llm.generate(prompts, params)  # any shape not covered by warm-up is compiled here, once
    before = _compiles()
    outs = device_llm.generate(prompts, params)
    assert _compiles() == before
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


def test_compiled_steps_are_replayed_after_each_buckets_first(device_llm: LLM, llama_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """After a bucket's first step through torch.compile the engine repeats that call (compile/replay.py)
    without entering Dynamo: the tokens stay Hugging Face's, and once every bucket has been met no step
    goes through torch.compile at all."""
    runner = device_llm.engine.runner
    if not device_llm.engine.config.compile_model:
        pytest.skip("op by op: no compiled call to replay")
    assert runner._replays is not None
    compiled_calls = []
    step = runner._step
    monkeypatch.setattr(runner, "_step", lambda *a: compiled_calls.append(1) or step(*a))

    def replayed() -> int:
        return sum(r.replays for r in runner._replays.values() if r is not None)

    prompts = mixed_prompts(3, hi=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    before = replayed()
    outs = device_llm.generate(prompts, params)
    assert replayed() - before > len(compiled_calls)  # most steps replayed, the rest compiled calls
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]
    compiled_calls.clear()
    before = replayed()
    outs = device_llm.generate(prompts, params)
    assert not compiled_calls and replayed() > before
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


def test_replay_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from torchbridge.serve.model_runner import _replaying

    assert _replaying(torch.device(DEV)) and not _replaying(torch.device("cpu"))
    monkeypatch.setenv("TORCHBRIDGE_SERVE_REPLAY", "0")
    assert not _replaying(torch.device(DEV))


def test_the_model_calls_the_shipped_kernels_on_the_device(device_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens above are unchanged with the kernels on (the default); here: they really run.
    Counted op by op (a compiled step does not re-enter Python; its model code is the same)."""
    if device_llm.engine.config.compile_model:
        pytest.skip("compiled steps run without re-entering the model's Python code")
    from torchbridge.kernels import paged_attention, rms_norm, rotary, swiglu

    calls: dict[str, int] = {}
    for module, name in ((rms_norm, "rms_norm"), (rms_norm, "add_rms_norm"), (rotary, "rotary"), (swiglu, "swiglu"),
                         (paged_attention, "paged_attention")):
        def counted(*a, _real=getattr(module, name), _name=name, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **k)

        monkeypatch.setattr(module, name, counted)
    device_llm.generate(mixed_prompts(1, hi=8), SamplingParams(temperature=0, max_tokens=3))
    assert set(calls) == {"rms_norm", "add_rms_norm", "rotary", "swiglu", "paged_attention"}, calls


def test_kernel_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.serve.models.llama import KERNELS, enabled_kernels

    assert enabled_kernels() == frozenset(KERNELS)
    monkeypatch.setenv("TORCHBRIDGE_SERVE_KERNELS", "0")
    assert enabled_kernels() == frozenset()
    monkeypatch.setenv("TORCHBRIDGE_SERVE_KERNELS", "rotary,swiglu")
    assert enabled_kernels() == {"rotary", "swiglu"}
    monkeypatch.setenv("TORCHBRIDGE_SERVE_KERNELS", "flash")
    with pytest.raises(ValueError, match="unknown kernels"):
        enabled_kernels()


def test_buckets_left_for_idle_time_warm_without_touching_requests(llama_dir: Path) -> None:
    """`warmup(everything=False)` (serve's default) runs the first bucket of each kind and leaves the rest to
    `warm_idle`. Here a warm step runs between every two steps of requests in flight (the engine loop only
    warms when idle, this is the harder case): warm steps write the scratch block only, so the requests'
    tokens still equal Hugging Face's, and afterwards every bucket is warm."""
    llm = LLM(str(llama_dir), device=DEV, block_size=16, num_blocks=24, max_model_len=48, max_num_seqs=4,
              max_num_batched_tokens=32, compile_model=True)
    eng = llm.engine
    shapes = eng.runner.bucket_shapes(4, 32)
    kinds = 3 if eng.runner.device_fresh_prefill else 2  # decode, prefill (and fresh prompts)
    assert eng.warmup(everything=False) == kinds < len(shapes)
    assert len(eng.warmup_pending) == len(shapes) - kinds
    prompts = mixed_prompts(3, hi=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for u in eng.step():
            tokens[u.request_id] += u.new_token_ids
        eng.warm_idle()
    assert [tokens[str(i)] for i in range(len(prompts))] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]
    while eng.warmup_pending:
        eng.warm_idle()
    assert len(eng.runner.shapes_warmed) == len(shapes)


def test_warm_up_waits_for_its_programs(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device runs programs asynchronously: warm-up must not return with its steps still queued (the first
    request's step waited behind them). It synchronizes after the last warm step, and every result is ready."""
    import jax
    import torch

    from torchbridge.device.runtime import STATE

    llm = LLM(str(llama_dir), device=DEV, block_size=16, num_blocks=24, max_model_len=48, max_num_seqs=4,
              max_num_batched_tokens=32, compile_model=True)
    runner = llm.engine.runner
    events: list[str] = []
    step = runner._step

    def counted_step(*args: object) -> object:
        events.append("step")
        return step(*args)

    runner._step = counted_step
    module = torch.get_device_module(runner.device)
    sync = module.synchronize
    monkeypatch.setattr(module, "synchronize", lambda *a, **k: (events.append("sync"), sync(*a, **k))[1])
    buckets = runner.warmup(4, 32, progress=False)
    assert events.count("step") == buckets and events[-1] == "sync"
    pending = STATE.last_results.get(runner.device.index or 0)
    assert pending is not None and all(x.is_ready() for x in jax.tree.leaves(pending))


@pytest.mark.parametrize("tiles", ["default", "off"])
def test_16bit_linears_multiply_float32_weights_on_the_cpu_platform(llama_dir: Path, tiles: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """XLA:CPU multiplies 16-bit floats in float32, converting the weight at every call, and its dot at a
    decode step's rows is about twice as fast with the weight stored [in, out]: on that platform the engine
    keeps each bf16 linear's weight as float32 [in, out] (serve/linear.py `transpose`; the 16-bit copy released
    unless tied), except a layer whose every call goes to the kernel library's held weight (`always_held`: a
    bf16 layer held with tiles, where the CPU has a bf16 tile kernel), which keeps no copy at all. Accuracy
    against HF in bf16 is test_dtype's (on this device too); here: the layers really are laid out so, and serve."""
    from torchbridge.device.runtime import STATE
    from torchbridge.serve import cpu_kernels
    from torchbridge.serve.linear import Linear, always_held

    if STATE.platform != "cpu":
        pytest.skip(f"XLA on {STATE.platform} multiplies 16-bit floats natively: weights stay 16-bit")
    if tiles == "off":
        monkeypatch.setenv("TORCHBRIDGE_SERVE_TILES", "0")
    llm = LLM(str(llama_dir), device=DEV, dtype="bfloat16", block_size=16, num_blocks=24, max_model_len=48,
              max_num_seqs=4, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    held = [m for m in linears if always_held(m)]
    widened = [m for m in linears if not always_held(m)]
    assert linears and all(m.wt is None and m.wide is None for m in held)
    assert all(m.wt is not None and m.wt.dtype.itemsize == 4 and m.wt.device.type == DEV
               and m.wt.shape == (m.in_features, m.out_features) for m in widened)
    if tiles == "off" or cpu_kernels.tile_kernel() is None:
        assert not held, "a layer held with tiles where the tiles are off or the CPU has no bf16 tile kernel"
    else:  # the test model's layer shapes are multiples of 32: every one fits the tile layout
        assert held == linears
    tied = model.model.embed_tokens.weight
    assert all(m.weight.device.type == "meta" or m.weight is tied for m in linears)
    out = llm.generate(mixed_prompts(2, hi=12), SamplingParams(temperature=0, max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_linears_run_the_panel_kernel_and_can_be_switched_off(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the panel kernel builds (AVX2 or AVX-512) the engine on the device holds every float32 linear as
    panels for the CPU kernels' float32 kernel, called inside the compiled step for decode rows (serve/linear.py `hold(panels=True)`);
    greedy tokens against HF are test_greedy_on_device_matches_hf_generate_on_cpu's, which runs through it
    here. TORCHBRIDGE_SERVE_PANELS=0 keeps every product in XLA."""
    import torch

    from torchbridge.device.runtime import STATE
    from torchbridge.serve import cpu_kernels
    from torchbridge.serve.linear import HELD_PANEL_MAX_ROWS, Linear

    if STATE.platform != "cpu" or cpu_kernels.available() is not None or not cpu_kernels.panel_linear_available():
        pytest.skip("the panel kernel is built only for AVX2/FMA or AVX-512 CPUs, for JAX's CPU platform")
    kw = dict(device=DEV, block_size=16, num_blocks=24, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32)

    def held_rows(llm: LLM) -> set:
        return {m.held_rows if m.held is not None else None
                for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}

    llm = LLM(str(llama_dir), **kw)
    assert held_rows(llm) == {(1, HELD_PANEL_MAX_ROWS)}
    keys = {m.held for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}
    assert torch.ops.torchbridge_serve.held_weights() >= len(keys) > 0  # the library has them, by their keys
    out = llm.generate(mixed_prompts(2, hi=12), SamplingParams(temperature=0, max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    monkeypatch.setenv("TORCHBRIDGE_SERVE_PANELS", "0")
    assert held_rows(LLM(str(llama_dir), **kw)) == {None}
