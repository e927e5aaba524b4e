"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torchbridge.serve.config import EngineConfig
from torchbridge.serve.engine import LLMEngine
from torchbridge.serve.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict] | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str, device: str = "cpu", **engine_args: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), device=device, **engine_args))  # type: ignore[arg-type]
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - the Tokenizer wrapper, or None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run all prompts to completion (batched continuously) and return outputs in prompt order.
        Prompts are strings or lists of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = f"offline-{next(self._ids)}"
            reqs.append((rid, prompt, self.engine.add_request(rid, prompt, p)))
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generating")
        while self.engine.has_unfinished():
            for u in self.engine.step():
                if bar is not None and u.finished and u.request_id not in self.engine.requests:
                    bar.update(1)
        if bar is not None:
            bar.close()
        out = []
        for rid, prompt, req in reqs:
            choices = [
                CompletionOutput(
                    s.index, s.text, s.output_ids, s.finish_reason, s.stop_reason,
                    s.logprobs if s.params.logprobs is not None else None,
                )
                for s in req.seqs
            ]
            out.append(RequestOutput(rid, prompt if isinstance(prompt, str) else None, req.prompt_ids, choices))
        return out
