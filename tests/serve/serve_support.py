"""Test support for the engine: tiny random-init Hugging Face checkpoints with an offline-trained
tokenizer, and the Hugging Face reference (`generate()`, logits) the engine is checked against.
(Not named conftest: other test directories have a conftest module too.)"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

API_KEY = "test-key"
DEVICES = ["cpu"]  # the bridge device is covered by test_engine_on_device.py (compiles cost CI time)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks. "
    "Continuous batching lets new requests join a running batch. Prefix caching shares identical prompt "
    "prefixes between requests. Speculative decoding proposes tokens and verifies them in one step. "
    "Hello world! How are you today? I am fine, thank you. 0123456789 + - * / = ( ) [ ] { } < > "
    "user assistant system: Once upon a time there was a small model that learned to count: one two three "
    "four five six seven eight nine ten. The end.\n"
) * 8

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def make_config(arch: str, vocab_size: int = 320, **overrides: object):  # noqa: ANN201
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**{"sliding_window": 12, **common})
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{"head_dim": 16, **common})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **{"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
               "norm_topk_prob": True, **common}
        )
    raise ValueError(arch)


def save_model(out_dir: Path, arch: str, tokenizer_dir: Path | None, seed: int = 0, **overrides: object) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides))
    # A wider init than the default 0.02 spreads the logits, so greedy choices are not near-ties that
    # float rounding could flip between two correct implementations.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face generate(), one prompt at a time (no padding), greedy."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(model_dir))(torch.tensor([ids])).logits[0]


def mixed_prompts(n: int, vocab: int = 320, seed: int = 1, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@contextlib.contextmanager
def running_server(app: object) -> Iterator[str]:
    """A real uvicorn server for `app` on a free loopback port, in a thread; yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=15)


# ---- processes, by PID (servers, engine processes, tensor-parallel workers) -----------------------------
def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Wait up to `seconds` for the processes to end; the ones still running."""
    import time

    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
