"""Every shipped Pallas kernel lowers for TPU without a TPU: `jax.export(..., platforms=["tpu"])`
runs Mosaic's lowering on this host, so a kernel a real chip would reject at lowering fails here.
Shapes are the engine's (bf16, head_dim 128, 16-token blocks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from torchbridge.kernels import paged_attention, rms_norm, rotary, swiglu

BF16 = jnp.bfloat16
KERNELS = {
    "rms_norm": (lambda x, w: rms_norm.rms_norm_pallas(x, w, eps=1e-6), [(300, 1024), (1024,)]),
    "add_rms_norm": (lambda x, r, w: rms_norm.add_rms_norm_pallas(x, r, w, eps=1e-6), [(300, 1024), (300, 1024), (1024,)]),
    "rotary": (rotary.rotary_pallas, [(300, 8, 128), (300, 2, 128), (300, 128), (300, 128)]),
    "swiglu": (swiglu.swiglu_pallas, [(300, 2816), (300, 2816)]),
    "paged_attention": (lambda q, k, v, t, n: paged_attention.paged_attention_pallas(q, k, v, t, n, scale=0.088),
                        [(8, 8, 128), (64, 16, 2, 128), (64, 16, 2, 128), ((8, 4), jnp.int32), ((8,), jnp.int32)]),
}


def _args(specs: list) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(*s) if isinstance(s[0], tuple) else jax.ShapeDtypeStruct(s, BF16) for s in specs]


def _tpu_module(fn, args) -> str:
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_shipped_pallas_kernel_lowers_to_a_mosaic_call(name: str):
    fn, specs = KERNELS[name]
    assert "tpu_custom_call" in _tpu_module(fn, _args(specs))


def test_the_export_check_catches_a_kernel_mosaic_rejects():
    """A block shape TPU cannot tile (last dims neither (8, 128)-aligned nor whole) fails here."""
    def bad(x):
        spec = pl.BlockSpec((3, 100), lambda i: (i, 0))
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,), in_specs=[spec],
                              out_specs=spec)(x)

    with pytest.raises(Exception, match="divisible by 8 and 128"):
        _tpu_module(bad, [jax.ShapeDtypeStruct((6, 200), BF16)])


def test_auto_traces_only_the_branch_of_the_platform_it_is_traced_for():
    """The bridge's lowerings trace kernels for the runtime's platform (tiling.tracing_for): "auto" then
    traces one branch (the Pallas one on TPU only). Outside that (a jax.export for other platforms),
    the choice is left to lowering and both branches are traced."""
    from torchbridge.kernels import tiling

    x, w = jnp.ones((16, 128), BF16), jnp.ones((128,), BF16)

    def traced(platform):
        def fn(a, b):  # what the shipped rms_norm kernel's JAX function does; a new one each time, since
            # JAX caches a function's trace and the platform is not part of its key (fixed per process)
            return tiling.choose("auto", rms_norm.rms_norm_pallas, rms_norm.rms_norm_reference, a, b, eps=1e-6)

        with tiling.tracing_for(platform):
            return str(jax.make_jaxpr(fn)(x, w)), _tpu_module(fn, [x, w]) if platform != "cpu" else ""

    cpu_jaxpr, _ = traced("cpu")
    assert "pallas_call" not in cpu_jaxpr and "platform_index" not in cpu_jaxpr
    tpu_jaxpr, tpu_module = traced("tpu")
    assert "pallas_call" in tpu_jaxpr and "platform_index" not in tpu_jaxpr and "tpu_custom_call" in tpu_module
    both, exported = traced(None)
    assert "pallas_call" in both and "platform_index" in both and "tpu_custom_call" in exported
