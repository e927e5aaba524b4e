"""Grammar-constrained decoding with xgrammar: JSON schemas, JSON, regexes, choices, EBNF grammars
and tool calls, as a token mask applied to each constrained row's logits in the batched sampler.

A request's constraint is a `GuidedDecoding` (plain data, built from the request body without
importing xgrammar); the server compiles it off the event loop before the request reaches the engine
(an invalid schema or regex is a 400), the engine gives every sequence its own matcher, the sampler
masks the disallowed tokens of constrained rows (free rows in the same step are untouched), and each
sampled token advances the matcher. The grammar ends the output by allowing only a stop token once it
is complete.

Tool calls use the Hermes / Qwen format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
through xgrammar's structural tag for that format: with tool_choice "required" or a named function the
output is one or more such calls (arguments valid against the tool's schema); with "auto", free text
in which every call that starts is completed validly.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from torchbridge.serve.sampling_params import InvalidParam

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GuidedDecoding:
    kind: str  # one of KINDS
    spec: str = ""  # JSON schema text, regex, JSON list of choices, EBNF, or structural tag JSON
    strict: bool = True  # json: no properties beyond the schema's unless it allows them
    param: str = "response_format"  # the request field it came from, for error messages
    compiled: Any = field(default=None, compare=False, hash=False)  # xgrammar CompiledGrammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParam(self.param, f"unknown constraint kind {self.kind!r}")


CALL_BEGIN, CALL_ARGUMENTS, CALL_END = '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"


def tool_calls_decoding(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> GuidedDecoding:
    """The constraint for a tool-calling request. "required": one or more calls (one without
    parallel_tool_calls) separated by newlines and nothing else; a named function: exactly one call of
    it; "auto": xgrammar's Qwen/Hermes format, free text in which any call that starts is completed."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    def tag(tool: dict) -> Any:
        f = tool["function"]
        # Whitespace runs capped: unbounded, a small model can fill max_tokens with blanks inside a call.
        return st.TagFormat(begin=CALL_BEGIN + f["name"] + CALL_ARGUMENTS, end=CALL_END,
                            content=st.JSONSchemaFormat(json_schema=f.get("parameters") or {"type": "object"},
                                                        max_whitespace_cnt=1))

    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fmt: Any = tag(next(t for t in tools if t["function"]["name"] == name))
        structural = st.StructuralTag(format=fmt)
    elif tool_choice == "required":
        structural = st.StructuralTag(format=st.TagsWithSeparatorFormat(
            tags=[tag(t) for t in tools], separator="\n", at_least_one=True, stop_after_first=not parallel_tool_calls))
    else:
        try:
            structural = xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice="auto", reasoning="disabled",
                                                      parallel_tool_calls=parallel_tool_calls, max_whitespace_cnt=1)
        except ValueError as e:
            raise InvalidParam("tools", f"cannot build the tool-call grammar: {e}") from None
    return GuidedDecoding("structural_tag", structural.model_dump_json(), param="tools")


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer (it caches compiled grammars itself)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()  # compiles come from the server's worker threads

    def compile(self, g: GuidedDecoding) -> GuidedDecoding:
        """`g` with its grammar compiled; an invalid schema, regex or grammar raises InvalidParam."""
        if g.compiled is not None:
            return g
        c = self._compiler
        try:
            with self._lock:
                if g.kind == "json":
                    compiled = c.compile_json_schema(g.spec, strict_mode=g.strict, any_whitespace=False)
                elif g.kind == "json_object":  # any object (the builtin JSON grammar allows any value)
                    compiled = c.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
                elif g.kind == "regex":
                    compiled = c.compile_regex(g.spec)
                elif g.kind == "choice":
                    choices = json.loads(g.spec)
                    compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in choices))
                elif g.kind == "grammar":
                    compiled = c.compile_grammar(g.spec)
                else:
                    compiled = c.compile_structural_tag(g.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidParam(g.param, f"cannot compile the {g.kind} constraint: {e}") from None
        return GuidedDecoding(g.kind, g.spec, g.strict, g.param, compiled)

    def matcher(self, g: GuidedDecoding) -> Any:
        assert g.compiled is not None
        return self._xgr.GrammarMatcher(g.compiled)


class TokenMasks:
    """Fills and applies the allowed-token bitmasks of a step's constrained rows."""

    def __init__(self) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Mask, in place, the rows of `logits` whose matcher is not None."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers) or self._bitmask.shape[1] != words:
            self._bitmask = self._xgr.allocate_token_bitmask(max(len(matchers), 8), vocab)
        for i in rows:
            matchers[i].fill_next_token_bitmask(self._bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask[: len(matchers)], vocab_size=vocab, indices=rows)
