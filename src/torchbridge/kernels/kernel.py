"""`torchbridge.kernel`: a JAX or Pallas function becomes a torch op, with autograd.

    @torchbridge.kernel("mylib::rmsnorm", mutates_args=(), static_argnames=("eps",))
    def rmsnorm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array: ...
    y = rmsnorm(x_tpu, w_tpu, eps=1e-5)     # torch.ops.mylib.rmsnorm, eager or compiled

The op itself is a JaxOp (jax_op.py). The backward is a second JaxOp, `ns::name_backward`, taking
the output cotangents and the forward's arguments: the user's `register_backward` function, else
`jax.vjp` of `reference=` (the way to differentiate a Pallas kernel, which JAX cannot linearize),
else `jax.vjp` of the kernel itself. Being ops, both run through the device fast path in eager mode
and are traced into the one XLA program of a compiled forward and backward graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as pytree

from torchbridge.kernels.jax_op import JaxOp, KernelError
from torchbridge.kernels.signature import Param, Signature

_below_autograd = torch._C._AutoDispatchBelowAutograd


def _needs_grad(values: Any) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple, dict)) and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(v)):
            return True
    return False


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class Kernel:
    """The object `@torchbridge.kernel` returns: call it like the JAX function, with torch tensors."""

    def __init__(self, qualname: str, fn: Callable[..., Any], *, mutates_args: tuple[str, ...] = (),
                 static_argnames: tuple[str, ...] = (), reference: Callable[..., Any] | None = None,
                 interpret: Any = None) -> None:
        if "::" not in qualname:
            raise ValueError(f"torchbridge.kernel: name '{qualname}' must be 'namespace::name'")
        if qualname.endswith("_"):  # PyTorch reads a trailing underscore as an in-place variant
            raise ValueError(f"torchbridge.kernel: name '{qualname}' must not end in '_' (use mutates_args)")
        self.name = qualname
        self.fn = fn
        self.reference = reference
        self.sig = Signature.of(fn, qualname, tuple(mutates_args), tuple(static_argnames))
        if all(p.kind == "scalar" for p in self.sig.params):  # outputs take the device of an input array
            raise TypeError(f"torchbridge.kernel {qualname}: a kernel needs at least one array argument")
        self._forward = JaxOp(qualname, self.sig, lambda values: self.sig.call(self.fn, values), interpret)
        self.op = self._forward.op
        self._backward_fn: Callable[..., Any] | None = None
        self._backward: JaxOp | None = None
        self._out_specs: dict[Any, Any] = {}
        if not self.sig.mutates:
            bwd_params = (Param("_cotangents", "list", list[torch.Tensor]), *self.sig.params)
            bwd_sig = Signature.build(f"{qualname}_backward", bwd_params, "list", ())
            self._backward = JaxOp(f"{qualname}_backward", bwd_sig, self._vjp, interpret)
            self._forward.op_def.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", qualname)

    def __repr__(self) -> str:
        return f"<torchbridge.kernel {self.name}{self.sig.schema}>"

    # -- calling ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.sig.has_trees:
            args, kwargs = self.sig.flatten_call(args, kwargs)
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
                _needs_grad(args) or (kwargs and _needs_grad(kwargs.values())))):
            res = self.op(*args, **kwargs)
        else:
            with _below_autograd():  # no graph to record: skip PyTorch's Python autograd kernel (~7 us)
                res = self.op(*args, **kwargs)
        if self.sig.result == "tree":
            return pytree.tree_unflatten(list(res), self._out_spec(args, kwargs))
        return res

    @torch.compiler.disable  # plain Python under torch.compile too (a graph break, then the graph goes on)
    def _out_spec(self, args: tuple, kwargs: dict) -> Any:
        """The result's pytree structure, from jax.eval_shape (cached per argument layout), as a
        torch TreeSpec whose leaf order is JAX's (the order the op returns the leaves in)."""
        values = self.sig.bind(args, kwargs)
        leaves, spec = pytree.tree_flatten(values)
        key = (str(spec), tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in leaves))
        found = self._out_specs.get(key)
        if found is None:
            abstract = pytree.tree_map(lambda v: jax.ShapeDtypeStruct(tuple(v.shape), _jax_dtype(v.dtype))
                                       if isinstance(v, torch.Tensor) else v, values)
            out = jax.eval_shape(lambda a: self.sig.split_result(self.sig.call(self.fn, {**abstract, **a}))[0],
                                 {p.name: abstract[p.name] for p in self.sig.params if p.kind != "scalar"})
            found = self._out_specs[key] = pytree.tree_structure(jax.tree.map(lambda _: 0, out))
        return found

    # -- autograd ---------------------------------------------------------------------------------
    def register_backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(cotangent, *args)` -> one gradient per array argument (None for none), each shaped
        like its argument; `cotangent` has the result's structure and the args are the kernel's own
        (JAX arrays and scalars). Replaces the default, jax.vjp of `reference=` or of the kernel."""
        if self._backward is None:
            raise TypeError(f"{self.name}: a kernel that mutates its arguments has no backward")
        self._backward_fn = fn
        return fn

    def _setup_context(self, ctx: Any, inputs: tuple, output: Any) -> None:
        flat, spec = pytree.tree_flatten(list(inputs))
        tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*(flat[i] for i in tensors))
        ctx.kernel_inputs = ([None if i in tensors else v for i, v in enumerate(flat)], tensors, spec)
        outs = output if isinstance(output, (list, tuple)) else [output]
        ctx.kernel_outputs = [(o.shape, o.dtype, o.device) for o in outs]

    def _autograd_backward(self, ctx: Any, *grads: Any) -> tuple:
        flat, tensors, spec = ctx.kernel_inputs
        flat = list(flat)
        for i, t in zip(tensors, ctx.saved_tensors, strict=True):
            flat[i] = t
        inputs = pytree.tree_unflatten(flat, spec)
        cots = [g for gs in grads for g in (gs if isinstance(gs, (list, tuple)) else [gs])]
        cots = [torch.zeros(s, dtype=d, device=dev) if g is None else g
                for g, (s, d, dev) in zip(cots, ctx.kernel_outputs, strict=True)]
        grads_flat = iter(self._backward.op(cots, *inputs))
        out = []
        for v in inputs:
            if isinstance(v, (list, tuple)):
                out.append([next(grads_flat) if _differentiable(t) else None for t in v])
            else:
                out.append(next(grads_flat) if _differentiable(v) else None)
        return tuple(out)

    def _vjp(self, values: dict[str, Any]) -> list:
        """The backward op's JAX side: cotangents of the result -> gradients of the array leaves."""
        fwd = {p.name: values[p.name] for p in self.sig.params}
        primals = self.sig.arrays(fwd)
        target = self.reference or self.fn

        def f(*arrays: Any) -> Any:
            return self.sig.call(target, self.sig.with_arrays(fwd, arrays))

        out_shape = jax.eval_shape(f, *primals)
        cot = jax.tree.unflatten(jax.tree.structure(out_shape),
                                 [c.astype(o.dtype) for c, o in zip(values["_cotangents"], jax.tree.leaves(out_shape),
                                                                     strict=True)])
        if self._backward_fn is not None:
            grads = self._backward_fn(cot, *(fwd[p.name] for p in self.sig.params))
        else:
            try:
                _, vjp = jax.vjp(f, *primals)
                grads = vjp(cot)
            except Exception as e:  # noqa: BLE001 - a Pallas kernel: JAX cannot linearize pallas_call
                raise KernelError(f"{self.name}: cannot differentiate the kernel ({type(e).__name__}: {e}); give a "
                                  f"JAX reference (reference=) or a backward ({self.__name__}.register_backward)") from e
        grads = tuple(grads)
        if len(grads) != len(primals):
            raise KernelError(f"{self.name}: the backward returned {len(grads)} gradients for {len(primals)} "
                              "array arguments")
        out = []
        for primal, grad in zip(primals, grads, strict=True):
            p_leaves = jax.tree.leaves(primal)
            g_leaves = [None] * len(p_leaves) if grad is None else jax.tree.leaves(grad)
            for p, g in zip(p_leaves, g_leaves, strict=True):
                if jnp.issubdtype(p.dtype, jnp.inexact):
                    out.append(jnp.zeros(p.shape, p.dtype) if g is None else g.astype(p.dtype))
        return out


def _jax_dtype(dtype: torch.dtype) -> Any:
    from torchbridge.device import dtypes

    return dtypes.to_jax(dtype)


def kernel(name: str, *, mutates_args: tuple[str, ...] | list[str] = (), static_argnames: tuple[str, ...] | list[str] = (),
           reference: Callable[..., Any] | None = None, interpret: Any = None) -> Callable[[Callable[..., Any]], Kernel]:
    """Register a JAX (jnp or `pl.pallas_call`) function as the torch op `name` ("ns::op").

    mutates_args: array parameters the kernel writes; the function returns their new values as a
        dict (`{name: new}`, or `(result, {name: new})` when it also returns a result); the op
        writes them in place (visible through every view; a large sole-owned buffer is donated).
    static_argnames: scalar parameters whose value is part of the program (a new value compiles
        once, then is cached); other float/int parameters are traced values.
    reference: a JAX function with the same signature, differentiated (jax.vjp) for the backward
        when no `register_backward` is given: the way to train through a Pallas kernel.
    interpret: Pallas interpret mode; default: on where the device is JAX's CPU platform (and
        always in the CPU kernel), off elsewhere (Mosaic on TPU, Triton/Mosaic-GPU on GPU).
    """

    def deco(fn: Callable[..., Any]) -> Kernel:
        return Kernel(name, fn, mutates_args=tuple(mutates_args), static_argnames=tuple(static_argnames),
                      reference=reference, interpret=interpret)

    return deco


__all__ = ["Kernel", "KernelError", "kernel"]
