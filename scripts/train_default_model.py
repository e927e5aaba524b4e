#!/usr/bin/env python
"""Train the small default model that ``torchbridge serve`` uses when no ``--model`` is given.

Everything here runs offline on a CPU: the training text is the Python source of the
running interpreter's standard library, the tokenizer is trained from scratch, and the
model is a tiny Llama.  The result is written in plain Hugging Face format to
``src/torchbridge/assets/default-model/`` so any ``transformers``-compatible loader can
use it.

Reproduce with::

    .venv/bin/python scripts/train_default_model.py --minutes 25

The held-out split is a pure function of each file's path relative to the stdlib root
(see :func:`is_heldout`), so tests can rebuild the same evaluation text without running
training.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import torch

SEED = 1234
SUMMARY_FILE = "training_summary.json"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "src" / "torchbridge" / "assets" / "default-model"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# Test suites are excluded because they are huge and full of boilerplate; codec tables
# and pydoc's topic dump are data rather than code and would waste the model's capacity.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 4

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def stdlib_root() -> Path:
    """Directory holding the pure-Python standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_sources(root: Path | None = None) -> list[str]:
    """Sorted POSIX-style paths (relative to ``root``) of the stdlib sources used as corpus."""
    root = stdlib_root() if root is None else root
    out: list[str] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 0 < size <= MAX_FILE_BYTES:
            out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    """Whether a stdlib file belongs to the evaluation split.

    Hashing the relative path (not the contents) keeps the split stable across Python
    patch releases and independent of the corpus size cap.
    """
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def read_split(split: str, max_bytes: int, root: Path | None = None) -> list[tuple[str, str]]:
    """``(relative path, text)`` pairs of one split (``"train"`` or ``"heldout"``), capped at ``max_bytes``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    root = stdlib_root() if root is None else root
    want_heldout = split == "heldout"
    docs: list[tuple[str, str]] = []
    total = 0
    for rel in list_stdlib_sources(root):
        if is_heldout(rel) != want_heldout:
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


def chat_examples(docs: list[tuple[str, str]], rng: random.Random, limit: int) -> Iterator[list[dict[str, str]]]:
    """ChatML conversations built from documented stdlib functions.

    A small share of these teaches the model the chat markers, so the serving
    engine's chat endpoint answers with code and stops at ``<|im_end|>``.
    """
    made = 0
    order = list(range(len(docs)))
    rng.shuffle(order)
    for i in order:
        _, text = docs[i]
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(text, node)
            if not doc or not src or len(src) > 1500:
                continue
            summary = doc.strip().splitlines()[0].strip()
            if not summary:
                continue
            # get_source_segment drops the first line's indentation only; dedent the rest to match.
            first, _, rest = src.partition("\n")
            code = first + "\n" + textwrap.dedent(rest) if rest else first
            yield [
                {"role": "user", "content": f"Write a Python function `{node.name}`: {summary}"},
                {"role": "assistant", "content": code},
            ]
            made += 1
            if made >= limit:
                return


def train_tokenizer(texts: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    """Byte-level BPE (no unknown tokens possible) wrapped for ``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # No automatic BOS/EOS: chat prompts rendered by the template and plain prompts then
    # tokenize the same way whether or not the caller asks for special tokens.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        add_bos_token=False,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """One flat token stream with every document framed as ``<|bos|> ... <|eos|>``."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    batch = 256
    for start in range(0, len(texts), batch):
        for enc in backend.encode_batch(texts[start : start + batch], add_special_tokens=False):
            ids.append(bos)
            ids.extend(enc.ids)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_bias=False,
        mlp_bias=False,
    )


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-token cross-entropy over non-overlapping windows of a token stream."""
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    if n < 1:
        raise ValueError("held-out stream shorter than one window")
    total, count = 0.0, 0
    for start in range(0, n, 8):
        rows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(start, min(n, start + 8))]
        x = torch.stack(rows)
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += x[:, 1:].numel()
    return total / count


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warmup then cosine decay to ``floor * peak``, as a function of progress in [0, 1]."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    p = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))


def sample(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    kwargs: dict = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=50)
    else:
        kwargs.update(do_sample=False)
    out = model.generate(ids, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)


def write_model_card(out: Path, facts: dict) -> None:
    f = facts
    stages = f["stages"]
    total_steps = sum(st["steps"] for st in stages)
    total_tokens = sum(st["tokens_seen"] for st in stages)
    total_minutes = sum(st["minutes"] for st in stages)
    stage_lines = "\n".join(
        f"{i}. {st['steps']} steps, batch {st['batch_size']} x {st['seq_len']} tokens, peak LR {st['peak_lr']:g}, "
        f"{st['minutes']:.1f} min"
        for i, st in enumerate(stages, 1)
    )
    commands = " && \\\n  ".join(st["command"] for st in stages)
    card = f"""# torchbridge default model

A deliberately tiny Llama-architecture causal language model, bundled so that
`torchbridge serve` works out of the box and tests have a real Hugging Face model to load
without network access. It writes Python-flavoured text; it is **not** a useful assistant.

## Model

- Architecture: `LlamaForCausalLM`, hidden {f['hidden']}, intermediate {f['intermediate']},
  {f['layers']} layers, {f['heads']} attention heads, {f['kv_heads']} KV heads (GQA),
  RoPE theta {f['rope_theta']:g}, max positions {f['max_pos']}, tied embeddings.
- Parameters: {f['params']:,} ({f['dtype']} weights on disk).
- Tokenizer: byte-level BPE, vocabulary {f['vocab']} including the special tokens
  `{BOS}`, `{EOS}`, `{PAD}`, `{IM_START}`, `{IM_END}`. No special tokens are added
  automatically when encoding. A ChatML chat template is included
  (`add_generation_prompt` appends `{IM_START}assistant\\n`); generation stops on
  `{EOS}` or `{IM_END}`.

## Data

The `.py` files of the CPython {f['python']} standard library (test suites, codec tables and
`pydoc_data` excluded). Files are split by a hash of their relative path; {f['heldout_pct']}% of
files are held out for evaluation. Training used {f['train_files']} files ({f['train_mb']:.1f} MB,
{f['train_tokens']:,} tokens), plus {f['chat_examples']} ChatML conversations built from documented
stdlib functions (request = first docstring line, answer = the function's source).

## Training

AdamW (betas 0.9/0.95, weight decay 0.1), linear warmup then cosine decay over a wall-clock
budget, fp32 on CPU ({f['threads']} threads, shared with other jobs), seed {SEED}.
In total {total_steps} steps ({total_tokens:,} tokens) in {total_minutes:.1f} minutes of training:

{stage_lines}

## Evaluation (held-out stdlib files, {f['eval_tokens']:,} tokens)

| model | loss (nats/token) | perplexity |
|---|---|---|
| this model | {f['trained_loss']:.3f} | {math.exp(f['trained_loss']):.1f} |
| same config, random init | {f['random_loss']:.3f} | {math.exp(f['random_loss']):.1f} |

## Reproduce

```
{commands}
```

Training is bounded by wall-clock time, so the exact step count (and weights) depend on
the machine; pass `--steps N` to fix the step count instead.

## License

The weights and tokenizer are derived from CPython's standard library sources, which are
distributed under the Python Software Foundation License; see
https://docs.python.org/3/license.html.
"""
    (out / "README.md").write_text(card, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget")
    parser.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --minutes)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-corpus-mb", type=float, default=40.0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chat-fraction", type=float, default=0.05, help="share of training bytes as ChatML")
    parser.add_argument("--eval-windows", type=int, default=96)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from a directory written by an earlier run (reuses its tokenizer and weights)",
    )
    args = parser.parse_args(argv)

    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    random.seed(SEED)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    t_start = time.time()

    max_bytes = int(args.max_corpus_mb * 1e6)
    train_docs = read_split("train", max_bytes)
    heldout_docs = read_split("heldout", max_bytes)
    train_bytes = sum(len(t) for _, t in train_docs)
    print(
        f"corpus: {len(train_docs)} train files ({train_bytes / 1e6:.1f} MB), "
        f"{len(heldout_docs)} held-out files ({sum(len(t) for _, t in heldout_docs) / 1e6:.2f} MB)",
        flush=True,
    )

    train_texts = [t for _, t in train_docs]
    prior_stages: list[dict] = []
    if args.init_from is not None:
        from transformers import AutoTokenizer

        # Continuing a run must keep the exact vocabulary the weights were trained with.
        tokenizer = AutoTokenizer.from_pretrained(args.init_from, local_files_only=True)
        summary = args.init_from / SUMMARY_FILE
        if summary.exists():
            prior_stages = json.loads(summary.read_text())["stages"]
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab_size)
    print(f"tokenizer: vocab {len(tokenizer)} ({time.time() - t_start:.0f}s)", flush=True)

    chats: list[str] = []
    chat_budget = args.chat_fraction * train_bytes
    chat_bytes = 0
    for conv in chat_examples(train_docs, rng, limit=100_000):
        text = tokenizer.apply_chat_template(conv, tokenize=False)
        chats.append(text)
        chat_bytes += len(text)
        if chat_bytes >= chat_budget:
            break
    docs = train_texts + chats
    rng.shuffle(docs)
    train_stream = encode_stream(tokenizer, docs)
    eval_stream = encode_stream(tokenizer, [t for _, t in heldout_docs])
    print(
        f"tokens: train {train_stream.numel():,} ({len(chats)} chat examples), held-out {eval_stream.numel():,} "
        f"({train_bytes / max(1, train_stream.numel()):.2f} bytes/token)",
        flush=True,
    )

    torch.manual_seed(SEED)
    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, local_files_only=True, dtype=torch.float32)
        config = model.config
    else:
        config = make_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        model = LlamaForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    eval_windows = args.eval_windows
    eval_tokens = min(eval_windows, (eval_stream.numel() - 1) // args.seq_len) * args.seq_len
    torch.manual_seed(SEED + 1)
    random_loss = heldout_loss(LlamaForCausalLM(config).float(), eval_stream, args.seq_len, eval_windows)
    print(f"random-init held-out loss {random_loss:.4f} (ppl {math.exp(random_loss):.1f})", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(SEED)
    budget_s = args.minutes * 60.0
    max_start = train_stream.numel() - args.seq_len - 1
    step = 0
    smoothed = None
    t_train = time.time()
    model.train()
    while True:
        elapsed = time.time() - t_train
        progress = step / args.steps if args.steps else elapsed / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr, warmup=0.03, floor=0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, max_start, (args.batch_size,), generator=gen)
        x = torch.stack([train_stream[s : s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}  loss {loss.item():.4f}  smoothed {smoothed:.4f}  lr {lr:.2e}  "
                f"{step / el:.2f} steps/s  {el / 60:.1f} min",
                flush=True,
            )
    train_s = time.time() - t_train
    print(f"trained {step} steps in {train_s / 60:.1f} min", flush=True)

    save_dtype = getattr(torch, args.save_dtype)
    model = model.to(save_dtype)
    # Evaluate the weights exactly as they will be shipped (rounded to the save dtype).
    trained_loss = heldout_loss(model.float(), eval_stream, args.seq_len, eval_windows)
    print(f"held-out loss: trained {trained_loss:.4f} (ppl {math.exp(trained_loss):.2f}) vs "
          f"random init {random_loss:.4f} (ppl {math.exp(random_loss):.1f})", flush=True)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    for prompt in ["def ", "import ", "class Parser:\n    def __init__(self"]:
        print(f"--- greedy {prompt!r}\n{prompt}{sample(model, tokenizer, prompt, 80, 0.0)}", flush=True)
        print(f"--- t=0.8 {prompt!r}\n{prompt}{sample(model, tokenizer, prompt, 80, 0.8)}", flush=True)
    chat_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function `flatten`: Flatten a nested list."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    print(f"--- chat\n{chat_prompt}{sample(model, tokenizer, chat_prompt, 120, 0.0)}", flush=True)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(save_dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Some transformers versions store the template only in a separate file; keep it inline too
    # so older loaders that read tokenizer_config.json see it.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.setdefault("chat_template", CHAT_TEMPLATE)
    # A tokenizer reloaded via --init-from echoes its load-time kwargs into the saved config.
    for key in ("is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")

    command = ("python scripts/train_default_model.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    stages = [
        *prior_stages,
        {
            "command": command,
            "steps": step,
            "minutes": round(train_s / 60, 2),
            "tokens_seen": step * args.batch_size * args.seq_len,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "peak_lr": args.lr,
        },
    ]
    summary = {
        "stages": stages,
        "heldout_loss": round(trained_loss, 4),
        "random_init_heldout_loss": round(random_loss, 4),
        "eval_tokens": eval_tokens,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(
        out,
        {
            "hidden": config.hidden_size,
            "intermediate": config.intermediate_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "rope_theta": 10000.0,
            "max_pos": config.max_position_embeddings,
            "params": n_params,
            "dtype": args.save_dtype,
            "vocab": len(tokenizer),
            "python": ".".join(map(str, sys.version_info[:3])),
            "heldout_pct": HELDOUT_PERCENT,
            "train_files": len(train_docs),
            "train_mb": train_bytes / 1e6,
            "train_tokens": int(train_stream.numel()),
            "chat_examples": len(chats),
            "threads": args.threads,
            "eval_tokens": eval_tokens,
            "trained_loss": trained_loss,
            "random_loss": random_loss,
            "stages": stages,
        },
    )
    for p in out.iterdir():
        # save_pretrained may create files owner-only; packaged assets must be world-readable.
        p.chmod(0o644)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"saved to {out} ({size / 1e6:.1f} MB): {sorted(p.name for p in out.iterdir())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
