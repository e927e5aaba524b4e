"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

Types are checked here (floats must be finite); ranges live in SamplingParams.validate, which the
offline API shares, and what needs the model (token ids, context length) in the engine.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from torchbridge.serve.sampling_params import InvalidParam, SamplingParams
from torchbridge.serve.structured_output import GuidedDecoding


class _Body(BaseModel):
    # Unknown fields are accepted (clients send vendor extensions); NaN and infinities are not.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's newer `structured_outputs` field (one of its keys)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def guided(self) -> GuidedDecoding | None:
        """The request's output constraint; more than one is an error."""
        found: list[GuidedDecoding] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(GuidedDecoding("json_object", param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidParam("response_format", "json_schema needs a `json_schema.schema`")
            found.append(GuidedDecoding("json", json.dumps(rf.json_schema.schema_), bool(rf.json_schema.strict),
                                        "response_format"))
        so = self.structured_outputs
        for param, kind, value in (
            ("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice), ("guided_grammar", "grammar", self.guided_grammar),
            ("structured_outputs", "json", so and so.json_), ("structured_outputs", "regex", so and so.regex),
            ("structured_outputs", "choice", so and so.choice), ("structured_outputs", "grammar", so and so.grammar),
        ):
            if value is None:
                continue
            if kind == "choice" and not value:
                raise InvalidParam(param, "needs at least one choice")
            spec = value if isinstance(value, str) and kind != "choice" else json.dumps(value)
            found.append(GuidedDecoding(kind, spec, param=param))
        if so is not None and so.json_object:
            found.append(GuidedDecoding("json_object", param="structured_outputs"))
        if len(found) > 1:
            raise InvalidParam(found[1].param, "only one structured-output constraint per request")
        return found[0] if found else None

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
            guided=self.guided(),
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


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content, tool-call arguments as objects."""
        out = {**self.model_dump(exclude_none=True, by_alias=True), "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                  "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return out

    def text(self) -> str:
        """The message's text (the text parts of a content list, joined)."""
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


def _arguments(a: str | dict[str, Any]) -> Any:
    if isinstance(a, dict):
        return a
    try:
        return json.loads(a)
    except ValueError:
        return a


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def sampling_params(self) -> SamplingParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_new_tokens, lp)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def explicit_max_tokens(self) -> bool:
        return self.max_new_tokens is not None
