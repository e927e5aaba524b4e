"""Prompt -> token ids, as the router sees them.

Two tokenizers, a deliberate trade-off:

* `HFTokenizer` loads the replica's own tokenizer (and chat template) from a local model
  directory. Its blocks line up with the engine's, so the precise index (fed by engine KV events
  carrying token ids) and the approximate one agree, and KV capacity is counted in real blocks.
  Cost: tens of microseconds to milliseconds per prompt and a transformers import.
* `ChunkTokenizer` (the fallback) cuts the UTF-8 bytes of the rendered prompt into fixed chunks
  of `chars_per_token` bytes, one pseudo-token each. It is essentially free and stable, and since
  the approximate index only has to agree with itself, prefix affinity works just as well; but
  block boundaries do not match the engine's, so engine KV events cannot be matched (the precise
  index is disabled) and capacity in blocks is only an estimate (~4 bytes per token for English
  and code).
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class Tokenizer(Protocol):
    name: str
    exact: bool  # True when ids match the engine's, enabling the precise index

    def encode_prompt(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


def render_chat_plain(messages: list[dict[str, Any]]) -> str:
    """A template-free rendering: stable and prefix-preserving (turn k's rendering is a prefix of
    turn k+1's), which is all prefix affinity needs."""
    parts = []
    for m in messages:
        content = m.get("content", "")
        if not isinstance(content, str):  # list of content parts (OpenAI vision-style)
            content = json.dumps(content, sort_keys=True, ensure_ascii=False)
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    return "".join(parts)


class ChunkTokenizer:
    exact = False

    def __init__(self, chars_per_token: int = 4) -> None:
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        self.chars_per_token = chars_per_token
        self.name = f"chunk{chars_per_token}"

    def encode_prompt(self, prompt: str) -> list[int]:
        data = prompt.encode("utf-8")
        k = self.chars_per_token
        # Ids must fit the hash's int32 packing; reducing modulo a prime near 2^31 keeps them
        # distinct in practice (a collision only costs a spurious prefix match).
        return [int.from_bytes(data[i:i + k], "little") % 2147483629 for i in range(0, len(data), k)]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode_prompt(render_chat_plain(messages))


class HFTokenizer:
    exact = True

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # lazy: only needed when a model dir is given

        self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.name = f"hf:{model_dir}"

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.encode_prompt(render_chat_plain(messages))


def make_tokenizer(model_dir: str | None, chars_per_token: int = 4) -> Tokenizer:
    return HFTokenizer(model_dir) if model_dir else ChunkTokenizer(chars_per_token)


def request_tokens(tok: Tokenizer, body: dict[str, Any]) -> list[int]:
    """Token ids of an OpenAI request body (completions `prompt` or chat `messages`)."""
    if "messages" in body and isinstance(body["messages"], list):
        return tok.encode_chat(body["messages"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(x, int) for x in prompt):
            return list(prompt)  # already token ids
        prompt = "".join(p if isinstance(p, str) else json.dumps(p) for p in prompt)
    return tok.encode_prompt(str(prompt))
