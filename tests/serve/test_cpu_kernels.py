"""The engine's CPU kernels against PyTorch's own ops: the decode kernel (serve/csrc/paged_attention.cpp) and
the fresh prompts' prefill attention (serve/csrc/prefill_attention.cpp) against `F.scaled_dot_product_attention`,
the pointwise kernels against Hugging Face's modules, greedy argmax against `torch.max`.

The reference gathers each row's context out of the pool with plain indexing and runs
`F.scaled_dot_product_attention` in fp32 with an explicit mask: nothing of the kernel's own code."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from torchbridge.serve import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    why = cpu_kernels.available()
    assert why is None, f"the kernel must build where the test suite runs: {why}"


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    rows, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.zeros(rows, heads, d)
    for r in range(rows):
        n = int(lens[r])
        if n == 0:
            continue
        k = k_cache[tables[r]].reshape(-1, kv_heads, d)[:n].float().transpose(0, 1)  # [KVH, n, D]
        v = v_cache[tables[r]].reshape(-1, kv_heads, d)[:n].float().transpose(0, 1)
        visible = (torch.arange(n) >= (n - window if window else 0))[None, :]  # [1 query, n keys]
        g = heads // kv_heads
        o = F.scaled_dot_product_attention(q[r].float().view(kv_heads, g, 1, d), k[:, None].expand(-1, g, -1, -1),
                                           v[:, None].expand(-1, g, -1, -1), attn_mask=visible, scale=scale)
        out[r] = o.reshape(heads, d)
    return out


@pytest.fixture(params=["vector", "portable"])
def loops(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel's vector loops (AVX-512 where the build targets it) and its portable ones, which a
    machine without AVX-512 runs: both checked here whatever the machine."""
    torch.ops.torchbridge_serve._force_portable(request.param == "portable")
    yield request.param
    torch.ops.torchbridge_serve._force_portable(False)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 64), (4, 1, 144), (6, 3, 24)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_sdpa_on_the_gathered_context(dtype: torch.dtype, atol: float, heads: int, kv_heads: int,
                                               head_dim: int, window: int | None, loops: str) -> None:
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    # blocks of 5 positions: the kernel's 16-position chunks straddle blocks
    block_size = 5 if kv_heads == 2 else 16
    per_row = -(-203 // block_size)
    num_blocks = 7 * per_row + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # lengths: none, one key, not a multiple of 4 or of the block, exactly a block, many blocks
    lens = torch.tensor([0, 1, 3, 17, 16, 101, 203])
    tables = torch.randperm(num_blocks, generator=g)[: 7 * per_row].view(7, per_row)  # scattered, none shared
    q = torch.randn(7, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, lens, scale, window)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # no context: zeros, not NaN


def test_bad_tables_are_refused_by_name() -> None:
    k = torch.zeros(4, 16, 2, 8)
    q = torch.zeros(2, 2, 8)
    with pytest.raises(RuntimeError, match="names block 9 of a pool of 4"):
        cpu_kernels.paged_decode_attention(q, k, k, torch.tensor([[0, 1], [9, 2]]), torch.tensor([20, 5]), 1.0)
    with pytest.raises(RuntimeError, match="context length 40 exceeds its block table"):
        cpu_kernels.paged_decode_attention(q, k, k, torch.tensor([[0, 1], [2, 3]]), torch.tensor([40, 5]), 1.0)
    with pytest.raises(RuntimeError, match="head size or head count"):
        cpu_kernels.paged_decode_attention(torch.zeros(2, 3, 8), k, k, torch.tensor([[0], [1]]), torch.tensor([1, 1]), 1.0)


def test_the_engine_decodes_through_the_kernel_on_cpu(tmp_path) -> None:
    """The cpu default: decode steps are PagedDecodeGroups (not the workspace), and the engine's greedy
    tokens equal Hugging Face generate()'s for a mixed batch (the full comparison is test_engine.py)."""
    from serve_support import hf_greedy, mixed_prompts, save_model

    from torchbridge.serve import LLM, SamplingParams
    from torchbridge.serve.attention import PagedDecodeGroup

    model_dir = save_model(tmp_path, "llama", None, seed=2)
    llm = LLM(str(model_dir), block_size=4, num_blocks=128, max_model_len=96)
    runner = llm.engine.runner
    assert runner.decode_kernel and runner.workspace is None
    assert any(getattr(m, "cpu", None) is True for m in runner.model.modules())  # RMSNorm and rotary too
    kinds = []
    prepare = runner.prepare
    runner.prepare = lambda *a, **k: (lambda inp: kinds.extend(type(g) for g in inp.meta.groups) or inp)(prepare(*a, **k))
    prompts = mixed_prompts(4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert PagedDecodeGroup in kinds
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, 6) for p in prompts]


def test_a_few_queries_per_sequence_attend_as_kernel_rows(tmp_path) -> None:
    """Prompts of up to KERNEL_MAX_QUERIES tokens and speculative verify steps (here n-gram, 4 tokens) go
    through the decode kernel, one row per token with its own causal context; tokens equal HF's."""
    from serve_support import hf_greedy, save_model

    from torchbridge.serve import LLM, SamplingParams
    from torchbridge.serve.attention import AttentionGroup, FreshPrefillGroup, PagedDecodeGroup
    from torchbridge.serve.model_runner import KERNEL_MAX_QUERIES

    model_dir = save_model(tmp_path, "llama", None, seed=3)
    llm = LLM(str(model_dir), block_size=4, num_blocks=128, max_model_len=96, speculative_ngram=3)
    runner = llm.engine.runner
    steps = []
    prepare = runner.prepare
    runner.prepare = lambda *a, **k: (lambda inp: steps.append(inp) or inp)(prepare(*a, **k))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 9, 10, 11, 12], [20, 21, 22, 23] * 4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, 16) for p in prompts]
    assert llm.engine.spec_stats.num_draft_tokens > 0
    first = steps[0].meta.groups  # the three prefills: two short ones as kernel rows, the long one on its own
    kernel = [g for g in first if isinstance(g, PagedDecodeGroup)]
    assert len(kernel) == 1 and kernel[0].context_lens.tolist() == [1, 2, 3] + list(range(1, 9))
    fresh = [g for g in first if isinstance(g, FreshPrefillGroup)]
    assert len(fresh) == 1 and fresh[0].spans.tolist() == [[11, 16]] and len(prompts[2]) > KERNEL_MAX_QUERIES
    assert not any(isinstance(g, AttentionGroup) for g in first)
    assert all(isinstance(g, PagedDecodeGroup) for inp in steps[1:] for g in inp.meta.groups)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_prompts_from_their_first_token_attend_unpadded(tmp_path, family: str) -> None:
    """Prompts computed from their first token attend over their own keys and values, one causal call each
    (a FreshPrefillGroup); a long prompt's later chunks, which have context in the cache, and prompts longer
    than a sliding window keep the gathered, masked path. Tokens equal HF's either way."""
    from serve_support import hf_greedy, save_model

    from torchbridge.serve import LLM, SamplingParams
    from torchbridge.serve.attention import AttentionGroup, FreshPrefillGroup

    window = 24 if family == "mistral" else None
    model_dir = save_model(tmp_path, family, None, seed=5, **({"sliding_window": window} if window else {}))
    llm = LLM(str(model_dir), block_size=4, num_blocks=256, max_model_len=160, max_num_batched_tokens=48)
    runner = llm.engine.runner
    steps = []
    prepare = runner.prepare
    runner.prepare = lambda *a, **k: (lambda inp: steps.append(inp) or inp)(prepare(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (20, 13, 100, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, 8) for p in prompts]
    spans = [span for inp in steps for grp in inp.meta.groups if isinstance(grp, FreshPrefillGroup)
             for span in grp.spans.tolist()]
    gathered = [grp for inp in steps for grp in inp.meta.groups if isinstance(grp, AttentionGroup)]
    assert spans and gathered  # the 100-token prompt's later chunks (after 48 tokens a step) are gathered
    assert all(window is None or count <= window for _, count in spans)


# ---- fresh prompts' packed causal attention (serve/csrc/prefill_attention.cpp) --------------------------


def prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                      scale: float) -> torch.Tensor:
    """Per span: fp32 SDPA with an explicit lower-triangular mask, KV heads repeated for GQA; zeros elsewhere."""
    out = torch.zeros(q.shape)
    g = q.shape[1] // k.shape[1]
    for first, count in spans:
        if count == 0:
            continue
        rows = slice(first, first + count)
        causal = torch.ones(count, count, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1),
                                           k[rows].float().transpose(0, 1).repeat_interleave(g, 0),
                                           v[rows].float().transpose(0, 1).repeat_interleave(g, 0),
                                           attn_mask=causal, scale=scale)
        out[rows] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 32), (6, 3, 24)])
def test_prefill_attention_matches_sdpa_per_span(dtype: torch.dtype, atol: float, heads: int, kv_heads: int,
                                                 head_dim: int) -> None:
    """Spans of 1 to 300 rows (past the flash kernel's blocks), with gaps between them (rows of no span: zeros),
    padding spans (count 0) among them, and q as a slice of a wider q|k|v buffer (rows at a stride)."""
    g = torch.Generator().manual_seed(heads + head_dim)
    spans = [(2, 1), (3, 0), (5, 300), (305, 17), (0, 0), (330, 44)]
    n = 380
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    got = cpu_kernels.prefill_attention(q, k, v, torch.tensor(spans), 0.125)
    assert got.dtype == dtype and got.shape == (n, heads, head_dim)
    torch.testing.assert_close(got.float(), prefill_reference(q, k, v, spans, 0.125), atol=atol, rtol=atol)
    assert (got[:2] == 0).all() and (got[322:330] == 0).all() and (got[374:] == 0).all()


def test_prefill_attention_refuses_bad_input_by_name() -> None:
    op = torch.ops.torchbridge_serve.prefill_attention.default
    q, kv = torch.zeros(10, 4, 8), torch.zeros(10, 2, 8)
    out = torch.empty(10, 4, 8)
    with pytest.raises(RuntimeError, match=r"prefill_attention: span 1 \(first 3, count 4\) is not inside rows \[5, 10\)"):
        op(out, q, kv, kv, torch.tensor([[0, 5], [3, 4]]), 1.0)  # overlapping spans
    with pytest.raises(RuntimeError, match=r"span 0 \(first 8, count 4\) is not inside rows \[0, 10\)"):
        op(out, q, kv, kv, torch.tensor([[8, 4]]), 1.0)  # past the last row
    with pytest.raises(RuntimeError, match="spans must be int64 \\[S, 2\\]"):
        op(out, q, kv, kv, torch.tensor([[0, 5]], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="query heads a multiple of kv_heads"):
        op(out, q, torch.zeros(10, 3, 8), torch.zeros(10, 3, 8), torch.tensor([[0, 5]]), 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(out, q, kv.bfloat16(), kv.bfloat16(), torch.tensor([[0, 5]]), 1.0)


# ---- RMSNorm and rotary (serve/csrc/pointwise.cpp) against Hugging Face's own modules ----------------
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
       torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 16), (1, 200)])
def test_rms_norm_matches_transformers(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    ref = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(shape[-1], generator=g))
    ref = ref.to(dtype)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(cpu_kernels.rms_norm(x, ref.weight, 1e-5), ref(x), **TOL[dtype])
        total = x + r
        normed, summed = cpu_kernels.add_rms_norm(x, r.clone(), ref.weight, 1e-5)
        assert torch.equal(summed, total)
        torch.testing.assert_close(normed, ref(total), **TOL[dtype])
        # a strided input (a slice of a wider row) is normalised the same
        wide = torch.cat([x, x], dim=-1)
        torch.testing.assert_close(cpu_kernels.rms_norm(wide[..., : shape[-1]], ref.weight, 1e-5), ref(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_rotary_matches_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads, d = 6, 4, 2, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)  # q and k are views of it
    q = qkv[:, : heads * d].reshape(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(n, kv_heads, d)
    angles = torch.rand(n, d // 2, generator=g) * 50
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    got_q, got_k = cpu_kernels.rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), **TOL[dtype])
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # the values beside them untouched


def swiglu_kernel(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=gate.dtype)
    torch.ops.torchbridge_serve.swiglu.default(out, gate, up)
    return out


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows,width", [(1, 1408), (32, 1408), (5, 37), (3, 5), (17, 37)])
def test_swiglu_matches_eager_silu_times_up(dtype: torch.dtype, rows: int, width: int) -> None:
    """On the halves of one gate|up buffer, as the fused projection gives them (rows strided); widths that
    leave a tail past the 16-lane loop, and values far out on both sides of silu."""
    g = torch.Generator().manual_seed(rows * 10 + width)
    gate_up = 4 * torch.randn(rows, 2 * width, generator=g)
    gate_up[0, :3] = torch.tensor([-90.0, 90.0, 0.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = swiglu_kernel(gate, up)  # (cpu_kernels.swiglu leaves fewer than SWIGLU_MIN_ROWS rows to the eager ops)
    torch.testing.assert_close(cpu_kernels.swiglu(gate, up), got, **TOL[dtype])
    eager = F.silu(gate) * up
    torch.testing.assert_close(got, eager, **TOL[dtype])
    # no less accurate than the eager ops, against float64
    exact = F.silu(gate.double()) * up.double()
    assert (got.double() - exact).abs().max() <= (eager.double() - exact).abs().max() * 1.01 + 1e-30
    # separate tensors, and a NaN in gate, alike
    gate2, up2 = gate.clone(), up.clone()
    gate2[-1, -1] = float("nan")
    got2 = swiglu_kernel(gate2, up2)
    assert torch.isnan(got2[-1, -1])
    torch.testing.assert_close(got2.flatten()[:-1], (F.silu(gate2) * up2).flatten()[:-1], **TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_rotary_into_cache_writes_the_rotated_keys_and_values(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(11)
    n, heads, kv_heads, d, blocks, block_size = 7, 4, 2, 32, 6, 4
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)  # q, k, v are views of it
    q, k, v = (t.reshape(n, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    angles = torch.rand(n, d // 2, generator=g) * 50
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)
    k_cache = torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    k_before, v_before, v_rows = k_cache.clone(), v_cache.clone(), v.clone()
    got_q, got_k = cpu_kernels.rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    assert torch.equal(flat_k[slots], got_k) and torch.equal(flat_v[slots], v_rows)
    others = torch.ones(blocks * block_size, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat_k[others], k_before.view(-1, kv_heads, d)[others])
    assert torch.equal(flat_v[others], v_before.view(-1, kv_heads, d)[others])
    # a slot past the cache is refused by name before anything is written
    k_before, q_before = k_cache.clone(), q.clone()
    bad = slots.clone()
    bad[-1] = blocks * block_size
    with pytest.raises(RuntimeError, match="rotary_into_cache: token 6's slot 24 is outside the cache's 24 slots"):
        cpu_kernels.rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, bad)
    assert torch.equal(k_cache, k_before) and torch.equal(q, q_before)


def test_decode_attention_takes_rows_of_a_wider_buffer() -> None:
    """q as the step's q|k|v product gives it (each row's heads contiguous, rows strided): the same result."""
    g = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, d, block_size = 5, 4, 2, 32, 16
    k_cache = torch.randn(12, block_size, kv_heads, d, generator=g)
    v_cache = torch.randn(12, block_size, kv_heads, d, generator=g)
    tables = torch.randperm(12, generator=g)[: rows * 2].view(rows, 2)
    lens = torch.tensor([1, 17, 32, 9, 25])
    wide = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    q = wide[:, : heads * d].view(rows, heads, d)
    assert not q.is_contiguous()
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    assert torch.equal(got, cpu_kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, 0.2))
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, 0.2, None), atol=1e-5, rtol=1e-5)


def test_pointwise_bad_input_is_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="rms_norm: .*must share dtype"):
        cpu_kernels.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x must be contiguous"):
        cpu_kernels.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="rotary: q must be"):
        cpu_kernels.rotary(torch.zeros(2, 3, 7), torch.zeros(2, 1, 7), torch.zeros(2, 7), torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="swiglu: gate and up must be"):
        cpu_kernels.swiglu(torch.zeros(20, 8), torch.zeros(20, 4))
    with pytest.raises(RuntimeError, match="rotary_into_cache: slots must be"):
        cpu_kernels.rotary_into_cache(torch.zeros(2, 2, 8), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8),
                                      torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(3, 4, 1, 8),
                                      torch.zeros(3, 4, 1, 8), torch.zeros(3, dtype=torch.long))


def test_without_a_compiler_the_engine_runs_the_plain_ops(tmp_path, monkeypatch) -> None:
    """A machine where the build fails (no compiler): available() says why, the engine warns and serves
    through the workspace and torch's own ops, still token for token equal to Hugging Face."""
    from serve_support import hf_greedy, mixed_prompts, save_model

    from torchbridge.serve import LLM, SamplingParams

    def no_compiler() -> None:
        raise RuntimeError("Error building extension 'torchbridge_serve_cpu'\nc++: error: command not found")

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "_load", no_compiler)
    assert "c++: error: command not found" in cpu_kernels.available()
    model_dir = save_model(tmp_path, "qwen3", None, seed=4)
    llm = LLM(str(model_dir), block_size=4, num_blocks=128, max_model_len=96)
    runner = llm.engine.runner
    assert not runner.decode_kernel and runner.workspace is not None
    assert not any(getattr(m, "cpu", None) is True for m in runner.model.modules())  # (nn.Module.cpu is a method)
    prompts = mixed_prompts(3, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, 5) for p in prompts]


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 4096), (32, 4096), (5, 32000), (2, 128256)])
def test_row_argmax_equals_torch_max(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    best, index = cpu_kernels.row_argmax(logits)
    ref_best, ref_index = logits.max(dim=-1)
    assert torch.equal(index, ref_index) and torch.equal(best, ref_best)


def test_row_argmax_ties_infinities_and_nan_as_torch_max() -> None:
    """torch.max's rules: the first of tied maxima, NaN propagated at its first position, -inf rows at 0."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 50), generator=g).float()  # many tied maxima per row
    logits[1] = float("-inf")
    logits[2, 7] = float("nan")
    logits[2, 30] = float("nan")
    logits[3, 40] = float("inf")
    logits[4, :] = float("nan")
    logits[5, 10] = float("-inf")
    best, index = cpu_kernels.row_argmax(logits)
    ref_best, ref_index = logits.max(dim=-1)
    assert torch.equal(index, ref_index)
    assert torch.allclose(best, ref_best, equal_nan=True)
    assert int(index[2]) == 7 and bool(best[2].isnan()) and int(index[1]) == 0


def test_row_argmax_of_a_strided_view_and_bad_input() -> None:
    logits = torch.randn(4096, 6)
    best, index = cpu_kernels.row_argmax(logits.t())  # not contiguous: made so first
    ref_best, ref_index = logits.t().max(dim=-1)
    assert torch.equal(index, ref_index) and torch.equal(best, ref_best)
    with pytest.raises(RuntimeError, match="row_argmax: logits must be contiguous float32"):
        cpu_kernels.row_argmax(torch.randn(4, 8).double())
    with pytest.raises(RuntimeError, match="no columns"):
        cpu_kernels.row_argmax(torch.randn(4, 0))
