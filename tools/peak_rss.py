"""Run a command; print its wall seconds and the peak RSS of its whole process tree (the command
and every process it starts, summed, sampled every 10 ms; at least the largest single process's
own peak, which the kernel records exactly) as the last stdout line: `PEAK_RSS <kB> <seconds>`.

    python tools/peak_rss.py msllm export --ckpt RUN --format mindir --out OUT
"""
import os
import resource
import subprocess
import sys
import time

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def tree(pid: int) -> list[int]:
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [q for child in f.read().split() for q in tree(int(child))]
    except OSError:  # ended while we looked
        pass
    return pids


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_KB
    except OSError:
        return 0


def main() -> int:
    started = time.perf_counter()
    proc = subprocess.Popen(sys.argv[1:])
    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(rss_kb(pid) for pid in tree(proc.pid)))
        time.sleep(0.01)
    seconds = time.perf_counter() - started
    peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print(f"PEAK_RSS {peak} {seconds:.3f}", flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
