"""The Llama family in one file: Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE.

They differ only in small switches read from `ModelConfig`: bias on q/k/v (Qwen2), RMSNorm on each
head of q and k (Qwen3), a sliding window (Mistral), and a routed mixture of experts in place of the MLP
(Qwen3-MoE). Module names mirror the Hugging Face checkpoints so that weights load by name.

Tokens are flat ([N] ids, [N] positions); attention goes through the paged KV cache
(`torchbridge.serve.attention`), so the same forward serves prefill, decode and mixed steps.

On the bridge's device the model calls the shipped kernels (`torchbridge.kernels`: RMSNorm, the
residual add fused with the next norm, rotary, SwiGLU, paged-attention decode) instead of the op
sequences below; TORCHBRIDGE_SERVE_KERNELS picks them ("0": none, or a comma list of names), read
when the model is built. Other devices never import the kernels.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge.serve.attention import AttentionMetadata, paged_attention
from torchbridge.serve.config import ModelConfig
from torchbridge.serve.linear import Linear
from torchbridge.serve.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    all_reduce,
)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]

KERNELS = ("rms_norm", "rotary", "swiglu", "paged_attention", "prefill_attention")


def enabled_kernels() -> frozenset[str]:
    """The shipped kernels the model uses on the bridge's device (TORCHBRIDGE_SERVE_KERNELS)."""
    value = os.environ.get("TORCHBRIDGE_SERVE_KERNELS", ",".join(KERNELS)).strip()
    if value in ("0", "", "none"):
        return frozenset()
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = names - set(KERNELS)
    if unknown:
        raise ValueError(f"TORCHBRIDGE_SERVE_KERNELS: unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    return names


class _Kernels:
    """Which shipped kernels a module calls, and only on the bridge's device (set by the model); on the
    cpu, whether it calls the engine's C++ kernels (serve/cpu_kernels.py, same signatures)."""

    names: frozenset[str] = frozenset()
    device_type: str | None = None
    cpu: bool = False

    def kernel(self, name: str, x: torch.Tensor) -> Any:
        """The module of shipped kernel `name` (torchbridge.kernels.<name>) when it applies to `x`, else None."""
        if self.cpu and x.device.type == "cpu" and name in ("rms_norm", "rotary", "swiglu", "prefill_attention"):
            from torchbridge.serve import cpu_kernels

            return cpu_kernels
        if name not in self.names or x.device.type != self.device_type:
            return None
        # the bridge's device is in use, so its packages are loaded
        from torchbridge.kernels import paged_attention, prefill_attention, rms_norm, rotary, swiglu

        return {"rms_norm": rms_norm, "rotary": rotary, "swiglu": swiglu, "paged_attention": paged_attention,
                "prefill_attention": prefill_attention}[name]


class RMSNorm(_Kernels, nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel("rms_norm", x)
        if k is not None and self.weight.dtype == x.dtype:
            return k.rms_norm(x, self.weight, eps=self.eps)
        # Normalise in fp32 like the reference, then scale in the input dtype.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


def rope_tables(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin per (position, rotary dim), in fp32 whatever the model dtype."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(_Kernels, nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer = layer  # picks this layer's buffers in a decode workspace
        # With tensor parallelism a rank computes its share of the heads (and caches its K/V heads only).
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, cfg.attention_bias, tp)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, tp)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = d**-0.5
        self.sliding_window = cfg.sliding_window  # the decode kernel reads each context from position 0
        self.qkv_proj: Linear | None = None

    def fuse(self) -> None:
        """One q|k|v matmul instead of three: fewer, larger GEMMs (after the weights are loaded)."""
        lins = (self.q_proj, self.k_proj, self.v_proj)
        fused = Linear(lins[0].in_features, sum(x.out_features for x in lins), bias=self.q_proj.bias is not None)
        fused = fused.to(device=self.q_proj.weight.device, dtype=self.q_proj.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([x.weight for x in lins]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([x.bias for x in lins]))
        self.qkv_proj = fused

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv_proj is not None:
            qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([qd, kd, kd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        kern = self.kernel("rotary", q)
        cached = False
        if kern is not None and hasattr(kern, "rotary_into_cache"):  # (the CPU kernels, not the shipped ones)
            q, k = kern.rotary_into_cache(q, k, v, cos[:, 0], sin[:, 0], cache[0], cache[1], meta.slot_mapping)
            cached = True
        elif kern is not None:
            q, k = kern.rotary(q, k, cos[:, 0], sin[:, 0])
        else:
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        kern = self.kernel("paged_attention", q) if self.sliding_window is None else None
        decode = None if kern is None else kern.paged_attention
        kern = self.kernel("prefill_attention", q)
        prefill = None if kern is None else kern.prefill_attention
        out = paged_attention(q, k, v, cache[0], cache[1], meta, self.scale, self.layer, decode_kernel=decode,
                              cached=cached, prefill_kernel=prefill)
        return self.o_proj(out)


class MLP(_Kernels, nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TPGroup = SINGLE, reduce: bool = True) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, False, tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, reduce)
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        fused = Linear(w.shape[1], w.shape[0], bias=False).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            fused.weight.copy_(w)
        self.gate_up_proj = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        k = self.kernel("swiglu", x)
        return self.down_proj(F.silu(gate) * up if k is None else k.swiglu(gate, up))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))


class SparseMoE(nn.Module):
    """Top-k routed experts; softmax over all experts first, then (optionally) renormalise the top k."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.gate = Router(cfg)
        # Every rank routes alike (the router is replicated) and holds a slice of every expert; the
        # experts' partial sums are added locally and reduced once per layer.
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size, tp, reduce=False) for _ in range(cfg.num_experts)
        )
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # Loop over experts that got tokens: cheap for the small expert counts served here.
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return all_reduce(out, self.tp)


class DecoderLayer(_Kernels, nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, index, tp)
        self.mlp = SparseMoE(cfg, tp) if index in cfg.moe_layers else MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        norm = self.post_attention_layernorm
        k = self.kernel("rms_norm", x)
        if k is not None and norm.weight.dtype == x.dtype:  # the residual add fused with the next norm
            normed, x = k.add_rms_norm(x, attn, norm.weight, eps=norm.eps)
            return x + self.mlp(normed)
        x = x + attn
        return x + self.mlp(norm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`tp`: this rank's place in a tensor-parallel group; its modules hold this rank's shard (parallel.py)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.use_kernels(enabled_kernels())

    def use_kernels(self, names: frozenset[str]) -> None:
        """Call these shipped kernels (a subset of KERNELS) on the bridge's device."""
        from torchbridge import device_name

        for m in self.modules():
            if isinstance(m, _Kernels):
                m.names, m.device_type = frozenset(names), device_name()

    def use_cpu_kernels(self, on: bool) -> None:
        """Call the engine's C++ kernels (RMSNorm, rotary) for cpu tensors; they must be loaded."""
        for m in self.modules():
            if isinstance(m, _Kernels):
                m.cpu = on

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Returns the final hidden states [N, hidden]; call `compute_logits` on the rows to sample."""
        return self.model.norm(self.run_layers(self.model.embed_tokens(input_ids), positions, kv_caches, meta))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache,
                   meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers over the flat tokens' inputs `x` [N, hidden] at `positions`."""
        cos = self.rope_cos[positions].to(x.dtype)[:, None, :]
        sin = self.rope_sin[positions].to(x.dtype)[:, None, :]
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return x

    def fuse(self) -> None:
        """Fuse projections for inference; the per-projection weights are dropped to save memory."""
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.fuse()
            del attn.q_proj, attn.k_proj, attn.v_proj
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()
                del layer.mlp.gate_proj, layer.mlp.up_proj

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)
