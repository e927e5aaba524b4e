"""The default model bundled in ``torchbridge/assets/default-model`` loads with stock
``transformers`` and has actually learned something about Python source."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from torchbridge.train import data as recipe

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "src" / "torchbridge" / "assets" / "default-model"
EVAL_CHARS = 6000


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True, dtype=torch.float32)
    return m.eval()


def test_bundle_is_complete_and_small() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "README.md"):
        assert required in names, required
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert total < 12 * 1024 * 1024, total


def test_config_shape(model) -> None:
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.tie_word_embeddings
    assert cfg.max_position_embeddings >= 1024


def test_tokenizer_round_trips_python(tokenizer) -> None:
    snippet = (
        "import os\n\n\nclass Foo(Base):\n    \"\"\"Docstring with unicode: café ✓.\"\"\"\n\n"
        "    def bar(self, x: int = 3) -> dict[str, int]:\n\t\treturn {'a': x ** 2}  # tab-indented\n"
    )
    ids = tokenizer(snippet).input_ids
    assert tokenizer.decode(ids) == snippet
    # Byte-level BPE must compress source noticeably, otherwise the vocab was not learned.
    assert len(ids) < len(snippet.encode()) / 2
    for tok in ("bos", "eos", "pad"):
        assert getattr(tokenizer, f"{tok}_token_id") is not None


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Write hello world."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2


def test_generate_runs(model, tokenizer) -> None:
    ids = tokenizer("def ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 12
    assert isinstance(tokenizer.decode(out[0]), str)


def _loss(m, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(m(input_ids=ids, labels=ids).loss)


def test_heldout_loss_beats_random_init(model, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    # the recipe's own split (`python -m torchbridge train`, data.py): files the model never trained on
    docs = recipe.read_split("heldout", max_bytes=10_000_000)
    assert docs, "no held-out stdlib files found"
    assert all(recipe.is_heldout(rel) for rel, _ in docs)

    # A few KB from several held-out files, framed like training documents.
    stream: list[int] = []
    for _, text in docs[:3]:
        stream += [tokenizer.bos_token_id, *tokenizer(text[: EVAL_CHARS // 3]).input_ids, tokenizer.eos_token_id]
    ids = torch.tensor([stream[: model.config.max_position_embeddings]])

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(model.config).float().eval()
    random_loss = _loss(reference, ids)
    trained_loss = _loss(model, ids)
    # Random init sits near ln(vocab); the bundled model must be far below it.
    assert random_loss > 0.8 * math.log(model.config.vocab_size)
    # Two nats is a >7x perplexity gap: far beyond what noise in ~1k tokens could produce.
    assert trained_loss < random_loss - 2.0, (trained_loss, random_loss)
    assert trained_loss < 0.7 * random_loss, (trained_loss, random_loss)
