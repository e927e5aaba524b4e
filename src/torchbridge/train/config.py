"""The trainer's configuration: TOML sections -> typed dataclasses, validated before any process starts.

Every key is declared here with its type and default; a key the file has and these classes do not is an
error naming it (a typo must not silently train with the default). `validate` checks what depends on
several keys (parallel degrees against the rank count, batch divisibility, the corpus existing) and
names the key at fault. The shipped recipes live in train/configs/ (`default.toml` is the bundled model's).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent / "configs"
DEVICES = ("cpu", "tpu")
PRECISIONS = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A bad configuration value; the message starts with the key at fault (`section.key`)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class JobConfig:
    device: str = "cpu"  # "cpu" or the bridge's device ("tpu", or its TORCHBRIDGE_DEVICE_NAME)
    nproc: int = 1  # ranks (processes) on this machine; on the bridge's device, one emulated chip each
    out: str = "runs/train"  # checkpoints, logs, TensorBoard events and the exported model go here
    port: int = 0  # the launcher's rendezvous port (0: a free one)
    threads: int = 0  # torch.set_num_threads per rank (0: leave PyTorch's default)


@dataclass
class ModelSection:
    """A Hugging Face LlamaConfig's shape (vocab_size comes from the trained tokenizer)."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True


@dataclass
class DataSection:
    corpus: str = "stdlib"  # "stdlib": the interpreter's standard library sources; or a directory of .py files
    max_corpus_mb: float = 40.0  # per split
    heldout_percent: int = 4  # files held out for evaluation, chosen by a hash of their path
    vocab_size: int = 4096  # byte-level BPE trained from scratch on the training split
    seq_len: int = 256
    chat_fraction: float = 0.05  # ChatML "write function X" conversations, as a share of training bytes
    tool_call_fraction: float = 0.02  # Hermes-style tool-call conversations, as a share of training bytes


@dataclass
class TrainingSection:
    steps: int = 1500
    batch_size: int = 16  # global: sequences per optimizer step, over all data-parallel ranks
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 2e-3
    warmup_fraction: float = 0.03  # linear warm-up over this share of the steps, then cosine decay
    min_lr_ratio: float = 0.05  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # on matrices only (not norms)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 turns clipping off
    compile: bool = False  # torch.compile(backend=the device's: "tpu" on the bridge, inductor on cpu)
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward
    mixed_precision: str = "float32"  # "bfloat16": bf16 compute (FSDP2: bf16 params, fp32 reduce)
    seed: int = 1234


@dataclass
class ParallelSection:
    dp_shard: int = -1  # FSDP2 degree; -1: every rank tensor parallelism does not use
    tp: int = 1  # tensor-parallel degree (Megatron-style column/row-parallel projections)


@dataclass
class EvalSection:
    every: int = 250  # held-out loss every N steps (0: only at the end)
    windows: int = 96  # seq_len windows of the held-out stream


@dataclass
class CheckpointSection:
    every: int = 0  # a torch.distributed.checkpoint every N steps (0: only at the end)
    resume: bool = True  # continue from the newest checkpoint in OUT/checkpoints


@dataclass
class MetricsSection:
    log_every: int = 25
    tensorboard: bool = True  # OUT/tensorboard when the tensorboard package is installed
    progress_bar: bool = True
    peak_tflops: float = 0.0  # the chip's peak for MFU; 0: measured at start with a large GEMM


@dataclass
class ExportSection:
    enabled: bool = True  # a Hugging Face checkpoint in OUT/model at the end
    dtype: str = "bfloat16"


@dataclass
class TrainConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    export: ExportSection = field(default_factory=ExportSection)

    # the resolved degrees (after validate): dp_shard * tp == nproc
    @property
    def dp(self) -> int:
        return self.parallel.dp_shard

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """`value` as the declared type (ints are accepted for floats), else a ConfigError naming `key`."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float) and isinstance(value, bool) or not isinstance(value, annotation):
        raise ConfigError(key, f"expected {annotation.__name__}, got {value!r}")
    return value


def _fill(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown key (known in [{prefix.rstrip('.') or 'top'}]: "
                                                f"{', '.join(sorted(known))})")
    values = {}
    for name in known & data.keys():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(data[name], dict):
                raise ConfigError(f"{prefix}{name}", f"expected a [{name}] table")
            values[name] = _fill(hint, data[name], f"{prefix}{name}.")
        else:
            values[name] = _check_type(f"{prefix}{name}", data[name], hint)
    return cls(**values)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    return _fill(TrainConfig, data, "")


def load(path: str | Path | None = None) -> TrainConfig:
    """Read a TOML config (a path, or the name of a shipped one: "default", "tiny"); None: "default"."""
    path = resolve_path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path}: {e}") from None
    return from_dict(data)


def resolve_path(path: str | Path | None) -> Path:
    if path is None:
        path = "default"
    p = Path(path)
    if not p.suffix and not p.exists():
        p = CONFIGS / f"{path}.toml"
    if not p.is_file():
        shipped = ", ".join(sorted(c.stem for c in CONFIGS.glob("*.toml")))
        raise ConfigError("config", f"no such file {path} (shipped configs: {shipped})")
    return p


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Set dotted keys ("training.steps": 20), type-checked like the file's."""
    for dotted, value in overrides.items():
        section_name, _, key = dotted.rpartition(".")
        section = getattr(cfg, section_name) if section_name else cfg
        if not hasattr(section, key) or not dataclasses.is_dataclass(section):
            raise ConfigError(dotted, "unknown key")
        setattr(section, key, _check_type(dotted, value, typing.get_type_hints(type(section))[key]))
    return cfg


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be positive, got {value}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check what needs several keys; resolve dp_shard = -1. Raises ConfigError naming the key."""
    job, tr, par, data = cfg.job, cfg.training, cfg.parallel, cfg.data
    if job.device not in DEVICES and job.device != _bridge_device_name():
        raise ConfigError("job.device", f"expected one of {', '.join(DEVICES)}, got {job.device!r}")
    _positive("job.nproc", job.nproc)
    _positive("parallel.tp", par.tp)
    if job.nproc % par.tp:
        raise ConfigError("parallel.tp", f"tensor-parallel degree {par.tp} does not divide the {job.nproc} ranks")
    if par.dp_shard == -1:
        par.dp_shard = job.nproc // par.tp
    _positive("parallel.dp_shard", par.dp_shard)
    if par.dp_shard * par.tp != job.nproc:
        raise ConfigError("parallel.dp_shard", f"dp_shard {par.dp_shard} x tp {par.tp} = {par.dp_shard * par.tp} "
                                               f"is not the {job.nproc} ranks (job.nproc)")
    m = cfg.model
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        _positive(f"model.{key}", getattr(m, key))
    if m.hidden_size % m.num_heads:
        raise ConfigError("model.num_heads", f"{m.num_heads} heads do not divide hidden_size {m.hidden_size}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError("model.num_kv_heads", f"{m.num_kv_heads} KV heads do not divide {m.num_heads} heads")
    if m.num_kv_heads % par.tp:
        raise ConfigError("parallel.tp", f"tensor-parallel degree {par.tp} does not divide the "
                                         f"{m.num_kv_heads} KV heads (model.num_kv_heads)")
    if m.intermediate_size % par.tp:
        raise ConfigError("parallel.tp", f"tp {par.tp} does not divide model.intermediate_size {m.intermediate_size}")
    if data.vocab_size % par.tp:
        raise ConfigError("parallel.tp", f"tp {par.tp} does not divide data.vocab_size {data.vocab_size}")
    for key in ("steps", "batch_size", "grad_accum", "lr"):
        _positive(f"training.{key}", getattr(tr, key))
    if tr.batch_size % (par.dp_shard * tr.grad_accum):
        raise ConfigError("training.batch_size", f"{tr.batch_size} sequences do not split evenly over "
                                                 f"{par.dp_shard} data-parallel ranks x {tr.grad_accum} micro-batches")
    if len(tr.betas) != 2 or not all(0 <= b < 1 for b in tr.betas):
        raise ConfigError("training.betas", f"expected two values in [0, 1), got {tr.betas}")
    if not 0 <= tr.warmup_fraction < 1:
        raise ConfigError("training.warmup_fraction", f"expected [0, 1), got {tr.warmup_fraction}")
    if tr.mixed_precision not in PRECISIONS:
        raise ConfigError("training.mixed_precision", f"expected one of {', '.join(PRECISIONS)}")
    if cfg.export.dtype not in PRECISIONS:
        raise ConfigError("export.dtype", f"expected one of {', '.join(PRECISIONS)}")
    _positive("data.seq_len", data.seq_len)
    if data.seq_len > m.max_position_embeddings:
        raise ConfigError("data.seq_len", f"{data.seq_len} exceeds model.max_position_embeddings "
                                          f"{m.max_position_embeddings}")
    if data.vocab_size < 300:
        raise ConfigError("data.vocab_size", "byte-level BPE needs at least 256 bytes + special tokens (>= 300)")
    if not 0 < data.heldout_percent < 100:
        raise ConfigError("data.heldout_percent", f"expected 1..99, got {data.heldout_percent}")
    for key in ("chat_fraction", "tool_call_fraction"):
        if not 0 <= getattr(data, key) < 1:
            raise ConfigError(f"data.{key}", "expected a share in [0, 1)")
    _positive("data.max_corpus_mb", data.max_corpus_mb)
    if data.corpus != "stdlib":
        corpus = Path(data.corpus)
        if not corpus.is_dir():
            raise ConfigError("data.corpus", f"no such directory {corpus} (or \"stdlib\")")
        if not any(corpus.rglob("*.py")):
            raise ConfigError("data.corpus", f"no .py files under {corpus}")
    for key, value in (("eval.every", cfg.eval.every), ("checkpoint.every", cfg.checkpoint.every),
                       ("metrics.peak_tflops", cfg.metrics.peak_tflops), ("job.threads", job.threads),
                       ("job.port", job.port)):
        if value < 0:
            raise ConfigError(key, f"must not be negative, got {value}")
    _positive("eval.windows", cfg.eval.windows)
    _positive("metrics.log_every", cfg.metrics.log_every)
    return cfg


def _bridge_device_name() -> str:
    import os

    return os.environ.get("TORCHBRIDGE_DEVICE_NAME", "tpu")
