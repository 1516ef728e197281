"""tools/profile_step.py and bench_train.py's in-process A/B of msllm.kernels run end to end on a
tiny shape (the W1 tables are in the README)."""
import json
import os
import subprocess
import sys
import types
from collections import Counter

import pytest

from msllm.models import layers
from msllm.models.decoder import build_model
from tests.conftest import REPO

TINY = "hidden=64,ffn=128,vocab=512,seq=32,batch=2,layers=2,heads=4,kv_heads=2"
LAYERS = 2
LINEARS = 7 * LAYERS + 1   # q, k, v, o, gate, up, down per layer, and the output head
NORMS = 2 * LAYERS + 1     # two per layer and the final one
ROPES = 2 * LAYERS         # q and k per layer
# Each Linear runs one MatMul forward and two backward (input and weight gradient). Per layer
# attention runs q k^T and P v forward and dv, dP, dq, dk backward as BatchMatMuls.
MATMULS = 3 * LINEARS
BATCH_MATMULS = 6 * LAYERS


def run_tool(tmp_path, *flags) -> dict:
    proc = subprocess.run([sys.executable, "tools/profile_step.py", "--shape", TINY, "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("profile_*.json")
    return json.loads(path.read_text())


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): a tool check beyond CI's budget")
def test_kernel_profile_counts_one_step(tmp_path):
    r = run_tool(tmp_path, "--steps", "2", "--warmup", "1", "--fused-kernels", "off")
    ops = {o["op"]: o for o in r["ops"]}
    # One MindSpore Adam kernel per trainable parameter per step: checks the per-step normalisation.
    assert ops["Adam"]["kernels_per_step"] == r["trainable_params"] == 2 * 9 + 3
    # The portable RMSNorm is two skinny MatMuls forward ((x*x) @ ones, rsqrt(..) @ weight) and
    # three backward (the constant `ones` gets no gradient); the portable rope one forward (the
    # rotation matrix) and one backward.
    assert ops["MatMul"]["kernels_per_step"] == MATMULS + 5 * NORMS + 2 * ROPES
    assert ops["BatchMatMul"]["kernels_per_step"] == BATCH_MATMULS
    assert ops["MatMul"]["ms_per_step"] > 0  # timed, not only counted


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
    # The fused kernels replace norms and rope entirely, and no matmul of the model.
    assert ops["MatMul"]["kernels_per_step"] == MATMULS
    assert ops["BatchMatMul"]["kernels_per_step"] == BATCH_MATMULS


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): a tool check beyond CI's budget")
def test_threads_report_accounts_for_the_process_cpu(tmp_path):
    r = run_tool(tmp_path, "--threads-report", "--steps", "3", "--warmup", "1")
    threads = {t["thread"]: t for t in r["threads"]}
    assert "ActorThread_0" in threads  # MindSpore's runtime thread launches the step's kernels
    # Each thread's schedstat CPU time is part of the process's CPU time of the same steps (both per step;
    # the report leaves out threads under 0.1 ms a step, and the clocks tick at different granularities).
    threads_cpu = sum(t["cpu_ms_per_step"] for t in r["threads"])
    assert 0.5 * r["process_cpu_ms_per_step"] <= threads_cpu <= 1.2 * r["process_cpu_ms_per_step"] + 1
    assert len(r["wall_ms"]) == 3 and all(t["cpus"] for t in r["threads"])

def profile_step_module():
    sys.path.insert(0, str(REPO / "tools"))
    import profile_step
    return profile_step


def test_gemm_rows_from_onednn_verbose_lines():
    """--gemms' parser on oneDNN 3.10's own lines (captured from a W1 step): matmul `exec` lines grouped by
    layouts and dims, other lines skipped, times per call and per step, FLOPs with the batch."""
    src = "src:f32::blocked:{} wei:f32::blocked:{} dst:f32::blocked:{}"
    line = "onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:f32,undef,{},,,{},{}"
    lines = ["onednn_verbose,v1,info,cpu,runtime:threadpool,nthr:2",
             line.format(src.format("ab::f0", "ba::f0", "ab::f0"), "1024x512:512x512", "7.75415"),
             line.format(src.format("ab::f0", "ba::f0", "ab::f0"), "1024x512:512x512", "5.95386"),
             line.format(src.format("ba::f0", "ab::f0", "ab::f0"), "512x1024:1024x512", "5.5"),
             line.format(src.format("abc::f0", "acb::f0", "abc::f0"), "32x256x64:32x64x256", "2.28589"),
             line.replace("matmul", "reorder").format(src.format("ab::f0", "ba::f0", "ab::f0"), "4x4", "0.1")]
    rows = {(r["dims"], r["layouts"]): r for r in profile_step_module().gemm_rows(lines, steps=2)}
    assert set(rows) == {("1024x512:512x512", "ab ba"), ("512x1024:1024x512", "ba ab"),
                         ("32x256x64:32x64x256", "abc acb")}
    forward = rows["1024x512:512x512", "ab ba"]
    assert forward["calls_per_step"] == 1 and forward["ms_per_step"] == pytest.approx((7.75415 + 5.95386) / 2)
    assert forward["gflops"] == pytest.approx(2 * 1024 * 512 * 512 / 6.854005e-3 / 1e9)
    assert rows["32x256x64:32x64x256", "abc acb"]["gflops"] == pytest.approx(2 * 32 * 256 * 64 * 256 / 2.28589e-3 / 1e9)
    assert rows["512x1024:1024x512", "ba ab"]["calls_per_step"] == 0.5


def test_workers_profile_the_parents_family_and_shape():
    """--gemms and --compile run their worker on the model the parent was asked for: its family and shape
    (the compile worker once dropped --family and so compiled the Llama shape for any family)."""
    tool = profile_step_module()
    args = types.SimpleNamespace(workload="W1", family="qwen3_5", threads=2, steps=3, warmup=1, fused_kernels="auto",
                                 block_graph="inlined")
    for flag in ("--gemms-worker", "--compile-worker"):
        cmd = tool.worker_command(flag, {"hidden": 64, "layers": 2}, args)
        assert cmd[2] == flag
        given = dict(zip(cmd[3::2], cmd[4::2]))
        assert given == {"--workload": "W1", "--family": "qwen3_5", "--threads": "2", "--steps": "3", "--warmup": "1",
                         "--fused-kernels": "auto", "--block-graph": "inlined", "--shape": "hidden=64,layers=2"}


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): a tool check beyond CI's budget")
def test_gemm_profile_sees_every_matmul_of_the_step(tmp_path):
    r = run_tool(tmp_path, "--gemms", "--steps", "2", "--warmup", "1")
    calls = Counter()
    for g in r["gemms"]:
        calls["batched" if g["dims"].count("x") == 4 else "2-d"] += g["calls_per_step"]
    assert calls == {"2-d": MATMULS, "batched": BATCH_MATMULS}  # every MatMul and BatchMatMul goes to oneDNN
    assert r["gemm_ms_per_step"] == pytest.approx(sum(g["ms_per_step"] for g in r["gemms"]))


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): a tool check beyond CI's budget")
def test_compile_profile_splits_the_compile(tmp_path):
    r = run_tool(tmp_path / "shared", "--compile", "--block-graph", "shared")
    # MindSpore's phases nest: the backend phases inside the backend compile, which is part of the
    # graph compile, which is part of the compile the worker timed around step.compile().
    phases = r["backend_phases_s"]
    assert set(phases) == {"ConstructKernelGraph", "OptimizeGraph", "CreateKernel", "CreateDeviceAddress",
                           "GraphScheduler"}
    assert 0 < sum(phases.values()) <= r["backend_s"] * 1.001
    assert 0 < r["backend_s"] < r["graph_compile_s"] <= r["compile_s"] * 1.05
    # The blocks stay sub-graph calls (their own kernel graphs) unless inlining is asked for; inlined,
    # the step is 3 kernel graphs (the tool's comment).
    inlined = run_tool(tmp_path / "inlined", "--compile", "--block-graph", "inlined")
    assert r["kernel_graphs"] > inlined["kernel_graphs"] == 3


def bench_train():
    sys.path.insert(0, str(REPO / "tools"))
    import bench_train
    return bench_train


def test_ab_alternates_both_steps(monkeypatch):
    """ab_compare builds both sides, warms each up, alternates which runs first each round and
    reports each side's median step time. Fake steps on a fake clock: the "on" step takes 1 s,
    the "off" step 3 s, except one 100 s outlier each, which the median must ignore."""
    bench = bench_train()
    clock, calls = [0.0], []

    class FakeStep:
        def __init__(self, value, seconds):
            self.value, self.seconds = value, seconds

        def __call__(self, batch):
            calls.append(self.value)
            clock[0] += 100.0 if len(calls) in (8, 11) else self.seconds  # the 2nd timed step of each side
            return [types.SimpleNamespace(asnumpy=lambda: None)]

    def fake_train_step(w, threads, family, fused_kernels):
        assert family == "llama"  # the workload's family reaches both sides
        return FakeStep(fused_kernels, {"auto": 1.0, "off": 3.0}[fused_kernels]), "batch"

    monkeypatch.setattr(bench, "msllm_train_step", fake_train_step)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    r = bench.ab_compare({}, "fused-kernels", rounds=2, steps_per_round=3)
    # 3 warm-up steps each, then round 0: on, off; round 1: off, on (3 steps per side and round).
    assert calls == ["auto"] * 3 + ["off"] * 3 + ["auto"] * 3 + ["off"] * 3 + ["off"] * 3 + ["auto"] * 3
    assert (r["on_step_s"], r["off_step_s"], r["speedup"], r["steps_each"]) == (1.0, 3.0, 3.0, 6)


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): a tool check beyond CI's budget")
def test_ab_runs_the_real_steps():
    tiny = dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32, batch=2)
    r = bench_train().ab_compare(tiny, "fused-kernels", rounds=2, steps_per_round=2)
    assert r["steps_each"] == 4
    assert 0 < r["on_step_s"] < 10 and 0 < r["off_step_s"] < 10  # tiny steps: milliseconds, not a hang


def test_sched_placement_counts_wakeups_and_who_waited_behind_whom():
    """tools/sched_placement.py on a hand-written `perf script` trace: the pool worker woken once on its
    caller's CPU (preempting it for 2 ms) and once on the kernel thread's (preempting that one for 3 ms)."""
    sys.path.insert(0, str(REPO / "tools"))
    import sched_placement

    def switch(cpu, t, prev, prev_tid, state, nxt, next_tid):
        return (f"{prev} {prev_tid} [{cpu:03d}] {t:.6f}: sched:sched_switch: prev_comm={prev} prev_pid={prev_tid} "
                f"prev_prio=120 prev_state={state} ==> next_comm={nxt} next_pid={next_tid} next_prio=120")

    def wakeup(cpu, t, target):
        return f"X 1 [{cpu:03d}] {t:.6f}: sched:sched_wakeup: comm=msllm_pool_1 pid=12 prio=120 target_cpu={target:03d}"

    trace = [switch(1, 1.000, "swapper/1", 0, "R", "ActorThread_0", 10),
             switch(0, 1.000, "swapper/0", 0, "R", "KernelThread_0", 11),
             wakeup(1, 1.010, 1), switch(1, 1.010, "ActorThread_0", 10, "R", "msllm_pool_1", 12),
             switch(1, 1.012, "msllm_pool_1", 12, "S", "ActorThread_0", 10),
             wakeup(1, 1.020, 0), switch(0, 1.020, "KernelThread_0", 11, "R", "msllm_pool_1", 12),
             switch(0, 1.023, "msllm_pool_1", 12, "S", "KernelThread_0", 11),
             switch(0, 1.030, "KernelThread_0", 11, "S", "swapper/0", 0)]
    r = sched_placement.placement(trace)
    assert r["worker_wakeups"] == {"on the caller's CPU": 1, "elsewhere": 1}
    assert r["shared_s"].keys() == {("msllm_pool_1", "ActorThread_0"), ("msllm_pool_1", "KernelThread_0")}
    assert r["shared_s"][("msllm_pool_1", "ActorThread_0")] == pytest.approx(0.002)
    assert r["shared_s"][("msllm_pool_1", "KernelThread_0")] == pytest.approx(0.003)
    assert r["ran_s"]["msllm_pool_1"] == pytest.approx(0.005)
    assert r["ran_s"]["KernelThread_0"] == pytest.approx(0.027)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_gemm_floor_lists_every_linear_of_the_w1_model(family):
    """tools/bench_gemm.py --step times a W1 step's GEMMs from its own table: that table must be the model's
    Linears (plus the head, tied or not), or the floor it reports is another model's."""
    bench = bench_train()
    import bench_gemm  # tools/, on the path bench_train() put it on
    model = build_model(bench.model_config(dict(bench.WORKLOADS["W1"]), family))
    linears = Counter(tuple(cell.weight.shape[::-1]) for _, cell in model.cells_and_names()
                      if isinstance(cell, layers.Linear))
    if model.output is None:
        linears[tuple(model.tok_embeddings.weight.shape[::-1])] += 1
    table = Counter()
    for d_in, d_out, count in bench_gemm.STEP_LINEARS[family]:
        table[d_in, d_out] += count
    assert table == linears
    attention_layers = sum(1 for _, cell in model.cells_and_names() if isinstance(cell, layers.AttentionCore))
    assert bench_gemm.STEP_ATTENTION_LAYERS[family] == attention_layers


def test_the_gemm_floor_calls_the_linears_by_one_library_the_faster():
    """--step's floor pass calls every Linear GEMM by the library that sums less a step, never a mix (torch's
    threads spin after its calls and slow the sgemm calls after them); attention stays torch's."""
    bench_train()
    import bench_gemm

    def gemm(what, count, best):  # as step_gemms builds them: each by its first library
        return bench_gemm.StepGemm(what, "", count, {name: None for name in best}, best, next(iter(best)), 0.0)
    attention = gemm("attention", 6, {"torch": 1.0})
    # sgemm faster on the bigger GEMM, torch on the smaller: sgemm sums 3 * 2 + 10 * 1 = 16, torch 3 * 1 + 10 * 2 = 23
    avx2 = bench_gemm.by_faster_library([attention, gemm("small", 3, {"sgemm": 2.0, "torch": 1.0}),
                                         gemm("big", 10, {"sgemm": 1.0, "torch": 2.0})])
    assert [g.floor_by for g in avx2] == ["torch", "sgemm", "sgemm"]
    wide = bench_gemm.by_faster_library([attention, gemm("small", 3, {"sgemm": 2.0, "torch": 1.0}),
                                         gemm("big", 10, {"sgemm": 2.0, "torch": 1.5})])
    assert [g.floor_by for g in wide] == ["torch", "torch", "torch"]
