"""The offline corpus, its tokenizer, and the batches of each step.

The corpus is Python source: by default the running interpreter's standard library (test suites,
codec tables and pydoc's topic dump left out: they are huge, boilerplate or data). Files are split
into training and held-out by a hash of their relative path, so the split does not depend on the
Python patch release or the size cap, and tests can rebuild the held-out text without training.
To the source files the recipe adds two kinds of ChatML conversation built from documented stdlib
functions: "write function X" (answer: its source) and Hermes-style tool calls (the tools in the
system turn, the call as `<tool_call>` JSON, the result as a `<tool_response>` turn, then an answer),
rendered with the same chat template the exported model ships (chat_template.jinja).

`prepare` runs once per job, in the launching process before any rank starts: it trains a byte-level
BPE tokenizer on the training split and writes the tokenizer and both token streams to OUT/data (reused
when the data config is unchanged). Batches are a pure function of (seed, step): every rank draws the
same global batch and takes its data-parallel slice, so any rank count sees the same data, and a run
resumed at step k sees what an uninterrupted one does.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from torchbridge.train.config import ConfigError, DataSection

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE_FILE = Path(__file__).resolve().parent / "chat_template.jinja"
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)
MAX_FILE_BYTES = 200_000
DATA_DIR = "data"


def stdlib_root() -> Path:
    """Directory holding the pure-Python standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_root(corpus: str) -> Path:
    return stdlib_root() if corpus == "stdlib" else Path(corpus)


def list_sources(root: Path) -> list[str]:
    """Sorted POSIX-style paths (relative to `root`) of the .py files used as corpus."""
    out: list[str] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 0 < size <= MAX_FILE_BYTES:
            out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str, percent: int = 4) -> bool:
    """Whether a file belongs to the evaluation split (a hash of its path, not of its contents)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def read_split(split: str, max_bytes: int, root: Path | None = None, percent: int = 4) -> list[tuple[str, str]]:
    """`(relative path, text)` pairs of one split ("train" or "heldout"), capped at `max_bytes`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    root = stdlib_root() if root is None else root
    docs: list[tuple[str, str]] = []
    total = 0
    for rel in list_sources(root):
        if is_heldout(rel, percent) != (split == "heldout"):
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if total + len(text) > max_bytes:
            break
        docs.append((rel, text))
        total += len(text)
    return docs


@dataclass(frozen=True)
class Function:
    """A documented public function of the corpus: what both kinds of conversation are built from."""

    name: str
    summary: str  # the docstring's first line
    source: str  # dedented
    params: tuple[str, ...]  # positional parameters without defaults, `self` dropped
    literals: tuple[str, ...]  # short string constants of its module (plausible argument values)


def documented_functions(docs: list[tuple[str, str]], rng: random.Random) -> Iterator[Function]:
    """Documented public functions of the documents, in a seeded random order of files."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    for i in order:
        _, text = docs[i]
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        literals = tuple(sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                                 and isinstance(n.value, str) and 0 < len(n.value) <= 24 and n.value.isprintable()}))
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            src = _segment(lines, node)
            if not doc or not src or len(src) > 1500:
                continue
            summary = doc.strip().splitlines()[0].strip()
            if not summary:
                continue
            # get_source_segment drops the first line's indentation only; dedent the rest to match
            first, _, rest = src.partition("\n")
            args = node.args.posonlyargs + node.args.args
            required = args[: len(args) - len(node.args.defaults)]
            params = tuple(a.arg for a in required if a.arg not in ("self", "cls"))
            yield Function(node.name, summary, first + "\n" + textwrap.dedent(rest) if rest else first, params,
                           literals)


def _segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment on pre-split lines (it splits the whole file on every call: quadratic)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset: node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return head + "".join(lines[first + 1: last]) + tail


def write_function_chat(fn: Function) -> list[dict[str, Any]]:
    """A request for the function by its docstring's first line; the answer is its source."""
    return [{"role": "user", "content": f"Write a Python function `{fn.name}`: {fn.summary}"},
            {"role": "assistant", "content": fn.source}]


def tool_schema(fn: Function) -> dict[str, Any]:
    props = {p: {"type": "string", "description": f"the `{p}` argument"} for p in fn.params}
    return {"type": "function", "function": {"name": fn.name, "description": fn.summary,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(fn.params)}}}


def tool_call_chat(fn: Function, others: list[Function], rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages, tools): the user asks for the function's job, the assistant calls it (among 1-3 other
    tools), the tool answers, the assistant reports. Argument values are string constants of its module."""
    args = {p: rng.choice(fn.literals) if fn.literals else p for p in fn.params}
    tools = [tool_schema(f) for f in [fn, *others]]
    rng.shuffle(tools)
    described = ", ".join(f"{k}={v!r}" for k, v in args.items())
    ask = fn.summary[0].lower() + fn.summary[1:] if fn.summary else fn.name
    user = f"Please {ask.rstrip('.')}" + (f" ({described})." if described else ".")
    result = json.dumps({"result": rng.choice(fn.literals) if fn.literals else None})
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": fn.name, "arguments": args}}]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"`{fn.name}` returned {result}."},
    ]
    return messages, tools


def conversations(tokenizer: Any, docs: list[tuple[str, str]], seed: int, chat_bytes: float,
                  tool_bytes: float) -> tuple[list[str], list[str]]:
    """Rendered ChatML texts: "write function" chats up to `chat_bytes`, tool-call chats up to `tool_bytes`."""
    rng = random.Random(seed)
    functions = list(documented_functions(docs, rng))
    chats: list[str] = []
    size = 0
    for fn in functions:
        if size >= chat_bytes:
            break
        text = tokenizer.apply_chat_template(write_function_chat(fn), tokenize=False)
        chats.append(text)
        size += len(text)
    tool_chats: list[str] = []
    size = 0
    while functions and size < tool_bytes:
        fn = rng.choice(functions)
        others = rng.sample(functions, k=min(len(functions), rng.randint(1, 3)))
        messages, tools = tool_call_chat(fn, [o for o in others if o.name != fn.name], rng)
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        tool_chats.append(text)
        size += len(text)
    return chats, tool_chats


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:  # PreTrainedTokenizerFast
    """Byte-level BPE (no unknown tokens possible) wrapped for `transformers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # No automatic BOS/EOS: chat prompts rendered by the template and plain prompts then tokenize the
    # same way whether or not the caller asks for special tokens.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, extra_special_tokens=[IM_START, IM_END],
        add_bos_token=False, add_eos_token=False, chat_template=CHAT_TEMPLATE_FILE.read_text(),
        model_max_length=1024, clean_up_tokenization_spaces=False)


def encode_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """One flat token stream with every document framed as `<|bos|> ... <|eos|>`."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(texts), 256):
        for enc in tokenizer.backend_tokenizer.encode_batch(texts[start: start + 256], add_special_tokens=False):
            ids.append(bos)
            ids.extend(enc.ids)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


@dataclass
class Prepared:
    """What a rank needs: the tokenizer directory and both streams (and facts for the model card)."""

    tokenizer_dir: Path
    train: torch.Tensor
    heldout: torch.Tensor
    facts: dict[str, Any]

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)


def _fingerprint(data: DataSection, seed: int) -> str:
    return hashlib.sha256(json.dumps({**asdict(data), "seed": seed}, sort_keys=True).encode()).hexdigest()[:16]


def prepare(data: DataSection, seed: int, out: Path, log: Any = print) -> Prepared:
    """Tokenizer + token streams in OUT/data, built once per data config (reused when it is unchanged)."""
    where = out / DATA_DIR
    stamp = where / "fingerprint"
    fingerprint = _fingerprint(data, seed)
    if stamp.is_file() and stamp.read_text() == fingerprint:
        return load(out)
    root = corpus_root(data.corpus)
    max_bytes = int(data.max_corpus_mb * 1e6)
    train_docs = read_split("train", max_bytes, root, data.heldout_percent)
    heldout_docs = read_split("heldout", max_bytes, root, data.heldout_percent)
    if not train_docs or not heldout_docs:
        raise ConfigError("data.corpus", f"{root}: too few .py files for both splits "
                                         f"({len(train_docs)} train, {len(heldout_docs)} held out)")
    texts = [t for _, t in train_docs]
    train_bytes = sum(len(t) for t in texts)
    tokenizer = train_tokenizer(texts, data.vocab_size)
    chats, tool_chats = conversations(tokenizer, train_docs, seed, data.chat_fraction * train_bytes,
                                      data.tool_call_fraction * train_bytes)
    docs = texts + chats + tool_chats
    random.Random(seed).shuffle(docs)
    train = encode_stream(tokenizer, docs)
    heldout = encode_stream(tokenizer, [t for _, t in heldout_docs])
    facts = {"corpus": "stdlib" if data.corpus == "stdlib" else str(root), "train_files": len(train_docs),
             "heldout_files": len(heldout_docs), "train_bytes": train_bytes, "train_tokens": train.numel(),
             "heldout_tokens": heldout.numel(), "chat_examples": len(chats), "tool_call_examples": len(tool_chats),
             "vocab": len(tokenizer)}
    where.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(where / "tokenizer")
    torch.save({"train": train, "heldout": heldout}, where / "streams.pt")
    (where / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")
    stamp.write_text(fingerprint)
    log(f"data: {len(train_docs)} train files ({train_bytes / 1e6:.1f} MB) + {len(chats)} chats + "
        f"{len(tool_chats)} tool-call chats = {train.numel():,} tokens; held out {len(heldout_docs)} files, "
        f"{heldout.numel():,} tokens; vocab {len(tokenizer)}")
    return load(out)


def load(out: Path) -> Prepared:
    where = out / DATA_DIR
    streams = torch.load(where / "streams.pt")
    return Prepared(where / "tokenizer", streams["train"], streams["heldout"],
                    json.loads((where / "facts.json").read_text()))


def global_batch(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """[batch_size, seq_len + 1] windows of the stream at random offsets drawn from (seed, step) alone."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s: s + seq_len + 1] for s in starts.tolist()]).long()


def local_micro_batches(batch: torch.Tensor, accum: int, dp: int, dp_rank: int) -> list[torch.Tensor]:
    """This data-parallel rank's rows of each micro-batch (the global batch split `accum` ways, then `dp` ways)."""
    micro = batch.shape[0] // accum
    per_rank = micro // dp
    return [batch[m * micro + dp_rank * per_rank: m * micro + (dp_rank + 1) * per_rank] for m in range(accum)]


def eval_windows(stream: torch.Tensor, seq_len: int, windows: int) -> torch.Tensor:
    """[n, seq_len + 1] non-overlapping windows from the start of the held-out stream."""
    n = min(windows, (stream.numel() - 1) // seq_len)
    if n < 1:
        raise ConfigError("eval.windows", "the held-out stream is shorter than one data.seq_len window")
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).long()
