"""Loading a Hugging Face checkpoint directory (config.json + *.safetensors) into our modules.

With tensor parallelism each rank reads the whole checkpoint and keeps its shard of every split
weight: the block its module's `tp_dim` names (serve/parallel.py); other weights are replicated."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from torchbridge.serve.config import ModelConfig
from torchbridge.serve.linear import hold, pack, transpose, widen
from torchbridge.serve.models import eagle
from torchbridge.serve.models.llama import LlamaForCausalLM, rope_tables
from torchbridge.serve.parallel import SINGLE, TPGroup, shard

# Some checkpoints store a layer's experts fused as 3-D tensors; split them into per-expert weights.
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _checkpoint_tensors(model_dir: Path):  # noqa: ANN202 - a generator of (name, tensor)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, cfg: ModelConfig, device: str, dtype: torch.dtype, max_positions: int,
    tp: TPGroup = SINGLE, tiles: str | None = None, wide: bool = False, target: LlamaForCausalLM | None = None,
    transposed: bool = False, held: bool = False, panels: bool = False,
) -> LlamaForCausalLM:
    """The checkpoint in `model_dir` as the engine's model on `device`. `tiles`: bf16 linears also in AMX's
    tile layout, for that decode-row kernel ("amx" or "avx512bf16": serve/linear.py `pack`); `wide`: 16-bit
    linears' weights as float32 (`widen`); `transposed`: every linear's weight (widened or not) as [in, out]
    (`transpose`); `held`: 16-bit linears also handed, packed, to the engine's kernel library (`hold`: from a
    few rows on, products run oneDNN's 16-bit GEMM); `panels`: float32 linears (and 16-bit ones oneDNN does not
    run here) in the panel layout of the engine's AVX2 kernel instead of oneDNN's (`pack`), and with `held`
    every linear held in that layout (`hold(model, panels=True)`); with `held` and `tiles`, held bf16 linears
    also in the tile layout, whose kernel the library runs at a decode step's rows. With `target`, the
    checkpoint is an EAGLE head for that model (models/eagle.py), sharing its LM head and embedding."""
    model_dir = Path(model_dir)
    rename, shared = (lambda name: name), ()
    with torch.device("meta"):
        if target is None:
            model = LlamaForCausalLM(cfg, max_positions, tp)
        else:
            if tp.size > 1:
                raise ValueError("an EAGLE head runs on one rank")
            names = {eagle.checkpoint_name(n) for n, _ in _checkpoint_tensors(model_dir)}
            model = eagle.EagleHead(cfg, max_positions, fc_bias="model.fc.bias" in names)
            rename, shared = eagle.checkpoint_name, eagle.SHARED
    params = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _checkpoint_tensors(model_dir):
        name = rename(name)
        m = _FUSED_EXPERTS.match(name)
        if m:
            prefix, kind = m.groups()
            for e in range(tensor.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = tensor[e].chunk(2, dim=0)
                    state[f"{prefix}.{e}.gate_proj.weight"] = gate
                    state[f"{prefix}.{e}.up_proj.weight"] = up
                else:
                    state[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        elif name in params:
            state[name] = tensor
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
    missing = [n for n in params if n not in state and n not in shared
               and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name, tensor in state.items():
        dim = getattr(model.get_submodule(name.rpartition(".")[0]), "tp_dim", None)
        if dim is not None and dim < tensor.dim():  # a row-parallel linear's bias (if any) stays whole
            state[name] = tensor = shard(tensor, dim, tp)
        if tensor.shape != params[name].shape:
            raise ValueError(f"checkpoint {model_dir}: {name} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(params[name].shape)}")
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name])
    if cfg.tie_word_embeddings and target is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers were only shapes on meta; rope tables stay fp32 and are cast per step.
    cos, sin = rope_tables(cfg, max_positions)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.fuse()
    pack(model, tiles, panels)  # on the cpu: weights laid out once for oneDNN (or as panels), and as tiles if asked
    if held:
        hold(model, panels, tiles)  # (before `widen` releases the 16-bit weights)
    if wide:
        widen(model)  # 16-bit weights as float32, where the device multiplies in float32 anyway
    if transposed:
        transpose(model)  # the weights multiplied by as [in, out], the layout XLA:CPU's dot is fastest with
    if isinstance(model, eagle.EagleHead):
        assert target is not None
        model.share(target, own_embedding="model.embed_tokens.weight" in state)
    return model.eval()
