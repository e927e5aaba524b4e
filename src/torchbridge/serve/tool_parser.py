"""Tool calls out of generated text, chosen by `--tool-call-parser` (vLLM's flag).

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen, and the
bundled model's chat template). The same parser serves whole texts and streams: text before a call is
content, a call is reported once its closing tag arrives, and text that could still become an opening
tag is held back. A block whose JSON does not parse is left in the content, as vLLM does.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to emit now, and the tool calls completed by `text`."""
        self._buffer += text
        content, calls = "", []
        while True:
            if not self._in_call:
                i = self._buffer.find(self.START)
                if i < 0:
                    keep = _partial_suffix(self._buffer, self.START)
                    cut = len(self._buffer) - keep
                    content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    break
                content += self._buffer[:i]
                self._buffer, self._in_call = self._buffer[i + len(self.START):], True
            else:
                j = self._buffer.find(self.END)
                if j < 0:
                    break
                body, self._buffer, self._in_call = self._buffer[:j], self._buffer[j + len(self.END):], False
                call = _call(body)
                if call is None:
                    content += self.START + body + self.END
                else:
                    calls.append(call)
        self.calls += calls
        return content, calls

    def finish(self) -> str:
        """What is left at the end of the output (an unclosed call stays text)."""
        rest = (self.START if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return rest

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output as (content or None when only whitespace remains, tool calls)."""
        content, calls = self.feed(text)
        content += self.finish()
        return (content if content.strip() else None), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


TOOL_CALL_PARSERS = {"hermes": HermesToolParser}
