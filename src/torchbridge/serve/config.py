"""Engine and model configuration.

`ModelConfig` is the subset of a Hugging Face `config.json` that the Llama-family models need, read
without importing transformers so that the engine starts fast. `EngineConfig` holds the knobs of the
serving engine (cache geometry, batching limits, device).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        mc = cls.from_dict(json.loads(path.read_text()))
        # generation_config.json may name more stop tokens (a chat model's end-of-turn), as vLLM reads it.
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            for t in [eos] if isinstance(eos, int) else list(eos or []):
                if t not in mc.eos_token_ids:
                    mc.eos_token_ids.append(t)
        return mc

    @classmethod
    def from_dict(cls, c: dict) -> ModelConfig:
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architectures {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        num_heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // num_heads
        # transformers 5 nests rope settings in rope_parameters; 4.x used rope_theta + rope_scaling.
        rope = dict(c.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else c.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        eos = c.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = None
        if kind == "mistral":
            sliding = c.get("sliding_window")
        elif kind in ("qwen2", "qwen3", "qwen3_moe") and c.get("use_sliding_window"):
            sliding = c.get("sliding_window")
        num_layers = c["num_hidden_layers"]
        num_experts = int(c.get("num_experts", c.get("num_local_experts", 0)) or 0) if kind == "qwen3_moe" else 0
        moe_layers: list[int] = []
        if num_experts:
            step = c.get("decoder_sparse_step", 1) or 1
            dense = set(c.get("mlp_only_layers") or [])
            moe_layers = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        return cls(
            architecture=kind,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size", 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", kind == "qwen2")),
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            hidden_act=c.get("hidden_act", "silu"),
            eos_token_ids=eos_ids,
            bos_token_id=c.get("bos_token_id"),
            torch_dtype=str(c.get("dtype") or c.get("torch_dtype") or "float32"),
            num_experts=num_experts,
            num_experts_per_tok=c.get("num_experts_per_tok", 0),
            moe_intermediate_size=c.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
        )


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _is_bridge_device(device: str) -> bool:
    """Whether `device` is the bridge's, asked of torch: the name PrivateUse1 is registered under, with
    torchbridge's device module (`torch.<name>`) behind it."""
    kind = str(device).split(":", 1)[0]
    if kind != torch._C._get_privateuse1_backend_name():
        return False
    return type(getattr(torch, kind, None)).__module__.startswith("torchbridge.")


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    # None: room for max_num_seqs full-length sequences, but at most kv_cache_memory_gib of cache.
    num_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's --speculative-config (spec_decode.SpeculativeConfig, or its JSON as a string or dict).
    speculative_config: object = None
    # Shorthand for {"method": "ngram", "num_speculative_tokens": speculative_ngram, ...}.
    speculative_ngram: int = 0
    ngram_min: int = 1
    ngram_max: int = 3
    # None: on for devices that compile per shape (anything but cpu and cuda).
    shape_buckets: bool | None = None
    # None: on for the cpu without shape buckets. The engine's C++ kernels (serve/cpu_kernels.py): decode
    # attention over the paged cache, RMSNorm, rotary; where they cannot be built, the plain torch ops
    # run and the workspace below serves decodes.
    cpu_kernels: bool | None = None
    # None: on without shape buckets. Decodes read K/V from per-sequence contiguous rows (attention.py).
    decode_workspace: bool | None = None
    # None: on for the bridge's device. Each shape bucket's whole step (model and logits) is one
    # torch.compile(backend=<device>) graph, i.e. one XLA executable, instead of one per op.
    compile_model: bool | None = None
    # vLLM's --async-scheduling. None: on where the compiled step runs while the host works (the bridge's
    # device, without speculation or tensor parallelism). The next step is scheduled and prepared while the
    # current one runs, fed its tokens as they are sampled; a sequence that ends is computed one step more.
    async_scheduling: bool | None = None
    served_model_name: str | None = None
    # Ranks (processes, one per chip) the model is sharded over; rank 0 is this process (serve/workers.py).
    tensor_parallel_size: int = 1
    seed: int = 0
    kv_events: bool = True
    model_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.model_config = ModelConfig.from_dir(self.model)
        if self.max_model_len is None:
            self.max_model_len = min(self.model_config.max_position_embeddings, 4096)
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if not self.enable_chunked_prefill:
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        if self.num_blocks is None:
            per_seq = math.ceil(self.max_model_len / self.block_size)
            mc = self.model_config
            block_bytes = 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * self.torch_dtype.itemsize
            budget = int(self.kv_cache_memory_gib * 2**30 // block_bytes)
            self.num_blocks = max(per_seq, min(self.max_num_seqs * per_seq, budget))
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2")
        if self.shape_buckets is None:
            self.shape_buckets = torch.device(self.device).type not in ("cpu", "cuda")
        if self.cpu_kernels is None:
            self.cpu_kernels = torch.device(self.device).type == "cpu" and not self.shape_buckets
        if self.cpu_kernels and torch.device(self.device).type != "cpu":
            raise ValueError(f"cpu_kernels are the engine's CPU kernels; device {self.device!r} is not the cpu")
        if self.decode_workspace is None:
            self.decode_workspace = not self.shape_buckets
        if self.compile_model is None:
            self.compile_model = _is_bridge_device(self.device) and self.shape_buckets
        if self.compile_model and not self.shape_buckets:
            raise ValueError("compile_model needs shape_buckets: without them every step is a new shape to compile")
        supported = self.compile_model and _is_bridge_device(self.device)
        speculating = bool(self.speculative_config or self.speculative_ngram)
        if self.async_scheduling is None:
            self.async_scheduling = bool(supported) and self.tensor_parallel_size == 1 and not speculating
        elif self.async_scheduling:
            why = ("it needs the bridge's device with compile_model (a step the device runs while the host works)"
                   if not supported else "not with tensor_parallel_size > 1" if self.tensor_parallel_size > 1
                   else "not with speculative decoding" if speculating else None)
            if why:
                raise ValueError(f"async_scheduling: {why}")
        from torchbridge.serve.parallel import check_divisible

        check_divisible(self.model_config, self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            from torchbridge.serve.workers import check_placement

            check_placement(self.device, self.tensor_parallel_size)
        from torchbridge.serve.spec_decode import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # type: ignore[arg-type]
        if self.speculative_config is None and self.speculative_ngram:
            self.speculative_config = SpeculativeConfig("ngram", self.speculative_ngram, None, self.ngram_min,
                                                        self.ngram_max)
            self.speculative_config.validate()
        if self.tensor_parallel_size > 1 and self.speculative_config is not None and (
                self.speculative_config.method in ("draft_model", "eagle")):
            # the draft runs on rank 0's chip only and its steps are not in the plans the workers follow
            raise ValueError(f"--speculative-config with method {self.speculative_config.method} is not supported "
                             "with --tensor-parallel-size > 1 yet (use method ngram, or one rank)")
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).resolve().name

    @property
    def api_model_name(self) -> str:
        """The name the OpenAI API and the metrics give the model."""
        return self.served_model_name or "model"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        # fp32 on cpu keeps logits comparable to the reference; accelerators use the checkpoint's dtype.
        if torch.device(self.device).type == "cpu":
            return torch.float32
        return _DTYPES.get(self.model_config.torch_dtype, torch.float32)
