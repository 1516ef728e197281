"""The ONNX form of a Gated DeltaNet layer (msllm/models/mixers/gated_deltanet.py), emitted on a
graph_opt.onnx_decoder graph: the same projections, the depthwise causal conv as one grouped Conv
over [conv window, new inputs], and the gated delta rule in its recurrent form, an ONNX Scan over
the tokens that carries the state [b, value heads, d_k, d_v]. The state and the conv window enter
as inputs and leave updated, so the graph prefills and decodes like the KV cache does. The
chunked form msllm trains with would need a Loop over a sequence-dependent number of padded chunks;
the recurrent form is the same rule token by token (equal within fp32 reordering), at one
sequential step per prompt token. The rule runs in fp32 whatever the export dtype, as in msllm.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from msllm.models.mixers.gated_deltanet import L2_EPS

FLOAT = ir.DataType.FLOAT
INT64_MAX = np.iinfo(np.int64).max


def delta_rule_step(nv: int, dk: int, dv: int, name: str) -> ir.Graph:
    """The Scan body, one token: (state [b, nv, dk, dv]; q [b, nv, 1, dk] (scaled), k [b, nv, dk, 1],
    v [b, nv, 1, dv], decay exp(g) and beta [b, nv, 1, 1]) -> (the state decayed and corrected toward v,
    the read of it by q [b, nv, 1, dv])."""
    tape = ir.tape.Tape()
    state = ir.val(f"{name}_state", FLOAT, ["batch", nv, dk, dv])
    q, k, v = (ir.val(f"{name}_{x}", FLOAT, ["batch", nv, *shape])
               for x, shape in (("q", (1, dk)), ("k", (dk, 1)), ("v", (1, dv))))
    decay, beta = (ir.val(f"{name}_{x}", FLOAT, ["batch", nv, 1, 1]) for x in ("decay", "beta"))
    decayed = tape.op("Mul", [state, decay])
    remembered = tape.op("MatMul", [tape.op("Transpose", [k], attributes={"perm": [0, 1, 3, 2]}), decayed])
    correction = tape.op("Mul", [tape.op("Sub", [v, remembered]), beta])
    new_state = tape.op("Add", [decayed, tape.op("MatMul", [k, correction])])
    out = tape.op("MatMul", [q, new_state])
    for j, node in enumerate(tape.nodes):  # named apart from the outer graph's values (no shadowing)
        node.name, node.outputs[0].name = f"{name}_{node.op_type}_{j}", f"{name}_{j}"
    new_state.name, out.name = f"{name}_new_state", f"{name}_out"
    for value, shape in ((new_state, [dk, dv]), (out, [1, dv])):
        value.dtype, value.shape = FLOAT, ir.Shape(["batch", nv, *shape])
    return ir.Graph([state, q, k, v, decay, beta], [new_state, out], nodes=tape.nodes, name=name)


def gated_deltanet(g, x, w, seq, state, window, real, layer: int):
    """x [b*s, h] (the normed residual stream) -> (out [b*s, h], state after the tokens [b, nv, dk, dv]
    fp32, conv window after them [b, kernel - 1, conv] fp32). state and window: what the tokens before
    these left (fp32); real [b*s, 1]: 1 for a token, 0 for left padding (which then changes neither),
    None without a cache."""
    cfg = g.cfg
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    keys = nk * dk
    channels = 2 * keys + nv * dv
    if real is not None:
        x = g.op("Mul", x, real)
    qkv = g.op("Concat", g.linear(x, w["q"]), g.linear(x, w["k"]), g.linear(x, w["v"]), axis=-1)
    qkv = g.op("Reshape", g.op("Cast", qkv, to=FLOAT), g.shape(-1, seq, channels))
    inputs = g.op("Concat", window, qkv, axis=1)                      # [b, kernel - 1 + s, conv]
    new_window = g.op("Slice", inputs, seq, g.const([INT64_MAX]), g.const([1]))
    weight = g.op("Concat", *(g.param(w[f"conv_{part}.weight"], fp32=True) for part in "qkv"), axis=0)  # one Conv
    conv = g.op("Conv", g.op("Transpose", inputs, perm=[0, 2, 1]), weight, group=channels)
    conv = g.op("Transpose", conv, perm=[0, 2, 1])                    # [b, s, conv]
    conv = g.op("Mul", conv, g.op("Sigmoid", conv))

    def heads(start, n, d, each):
        """conv[..., start:start + n*d] as [b, s, nv, *each] (d features a head), a key head repeated
        for its run of value heads."""
        part = g.op("Reshape", g.part(conv, start, start + n * d), g.shape(0, 0, n, 1, d))
        part = g.op("Expand", part, g.const([1, 1, n, nv // n, 1]))
        return g.op("Reshape", part, g.shape(0, 0, nv, *each))

    def l2_normalised(x):
        total = g.op("ReduceSum", g.op("Mul", x, x), g.const([-1]), keepdims=1)
        return g.op("Div", x, g.op("Sqrt", g.op("Add", total, g.const(L2_EPS, np.float32))))

    q = g.op("Mul", l2_normalised(heads(0, nk, dk, (1, dk))), g.const(dk ** -0.5, np.float32))
    k = g.op("Reshape", l2_normalised(heads(keys, nk, dk, (1, dk))), g.shape(0, 0, nv, dk, 1))
    v = heads(2 * keys, nv, dv, (1, dv))
    per_head = g.shape(-1, seq, nv, 1, 1)
    beta = g.op("Reshape", g.op("Sigmoid", g.op("Cast", g.linear(x, w["beta"]), to=FLOAT)), per_head)
    rate = g.op("Neg", g.op("Exp", g.param(w["A_log"], fp32=True)))
    g_ = g.op("Mul", rate, g.op("Softplus", g.op("Add", g.op("Cast", g.linear(x, w["decay"]), to=FLOAT),
                                                  g.param(w["dt_bias"], fp32=True))))
    decay = g.op("Reshape", g.op("Exp", g_), per_head)
    state, out = g.tape.op_multi_out(
        "Scan", [state, q, k, v, decay, beta], num_outputs=2,
        attributes={"body": delta_rule_step(nv, dk, dv, f"layer{layer}_delta_rule"), "num_scan_inputs": 5,
                    "scan_input_axes": [1] * 5, "scan_output_axes": [1]})  # out [b, s, nv, 1, dv]
    out = g.rms_norm(g.op("Reshape", out, g.shape(-1, dv)), w["attention.norm"], plain=True)
    z = g.op("Reshape", g.op("Cast", g.linear(x, w["z"]), to=FLOAT), g.shape(-1, dv))
    out = g.op("Mul", g.op("Mul", out, z), g.op("Sigmoid", z))
    out = g.op("Cast", g.op("Reshape", out, g.shape(-1, nv * dv)), to=g.dtype)
    return g.linear(out, w["o"]), state, new_window
