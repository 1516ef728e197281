"""A kernel of the library as a MindSpore AOT Custom op: `aot` for one kernel, `differentiable` for a kernel
whose backward is the library's kernel of the same name + "Grad", `in_place` for a kernel that writes some of
its inputs, each declared in a line or two."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops
from mindspore.ops import signature as sig

from msllm.kernels.build import library


def same_as_first(*shapes_or_dtypes):
    return shapes_or_dtypes[0]


def one_float(*_):
    """The shape of a kernel's [1] status output (kernels that write their inputs in place)."""
    return [1]


def float32(*_):
    return ms.float32


def output_grad(out, dout):
    """What a backward kernel reads after the inputs by default: the gradient of the one output."""
    return (dout,)


def aot(name: str, out_shape=same_as_first, out_dtype=same_as_first, bprop=None,
        shape_by: dict | None = None):
    """The kernel `name` of the library as a MindSpore op; out_shape / out_dtype map the inputs' shapes /
    dtypes to the output's (a tuple of them for several outputs). shape_by: the Python values out_shape reads
    besides the inputs' shapes, made the op's attributes: PyNative caches an op's output shape by its name,
    attributes and input shapes, so a value known only to out_shape would give another instance's shape."""
    op = ops.Custom(f"{library()}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot", bprop=bprop)
    for key, value in (shape_by or {}).items():
        op.add_prim_attr(key, value)
    return op


def in_place(name: str, inputs: str, written: str, out_shape=one_float, out_dtype=float32, ints: str = ""):
    """The kernel `name`, whose inputs are named by `inputs` (space-separated), writing those named in `written`
    (Parameters) in place. Marked so, as AdamWUpdate its parameters, MindSpore orders it after the reads of their
    old values and before those of the new. `ints`: the integer inputs (the rest are one float dtype)."""
    op = aot(name, out_shape, out_dtype)
    writes, integer = set(written.split()), set(ints.split())
    op.__mindspore_signature__ = tuple(
        sig.make_sig(n, sig.sig_rw.RW_WRITE if n in writes else sig.sig_rw.RW_READ,
                     dtype=sig.sig_dtype.T1 if n in integer else sig.sig_dtype.T) for n in inputs.split())
    op.add_prim_attr("side_effect_mem", True)
    return op


def differentiable(name: str, inputs: str, out_shape=same_as_first, out_dtype=same_as_first, *, constant: str = "",
                   reads=output_grad, grad_dtype=None, shape_by: dict | None = None):
    """The kernel `name`, whose inputs are named by `inputs` (space-separated), with the kernel `name`Grad as
    its backward: called with all the inputs then `reads(out, dout)` (the forward outputs and output
    gradients it needs), it returns the gradient of each input not named in `constant`, in order, shaped
    (and, unless `grad_dtype` maps the dtypes, typed) as that input. The constant inputs (int segments,
    fixed scalars) get zeros. shape_by: as aot's. `reads` is compiled into the graph from its source: a def
    (a lambda inside a call that spans lines does not parse)."""
    names, fixed = inputs.split(), set(constant.split())
    learned = [i for i, input_name in enumerate(names) if input_name not in fixed]
    # Where each input's gradient comes from: the grad kernel's output number, or None for zeros.
    source = tuple(learned.index(i) if i in learned else None for i in range(len(names)))

    def like_learned(*shapes_or_dtypes):
        return tuple(shapes_or_dtypes[i] for i in learned)

    grad = aot(f"{name}Grad", like_learned, grad_dtype or like_learned)

    def take(grads, i, x):
        """Input i's gradient: its output of the grad kernel, or zeros for a constant input."""
        return ops.zeros_like(x) if source[i] is None else grads[source[i]]

    # Without constant inputs the grad kernel's outputs are the gradients as they are.
    return aot(name, out_shape, out_dtype, bprop_of(len(names), grad, reads, take if fixed else None), shape_by)


def bprop_of(count: int, grad, reads, take=None):
    """The bprop of an op of `count` inputs: g = grad(*inputs, *reads(out, dout)), then (unless take is
    None) take(g, i, input i) for each input. MindSpore reads a bprop's parameters (no *args), as its own
    custom-op autodiff does, and compiles a loop or comprehension over the inputs ~0.5 s slower than these
    unrolled lines."""
    if count == 2:
        def bprop(x0, x1, out, dout):
            g = grad(x0, x1, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1))
    elif count == 3:
        def bprop(x0, x1, x2, out, dout):
            g = grad(x0, x1, x2, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1), take(g, 2, x2))
    elif count == 4:
        def bprop(x0, x1, x2, x3, out, dout):
            g = grad(x0, x1, x2, x3, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1), take(g, 2, x2), take(g, 3, x3))
    elif count == 5:
        def bprop(x0, x1, x2, x3, x4, out, dout):
            g = grad(x0, x1, x2, x3, x4, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1), take(g, 2, x2), take(g, 3, x3),
                                           take(g, 4, x4))
    elif count == 6:
        def bprop(x0, x1, x2, x3, x4, x5, out, dout):
            g = grad(x0, x1, x2, x3, x4, x5, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1), take(g, 2, x2), take(g, 3, x3),
                                           take(g, 4, x4), take(g, 5, x5))
    elif count == 7:
        def bprop(x0, x1, x2, x3, x4, x5, x6, out, dout):
            g = grad(x0, x1, x2, x3, x4, x5, x6, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1), take(g, 2, x2), take(g, 3, x3),
                                           take(g, 4, x4), take(g, 5, x5), take(g, 6, x6))
    elif count == 8:
        def bprop(x0, x1, x2, x3, x4, x5, x6, x7, out, dout):
            g = grad(x0, x1, x2, x3, x4, x5, x6, x7, *reads(out, dout))
            return g if take is None else (take(g, 0, x0), take(g, 1, x1), take(g, 2, x2), take(g, 3, x3),
                                           take(g, 4, x4), take(g, 5, x5), take(g, 6, x6), take(g, 7, x7))
    else:
        raise ValueError(f"a differentiable kernel takes 2 to 8 inputs, not {count}: add its bprop signature here")
    return bprop
