"""Where an msllm train step's time goes, reproducibly.

Kernel time: runs the train step (GRAPH mode) under MindSpore's profiler and prints, per kernel
type, how many kernels one step launches and their summed time per step, next to the wall time
of the same steps without the profiler.
Threads (--threads-report, Linux): per thread of the process (MindSpore's ActorThread_* and KernelThread_*,
msllm's kernel pool msllm_pool_*, ...) its CPU time and its time runnable but waiting for a CPU per step
(/proc schedstat), its context switches and the CPUs it may run on, next to the step's wall and process
CPU time. These hold on a loaded machine where wall times do not: e.g. a pool thread that waits as long as
it runs shares a CPU with another busy thread.
GEMMs (--gemms): every oneDNN matmul the step runs (MindSpore's CPU MatMul and BatchMatMul), from oneDNN's
own verbose log (ONEDNN_VERBOSE=1 in a worker process): per shape and operand layout (`ba`: stored transposed)
the calls a step makes, ms a call and GFLOP/s. The kernel profile's MatMul row says how long; this says which.
Compile time: compiles the step once with MindSpore's compile statistics switched on
(MS_DEV_RUNTIME_CONF=compile_statistics:True) and splits it into frontend (parse, type
inference, autodiff, graph passes) and backend phases (kernel graph passes, kernel creation,
actor scheduling).

    python tools/profile_step.py                          # W1 kernel profile
    python tools/profile_step.py --compile --layers 32    # W1 shape, 32 layers: compile phases
    python tools/profile_step.py --threads-report         # W1: CPU and run-queue wait of each thread
    python tools/profile_step.py --gemms --family qwen3_5 # W1 hybrid: its GEMMs by shape, ms and GFLOP/s
    python tools/profile_step.py --shape hidden=64,ffn=128,vocab=512,seq=32,batch=2,layers=2

JSON goes to runs/profile/.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_train import WORKLOADS, msllm_train_step  # noqa: E402

PHASE = re.compile(r"\[PROF\](\w+) costs ([0-9.]+) msec")
# Backend phases worth naming; each runs once per kernel graph, so they are summed.
BACKEND_PHASES = ("ConstructKernelGraph", "OptimizeGraph", "CreateKernel", "CreateDeviceAddress", "GraphScheduler")


def workload(args) -> dict:
    w = dict(WORKLOADS[args.workload])
    for item in filter(None, args.shape.split(",")):
        key, _, value = item.partition("=")
        if key not in w:
            raise SystemExit(f"--shape: unknown key {key!r}; known: {', '.join(w)}")
        w[key] = int(value)
    if args.layers:
        w["layers"] = args.layers
    return w


def kernel_profile(w: dict, args) -> dict:
    step, batch = msllm_train_step(w, threads=args.threads, fused_kernels=args.fused_kernels,
                                   block_graph=args.block_graph, family=args.family)
    num_params = len(step.optimizer.params)
    for _ in range(args.warmup):
        step(batch)[0].asnumpy()
    wall = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(batch)[0].asnumpy()
        wall.append(time.perf_counter() - t0)
    ops = kernel_types(lambda: step(batch)[0].asnumpy(), args.steps)
    return {"wall_ms_per_step": statistics.median(wall) * 1e3, "trainable_params": num_params, "ops": ops}


def kernel_types(run, steps: int) -> list[dict]:
    """Under MindSpore's profiler over `steps` calls of run(): per kernel type, the kernels one call launches
    and their summed ms, most time first."""
    from mindspore.profiler import Profiler

    with tempfile.TemporaryDirectory() as tmp:
        profiler = Profiler(output_path=tmp)
        for _ in range(steps):
            run()
        profiler.stop()
        profiler.analyse()
        found = sorted(Path(tmp).rglob("cpu_op_type_info_*.csv"))
        if not found:
            raise SystemExit(f"MindSpore's profiler wrote no cpu_op_type_info_*.csv under {tmp}")
        with open(found[0]) as f:
            rows = list(csv.DictReader(f))
    return sorted(({"op": r["op_type"], "kernels_per_step": int(r["type_occurrences"]) / steps,
                    "ms_per_step": float(r["total_compute_time"]) / steps} for r in rows),
                  key=lambda r: -r["ms_per_step"])


def thread_times() -> dict:
    """tid -> (name, ns on a CPU, ns runnable but waiting, context switches) of this process's threads."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            run_ns, wait_ns, _ = map(int, (task / "schedstat").read_text().split())
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            switches = int(status["voluntary_ctxt_switches"]) + int(status["nonvoluntary_ctxt_switches"])
            out[int(task.name)] = ((task / "comm").read_text().strip(), run_ns, wait_ns, switches)
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return out


def thread_report(w: dict, args) -> dict:
    step, batch = msllm_train_step(w, threads=args.threads, fused_kernels=args.fused_kernels,
                                   block_graph=args.block_graph, family=args.family)
    for _ in range(args.warmup):
        step(batch)[0].asnumpy()
    before, wall, cpu = thread_times(), [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step(batch)[0].asnumpy()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    after = thread_times()
    threads = []
    for tid, (name, run_ns, wait_ns, switches) in after.items():
        _, run0, wait0, switches0 = before.get(tid, (name, 0, 0, 0))
        run_ms = (run_ns - run0) / 1e6 / args.steps
        if run_ms >= 0.1:  # threads that worked during the steps
            threads.append({"thread": name, "tid": tid, "cpu_ms_per_step": run_ms,
                            "wait_ms_per_step": (wait_ns - wait0) / 1e6 / args.steps,
                            "switches_per_step": (switches - switches0) / args.steps,
                            "cpus": sorted(os.sched_getaffinity(tid))})
    return {"wall_ms_per_step": statistics.median(wall) * 1e3, "wall_ms": [x * 1e3 for x in wall],
            "process_cpu_ms_per_step": statistics.median(cpu) * 1e3,
            "threads": sorted(threads, key=lambda t: -t["cpu_ms_per_step"])}


GEMM_MARK = "GEMMS_TIMED"


def gemms_worker(w: dict, args) -> None:
    """Warm up, then mark where the timed steps' oneDNN lines start (the parent reads the ones after)."""
    step, batch = msllm_train_step(w, threads=args.threads, fused_kernels=args.fused_kernels,
                                   block_graph=args.block_graph, family=args.family)
    for _ in range(args.warmup):
        step(batch)[0].asnumpy()
    print(GEMM_MARK, flush=True)
    for _ in range(args.steps):
        step(batch)[0].asnumpy()


def gemm_rows(lines, steps: int) -> list[dict]:
    """oneDNN verbose `exec` lines of matmul primitives -> per (operand layouts, dims): calls per step, ms a
    call, ms per step and GFLOP/s, most time first. dims are oneDNN's "src:weights" ([batch x] M x K : K x N)."""
    found = defaultdict(list)
    for line in lines:
        fields = line.split(",")
        if len(fields) < 12 or fields[3] != "exec" or fields[5] != "matmul":
            continue
        src, wei = (part.split("::")[1].split(":")[-1] for part in fields[8].split()[:2])  # "src:f32::blocked:ba::f0"
        found[(fields[6], src, wei, fields[-2])].append(float(fields[-1]))
    rows = []
    for (impl, src, wei, dims), ms in found.items():
        a, b = (list(map(int, d.split("x"))) for d in dims.split(":"))
        flops = 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
        mean = statistics.mean(ms)
        rows.append({"dims": dims, "layouts": f"{src} {wei}", "impl": impl, "calls_per_step": len(ms) / steps,
                     "ms_per_call": mean, "ms_per_step": sum(ms) / steps, "gflops": flops / mean / 1e6})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def worker_command(flag: str, w: dict, args) -> list[str]:
    """This script as the worker `flag` (--gemms-worker, --compile-worker) on the parent's model and step."""
    return [sys.executable, __file__, flag, "--workload", args.workload, "--family", args.family,
            "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--fused-kernels", args.fused_kernels, "--block-graph", args.block_graph,
            "--shape", ",".join(f"{k}={v}" for k, v in w.items())]


def gemm_profile(w: dict, args) -> dict:
    cmd = worker_command("--gemms-worker", w, args)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ONEDNN_VERBOSE": "1"}, cwd=REPO)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or GEMM_MARK not in lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"GEMM worker failed (exit {proc.returncode}): {tail}")
    rows = gemm_rows(lines[lines.index(GEMM_MARK) + 1:], args.steps)
    return {"gemm_ms_per_step": sum(r["ms_per_step"] for r in rows), "gemms": rows}


def compile_worker(w: dict, args) -> None:
    step, batch = msllm_train_step(w, threads=args.threads, fused_kernels=args.fused_kernels,
                                   block_graph=args.block_graph, family=args.family)
    t0 = time.perf_counter()
    step.compile(batch)
    print(f"COMPILE_S {time.perf_counter() - t0}", flush=True)


def compile_profile(w: dict, args) -> dict:
    cmd = worker_command("--compile-worker", w, args)
    env = {**os.environ, "GLOG_v": "3", "MS_DEV_RUNTIME_CONF": "compile_statistics:True"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    phases, counts = defaultdict(float), defaultdict(int)
    for m in PHASE.finditer(proc.stdout + proc.stderr):
        phases[m.group(1)] += float(m.group(2)) / 1e3
        counts[m.group(1)] += 1
    seconds = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("COMPILE_S ")]
    if not seconds or "compile_graph" not in phases:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"compile worker failed (exit {proc.returncode}): {tail}")
    total, backend = phases["compile_graph"], phases["compile_backend_graph"]
    # The backend builds one kernel graph per piece of the step between sub-graph calls, plus one
    # per called graph: 3 with the blocks inlined, more when every layer calls the shared block graph.
    return {"compile_s": seconds[0], "graph_compile_s": total, "frontend_s": total - backend, "backend_s": backend,
            "kernel_graphs": counts["ConstructKernelGraph"],
            "backend_phases_s": {p: phases[p] for p in BACKEND_PHASES if p in phases}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1", choices=list(WORKLOADS))
    p.add_argument("--family", default="llama", help="the workload's shape as this family (bench_train.FAMILIES)")
    p.add_argument("--shape", default="", help="overrides of the workload, e.g. hidden=64,layers=2")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="profile the compile instead of the step")
    p.add_argument("--threads-report", action="store_true", help="CPU and run-queue wait per thread instead of kernels")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fused-kernels", default="auto", choices=["auto", "off"])
    p.add_argument("--block-graph", default="auto", choices=["auto", "shared", "inlined"])
    p.add_argument("--out", default="runs/profile")
    p.add_argument("--gemms", action="store_true", help="the step's oneDNN GEMMs by shape instead of kernels")
    p.add_argument("--compile-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gemms-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    w = workload(args)
    if args.compile_worker:
        compile_worker(w, args)
        return 0
    if args.gemms_worker:
        gemms_worker(w, args)
        return 0

    print(f"{args.workload} {w}, {args.threads} threads")
    if args.threads_report:
        r = thread_report(w, args)
        print(f"step {r['wall_ms_per_step']:.1f} ms wall, {r['process_cpu_ms_per_step']:.1f} ms process CPU "
              f"(steps: {', '.join(f'{x:.0f}' for x in r['wall_ms'])} ms)")
        print("| thread | CPU ms per step | waiting for a CPU ms per step | switches per step | CPUs |")
        print("|---|---|---|---|---|")
        for t in r["threads"]:
            print(f"| {t['thread']} | {t['cpu_ms_per_step']:.1f} | {t['wait_ms_per_step']:.1f} | "
                  f"{t['switches_per_step']:.0f} | {','.join(map(str, t['cpus']))} |")
    elif args.gemms:
        r = gemm_profile(w, args)
        print(f"{r['gemm_ms_per_step']:.1f} ms of oneDNN GEMMs per step ({args.steps} steps, ONEDNN_VERBOSE)")
        print("| dims (src:weights) | layouts | calls per step | ms a call | ms per step | GFLOP/s |")
        print("|---|---|---|---|---|---|")
        for g in r["gemms"]:
            print(f"| {g['dims']} | {g['layouts']} | {g['calls_per_step']:.0f} | {g['ms_per_call']:.2f} | "
                  f"{g['ms_per_step']:.1f} | {g['gflops']:.0f} |")
    elif args.compile:
        r = compile_profile(w, args)
        print(f"compile {r['compile_s']:.2f} s: frontend {r['frontend_s']:.2f} s, backend {r['backend_s']:.2f} s, "
              f"{r['kernel_graphs']} kernel graphs")
        for phase, s in r["backend_phases_s"].items():
            print(f"  backend {phase:<20} {s:6.2f} s")
    else:
        r = kernel_profile(w, args)
        kernels = sum(o["kernels_per_step"] for o in r["ops"])
        busy = sum(o["ms_per_step"] for o in r["ops"])
        print(f"step {r['wall_ms_per_step']:.1f} ms wall (no profiler); {kernels:.0f} kernels, "
              f"{busy:.1f} ms summed kernel time per profiled step")
        print("| kernel type | kernels per step | ms per step | share |")
        print("|---|---|---|---|")
        for o in r["ops"]:
            print(f"| {o['op']} | {o['kernels_per_step']:.0f} | {o['ms_per_step']:.1f} | {o['ms_per_step'] / busy:.1%} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = "threads" if args.threads_report else "gemms" if args.gemms else "compile" if args.compile else "kernels"
    path = out / f"profile_{kind}_{args.workload}_L{w['layers']}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps({"workload": args.workload, "shape": w, "threads": args.threads, **r}, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
