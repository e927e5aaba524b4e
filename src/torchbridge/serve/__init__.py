"""torchbridge.serve: a vLLM-class LLM engine in plain PyTorch, for any torch device.

`LLM` / `SamplingParams` are the offline API; `python -m torchbridge serve` starts the OpenAI-compatible
HTTP server (see `torchbridge.serve.server` for the endpoints and the KV-event format).
"""

from __future__ import annotations

from pathlib import Path

from torchbridge.serve.sampling_params import SamplingParams


def default_model_dir() -> Path:
    """The model bundled with the package (a tiny Llama in Hugging Face format)."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-model"


def default_eagle_dir() -> Path:
    """The EAGLE head bundled for the bundled model (scripts/distill_draft.py --method eagle made it):
    `speculative_config={"method": "eagle", "model": str(default_eagle_dir())}`."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-eagle"


def __getattr__(name: str) -> object:
    # The engine pulls in transformers (for the tokenizer); import it only when asked for.
    if name == "LLM":
        from torchbridge.serve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "default_eagle_dir", "default_model_dir"]
