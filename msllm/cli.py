"""msllm <command>: one entry point for training, sampling, conversion and export."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from msllm.config import ConfigError
from msllm.errors import UserError

PLANNED = {
    "launch": "multi-process launch over msrun (roadmap)",
}


def cmd_train(args) -> int:
    from msllm.config import load_config

    overrides = list(args.set)
    if args.mode:
        overrides.append(f"train.mode={args.mode}")
    if args.device:
        overrides.append(f"train.device={args.device}")
    if args.resume:
        config_path = Path(args.resume) / "config.yaml"
        if not config_path.exists():
            raise ConfigError(str(config_path), "<file>", "not found; --resume takes a run dir made by msllm train")
        cfg = load_config(config_path, overrides + [f"train.run_dir={args.resume}"])
    else:
        cfg = load_config(args.config, overrides)
    from msllm.generate import generate_text  # the config is valid: now load MindSpore
    from msllm.inference import cell_engine
    from msllm.train.trainer import Trainer

    trainer = Trainer(cfg, resume=bool(args.resume))
    result = trainer.fit()
    if trainer.rank == 0 and cfg.train.sample_tokens > 0:
        # KV cache; in graph mode prefill and decode compile once each (dynamic shapes)
        text = generate_text(cell_engine(trainer.inference_model()), trainer.tokenizer, cfg.train.sample_prompt,
                             cfg.train.sample_tokens, max_len=cfg.data.seq_len)
        print(f"--- sample (greedy) ---\n{text}\n---", flush=True)
    if "val_loss" in result:
        print(f"done: step {result['step']}, val_loss {result['val_loss']:.4f}, run dir {cfg.train.run_dir}")
    return 0


def cmd_generate(args) -> int:
    from graph_opt.runtime import load_engine
    from msllm import device
    from msllm.generate import generate_text

    device.setup("cpu", "graph")  # prefill and decode compile once each (dynamic shapes)
    engine, model_cfg, tokenizer = load_engine(args.engine, args.ckpt)
    print(generate_text(engine, tokenizer, args.prompt, args.max_new_tokens, top_k=args.top_k,
                        temperature=args.temperature, seed=args.seed, max_len=model_cfg.max_seq_len))
    return 0


def cmd_export(args) -> int:
    from graph_opt.export import export

    export(args.ckpt, args.format, args.out, dtype=args.dtype, external_data=args.external_data, force=args.force,
           log=lambda line: print(line, flush=True))
    return 0


def cmd_convert(args) -> int:
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
    return _print_report(args.hf, args.ckpt, args)


def _print_report(hf, ckpt, args) -> int:
    from interop.verify import verify

    report = verify(hf, ckpt, seq_len=args.seq_len, batch=args.batch, seed=args.seed, tolerance=args.tolerance)
    print(f"msllm verify: Hugging Face {hf} vs {ckpt}")
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_lint(args) -> int:
    from graph_opt.lint import lint_paths
    from msllm.config import load_config

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
    from msllm.config import load_config

    cfg = load_config(args.config, args.set) if args.config or args.set else None
    return doctor.main(cfg, args.config)


def cmd_plan(args) -> int:
    from msllm.config import load_config
    from msllm.parallel import plan

    cfg = load_config(args.config, args.set)
    device = args.device or {"ascend": "910b", "gpu": "h100", "cpu": "cpu"}[cfg.train.device]
    memory = plan.parse_bytes(args.device_mem) if args.device_mem else None
    return plan.run(cfg, args.config, args.devices, device, memory, args.global_batch, args.seq_len,
                    check=args.check, top=args.top, flash=args.flash,
                    err=lambda line: print(line, file=sys.stderr))


def _verify_options(p) -> None:
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (capped at the model context)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max_rel limit (default: by dtype, see interop/verify.py)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a YAML config")
    p.add_argument("--config", default=None, help="YAML config (default: built-in tiny CPU config)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    p.add_argument("--mode", choices=["graph", "pynative"], help="shorthand for --set train.mode=...")
    p.add_argument("--device", choices=["cpu", "gpu", "ascend"], help="shorthand for --set train.device=...")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("--ckpt", required=True, help="run dir or checkpoint dir (msllm engine), export dir (others)")
    p.add_argument("--engine", default="msllm", help="msllm (the trained Cells) | mindir | onnxruntime")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top-k", type=int, default=0, help="0 = greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="export a run to MindIR or ONNX for deployment, verified on reload")
    p.add_argument("--ckpt", required=True, help="run dir or checkpoint dir")
    p.add_argument("--format", required=True, help="mindir | onnx")
    p.add_argument("--out", required=True, help="output directory (replaced only with --force)")
    p.add_argument("--dtype", default="fp32", help="fp32 | fp16 (weights and activations; norms, softmax fp32)")
    p.add_argument("--external-data", action="store_true",
                   help="ONNX: weights in a separate file (automatic above 2 GB)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("convert", help="convert a checkpoint between HF, msllm and MindFormers layouts")
    p.add_argument("src", help="HF model dir, msllm checkpoint or run dir, or MindFormers dir / weights file")
    p.add_argument("dst", help="destination dir (written under a temporary name, then renamed)")
    p.add_argument("--to", choices=["msllm", "hf", "mindformers"], default=None,
                   help="destination layout (default: hf from msllm, msllm otherwise)")
    p.add_argument("--dtype", choices=["keep", "fp32", "fp16", "bf16"], default="keep")
    p.add_argument("--mf-format", choices=["ckpt", "safetensors"], default="ckpt",
                   help="MindFormers weights file format")
    p.add_argument("--max-shard-mb", type=int, default=5120, help="HF destination shard size")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="msllm context (default: HF max_position_embeddings, capped at 8192)")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--verify", action="store_true", help="then run verify on the HF side and the msllm side")
    _verify_options(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("verify", help="compare an msllm or MindFormers checkpoint with the HF model, layer by layer")
    p.add_argument("--hf", required=True, help="Hugging Face model dir")
    p.add_argument("--ckpt", required=True, help="msllm checkpoint / run dir, or MindFormers dir")
    _verify_options(p)
    p.set_defaults(func=cmd_verify)

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
                   help="sequences per optimizer step (default: train.batch_size x train.accum_steps)")
    p.add_argument("--check", action="store_true", help="validate the config's parallel section for --devices")
    p.add_argument("--flash", action="store_true", help="activations as with a fused flash-attention kernel")
    p.add_argument("--top", type=int, default=10, help="layouts shown")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.set_defaults(func=cmd_plan)

    for name, what in PLANNED.items():
        p = sub.add_parser(name, help=f"not implemented yet: {what}")
        p.set_defaults(func=lambda args, name=name: _not_yet(name))
    return parser


def _not_yet(name: str) -> int:
    print(f"msllm {name}: not implemented yet ({PLANNED[name]})", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:  # every module's one-line error derives from it; importing it loads nothing heavy
        print(f"msllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"msllm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
