"""A kernel of the library as a MindSpore AOT Custom op: `aot` for one kernel, `differentiable` for a kernel
whose backward is the library's kernel of the same name + "Grad", declared in a line or two."""
from __future__ import annotations

from mindspore import ops

from msllm.kernels.build import library


def same_as_first(*shapes_or_dtypes):
    return shapes_or_dtypes[0]


def output_grad(out, dout):
    """What a backward kernel reads after the inputs by default: the gradient of the one output."""
    return (dout,)


def aot(name: str, out_shape=same_as_first, out_dtype=same_as_first, bprop=None):
    """The kernel `name` of the library as a MindSpore op; out_shape / out_dtype map the inputs' shapes /
    dtypes to the output's (a tuple of them for several outputs)."""
    return ops.Custom(f"{library()}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot",
                      bprop=bprop)


def differentiable(name: str, inputs: str, out_shape=same_as_first, out_dtype=same_as_first, *, constant: str = "",
                   reads=output_grad, grad_dtype=None):
    """The kernel `name`, whose inputs are named by `inputs` (space-separated), with the kernel `name`Grad as
    its backward: called with all the inputs then `reads(out, dout)` (the forward outputs and output
    gradients it needs), it returns the gradient of each input not named in `constant`, in order, shaped
    (and, unless `grad_dtype` maps the dtypes, typed) as that input. The constant inputs (int segments,
    fixed scalars) get zeros."""
    names, fixed = inputs.split(), set(constant.split())
    learned = [i for i, input_name in enumerate(names) if input_name not in fixed]
    # Where each input's gradient comes from: the grad kernel's output number, or None for zeros.
    source = [learned.index(i) if i in learned else None for i in range(len(names))]

    def like_learned(*shapes_or_dtypes):
        return tuple(shapes_or_dtypes[i] for i in learned)

    grad = aot(f"{name}Grad", like_learned, grad_dtype or like_learned)

    def backward(inputs, out, dout):
        grads = grad(*inputs, *reads(out, dout))
        return tuple(ops.zeros_like(inputs[i]) if k is None else grads[k] for i, k in enumerate(source))

    return aot(name, out_shape, out_dtype, bprop_of(len(names), backward))


def bprop_of(count: int, backward):
    """backward(inputs, out, dout) as the bprop of an op of `count` inputs. MindSpore reads a bprop's
    parameters (no *args), so one signature per count, as its own custom-op autodiff does."""
    if count == 2:
        def bprop(x0, x1, out, dout):
            return backward((x0, x1), out, dout)
    elif count == 3:
        def bprop(x0, x1, x2, out, dout):
            return backward((x0, x1, x2), out, dout)
    elif count == 4:
        def bprop(x0, x1, x2, x3, out, dout):
            return backward((x0, x1, x2, x3), out, dout)
    elif count == 5:
        def bprop(x0, x1, x2, x3, x4, out, dout):
            return backward((x0, x1, x2, x3, x4), out, dout)
    elif count == 6:
        def bprop(x0, x1, x2, x3, x4, x5, out, dout):
            return backward((x0, x1, x2, x3, x4, x5), out, dout)
    elif count == 7:
        def bprop(x0, x1, x2, x3, x4, x5, x6, out, dout):
            return backward((x0, x1, x2, x3, x4, x5, x6), out, dout)
    elif count == 8:
        def bprop(x0, x1, x2, x3, x4, x5, x6, x7, out, dout):
            return backward((x0, x1, x2, x3, x4, x5, x6, x7), out, dout)
    else:
        raise ValueError(f"a differentiable kernel takes 2 to 8 inputs, not {count}: add its bprop signature here")
    return bprop
