"""Model implementations and checkpoint loading."""

from torchbridge.serve.models.llama import LlamaForCausalLM
from torchbridge.serve.models.loader import load_model

__all__ = ["LlamaForCausalLM", "load_model"]
