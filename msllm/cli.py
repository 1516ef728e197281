"""msllm <command>: one entry point for training, sampling, conversion and export."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from msllm.config import ConfigError

PLANNED = {
    "plan": "Ascend semi-auto parallel planning (roadmap)",
    "lint": "graph_opt static-graph lint (roadmap)",
    "launch": "multi-process launch over msrun (roadmap)",
}


def cmd_train(args) -> int:
    from msllm.config import load_config
    from msllm.generate import generate_text
    from msllm.train.trainer import Trainer

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
    trainer = Trainer(cfg, resume=bool(args.resume))
    result = trainer.fit()
    if trainer.rank == 0 and cfg.train.sample_tokens > 0:
        import mindspore as ms
        ms.set_context(mode=ms.PYNATIVE_MODE)  # one compile per length would dominate in graph mode
        text = generate_text(trainer.model, trainer.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                             max_len=cfg.data.seq_len)
        print(f"--- sample (greedy) ---\n{text}\n---", flush=True)
    if "val_loss" in result:
        print(f"done: step {result['step']}, val_loss {result['val_loss']:.4f}, run dir {cfg.train.run_dir}")
    return 0


def cmd_generate(args) -> int:
    import mindspore as ms
    from msllm import device
    from msllm.generate import generate_text, load_run

    device.setup("cpu", "pynative")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg, model, tokenizer = load_run(args.ckpt)
    print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens, top_k=args.top_k,
                        temperature=args.temperature, seed=args.seed, max_len=cfg.model.max_seq_len))
    return 0


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
    p.add_argument("--ckpt", required=True, help="run dir or checkpoint dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top-k", type=int, default=0, help="0 = greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    for name, what in PLANNED.items():
        p = sub.add_parser(name, help=f"not implemented yet: {what}")
        p.set_defaults(func=lambda args, name=name: _not_yet(name))
    return parser


def _not_yet(name: str) -> int:
    print(f"msllm {name}: not implemented yet ({PLANNED[name]})", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from msllm.checkpoint import CheckpointError
    from msllm.data.corpus import DataError
    from msllm.device import DeviceError
    from msllm.train.trainer import NonFiniteError

    try:
        return args.func(args)
    except (ConfigError, DataError, DeviceError, CheckpointError, NonFiniteError) as e:
        print(f"msllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"msllm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
