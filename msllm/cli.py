"""msllm <command>: one entry point for training, sampling, conversion and export."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

from msllm.config import ConfigError
from msllm.errors import UserError

class UsageError(UserError, ValueError):
    """A command-line value that is wrong only in the light of what it points at (e.g. --top-k > vocab)."""


def train_config(args):
    """The run's Config from `msllm train` arguments, checked before MindSpore is imported or anything written."""
    from msllm.config_file import load_config
    from msllm.preflight import check_train

    overrides = list(args.set)
    if args.mode:
        overrides.append(f"train.mode={args.mode}")
    if args.device:
        overrides.append(f"train.device={args.device}")
    if args.init_from:
        if args.resume:
            raise UsageError("--init-from: not used with --resume, which continues a run from its own checkpoints "
                             "(the run's config.yaml already names what it started from)")
        overrides.append(f"train.init_from={args.init_from}")
    if args.resume:
        if args.config:
            raise ConfigError("--config", args.config, "not used with --resume, which reads RUN_DIR/config.yaml; "
                                                       "change values with --set")
        config_path = Path(args.resume) / "config.yaml"
        if not config_path.is_file():
            raise ConfigError(str(config_path), "<file>", "not found; --resume takes a run dir made by msllm train")
        cfg = load_config(config_path, overrides + [f"train.run_dir={args.resume}"])
    else:
        cfg = load_config(args.config, overrides, pretrained=_describe_pretrained)
    check_train(cfg, resume=bool(args.resume))
    return cfg


def cmd_train(args) -> int:
    cfg = train_config(args)
    pretrained = None
    if cfg.train.init_from and (cfg.lora.rank > 0 or not args.resume):  # a LoRA run re-reads its base on resume
        from interop.pretrained import InitFrom
        pretrained = InitFrom(cfg)

    from msllm.generate import generate_text
    from msllm.inference import cell_engine
    from msllm.train.trainer import Trainer

    with removed_on_failure(Path(cfg.train.run_dir)):
        trainer = Trainer(cfg, resume=bool(args.resume), pretrained=pretrained)
    result = trainer.fit()
    if trainer.rank == 0 and cfg.train.sample_tokens > 0:
        # KV cache; in graph mode prefill and decode compile once each (dynamic shapes)
        text = generate_text(cell_engine(trainer.inference_model()), trainer.tokenizer, cfg.train.sample_prompt,
                             cfg.train.sample_tokens, max_len=cfg.data.seq_len)
        print(f"--- sample (greedy) ---\n{text}\n---", flush=True)
    if "val_loss" in result:
        print(f"done: step {result['step']}, val_loss {result['val_loss']:.4f}, run dir {cfg.train.run_dir}")
    return 0


def _describe_pretrained(init_from: str, lora_from: str | None):
    """train.init_from as load_config needs it (msllm itself never imports interop)."""
    from interop.hf_config import check_dir

    check_dir(init_from)  # an HF config msllm cannot compute is refused before torch is imported
    from interop.pretrained import describe
    return describe(init_from, lora_from)


def cmd_lora(args) -> int:
    from msllm.preflight import check_new_dir

    check_new_dir(args.out, args.force, "OUT")
    from interop import pretrained

    if args.lora_command == "merge":
        out = pretrained.merge(args.run, args.out, base=args.base, force=args.force)
        print(f"msllm lora merge: wrote {out} (a full msllm checkpoint: convert --to hf, verify, export, generate)")
    else:
        out = pretrained.export_peft(args.run, args.out, base=args.base, force=args.force)
        print(f"msllm lora export: wrote {out} (PEFT adapter: PeftModel.from_pretrained(base_model, '{out}'))")
    return 0


@contextlib.contextmanager
def removed_on_failure(folder: Path):
    """Remove the directories this block creates for `folder` (it and missing parents) if it fails,
    so a run that stops while setting up (bad corpus, Ctrl-C) leaves no run dir behind."""
    top = None
    for path in (folder.absolute(), *folder.absolute().parents):
        if path.exists():
            break
        top = path
    try:
        yield
    except BaseException:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        raise


def cmd_launch(args) -> int:
    from msllm.layout.check import data_replicas
    from msllm.parallel.launch import Layout, launch

    rest = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if rest[:1] != ["train"]:
        raise UsageError(f"launch runs `msllm train` on every worker: give `-- train ARGS...` "
                         f"(got {' '.join(rest) or 'nothing'})")
    layout = Layout(args.nproc, args.nnodes, args.node_rank, args.master or "")
    layout.check()
    train_args = build_parser().commands["train"].parse_args(rest[1:])
    train_args.command, train_args.verbose = "train", args.verbose
    cfg = train_config(train_args)  # a bad config fails here, once, before any worker starts
    data_replicas(cfg, layout.world, "--set" if any(s.startswith(("parallel.dp=", "parallel.cp=")) for s in train_args.set)
                  else "config")
    run_dir = Path(cfg.train.run_dir)
    log_dir = run_dir / "logs"
    verbose = ["--verbose"] if args.verbose else []
    restarts = cfg.train.max_restarts if args.max_restarts is None else args.max_restarts
    if restarts == 0:
        return launch(layout, verbose + rest, log_dir, args.timeout, args.verbose)
    from msllm.parallel.launch import launch_with_restarts

    # A restart continues the run from its checkpoints; the overrides it was started with still apply.
    kept = [a for s in train_args.set for a in ("--set", s)]
    kept += [a for flag in ("mode", "device") if getattr(train_args, flag) for a in (f"--{flag}", getattr(train_args, flag))]
    resume = verbose + ["train", "--resume", str(run_dir), *kept]
    return launch_with_restarts(layout, verbose + rest, resume, run_dir, log_dir, restarts, args.timeout, args.verbose)


def cmd_generate(args) -> int:
    from graph_opt.runtime import MINDSPORE_ENGINES, load_engine
    from msllm import chat
    from msllm.generate import Sampling, TextStream, generate

    if args.system is not None and args.chat is None:
        raise UsageError("--system: only used with --chat MESSAGE")
    uses_mindspore = args.engine in MINDSPORE_ENGINES  # onnxruntime runs without importing MindSpore
    if uses_mindspore:
        from msllm import device

        device.setup("cpu", "graph")  # prefill and decode compile once each per shape
    engine, model_cfg, tokenizer, conventions = load_engine(args.engine, args.ckpt)
    if args.compile_cache and uses_mindspore:  # the next start skips compiling; one sub-dir per model and engine
        key = json.dumps([args.engine, dataclasses.asdict(model_cfg)], sort_keys=True).encode()
        device.use_compile_cache(Path(args.compile_cache) / hashlib.sha256(key).hexdigest()[:16])
    if args.top_k > model_cfg.vocab_size:
        raise UsageError(f"--top-k {args.top_k}: above the model's vocabulary of {model_cfg.vocab_size} tokens "
                         f"(0 = greedy)")
    if args.chat is not None:  # the reply alone is printed
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.chat}]
        flag, texts, echo = "--chat", [chat.render(conventions, messages, args.ckpt)], [""]
        prompts = [tokenizer.encode(texts[0], add_special_tokens=False).ids]
    else:  # the prompt and its continuation are printed
        flag, texts = "--prompt", args.prompt or ["def "]
        prompts, echo = [tokenizer.encode(text).ids or [0] for text in texts], texts
    context = model_cfg.max_seq_len
    longest = max(len(p) for p in prompts)
    if longest >= context:
        raise UsageError(f"{flag}: {longest} tokens leave no room in the model's context of {context} tokens; "
                         f"shorten it")
    max_new = min(args.max_new_tokens, context - longest)
    capped = (f"; --max-new-tokens {args.max_new_tokens} capped at {max_new}, what fits in the {context}-token "
              f"context" if max_new < args.max_new_tokens else "")

    streams = [TextStream(tokenizer, args.stop) for _ in prompts]
    live = len(prompts) == 1  # one prompt streams to stdout token by token; a batch prints when done

    def on_token(row, token):
        text = streams[row].add(token)
        if live:
            print(echo.pop() if echo else "", text, sep="", end="", flush=True)  # the prompt, with the first token
        return streams[row].stopped

    sampling = Sampling(args.top_k, args.top_p, args.temperature, args.seed)
    result = generate(engine, prompts, max_new, sampling, conventions.eos_ids, on_token)
    for row, stream in enumerate(streams):
        rest = stream.flush()
        if live:
            print(*echo, rest, sep="", flush=True)
        else:
            print(echo[row] + stream.text, flush=True)
    new = sum(len(ids) for ids in result.ids)
    rate = result.decode_tok_s()
    decode = (f", decode {rate:.1f} tok/s after a first step of {result.step_s[0]:.2f} s" if rate
              else f", one decode step of {result.step_s[0]:.2f} s" if result.step_s else "")
    print(f"msllm generate: {sum(len(p) for p in prompts)} prompt tokens, {new} new tokens "
          f"({', '.join(sorted(set(result.stopped)))}), first token {result.first_token_s:.2f} s{decode}{capped}",
          file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    from msllm.preflight import check_new_dir

    check_new_dir(args.out, args.force, "--out")
    from graph_opt.export import export

    export(args.ckpt, args.format, args.out, dtype=args.dtype, embed_weights=args.embed_weights, force=args.force,
           log=lambda line: print(line, flush=True))
    return 0


def cmd_convert(args) -> int:
    from msllm.preflight import check_new_dir

    check_new_dir(args.dst, args.force, "dst")
    from interop.hf_config import check_dir

    check_dir(args.src)
    from interop import InteropError
    from interop.convert import convert
    from interop.layouts import detect

    if args.verify and "hf" not in (args.to, detect(args.src)):
        raise InteropError("--verify compares against Hugging Face: SRC or --to must be hf")
    r = convert(args.src, args.dst, to=args.to, dtype=args.dtype, mf_format=args.mf_format,
                max_shard_bytes=args.max_shard_mb << 20, max_seq_len=args.max_seq_len, force=args.force)
    print(f"msllm convert: {r.source_layout} -> {r.layout}: wrote {r.path} ({r.tensors} tensors, "
          f"{r.bytes / 1e6:.1f} MB in {r.seconds:.2f} s, {r.bytes / 1e6 / max(r.seconds, 1e-9):.0f} MB/s)")
    if not args.verify:
        return 0
    hf, ckpt = (r.path, args.src) if r.layout == "hf" else (args.src, r.path)
    return _print_report(hf, ckpt, args)


def cmd_verify(args) -> int:
    from interop.hf_config import check_dir

    if args.ckpt is None and not args.train:
        raise UsageError("--ckpt is required (only --train converts the --hf weights itself)")
    check_dir(args.hf)
    if not args.train:
        return _print_report(args.hf, args.ckpt, args)
    from interop.verify_train import verify_train

    report = verify_train(args.hf, args.ckpt, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                          seed=args.seed, tolerance=args.tolerance, data=args.data)
    print(f"msllm verify --train: Hugging Face {args.hf} + torch AdamW vs {report.source}, GRAPH train step")
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _print_report(hf, ckpt, args) -> int:
    from interop.verify import verify

    report = verify(hf, ckpt, seq_len=args.seq_len, batch=args.batch, seed=args.seed, tolerance=args.tolerance)
    print(f"msllm verify: Hugging Face {hf} vs {ckpt}")
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_lint(args) -> int:
    from graph_opt.lint import lint_paths
    from msllm.config_file import load_config

    cfg = load_config(args.config, args.set) if args.compile else None  # a bad config fails first
    paths = args.paths or [str(Path(__file__).resolve().parent)]  # default: msllm's own package
    findings, files, functions = lint_paths(paths)
    for finding in findings:
        print(finding)
    if cfg is not None:
        from graph_opt.compile_check import compile_train_step

        failed = compile_train_step(cfg)
        if failed is not None:
            print(failed)
            findings.append(failed)
    where = f"{files} file{'s' if files != 1 else ''}, {functions} compiled function{'s' if functions != 1 else ''}"
    print(f"msllm lint: {len(findings)} problem{'s' if len(findings) != 1 else ''} ({where})" if findings
          else f"msllm lint: clean ({where})")
    return 1 if findings else 0


def cmd_doctor(args) -> int:
    from msllm import doctor
    from msllm.config_file import load_config

    cfg = load_config(args.config, args.set) if args.config or args.set else None
    return doctor.main(cfg, args.config)


def cmd_plan(args) -> int:
    from msllm.config_file import load_config
    from msllm.layout import plan

    cfg = load_config(args.config, args.set)
    device = args.device or {"ascend": "910b", "gpu": "h100", "cpu": "cpu"}[cfg.train.device]
    memory = plan.parse_bytes(args.device_mem) if args.device_mem else None
    return plan.run(cfg, args.config, args.devices, device, memory, args.global_batch, args.seq_len,
                    check=args.check, top=args.top,
                    err=lambda line: print(line, file=sys.stderr), given=args.set)


# --- argument types: a bad value is an argparse error naming the option

def int_at_least(low: int):
    def integer(text: str) -> int:
        value = int(text)  # ValueError: argparse says "invalid integer value"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return integer


def number_at_least(low: float):
    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}, got {text}")
        return value
    return number


def non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, `msllm <command>: error: ...`, exit 2, like every other error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


EXAMPLES = {
    "launch": """examples:
  msllm launch --nproc 2 -- train --config configs/tiny.yaml          # 2 data-parallel workers, one node
  msllm launch --nproc 2 -- train --resume runs/tiny                   # continue (any world size, same global batch)
  msllm launch --nproc 8 --nnodes 2 --node-rank 0 --master 10.0.0.1:8118 -- train --config C   # on node 0
  msllm launch --nproc 8 --nnodes 2 --node-rank 1 --master 10.0.0.1:8118 -- train --config C   # on node 1""",
    "train": """examples:
  msllm train                                            # tiny Llama on the stdlib sources, CPU, runs/tiny
  msllm train --config configs/tiny.yaml --set train.steps=1000 --set optim.lr=1e-3
  msllm train --config configs/tiny.yaml --mode pynative  # same code, eager
  msllm train --resume runs/tiny --set train.steps=800    # continue a run from its newest checkpoint
  msllm train --init-from ~/models/Qwen2-0.5B --set data.path=sft.jsonl --set lora.rank=8   # fine-tune""",
    "lora": """examples:
  msllm lora merge runs/sft merged              # base + adapters -> a full msllm checkpoint
  msllm lora export runs/sft adapter --format peft   # un-merged, for peft.PeftModel.from_pretrained""",
    "generate": """examples:
  msllm generate --ckpt runs/tiny --prompt "def parse(" --top-k 20 --temperature 0.8
  msllm generate --ckpt runs/smollm2 --chat "What is the capital of France?" --system "Answer briefly."
  msllm generate --ckpt runs/tiny --prompt "def " --prompt "class " --stop "\\n\\n"   # a batch of two
  msllm generate --engine onnxruntime --ckpt exports/tiny-onnx --prompt "def parse(\"""",
    "export": """examples:
  msllm export --ckpt runs/tiny --format onnx --out exports/tiny-onnx
  msllm export --ckpt runs/tiny --format mindir --out exports/tiny-mindir --dtype fp16 --force""",
    "convert": """examples:
  msllm convert ~/models/Llama-3.2-1B runs/llama32 --verify    # HF -> msllm, then compare layer by layer
  msllm convert runs/llama32 llama32_hf --max-shard-mb 2048    # msllm -> HF, 2 GB shards
  msllm convert ~/models/Qwen2-0.5B qwen_mf --to mindformers --mf-format safetensors""",
    "verify": """examples:
  msllm verify --hf ~/models/Llama-3.2-1B --ckpt runs/llama32
  msllm verify --hf ~/models/Llama-3.2-1B --ckpt runs/llama32 --seq-len 64 --batch 1 --tolerance 1e-3
  msllm verify --train --hf ~/models/Llama-3.2-1B --steps 3   # train steps vs HF + torch AdamW""",
}


def _verify_options(p) -> None:
    p.add_argument("--seq-len", type=int_at_least(1), default=32, help="tokens per sequence (capped at the model "
                                                                      "context; default 32)")
    p.add_argument("--batch", type=int_at_least(1), default=2, help="sequences compared (default 2)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random token ids (default 0)")
    p.add_argument("--tolerance", type=number_at_least(0), default=None,
                   help="max_rel limit (default: by stored dtype, see interop/verify.py)")


def build_parser() -> Parser:
    parser = Parser(prog="msllm", description=__doc__)
    parser.add_argument("--verbose", action="store_true",
                        help="show MindSpore's log and Python warnings, and tracebacks of file errors")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}

    def command(name: str, help: str):
        p = sub.add_parser(name, help=help, description=help, epilog=EXAMPLES.get(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="show MindSpore's log and Python warnings, and tracebacks of file errors")
        commands[name] = p
        return p

    p = command("train", "train a model from a YAML config")
    p.add_argument("--config", default=None, help="YAML config (default: built-in tiny CPU config)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (read as YAML, text keys as written; repeatable), "
                   "e.g. --set optim.lr=1e-3")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    p.add_argument("--init-from", metavar="PATH", help="start from pretrained weights (HF dir, msllm checkpoint or "
                                                       "run dir, MindFormers dir); shorthand for train.init_from")
    p.add_argument("--mode", choices=["graph", "pynative"], help="shorthand for --set train.mode=...")
    p.add_argument("--device", choices=["cpu", "gpu", "ascend"], help="shorthand for --set train.device=...")
    p.set_defaults(func=cmd_train)

    p = command("generate", "sample text from a trained run or an export")
    p.add_argument("--ckpt", required=True, help="run dir or checkpoint dir (msllm engine), export dir (others)")
    p.add_argument("--engine", choices=["msllm", "mindir", "onnxruntime"], default="msllm",
                   help="msllm: the trained Cells; mindir / onnxruntime: an msllm export (default msllm)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", default=None,
                        help="text to continue (default 'def '); repeat it for a batch of prompts")
    prompt.add_argument("--chat", metavar="MESSAGE", default=None,
                        help="a user message, put in the model's own chat template; prints the reply")
    p.add_argument("--system", default=None, help="a system message before the --chat message")
    p.add_argument("--stop", action="append", default=[], type=non_empty, metavar="STRING",
                   help="also end a reply at this text, which is not printed (repeatable); the model's EOS "
                        "tokens always end it")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=64,
                   help="tokens to add at most, capped at what fits in the model's context (default 64)")
    p.add_argument("--top-k", type=int_at_least(0), default=0,
                   help="sample from the k most likely tokens; 0 with --top-p 1 = greedy (default)")
    p.add_argument("--top-p", type=probability, default=1.0,
                   help="sample from the most likely tokens whose probabilities add up to p (default 1.0)")
    p.add_argument("--temperature", type=number_at_least(0), default=1.0,
                   help="softmax temperature for --top-k / --top-p sampling (default 1.0)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="sampling seed (default 0)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="dir for MindSpore's compile cache (a sub-dir per model and engine): the next "
                        "start with the same model and shapes skips graph compilation (default: none)")
    p.set_defaults(func=cmd_generate)

    p = command("export", "export a run to MindIR or ONNX for deployment, verified on reload")
    p.add_argument("--ckpt", required=True, help="run dir or checkpoint dir")
    p.add_argument("--format", required=True, choices=["mindir", "onnx"], help="graph format")
    p.add_argument("--out", required=True, help="output directory (its parent must exist; replaced only with "
                                                "--force)")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32",
                   help="weights and activations (norms, softmax stay fp32; default fp32)")
    p.add_argument("--embed-weights", action="store_true",
                   help="ONNX: each graph file carries its own copy of the weights (self-contained files, up to "
                        "2 GB of weights); default: written once to weights.onnx.data beside the graphs")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(func=cmd_export)

    p = command("convert", "convert a checkpoint between HF, msllm and MindFormers layouts")
    p.add_argument("src", help="HF model dir, msllm checkpoint or run dir, or MindFormers dir / weights file")
    p.add_argument("dst", help="destination dir; its parent must exist (written under a temporary name, "
                               "then renamed)")
    p.add_argument("--to", choices=["msllm", "hf", "mindformers"], default=None,
                   help="destination layout (default: hf from msllm, msllm otherwise)")
    p.add_argument("--dtype", choices=["keep", "fp32", "fp16", "bf16"], default="keep",
                   help="stored dtype of the destination (default keep)")
    p.add_argument("--mf-format", choices=["ckpt", "safetensors"], default="ckpt",
                   help="MindFormers weights file format (default ckpt)")
    p.add_argument("--max-shard-mb", type=int_at_least(1), default=5120,
                   help="HF destination shard size in MB (default 5120)")
    p.add_argument("--max-seq-len", type=int_at_least(2), default=None,
                   help="shrink the msllm context (default: HF max_position_embeddings)")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--verify", action="store_true", help="then run verify on the HF side and the msllm side")
    _verify_options(p)
    p.set_defaults(func=cmd_convert)

    p = command("verify", "compare an msllm or MindFormers checkpoint with the HF model, layer by layer")
    p.add_argument("--hf", required=True, help="Hugging Face model dir")
    p.add_argument("--ckpt", default=None, help="msllm checkpoint / run dir, or MindFormers dir (optional with "
                                                "--train: without it the --hf weights are converted in memory; "
                                                "with it both sides train from its weights)")
    p.add_argument("--train", action="store_true", help="compare train steps (loss, gradients, updated weights) "
                                                        "with HF + torch AdamW + clip_grad_norm_")
    p.add_argument("--steps", type=int_at_least(1), default=3, help="train steps compared with --train (default 3)")
    p.add_argument("--data", default=None, metavar="SHARD_DIR",
                   help="--train batches from a pretokenized shard (e.g. RUN_DIR/data) instead of random tokens")
    _verify_options(p)
    p.set_defaults(func=cmd_verify)

    p = command("lora", "merge a LoRA run into a full checkpoint, or export its adapter for PEFT")
    lora = p.add_subparsers(dest="lora_command", required=True)
    for name, what in (("merge", "fold the adapters into the base: a full msllm checkpoint dir"),
                       ("export", "the un-merged adapter as a Hugging Face PEFT dir")):
        q = lora.add_parser(name, help=what, description=what)
        q.add_argument("run", help="LoRA run dir or checkpoint dir")
        q.add_argument("out", help="output dir; its parent must exist (written under a temporary name, then renamed)")
        if name == "export":
            q.add_argument("--format", choices=["peft"], required=True, help="adapter format")
        q.add_argument("--base", default=None, help="the base model, if it moved since training (its sha256 must "
                                                    "match the one the run recorded)")
        q.add_argument("--force", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=cmd_lora)

    p = sub.add_parser("lint", help="find what GRAPH_MODE rejects or silently slows in Cells, before compiling")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help=".py files, directories or module names (default: msllm's own package)")
    p.add_argument("--compile", action="store_true",
                   help="also compile the train step of --config and point a compile error at its file:line")
    p.add_argument("--config", default=None, help="YAML config for --compile (default: built-in tiny CPU config)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("doctor", help="versions, devices, CPU, memory and disk on one screen, problems with fixes")
    p.add_argument("--config", default=None, help="also check what this config needs (exit 1 if something is missing)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("plan", help="lay a config out over N devices: memory, communication, step time per layout")
    p.add_argument("--config", required=True, help="YAML config")
    p.add_argument("--devices", type=int, required=True, help="number of devices (dp x tp x pp)")
    p.add_argument("--device-mem", default=None, help="memory per device, e.g. 64GB (default: the device's)")
    p.add_argument("--device", choices=["910b", "h100", "cpu"], default=None,
                   help="device profile (default: from train.device)")
    p.add_argument("--seq-len", type=int, default=None, help="default: data.seq_len")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: train.batch_size x accum_steps x parallel.dp)")
    p.add_argument("--check", action="store_true", help="validate the config's parallel section for --devices")
    p.add_argument("--top", type=int_at_least(1), default=10, help="layouts shown")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.set_defaults(func=cmd_plan)

    p = command("launch", "train on several worker processes (and nodes) through MindSpore's msrun")
    p.add_argument("--nproc", type=int_at_least(1), required=True, help="worker processes on this node")
    p.add_argument("--nnodes", type=int_at_least(1), default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int_at_least(0), default=0, help="this node's index, 0 .. nnodes-1")
    p.add_argument("--master", default=None, metavar="ADDR:PORT",
                   help="node 0's address and a free port (default: 127.0.0.1 and a free port, one node only)")
    p.add_argument("--timeout", type=int_at_least(5), default=60,
                   help="seconds to wait for every worker to join, and for a silent one (default 60)")
    p.add_argument("--max-restarts", type=int_at_least(0), default=None,
                   help="when a worker dies, restart all workers from the newest checkpoint up to N times "
                        "(default: train.max_restarts, 0)")
    p.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- train ARGS",
                   help="the msllm train command every worker runs")
    p.set_defaults(func=cmd_launch)

    parser.commands = commands
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def quiet(verbose: bool) -> None:
    """Before MindSpore is imported: its log (GLOG_v, 4 = critical only) and Python deprecation
    warnings stay off the terminal unless --verbose or GLOG_v is set."""
    if verbose:
        return
    os.environ.setdefault("GLOG_v", "4")
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    quiet(args.verbose)
    command = " ".join(filter(None, (args.command, getattr(args, "lora_command", None))))
    # MindSpore's runtime turns SIGINT into SIGTERM (its handler kills the process with SIGTERM): make
    # both a KeyboardInterrupt, so Ctrl-C cleans up temporary files and ends with one line, exit 130.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except UserError as e:  # every module's one-line error derives from it; importing it loads nothing heavy
        print(f"msllm {command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file problem no check foresaw: still one line (--verbose shows the traceback)
        if args.verbose:
            raise
        print(f"msllm {command}: error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}",
              file=sys.stderr)
        return 2
    except MemoryError as e:  # a size asked for on the command line or in the config (--batch, model.*)
        if args.verbose:
            raise
        print(f"msllm {command}: error: out of memory ({e}); ask for less (batch, sequence length, model "
              f"size)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"msllm {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
