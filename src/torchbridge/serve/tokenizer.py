"""The checkpoint's tokenizer (tokenizer.json + tokenizer_config.json, chat template included)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from torchbridge.serve.detokenizer import Detokenizer


def tokenizer_of(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None for a checkpoint without one (the engine then works in ids)."""
    d = Path(model_dir)
    if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
        return Tokenizer(d)
    return None


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_id = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        # The longest vocabulary entry, in characters: for tokenizers that spell out every byte of the
        # text (byte-level BPE, SentencePiece) no token covers more characters of a prompt than this.
        self.max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1)
        # The Rust tokenizer's decode, when it alone is what hf.decode computes: windows of it are exact
        # (detokenizer.py). A whole-text clean-up after it (clean_up_tokenization_spaces) is not.
        rust = getattr(self.hf, "_tokenizer", None)
        self._windowed = rust is not None and not getattr(self.hf, "clean_up_tokenization_spaces", False)
        self._rust_decode = rust.decode if rust is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def detokenizer(self, start: int = 0) -> Detokenizer:
        """An incremental detokenizer for output tokens from index `start` of the lists it is given."""
        if self._windowed:
            decode = self._rust_decode

            def window(ids: list[int]) -> str:
                return decode(ids, skip_special_tokens=True)

            return Detokenizer(window, start)
        return Detokenizer(self.decode, start, windowed=False)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The chat template applied as text (tokenized later, on the engine thread, without adding
        special tokens a second time). `tools` (OpenAI function tools) go to the template, which renders
        them into the prompt if it knows how."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                           tools=tools or None)
