"""tools/profile_step.py and bench_train.py's in-process A/B of msllm.kernels run end to end on a
tiny shape (the W1 tables are in the README)."""
import json
import subprocess
import sys

from tests.conftest import REPO

TINY = "hidden=64,ffn=128,vocab=512,seq=32,batch=2,layers=2,heads=4,kv_heads=2"


def run_tool(tmp_path, *flags) -> dict:
    proc = subprocess.run([sys.executable, "tools/profile_step.py", "--shape", TINY, "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("profile_*.json")
    return json.loads(path.read_text())


def test_kernel_profile_counts_one_step(tmp_path):
    r = run_tool(tmp_path, "--steps", "2", "--warmup", "1", "--fused-kernels", "off")
    ops = {o["op"]: o for o in r["ops"]}
    # One MindSpore Adam kernel per trainable parameter per step: checks the per-step normalisation.
    assert ops["Adam"]["kernels_per_step"] == r["trainable_params"] == 2 * 9 + 3
    assert ops["MatMul"]["kernels_per_step"] > 0 and ops["MatMul"]["ms_per_step"] > 0
    assert r["wall_ms_per_step"] > 0


def test_kernel_profile_with_fused_kernels(tmp_path):
    r = run_tool(tmp_path, "--steps", "2", "--warmup", "1")
    ops = {o["op"]: o for o in r["ops"]}
    assert "Adam" not in ops
    # Per step: one AdamW and one sum-of-squares call for all 21 parameters, RMSNorm forward +
    # backward for 5 norms; for each of 2 layers SwiGLU, attention softmax and q and k rope,
    # forward + backward.
    assert r["trainable_params"] == 21
    assert ops["Custom"]["kernels_per_step"] == 2 + 2 * 5 + 2 * (2 + 2 + 4)
    assert "Softmax" not in ops and "BroadcastTo" not in ops  # tables are read per row, not broadcast


def test_compile_profile_splits_the_compile(tmp_path):
    r = run_tool(tmp_path / "shared", "--compile", "--block-graph", "shared")
    assert r["frontend_s"] > 0 and r["backend_s"] > 0
    assert r["backend_phases_s"]["CreateKernel"] > 0
    # The phases MindSpore reports belong to the compile the worker timed around step.compile().
    assert r["graph_compile_s"] <= r["compile_s"] * 1.05
    # The blocks stay sub-graph calls (their own kernel graphs) unless inlining is asked for.
    inlined = run_tool(tmp_path / "inlined", "--compile", "--block-graph", "inlined")
    assert r["kernel_graphs"] > inlined["kernel_graphs"] >= 1


def test_ab_alternates_both_steps():
    sys.path.insert(0, str(REPO / "tools"))
    from bench_train import ab_compare

    tiny = dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32, batch=2)
    r = ab_compare(tiny, "fused-kernels", rounds=2, steps_per_round=2)
    assert r["steps_each"] == 4
    assert r["on_step_s"] > 0 and r["off_step_s"] > 0
    assert abs(r["speedup"] - r["off_step_s"] / r["on_step_s"]) < 1e-9
