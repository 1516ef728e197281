"""Where the scheduler put an msllm train step's threads, from a system-wide trace of context switches.

    python tools/bench_train.py --variants msllm-graph --steps 40 &      # one msllm process, no other
    sleep 90; perf record -e sched:sched_switch -e sched:sched_wakeup -a -o /tmp/w1.perf -- sleep 6
    perf script -i /tmp/w1.perf | python tools/sched_placement.py --pid PID   # while PID still runs

Reads `perf script` lines. The threads are told apart by name: MindSpore's ActorThread_0 (it calls the
kernels), KernelThread_0 (its second GEMM thread, which spins with sched_yield between tasks) and msllm's
kernel pool worker msllm_pool_1; --pid keeps to that process's threads (other msllm processes have the same
names). Prints how many of the worker's wake-ups landed on the CPU of the calling
thread, and for each pair of threads how long one ran while the other sat preempted (runnable) on the
same CPU: ActorThread_0 waiting behind KernelThread_0 (or the reverse) means a GEMM's two halves ran one
after the other. These hold on a loaded machine, where wall times do not (others' threads are counted
apart, as "another process").
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

THREADS = ("ActorThread_0", "KernelThread_0", "msllm_pool_1")
SWITCH = re.compile(r"\[(\d+)\]\s+([\d.]+): sched:sched_switch: prev_comm=(.*) prev_pid=(\d+) .*prev_state=(\S+) "
                    r"==> next_comm=(.*) next_pid=(\d+)")
WAKEUP = re.compile(r"\[(\d+)\]\s+([\d.]+): sched:sched_wakeup: comm=(.*) pid=(\d+) .*target_cpu=(\d+)")


def threads_of(pid: int) -> dict:
    """tid -> name of the process's THREADS."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name in THREADS:
            out[int(task.name)] = name
    return out


def placement(lines, names: dict | None = None) -> dict:
    """names: tid -> name of the threads to follow (threads_of), or None: any thread with one of THREADS' names."""
    fixed = names is not None
    names, running, preempted, cpu_of = dict(names or {}), {}, {}, {}  # cpu -> tid; tid -> cpu (runnable)
    shared, ran = defaultdict(float), defaultdict(float)
    wakeups = {"on the caller's CPU": 0, "elsewhere": 0}
    last = None
    for line in lines:
        switch, wakeup = SWITCH.search(line), WAKEUP.search(line)
        if not (switch or wakeup):
            continue
        t = float((switch or wakeup)[2])
        if last is not None:  # the interval since the previous event
            for cpu, tid in running.items():
                runner = names.get(tid, "another process" if tid else "nothing")
                if tid in names:
                    ran[runner] += t - last
                for victim, where in preempted.items():
                    if where == cpu:
                        shared[(runner, names[victim])] += t - last
        last = t
        if wakeup:
            if names.get(int(wakeup[4])) == "msllm_pool_1" or (not fixed and wakeup[3].strip() == "msllm_pool_1"):
                caller = next((tid for tid, name in names.items() if name == "ActorThread_0"), None)
                same = caller is not None and int(wakeup[5]) == cpu_of.get(caller)
                wakeups["on the caller's CPU" if same else "elsewhere"] += 1
            continue
        cpu, prev, nxt = int(switch[1]), int(switch[4]), int(switch[7])
        for comm, tid in ((switch[3].strip(), prev), (switch[6].strip(), nxt)):
            if comm in THREADS and not fixed:
                names[tid] = comm
        running[cpu] = nxt
        cpu_of[nxt] = cpu
        if prev in names and switch[5].startswith("R"):
            preempted[prev] = cpu
        else:
            preempted.pop(prev, None)
        preempted.pop(nxt, None)
    return {"worker_wakeups": wakeups, "ran_s": dict(ran), "shared_s": dict(shared)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pid", type=int, help="the msllm process (it must still run): its threads alone")
    args = p.parse_args()
    r = placement(sys.stdin, threads_of(args.pid) if args.pid else None)
    print(f"msllm_pool_1 wake-ups: {r['worker_wakeups']}")
    print("ran (s): " + ", ".join(f"{name} {s:.3f}" for name, s in sorted(r["ran_s"].items())))
    print("| ran | while this one waited on its CPU | s |")
    print("|---|---|---|")
    for (runner, victim), s in sorted(r["shared_s"].items(), key=lambda kv: -kv[1]):
        print(f"| {runner} | {victim} | {s:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
