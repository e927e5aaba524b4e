"""Structured outputs and tool calling through the official `openai` client, against the bundled model
(a 4M-parameter code model that knows nothing of JSON or tools: validity comes from the grammar).
Every output is checked with `jsonschema` / `re` / `json`, never against the server's own claims."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from serve_support import hf_greedy, running_server

from torchbridge.serve import default_model_dir

MODEL = "default-model"
BUNDLED = default_model_dir()

# Bounded where the grammar must end the output (strings, arrays, integers): within max_tokens every
# output is then complete, whatever the model prefers to write.
S = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "roles": {"type": "array", "maxItems": 2,
                                                                        "items": {"enum": ["admin", "dev", "ops"]}}},
        "required": ["id", "roles"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"enum": [200, 404, 500]}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"first": S, "last": S, "middle": S}, "required": ["first", "last"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"kind": {"enum": ["file", "dir"]}, "size": {"type": "integer", "minimum": 0,
                                                                              "maximum": 4096}},
     "required": ["kind", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"level": {"enum": ["debug", "info", "warning", "error"]}, "message": S},
     "required": ["level", "message"]},
    {"type": "object", "properties": {"enabled": {"type": "boolean"}, "retries": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 5}},
     "required": ["enabled", "retries"]},
    {"type": "object", "properties": {"lang": {"enum": ["python", "c", "rust"]}, "files": {
        "type": "array", "maxItems": 3, "items": S}}, "required": ["lang", "files"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "null"}, {"type": "boolean"}, S]}},
     "required": ["value"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [S, {"type": "boolean"}],
                                               "minItems": 2, "maxItems": 2}}, "required": ["pair"]},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {"name": S, "email": S},
                                                "required": ["name"]},
                                      "public": {"type": "boolean"}}, "required": ["owner", "public"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"]},
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": S, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {"name": "search_code", "parameters": {
    "type": "object", "properties": {"query": S, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
    "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
ASK = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url():  # noqa: ANN201 - yields the server's base URL
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.engine_process import EngineProcess
    from torchbridge.serve.server import create_app

    # The engine in its own process, as `serve` runs it: grammars compile there, off its step loop.
    engine = EngineProcess(EngineConfig(model=str(BUNDLED), max_model_len=1024, max_num_seqs=32,
                                        served_model_name=MODEL))
    engine.start()
    try:
        with running_server(create_app(engine, tool_call_parser="hermes", enable_auto_tool_choice=True)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def _schema_request(client: openai.OpenAI, schema: dict, i: int) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Describe item {i} as JSON."}], max_tokens=400,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    return r.choices[0].message.content


def test_json_schema_outputs_validate_against_20_schemas(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # concurrent: constrained rows share steps
        outs = list(pool.map(lambda a: _schema_request(client, *a), [(s, i) for i, s in enumerate(SCHEMAS)]))
    for schema, text in zip(SCHEMAS, outs, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_json_schema_streamed_and_json_object(client: openai.OpenAI) -> None:
    schema = SCHEMAS[5]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A user, please."}], max_tokens=300, temperature=0.8,
        seed=7, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model=MODEL, prompt="config = ", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":  # json_object has no bound: a long object may be cut off
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


def test_guided_choice_regex_and_grammar(client: openai.OpenAI) -> None:
    choices = ["alpha", "beta", "gamma delta"]
    for seed in range(3):
        r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a date?"}], max_tokens=30,
                                       temperature=0.7, seed=3,
                                       extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="y = ", max_tokens=30, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"[a-f]{4}"}})
    assert re.fullmatch(r"[a-f]{4}", r.choices[0].text)
    grammar = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?'
    r = client.completions.create(model=MODEL, prompt="z = ", max_tokens=30, temperature=0.9, seed=1,
                                  extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", r.choices[0].text)


def test_constrained_and_free_requests_share_a_step(client: openai.OpenAI) -> None:
    """A free request batched with constrained ones decodes exactly as Hugging Face does alone."""
    from transformers import AutoTokenizer

    prompt = "def parse(line):\n"
    ids = AutoTokenizer.from_pretrained(str(BUNDLED)).encode(prompt)
    expected = AutoTokenizer.from_pretrained(str(BUNDLED)).decode(hf_greedy(BUNDLED, ids, 24),
                                                                    skip_special_tokens=True)

    def free() -> str:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(_schema_request, client, SCHEMAS[i], i) for i in (0, 3, 12)]
        text = pool.submit(free).result()
        for f in constrained:
            f.result()
    assert text == expected


def _check_calls(calls: list, allowed: list[dict]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert c["function"]["name"] in by_name
        jsonschema.validate(json.loads(c["function"]["arguments"]), by_name[c["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_required_and_named(client: openai.OpenAI, choice: str, stream: bool) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "search_code"}}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=300, temperature=0)
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0]
        calls = [c.model_dump() for c in msg.message.tool_calls or []]
        finish = msg.finish_reason
    else:
        acc: dict[int, dict] = {}
        finish = None
        for ch in client.chat.completions.create(**kw, stream=True):
            if not ch.choices:
                continue
            finish = ch.choices[0].finish_reason or finish
            for d in ch.choices[0].delta.tool_calls or []:
                slot = acc.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] += d.id or ""
                slot["function"]["name"] += d.function.name or ""
                slot["function"]["arguments"] += d.function.arguments or ""
        calls = [acc[k] for k in sorted(acc)]
    _check_calls(calls, TOOLS if choice == "required" else [SEARCH])
    if choice == "named":
        assert len(calls) == 1 and finish == "tool_calls"
    else:  # parallel calls: the model may go on calling until max_tokens; every returned call is complete
        assert finish in ("tool_calls", "length")


def test_tool_calls_auto_and_none(client: openai.OpenAI, base_url: str) -> None:
    """auto: whatever the model writes, every call it makes is complete and valid; none: plain text.
    The tools reach the prompt through the chat template (prompt tokens as Hugging Face renders them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BUNDLED))
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80,
                                       temperature=0, parallel_tool_calls=False)
    rendered = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tok.encode(rendered))
    m = r.choices[0].message
    if m.tool_calls:
        _check_calls([c.model_dump() for c in m.tool_calls], TOOLS)
        assert len(m.tool_calls) == 1
    else:
        assert "<tool_call>" not in (m.content or "")
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=10,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=0.9, seed=5)
    assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    _check_calls([c.model_dump() for c in r.choices[0].message.tool_calls], TOOLS)


def test_bad_structured_requests_are_400(client: openai.OpenAI) -> None:
    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        dict(extra_body={"guided_regex": "("}),
        dict(extra_body={"guided_choice": []}),
        dict(extra_body={"guided_grammar": "root ::= nope"}),
        dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kw)
        assert e.value.response.json()["error"]["message"], kw
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3).choices


def test_auto_tool_choice_needs_the_server_flags(server: tuple) -> None:
    """The default test server runs without --enable-auto-tool-choice (as vLLM, "auto" is then a 400)."""
    from serve_support import API_KEY

    c = openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=3)
    assert "--enable-auto-tool-choice" in e.value.response.json()["error"]["message"]


def test_hermes_parser_streams_like_it_parses() -> None:
    from torchbridge.serve.tool_parser import HermesToolParser

    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>{"name": "search_code", "arguments": {"query": "x"}}</tool_call> done <tool')
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check.\n done <tool"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("search_code", {"query": "x"})]
    p, streamed, scalls = HermesToolParser(), "", []
    for ch in text:  # one character at a time: tags split across deltas
        c, new = p.feed(ch)
        streamed += c
        scalls += new
        assert "<tool_call" not in streamed
    streamed += p.finish()
    assert streamed == content and [c["function"] for c in scalls] == [c["function"] for c in calls]
    assert HermesToolParser().parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])


def test_bundled_template_without_tools_is_unchanged() -> None:
    """The template gained tool rendering; conversations without tools render as the model was trained."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BUNDLED))
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    # one template: a copy inside tokenizer_config.json (older exports wrote one) must not disagree
    shipped = Path(BUNDLED / "chat_template.jinja").read_text()
    assert json.loads((BUNDLED / "tokenizer_config.json").read_text()).get("chat_template", shipped) == shipped
