"""Turns a scheduled batch into tensors, runs the model, and returns the logits to sample from.

With shape buckets on, every tensor of a step is padded up to a bucket (tokens, batch, query length,
blocks, sampled rows; each a power of two), so a compiling backend sees a handful of shapes that
`warmup()` can trace at start-up and none later. Padding tokens write their K/V into a scratch block
and are never sampled, so padded and unpadded steps give the same logits.

A step is first reduced to a `StepPlan` (plain data: per sequence its new tokens, positions and block
table), then prepared into tensors. With tensor parallelism (`tensor_parallel_size` N > 1) this
process is rank 0 of N: it sends each plan to the worker processes (serve/workers.py), and every rank
prepares the same tensors from it and runs the same step on its shard of the model and of the KV cache;
rank 0's logits are sampled.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchbridge.serve.attention import (
    AttentionGroup,
    AttentionMetadata,
    DecodeWorkspace,
    FreshPrefillGroup,
    PagedDecodeGroup,
    WorkspaceGroup,
    build_mask,
)
from torchbridge.serve.config import EngineConfig
from torchbridge.serve.models import load_model
from torchbridge.serve.parallel import SINGLE, TPGroup
from torchbridge.serve.scheduler import Batch


def _rank_device(device: str, rank: int) -> str:
    """The device of tensor-parallel rank `rank` (torchrun's convention: <type>:<base index + rank>)."""
    d = torch.device(device)
    return "cpu" if d.type == "cpu" else f"{d.type}:{(d.index or 0) + rank}"


def _bucket(n: int, smallest: int = 1) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


def _token_bucket(n: int, decode_only: bool) -> int:
    """The padded token count of a step: a step of decodes only has one token per sequence, as many as its
    batch's bucket (a single-user decode step then runs its linears over 2 rows, not 16); any step with
    a prompt's chunk pads to 16 or more."""
    return _bucket(n, MIN_BUCKET if decode_only else 16)


# The smallest bucket of a decode batch, of a block table and of the rows sampled. Dynamo specialises a
# size of 1 (a new graph, ~5 s of start-up each: decode of one sequence or of one block, each alone and
# together, was four structures where two remain); one padding row or block costs next to nothing (a
# memory-bound decode step reads the same weights for 2 rows as for 1; vLLM's TPU runner pads to 8 rows).
MIN_BUCKET = 2
# A sequence with at most this many tokens in a step attends through the cpu decode kernel, a row per token
# (reading the paged cache in place), instead of gathering its context for SDPA: single-user speculative
# verify steps (k + 1 tokens) on the bundled model spent most of their attention time in that gather.
KERNEL_MAX_QUERIES = 8
# The smallest bucket of fresh prompts in a device step (attention.FreshPrefillGroup): a padding span costs
# nothing, and one bucket for 1-16 prompts keeps one compiled program per token bucket where it is met.
FRESH_MIN_SPANS = 16


@dataclass
class PlannedSeq:
    """One scheduled sequence, as every rank needs it to build the step's tensors."""

    seq_id: int
    start: int  # tokens already in the KV cache (the first new token's position)
    tokens: list[int]  # fed this step: a prefill chunk or the decode token, then any draft tokens
    block_table: list[int]  # the blocks covering positions [0, start + len(tokens))
    num_samples: int  # logits rows to sample: 0, or 1 + drafts


StepPlan = list[PlannedSeq]
Shape = tuple[str, int, int]  # a warm-up bucket: ("decode", batch, blocks), ("prefill", tokens, blocks), ("fresh", tokens, spans)


def plan(batch: Batch, block_size: int) -> StepPlan:
    out = []
    for it in batch.items:
        seq = it.seq
        start = seq.num_computed_tokens
        toks = seq.token_ids[start : start + it.num_tokens]
        # (async scheduling: a token still being sampled is fed as 0 here and filled in before launch)
        toks = toks + [0] * (it.num_tokens - len(toks)) + it.draft_tokens
        blocks = seq.block_table[: -(-(start + len(toks)) // block_size)]
        out.append(PlannedSeq(seq.seq_id, start, toks, blocks, 1 + len(it.draft_tokens) if it.samples else 0))
    return out


@dataclass
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    rows: list[tuple[int, int]]  # per batch item: (first row, row count) in the logits; count 0: none
    num_rows: int
    features: torch.Tensor | None = None  # an EAGLE head's step: the target's features per token [N, hidden]

    def host_tensors(self) -> list[torch.Tensor]:
        """Every index tensor of the step, in a fixed order (a compiled step's replay takes them so)."""
        out = [self.input_ids, self.positions, self.meta.slot_mapping, self.sample_index]
        for g in self.meta.groups:
            if isinstance(g, AttentionGroup):
                out += [g.query_index, g.block_tables, g.mask, g.out_tokens, g.out_cells]
            elif isinstance(g, FreshPrefillGroup):
                out.append(g.spans)
        return out if self.features is None else [*out, self.features]

    def replay_key(self) -> tuple:
        """The step's shape bucket and the kinds of its attention groups: one compiled call each."""
        return (ModelRunner.shape_key(self.input_ids, self.sample_index, self.meta),
                tuple(type(g).__name__ for g in self.meta.groups))


def _step(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
          meta: AttentionMetadata, sample_index: torch.Tensor, features: torch.Tensor | None = None,
          keep_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One engine step: the model over every scheduled token, then the logits (float32) of the rows to sample.
    `features`: an EAGLE head's second input; `keep_hidden`: also return the final hidden states [N, hidden]
    (the features an EAGLE head drafts from)."""
    # Index tensors built on the host (a compiled step's): moved here, inside the graph, so the backend
    # hands them to its executable as arguments, moved with the call in one batch (one transfer each
    # from Python cost ~0.35 ms; nine per step).
    device = kv_caches[0][0].device
    input_ids, positions, sample_index = input_ids.to(device), positions.to(device), sample_index.to(device)
    meta = _meta_on(meta, device)
    # Sizes that are one size, said to torch once per step, so that a step traced with symbolic bucket
    # sizes knows them equal (as the kernels need): one token count for every per-token tensor, and per
    # attention group one batch, query length and context (blocks x block size) in each of its tensors.
    torch._check(positions.shape[0] == input_ids.shape[0])
    torch._check(meta.slot_mapping.shape[0] == input_ids.shape[0])
    block_size = kv_caches[0][0].shape[1]
    for g in meta.groups:
        if isinstance(g, AttentionGroup):
            batch, max_q = g.query_index.shape
            torch._check(g.block_tables.shape[0] == batch)
            torch._check(g.mask.shape[0] == batch)
            torch._check(g.mask.shape[2] == max_q)
            torch._check(g.mask.shape[3] == g.block_tables.shape[1] * block_size)
    if features is None:
        hidden = model(input_ids, positions, kv_caches, meta)
    else:
        hidden = model(input_ids, positions, kv_caches, meta, features.to(device))
    # float32 here, inside the step: on a compiling device an eager `.float()` afterwards was a program of its
    # own per logits shape, compiled when the first request met that shape (warm-up does not sample)
    logits = model.compute_logits(hidden[sample_index]).float()
    return (logits, hidden) if keep_hidden else logits


def _meta_on(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """`meta` with its attention groups' index tensors and mask on `device` (tensors already there stay)."""
    groups: list[AttentionGroup | WorkspaceGroup | PagedDecodeGroup | FreshPrefillGroup] = []
    for g in meta.groups:
        if isinstance(g, AttentionGroup):
            g = AttentionGroup(g.query_index.to(device), g.block_tables.to(device), g.mask.to(device),
                               g.out_tokens.to(device), g.out_cells.to(device))
        elif isinstance(g, FreshPrefillGroup):
            g = FreshPrefillGroup(g.spans.to(device))
        groups.append(g)
    return AttentionMetadata(slot_mapping=meta.slot_mapping.to(device), groups=groups)


# Dynamo graphs the step may keep (its default of 8 would send later structures back to eager): with
# symbolic bucket sizes a handful (decode, prefill, mixed steps; sizes of 1 are specialised).
_MAX_STEP_GRAPHS = 512


def _mark_bucket_sizes(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       sample_index: torch.Tensor, features: torch.Tensor | None) -> None:
    """Mark the step's bucketed sizes (tokens, rows to sample, and per attention group its batch,
    query length, blocks and results) symbolic: Dynamo then traces one graph for all buckets, and the
    backend compiles it once per bucket (`symbolic_sizes="exact"`), where one trace per bucket cost ~5 s of
    start-up each. The KV cache and the weights keep static sizes."""
    from torch._dynamo import maybe_mark_dynamic

    for t in (input_ids, positions, meta.slot_mapping, sample_index, features):
        if t is not None:
            maybe_mark_dynamic(t, 0)
    for g in meta.groups:
        if isinstance(g, AttentionGroup):
            maybe_mark_dynamic(g.query_index, (0, 1))
            maybe_mark_dynamic(g.block_tables, (0, 1))
            maybe_mark_dynamic(g.mask, (0, 2, 3))
            maybe_mark_dynamic(g.out_tokens, 0)
            maybe_mark_dynamic(g.out_cells, 0)
        elif isinstance(g, FreshPrefillGroup):
            maybe_mark_dynamic(g.spans, 0)


def _compiled_step(device: torch.device):  # noqa: ANN202 - a torch.compile wrapper of _step
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(_step, backend=device.type, options={"symbolic_sizes": "exact"})
    cfg = torch._dynamo.config
    # Dynamo reads these while it compiles, inside the call: set for the engine's own calls only, not for
    # other compiled code in the process. No duck sizing: two bucket sizes equal in one step (tokens and
    # results) are not the same size in the next.
    limits = cfg.patch(recompile_limit=max(cfg.recompile_limit, _MAX_STEP_GRAPHS),
                       accumulated_recompile_limit=max(cfg.accumulated_recompile_limit, _MAX_STEP_GRAPHS))
    no_duck = fx_config.patch(use_duck_shape=False)

    def step(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
             meta: AttentionMetadata, sample_index: torch.Tensor, features: torch.Tensor | None = None,
             keep_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _mark_bucket_sizes(input_ids, positions, meta, sample_index, features)
        with limits, no_duck:
            return compiled(model, input_ids, positions, kv_caches, meta, sample_index, features, keep_hidden)

    return step


def _kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V cache. On the bridge's device over JAX's CPU platform a 16-bit float cache is
    uint16 storage viewed as its dtype: XLA's CPU backend moves 16-bit floats through float32 (the whole
    cache converted there and back at every step), so the device moves them as bits (lowerings/moves.py),
    and a buffer held as uint16 makes those bitcasts free (a bf16 decode step of the bundled model: 127 ->
    ~10 ms)."""
    if device.type not in ("cpu", "cuda", "meta"):
        from torchbridge.device import buffers, dtypes
        from torchbridge.device.lowerings.moves import moved_as_bits
        from torchbridge.device.runtime import STATE

        if device.type == STATE.name and moved_as_bits(dtypes.to_jax(dtype)):
            bits = torch.empty(shape, dtype=torch.uint16, device=device)
            # its own buffer, of uint16, now: the device's lazy zeros would take their first reader's dtype
            # (bf16) and be one buffer shared by every cache (none donated to the first step)
            buffers.write_from_host(bits, torch.zeros(shape, dtype=torch.uint16))
            return bits.view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _on_bridge(device: torch.device) -> bool:
    """Whether `device` is the bridge's device (its compiled steps run through the bridge's backend)."""
    if device.type in ("cpu", "cuda", "meta"):
        return False
    from torchbridge.device.runtime import STATE

    return device.type == STATE.name


def _bridge_on_cpu_platform(device: torch.device) -> bool:
    """Whether `device` is the bridge's device over JAX's CPU platform (XLA:CPU runs the compiled step)."""
    if not _on_bridge(device):
        return False  # (before importing the device's runtime: a cpu engine never loads JAX)
    from torchbridge.device.runtime import STATE

    return STATE.platform == "cpu"


def _load_kernels_for_device(device: torch.device) -> None:
    """On the bridge's device over JAX's CPU platform, load the engine's CPU kernels: the device's paged
    attention kernel then runs the C++ decode kernel inside the compiled step instead of gathering every
    row's context (kernels/paged_attention.py). Where they do not build, the device keeps its own."""
    if _bridge_on_cpu_platform(device):
        from torchbridge.device import host_calls
        from torchbridge.serve import cpu_kernels

        if cpu_kernels.available() is None:
            host_calls.use_paged_decode()


def _wide_weights(device: torch.device) -> bool:
    """Whether 16-bit linears keep float32 weights (serve/linear.py `widen`): on the bridge's device over
    JAX's CPU platform, whose compiler multiplies 16-bit floats in float32, converting the weight at every
    call. TORCHBRIDGE_SERVE_WIDE=0 keeps the 16-bit weights (for A/B measurements)."""
    return _bridge_on_cpu_platform(device) and os.environ.get("TORCHBRIDGE_SERVE_WIDE", "1") != "0"


def _transposed_weights(device: torch.device) -> bool:
    """Whether linears keep their weights as [in, out] (serve/linear.py `transpose`): on the bridge's device over
    JAX's CPU platform, whose dot at a decode step's rows is about twice as fast with that layout.
    TORCHBRIDGE_SERVE_TRANSPOSE=0 keeps nn.Linear's [out, in] (for A/B measurements)."""
    return _bridge_on_cpu_platform(device) and os.environ.get("TORCHBRIDGE_SERVE_TRANSPOSE", "1") != "0"


def _held_weights(device: torch.device) -> bool:
    """Whether 16-bit linears are also handed, packed, to the engine's kernel library (serve/linear.py `hold`,
    which takes the layers whose dtype oneDNN multiplies on this CPU; with `_panels()`, every float layer as
    panels instead): on the bridge's device over JAX's CPU platform, where the kernels build.
    TORCHBRIDGE_SERVE_HELD=0 keeps every product in XLA (for A/B measurements)."""
    return (_bridge_on_cpu_platform(device) and os.environ.get("TORCHBRIDGE_SERVE_HELD", "1") != "0"
            and _cpu_kernels_build())


def _replaying(device: torch.device) -> bool:
    """Whether the compiled step is replayed per bucket (compile/replay.py): on the bridge's device, whose
    backend records the calls; TORCHBRIDGE_SERVE_REPLAY=0 always takes the full path (for A/B measurements)."""
    return _on_bridge(device) and os.environ.get("TORCHBRIDGE_SERVE_REPLAY", "1") != "0"


def _cpu_kernels_build() -> bool:
    from torchbridge.serve import cpu_kernels

    return cpu_kernels.available() is None


def _tile_kernel() -> str | None:
    """The kernel for bf16 decode-row linears (serve/linear.py): AMX, else AVX512-BF16, where the CPU has it;
    TORCHBRIDGE_SERVE_TILES=0 (or the older TORCHBRIDGE_SERVE_AMX=0) keeps them on oneDNN (for A/B runs)."""
    from torchbridge.serve import cpu_kernels

    if "0" in (os.environ.get("TORCHBRIDGE_SERVE_TILES"), os.environ.get("TORCHBRIDGE_SERVE_AMX")):
        return None
    return cpu_kernels.tile_kernel()


def _panels() -> bool:
    """Whether float32 linears run the engine's AVX2 panel kernel (serve/linear.py): where it was built for this
    CPU; TORCHBRIDGE_SERVE_PANELS=0 keeps them on oneDNN on the cpu, in XLA on the bridge's device (A/B runs)."""
    from torchbridge.serve import cpu_kernels

    return os.environ.get("TORCHBRIDGE_SERVE_PANELS") != "0" and cpu_kernels.panel_linear_available()


class ModelRunner:
    """`rank`/`port`: set in a tensor-parallel worker process (serve/workers.py); rank 0 starts the workers.
    `target`: `config.model` is an EAGLE head for this (target) model, and each step takes its features.
    `keep_hidden`: each step also keeps its final hidden states in `last_hidden` (an EAGLE head's features)."""

    def __init__(self, config: EngineConfig, rank: int = 0, port: int | None = None,
                 target: torch.nn.Module | None = None, keep_hidden: bool = False) -> None:
        self.config = config
        self.takes_features = target is not None
        self.keep_hidden = keep_hidden
        self.last_hidden: torch.Tensor | None = None  # [real tokens, hidden] of the last step, on the host
        self.workers = None
        self.tp: TPGroup = SINGLE
        if config.tensor_parallel_size > 1:
            from torchbridge.serve import workers

            if rank == 0:
                port = workers.pick_port()
                self.workers = workers.WorkerGroup(config, port)
            assert port is not None
            self.tp = workers.join_group(config, rank, port, self.workers)  # once all N ranks are connected
        self.device = torch.device(config.device if rank == 0 else _rank_device(config.device, rank))
        self.dtype = config.torch_dtype
        mc = config.model_config
        self.block_size = config.block_size
        self.scratch_block = config.num_blocks
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        # The CPU kernels, when asked for and they build (else plain torch ops, and the workspace, if on,
        # serves decodes).
        self.decode_kernel = bool(config.cpu_kernels) and _cpu_kernels_build()
        held = _held_weights(self.device)
        # (on the bridge's device the held bf16 weights' decode rows run the same tile kernel)
        tiles = _tile_kernel() if (self.decode_kernel or held) and self.dtype == torch.bfloat16 else None
        # On the cpu the panel kernel is one of the CPU kernels (config.py allows those only there); on the
        # bridge's device over JAX's CPU platform its compiled step calls the same kernel by held weights.
        panels = (self.decode_kernel or held) and _panels()
        _load_kernels_for_device(self.device)
        self.model = load_model(config.model, mc, str(self.device), self.dtype, config.max_model_len + 1, self.tp, tiles,
                                _wide_weights(self.device), target, transposed=_transposed_weights(self.device),
                                held=held, panels=panels)
        shape = (config.num_blocks + 1, config.block_size, mc.num_kv_heads // self.tp.size, mc.head_dim)
        self.kv_caches = [(_kv_cache(shape, self.dtype, self.device), _kv_cache(shape, self.dtype, self.device))
                          for _ in range(mc.num_layers)]
        self.sliding_window = mc.sliding_window
        # Prompts from their first token attend unpadded, one causal call each (attention.FreshPrefillGroup);
        # off (TORCHBRIDGE_SERVE_FRESH_PREFILL=0, or set by the bench's A/B), they join the gathered, masked group.
        self.fresh_prefill = os.environ.get("TORCHBRIDGE_SERVE_FRESH_PREFILL", "1") != "0"
        # On the bridge's device over JAX's CPU platform, where the CPU kernels build, the same group runs the
        # same kernel as a custom call (kernels/prefill_attention.py); other devices pad prompts into the masked
        # group (no packed kernel for them yet).
        self.device_fresh_prefill = (_bridge_on_cpu_platform(self.device) and _cpu_kernels_build()
                                     and any("prefill_attention" in getattr(m, "names", ())
                                             for m in self.model.modules()))
        self.model.use_cpu_kernels(self.decode_kernel)
        self.workspace = None if self.decode_kernel else (
            DecodeWorkspace(mc.num_layers, mc.num_kv_heads // self.tp.size, mc.head_dim, self.dtype, self.device,
                            config.max_num_seqs, config.num_blocks * config.block_size)
            if config.decode_workspace else None
        )
        self._step = _compiled_step(self.device) if config.compile_model else _step
        # Replays of the compiled step, per shape bucket (compile/replay.py): after a bucket's first step
        # the engine repeats its compiled call without Dynamo's guards or the backend's argument walk.
        # None: not replaying (eager, or another backend). A bucket whose capture cannot replay maps to None.
        self._replays: dict[tuple, Any] | None = {} if config.compile_model and _replaying(self.device) else None
        # Where a step's index tensors are built: a compiled step takes them from the host and moves them
        # itself (_step), in one batch with its executable's call.
        self.input_device = torch.device("cpu") if config.compile_model else self.device
        # Shape keys of steps run, and of steps traced by warmup(): with buckets, steady state stays
        # within a small set (the tests check that decode steps only use warmed shapes).
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.shapes_warmed: set[tuple[int, ...]] = set()

    def prepare(self, step: StepPlan, pad: bool | None = None) -> StepInput:
        pad = self.config.shape_buckets if pad is None else pad
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample: list[int] = []
        rows: list[tuple[int, int]] = []
        # Per group (decodes, chunks): (first flat token, query length, context length, block table).
        groups: dict[bool, list[tuple[int, int, int, list[int]]]] = {True: [], False: []}
        decodes: list[tuple[PlannedSeq, int, int]] = []  # (seq, flat token, position) of one-token items
        fresh: list[tuple[int, int]] = []  # (flat token, count) of prompts from their first token
        use_kernel = self.decode_kernel and not pad
        # (on the bridge's device a fresh prompt needs two tokens or more: one token is a decode group's row)
        fresh_from = 1 if use_kernel else 2 if pad and self.device_fresh_prefill else None
        use_ws = self.workspace is not None and not pad
        for seq in step:
            start, toks = seq.start, seq.tokens
            first = len(ids)
            ids.extend(toks)
            p = range(start, start + len(toks))
            pos.extend(p)
            slots.extend(seq.block_table[i // bs] * bs + i % bs for i in p)
            ctx = start + len(toks)
            if (use_ws or use_kernel) and len(toks) == 1:
                decodes.append((seq, first, start))
            elif use_kernel and len(toks) <= KERNEL_MAX_QUERIES:
                # A few queries (a speculative verify, a short chunk): one decode row each, its context
                # ending at its own position (causal; the step's K/V are in the cache before attention).
                decodes.extend((seq, first + j, start + j) for j in range(len(toks)))
            elif (fresh_from is not None and start == 0 and len(toks) >= fresh_from and self.fresh_prefill
                  and (self.sliding_window is None or len(toks) <= self.sliding_window)):
                fresh.append((first, len(toks)))  # a prompt's first chunk: its own keys and values only
            else:
                groups[len(toks) == 1].append((first, len(toks), ctx, seq.block_table))
            k = seq.num_samples
            rows.append((len(sample), k))
            sample.extend(range(first + len(toks) - k, first + len(toks)))
        num_real = len(ids)
        n, m = len(ids), len(sample)
        if pad:
            n, m = _token_bucket(n, n == len(rows)), _bucket(m, MIN_BUCKET)  # (n == sequences: decodes only)
        ids += [0] * (n - len(ids))
        pos += [0] * (n - len(pos))
        slots += [self.scratch_block * bs] * (n - len(slots))
        sample += [0] * (m - len(sample))
        dev = self.input_device

        def tensor(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        attn_groups: list[AttentionGroup | WorkspaceGroup | PagedDecodeGroup | FreshPrefillGroup] = []
        if use_kernel and decodes:
            attn_groups.append(self._kernel_group(decodes, tensor))
        elif use_ws:
            ws_group = self._workspace_group(decodes, tensor)
            if ws_group is None:  # over the workspace's capacity: gather like the other groups
                groups[True] = [(f, 1, p + 1, sq.block_table[: -(-(p + 1) // bs)]) for sq, f, p in decodes]
            else:
                attn_groups.append(ws_group)
        elif self.workspace is not None:
            self.workspace.release_all()  # a padded step does not write the workspace
        attn_groups += [self._group(g, pos, n, pad, tensor) for g in groups.values() if g]
        if fresh:
            # a bucketed count of spans on the device (padding spans count 0: they cost nothing)
            fresh += [(0, 0)] * ((_bucket(len(fresh), FRESH_MIN_SPANS) if pad else len(fresh)) - len(fresh))
            attn_groups.append(FreshPrefillGroup(tensor(fresh)))  # type: ignore[operator]
        meta = AttentionMetadata(slot_mapping=tensor(slots), groups=attn_groups)
        assert num_real <= n
        return StepInput(tensor(ids), tensor(pos), meta, tensor(sample), rows, len(sample))

    def _group(self, members: list[tuple[int, int, int, list[int]]], pos: list[int], n: int, pad: bool,
               tensor: object) -> AttentionGroup:
        bs = self.block_size
        b, t = len(members), max(q for _, q, _, _ in members)
        mb = max(len(tb) for *_, tb in members)
        out_len = sum(q for _, q, _, _ in members)
        if pad:
            # (a prefill group of one sequence, the usual chunked prefill, keeps its one row)
            b, t, out_len = _bucket(b, MIN_BUCKET if t == 1 else 1), _bucket(t), _bucket(out_len, 16)
            mb = min(_bucket(mb, MIN_BUCKET), _bucket(self.max_blocks_per_seq))
        query_index = [[0] * t for _ in range(b)]
        q_pos = [[0] * t for _ in range(b)]
        ctx_lens = [0] * b
        out_tokens: list[int] = []
        out_cells: list[int] = []
        tables = []
        for row, (first, q, ctx, tb) in enumerate(members):
            for j in range(q):
                query_index[row][j] = first + j
                q_pos[row][j] = pos[first + j]
                out_tokens.append(first + j)
                out_cells.append(row * t + j)
            ctx_lens[row] = ctx
            tables.append(tb + [self.scratch_block] * (mb - len(tb)))
        tables += [[self.scratch_block] * mb for _ in range(b - len(members))]
        # Padding results land in row n of the output, which is dropped.
        out_tokens += [n] * (out_len - len(out_tokens))
        out_cells += [0] * (out_len - len(out_cells))
        # The mask is built on the host and copied once: on the device it was ~8 eager ops per step, each a
        # new program for every shape bucket at start-up.
        mask = build_mask(torch.tensor(q_pos), torch.tensor(ctx_lens), mb * bs, self.sliding_window)
        return AttentionGroup(
            query_index=tensor(query_index),  # type: ignore[operator]
            block_tables=tensor(tables),  # type: ignore[operator]
            mask=mask.to(self.input_device),
            out_tokens=tensor(out_tokens),  # type: ignore[operator]
            out_cells=tensor(out_cells),  # type: ignore[operator]
        )

    def _kernel_group(self, decodes: list[tuple[PlannedSeq, int, int]], tensor: object) -> PagedDecodeGroup:
        mb = max(len(seq.block_table) for seq, _, _ in decodes)
        tables = [seq.block_table + [self.scratch_block] * (mb - len(seq.block_table)) for seq, _, _ in decodes]
        return PagedDecodeGroup(
            query_index=tensor([first for _, first, _ in decodes]),  # type: ignore[operator]
            block_tables=tensor(tables),  # type: ignore[operator]
            context_lens=tensor([start + 1 for _, _, start in decodes]),  # type: ignore[operator]
            window=self.sliding_window,
        )

    def _workspace_group(self, decodes: list[tuple[PlannedSeq, int, int]], tensor: object) -> WorkspaceGroup | None:
        ws = self.workspace
        assert ws is not None
        if not decodes:
            ws.release_all()
            return None
        bs = self.block_size
        starts = [p for _, _, p in decodes]

        def fill(row: int, i: int, k_rows: list[torch.Tensor], v_rows: list[torch.Tensor]) -> None:
            seq, _, start = decodes[i]
            if start == 0:
                return
            blocks = torch.tensor(seq.block_table[: -(-start // bs)], dtype=torch.long, device=self.device)
            for (kc, vc), kw, vw in zip(self.kv_caches, k_rows, v_rows, strict=True):
                for cache, w in ((kc, kw), (vc, vw)):
                    ctx = cache.index_select(0, blocks).flatten(0, 1)[:start]  # [start, KVH, D]
                    w[row, :, :start].copy_(ctx.transpose(0, 1))

        rows = ws.assign([s.seq_id for s, _, _ in decodes], starts, fill)
        if rows is None:
            return None
        r, kvh = len(decodes), ws.num_kv_heads
        query_index, q_pos = [0] * r, [0] * r
        for row, (_, first, start) in zip(rows, decodes, strict=True):
            query_index[row], q_pos[row] = first, start
        kv_len = max(starts) + 1
        pos_t = tensor(q_pos)  # type: ignore[operator]
        # Cell (row, head, position) of each row's new K/V, rows then heads (the order k[query_index] has).
        heads = torch.arange(r * kvh, device=self.device).view(r, kvh)
        write_index = (heads * ws.length + pos_t[:, None]).flatten()
        return WorkspaceGroup(
            workspace=ws,
            query_index=tensor(query_index),  # type: ignore[operator]
            write_index=write_index,
            mask=build_mask(pos_t[:, None], pos_t + 1, kv_len, self.sliding_window),
            kv_len=kv_len,
        )

    @staticmethod
    def shape_key(input_ids: torch.Tensor, sample_index: torch.Tensor, meta: AttentionMetadata) -> tuple[int, ...]:
        """Every dimension a compiled step depends on."""
        groups = (
            x for g in meta.groups for x in (
                (g.query_index.shape[0], g.kv_len) if isinstance(g, WorkspaceGroup)
                else (*g.block_tables.shape,) if isinstance(g, PagedDecodeGroup)
                else (g.spans.shape[0],) if isinstance(g, FreshPrefillGroup)
                else (*g.query_index.shape, g.block_tables.shape[1], g.out_tokens.shape[0])
            )
        )
        return (input_ids.shape[0], sample_index.shape[0], *groups)

    def run(self, batch: Batch, pad: bool | None = None,
            features: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Logits (fp32, on cpu) of the rows to sample, and each item's (first row, count). `features`: an
        EAGLE head's, one row per token fed, in the batch's order."""
        step = plan(batch, self.block_size)
        if self.workers is None:
            logits, rows = self.execute(step, pad, features)
            return logits.float().cpu(), rows
        self.workers.send("execute", step, pad)
        try:
            logits, rows = self.execute(step, pad)
        except Exception as e:  # no later step could pair up: the group stops, naming a dead worker if one is
            raise self.workers.step_failed(e) from e
        return logits.float().cpu(), rows

    @torch.inference_mode()
    def execute(self, step: StepPlan, pad: bool | None = None,
                features: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """This rank's part of one step: the logits of the rows to sample (on the device, or on the host
        where the compiled step was replayed)."""
        inp = self.prepare(step, pad)
        if self.takes_features:
            if features is None:
                raise ValueError("an EAGLE head's step needs the target's features")
            n, real = inp.input_ids.shape[0], features.shape[0]
            if real < n:  # padding rows: their outputs are dropped
                features = torch.cat([features, features.new_zeros((n - real, features.shape[1]))])
            inp.features = features.to(self.input_device)
        self.shapes_seen.add(self.shape_key(inp.input_ids, inp.sample_index, inp.meta))
        out = self._run_step(inp)
        logits = out
        if self.keep_hidden:
            logits, hidden = out
            self.last_hidden = hidden[: sum(len(s.tokens) for s in step)].cpu()
        num_real = sum(c for _, c in inp.rows)
        return logits[:num_real], inp.rows

    @property
    def launches(self) -> bool:
        """Whether a step can run while the host schedules and prepares the next (`stage`): a replayed
        compiled step, whose executable JAX dispatches without waiting for it."""
        return self._replays is not None and self.workers is None and not self.keep_hidden and not self.takes_features

    @torch.inference_mode()
    def stage(self, inp: StepInput) -> Callable[[], Callable[[], torch.Tensor]]:
        """Get `inp`'s step (prepared by `prepare`, on a runner that `launches`) ready to start, and return
        what starts it; that returns what waits for it: the logits (fp32, on the host) of its rows to sample.
        Until the start the caller may still write `inp`'s host tensors in place (async scheduling fills in
        the tokens being sampled). A bucket's first step (its capture), or one that cannot replay, runs when
        started and is done when the start returns."""
        self.shapes_seen.add(self.shape_key(inp.input_ids, inp.sample_index, inp.meta))
        num_real = sum(c for _, c in inp.rows)
        assert self._replays is not None
        rep = self._replays.get(inp.replay_key())
        staged = None if rep is None else rep.stage(inp.host_tensors())
        if staged is not None:
            def start() -> Callable[[], torch.Tensor]:
                launched = staged.launch()
                return lambda: launched.result()[0][:num_real]
            return start

        def run() -> Callable[[], torch.Tensor]:
            with torch.inference_mode():
                logits = self._run_step(inp)[:num_real].float().cpu()  # type: ignore[index] (no hidden states kept)
            return lambda: logits
        return run

    def _run_step(self, inp: StepInput) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The compiled (or eager) step on `inp`; replayed where this bucket's step was captured (its outputs
        then come back on the host: the caller copies them there next). Logits, and with `keep_hidden` the
        final hidden states."""
        replays = self._replays
        if replays is None:
            return self._call_step(inp)
        from torchbridge.compile import replay

        key, sources = inp.replay_key(), inp.host_tensors()
        known = key in replays
        rep = replays.get(key)
        if rep is not None:
            out = rep(sources, host_outputs=True)
            if out is not None:
                return (out[0], out[1]) if self.keep_hidden else out[0]
        elif known:  # (this bucket's step cannot be replayed: a graph break, say)
            return self._call_step(inp)
        with replay.capture() as cap:  # the bucket's first step, or a replay that no longer fits
            out = self._call_step(inp)
        replays[key] = cap.replay(sources)
        return out

    def _call_step(self, inp: StepInput) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._step(self.model, inp.input_ids, inp.positions, self.kv_caches, inp.meta, inp.sample_index,
                          inp.features, self.keep_hidden)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); this runner cannot step afterwards."""
        if self.workers is not None:
            self.workers.close()

    def bucket_shapes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[Shape]:
        """Every decode bucket (batch x blocks) and every single-sequence prefill bucket (tokens x blocks)
        the limits allow, and where the device packs fresh prompts (`device_fresh_prefill`) a bucket of
        them per token bucket (tokens x `FRESH_MIN_SPANS`), smallest first."""
        bs = self.block_size
        batches = [x for x in (2**i for i in range(20)) if MIN_BUCKET <= x <= _bucket(max_num_seqs, MIN_BUCKET)]
        most = _bucket(self.max_blocks_per_seq)
        blocks = [x for x in (2**i for i in range(20)) if min(MIN_BUCKET, most) <= x <= most]
        tokens = [x for x in (2**i for i in range(4, 20)) if x <= _bucket(max_num_batched_tokens, 16)]
        shapes = [("decode", b, mb) for b, mb in itertools.product(batches, blocks)]
        shapes += [("prefill", t, mb) for t, mb in itertools.product(tokens, blocks) if t <= mb * bs]
        if self.device_fresh_prefill and self.fresh_prefill:  # prompts from their first token: (tokens, spans)
            shapes += [("fresh", t, FRESH_MIN_SPANS) for t in tokens]
        return sorted(shapes, key=lambda s: s[1] * s[2])

    @torch.inference_mode()
    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, progress: bool = True) -> int:
        """Run every bucket of `bucket_shapes` once, so that a compiling backend has traced them before
        the first request. Returns the shape count."""
        shapes = self.bucket_shapes(max_num_seqs, max_num_batched_tokens)
        self.warm(shapes, progress)
        return len(shapes)

    @torch.inference_mode()
    def warm(self, shapes: list[Shape], progress: bool = True) -> None:
        """Run one padded step of each of `shapes` (on every tensor-parallel rank): its K/V goes to the
        scratch block, so requests in flight are not touched."""
        if self.workers is not None:
            self.workers.send("warm", shapes, False)
        if self.config.compile_model:
            # Each bucket is a new shape by design: the compile backend's recompile warnings would only be noise.
            from torchbridge.compile import recompiles_expected

            with recompiles_expected():
                self._warm(shapes, progress)
        else:
            self._warm(shapes, progress)
        # A device runs its programs asynchronously: without this wait the last warm steps (the largest
        # buckets, each slower on its first run) were still queued when warm-up returned, and the first
        # request's step waited for them (0.3-0.8 s on the bundled model).
        torch.get_device_module(self.device).synchronize(self.device)

    def _warm(self, shapes: list[Shape], progress: bool) -> None:
        from tqdm import tqdm

        bs = self.block_size

        def zeros(size: int) -> torch.Tensor:  # one tensor per input, as prepare() makes them (no aliases)
            return torch.zeros((size,), dtype=torch.long, device=self.input_device)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.input_device)

        for kind, x, mb in tqdm(shapes, desc="warming up shape buckets", disable=not progress):
            b, t = (x, 1) if kind == "decode" else (1, x)
            n = _token_bucket(b * t, kind == "decode")
            table = [self.scratch_block] * mb
            group: AttentionGroup | FreshPrefillGroup
            if kind == "fresh":  # (mb: the count of spans) one prompt of all n tokens, the other spans padding
                group = FreshPrefillGroup(tensor([(0, n)] + [(0, 0)] * (mb - 1)))
            else:
                group = self._group([(0, 1, 0, table)] * b if kind == "decode" else [(0, t, 0, table)], [0] * n, n,
                                    True, tensor)
            meta = AttentionMetadata(slot_mapping=torch.full((n,), self.scratch_block * bs, dtype=torch.long,
                                                             device=self.input_device), groups=[group])
            ids, sample_index = zeros(n), zeros(_bucket(b if kind == "decode" else 1, MIN_BUCKET))
            features = None
            if self.takes_features:
                features = torch.zeros((n, self.config.model_config.hidden_size), dtype=self.dtype,
                                       device=self.input_device)
            self._step(self.model, ids, zeros(n), self.kv_caches, meta, sample_index, features, self.keep_hidden)
            self.shapes_warmed.add(self.shape_key(ids, sample_index, meta))
