"""The checkpoint's tokenizer (tokenizer.json + tokenizer_config.json, chat template included)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_id = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        # The longest vocabulary entry, in characters: for tokenizers that spell out every byte of the
        # text (byte-level BPE, SentencePiece) no token covers more characters of a prompt than this.
        self.max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

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
