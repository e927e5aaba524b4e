"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

Types are checked here (floats must be finite); ranges live in SamplingParams.validate, which the
offline API shares, and what needs the model (token ids, context length) in the engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from torchbridge.serve.sampling_params import InvalidParam, SamplingParams


class _Body(BaseModel):
    # Unknown fields are accepted (clients send vendor extensions); NaN and infinities are not.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            min_tokens=self.min_tokens,
            logit_bias=_token_keys(self.logit_bias or {}),
        )


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends logit_bias keys as strings of token ids."""
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise InvalidParam("logit_bias", f"keys must be token ids (integers as strings), got {k!r}") from None
    return out


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def sampling_params(self) -> SamplingParams:
        return self._params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)

    @property
    def explicit_max_tokens(self) -> bool:
        return self.max_tokens is not None

    def prompts(self) -> list[str | list[int]]:
        p: Any = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(_Body):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (the text parts of a content list, joined)."""
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_new_tokens, lp)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def explicit_max_tokens(self) -> bool:
        return self.max_new_tokens is not None
