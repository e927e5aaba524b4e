"""The asyncio front of the engine (serve/async_engine.py): a consumer that falls behind gets the deltas
waiting for it merged, and the merged stream says exactly what the offline engine says."""

from __future__ import annotations

import asyncio
from pathlib import Path

from serve_support import mixed_prompts

from torchbridge.serve import LLM, SamplingParams
from torchbridge.serve.async_engine import AsyncEngine, _merged
from torchbridge.serve.config import EngineConfig
from torchbridge.serve.engine import LLMEngine, SeqUpdate


def _update(index: int, ids: list[int], finished: bool = False, error: str | None = None) -> SeqUpdate:
    return SeqUpdate("r", index, ids, "".join(f"<{i}>" for i in ids), [{"token": i} for i in ids], finished,
                     "length" if finished else None, None, None, error)  # type: ignore[arg-type]


def test_merge_joins_runs_of_one_choice_and_stops_at_finish_and_errors() -> None:
    items = [_update(0, [1]), _update(0, [2, 3]), _update(1, [4]), _update(1, [5], finished=True),
             _update(1, [6]), _update(0, [7], error="boom"), _update(0, [8])]
    got = _merged(items)
    assert [(u.index, u.new_token_ids, u.finished, u.error) for u in got] == [
        (0, [1, 2, 3], False, None), (1, [4, 5], True, None), (1, [6], False, None), (0, [7], False, "boom"),
        (0, [8], False, None)]
    assert got[0].new_text == "<1><2><3>" and got[0].new_logprobs == [{"token": 1}, {"token": 2}, {"token": 3}]
    err = RuntimeError("engine failed")
    assert _merged([_update(0, [1]), err, _update(0, [2])])[1] is err


def test_a_slow_consumer_gets_merged_deltas_with_the_offline_text(llama_dir: Path) -> None:
    prompts = mixed_prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0] for o in LLM(str(llama_dir), block_size=4, num_blocks=128).generate(prompts, params)]
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), block_size=4, num_blocks=128)))
    engine.start()

    async def consume(i: int) -> list[SeqUpdate]:
        got = []
        async for u in engine.generate(f"r{i}", prompts[i], params):
            got.append(u)
            if len(got) == 1:
                await asyncio.sleep(0.5)  # fall behind: the engine keeps stepping meanwhile
        return got

    async def main() -> list[list[SeqUpdate]]:
        return await asyncio.gather(*(consume(i) for i in range(len(prompts))))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    for got, ref in zip(streams, want, strict=True):
        assert [t for u in got for t in u.new_token_ids] == list(ref.token_ids)
        assert "".join(u.new_text for u in got) == ref.text
        assert got[-1].finished and not any(u.finished for u in got[:-1])
    # Twelve tokens in fewer deltas: what waited during the sleep came as one.
    assert any(len(got) < 12 for got in streams), [len(g) for g in streams]
