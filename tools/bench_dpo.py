"""DPO train step: msllm's compiled step vs TRL's DPOTrainer + torch eager, on the same pairs and model.

A W1-sized Llama (random weights, saved as a Hugging Face checkpoint) and a word-level tokenizer whose
words are its token ids ("w17 w4 ..."), so both stacks tokenize every pair to the same ids. The pairs
have a prompt of 64-128 tokens and completions of 32-127; rows of --seq tokens. LoRA (rank 8 on q, k,
v, o): both stacks compute the reference log-probs in the step with the adapters switched off (msllm:
lora.on; TRL: peft's disable_adapter), so each step is two forwards of the pairs and one backward.

    python tools/bench_dpo.py                        # W1 shape, 4 pairs a step, 2 rounds alternated
    python tools/bench_dpo.py --shape tiny --steps 2 # a smoke run of the tool
    python tools/bench_dpo.py --variants msllm-after,msllm-shared,trl   # + dpo.share_prompt
    python tools/bench_dpo.py --variants msllm-shared,msllm-shared-flash,trl   # its attention core

msllm-shared is msllm with dpo.share_prompt: each pair one row (its prompt once, the completions
branching from it) of the longest pair's length rounded up to 32, instead of two rows of --seq;
msllm-shared-flash the same with train.attention: flash (the CPU flash kernel instead of the softmax core),
msllm-before-shared msllm-shared on the --before checkout.

Every variant runs in a process of its own (msllm's with PYTHONPATH on its checkout) and reports the
median step time after warm-up and its peak RSS; the variants alternate over --rounds rounds, the
order flipped each round. TRL's step is what its trainer runs per batch: _compute_loss on the
collated pairs, backward, AdamW's step, zero_grad.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_big_vocab import alternate, print_result, provenance, run_worker, save, time_steps  # noqa: E402

SHAPES = {
    "W1": dict(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=8, max_position_embeddings=1024),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=1024),
}
RANK, TARGETS = 8, "q,k,v,o"


def write_model(shape: str, out: Path):
    """The HF model (random weights, seed 0) and its word-level tokenizer in `out`; -> text(n, rng): n
    random words, each one token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = SHAPES[shape]["vocab_size"]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                 tie_word_embeddings=False)).save_pretrained(out)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}  # no special a prefix of a word
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>").save_pretrained(out)
    return lambda n, rng: " ".join(f"w{i}" for i in rng.integers(3, vocab, n))


def write_inputs(shape: str, out: Path, pairs: int, seq: int) -> None:
    """The HF model, the tokenizer and pairs.jsonl in `out`."""
    import numpy as np

    words = write_model(shape, out)
    rng = np.random.default_rng(0)
    text = lambda n: words(n, rng)  # noqa: E731
    rows = []
    for _ in range(pairs):
        prompt = int(rng.integers(64, 129))
        longest = seq - prompt - 1  # + EOS, within seq + 1 tokens
        rows.append({"prompt": text(prompt), "chosen": " " + text(int(rng.integers(32, longest))),
                     "rejected": " " + text(int(rng.integers(32, longest)))})
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def shared_row_length(pairs: Path) -> int:
    """data.seq_len of msllm-shared's rows: the longest pair as one row (prompt, EOS-ended completions, the
    prompt's last token again: msllm.data.preference), less its last label, rounded up to 32 tokens."""
    words = lambda text: len(text.split())  # noqa: E731 (one token a word)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    longest = max(words(r["prompt"]) + words(r["chosen"]) + 1 + 1 + words(r["rejected"]) + 1 for r in rows)
    return -(-(longest - 1) // 32) * 32


def worker_msllm(args) -> dict:
    import mindspore as ms
    import numpy as np

    import msllm
    from interop.pretrained import InitFrom, describe
    from msllm import device
    from msllm.config_file import load_config
    from msllm.data import preference
    from msllm.data.loader import head_rows
    from msllm.train.build import build_train_step

    device.setup("cpu", "graph", args.threads)
    hf = Path(args.hf)
    shared = "shared" in args.worker
    attention = "flash" if args.worker.endswith("-flash") else "auto"
    seq = args.shared_seq if shared else args.seq
    cfg = load_config(None, [f"train.init_from={hf}", f"data.path={hf / 'pairs.jsonl'}", f"data.seq_len={seq}",
                             f"train.batch_size={args.pairs}", f"train.threads={args.threads}", "train.steps=1000",
                             "train.objective=dpo", "optim.warmup_steps=0", "optim.grad_clip=1.0",
                             f"lora.rank={RANK}", f"lora.alpha={2 * RANK}", f"lora.targets=[{TARGETS}]",
                             f"dpo.share_prompt={str(shared).lower()}", f"train.attention={attention}"],
                      pretrained=describe)
    init = InitFrom(cfg)
    built = build_train_step(cfg, load_weights=init.load_base)
    init.load_adapter(built.model.trainable_params())
    _, tokens, mask = preference.encode(hf / "pairs.jsonl", hf / "tokenizer.json", seq, shared)
    if shared:  # one row a pair: tokens, mask, segments, positions
        tables = [preference.branch_tables(m) for m in mask]
        columns = [tokens, mask.astype("float32"), *(np.stack(t) for t in zip(*tables))]
    else:
        columns = [tokens.reshape(args.pairs, 2, -1), mask.reshape(args.pairs, 2, -1).astype("float32")]
    if cfg.train.head_rows == "loss":  # as the trainer's batches: only the completions' positions reach the head
        columns.append(head_rows(columns[1], 1))
    inputs = [ms.Tensor(c) for c in columns]
    result = time_steps(lambda: built.train_step(*inputs)[0].asnumpy(), args.steps, args.warmup)
    result["msllm"] = str(Path(msllm.__file__).parents[1])
    return result


def worker_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    hf = Path(args.hf)
    rows = [json.loads(line) for line in (hf / "pairs.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(hf).float()
    modules = [f"{m}_proj" for m in TARGETS.split(",")]
    config = DPOConfig(output_dir=tempfile.mkdtemp(), beta=0.1, report_to=[], use_cpu=True, bf16=False,
                       per_device_train_batch_size=args.pairs, max_length=args.seq + 1, max_grad_norm=1.0)
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(hf),
                         peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=modules))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(args.pairs)])
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step():
        loss = trainer._compute_loss(trainer.model, batch, False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return time_steps(step, args.steps, args.warmup)


def spawn(variant: str, args, hf: Path) -> dict:
    side = args.before if variant.startswith("msllm-before") else args.after if variant.startswith("msllm") else str(REPO)
    cmd = [sys.executable, __file__, "--worker", variant, "--hf", str(hf), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--pairs", str(args.pairs),
           "--seq", str(args.seq), "--shared-seq", str(args.shared_seq)]
    return run_worker(cmd, side)


def report(args, results: dict) -> str:
    tokens = args.pairs * 2 * args.seq
    lines = [f"# DPO train step on CPU, {args.shape}: msllm vs TRL DPOTrainer + torch eager", "",
             *provenance("bench_dpo.py", args),
             f"* **Conditions**: fp32, {args.pairs} pairs a step ({tokens} tokens: chosen and rejected rows of "
             f"{args.seq}; msllm-shared: one row of {args.shared_seq} a pair), LoRA rank {RANK} alpha {2 * RANK} "
             f"on {TARGETS}, reference = adapters off in the step, "
             f"sigmoid loss beta 0.1, AdamW + clip 1.0; {args.threads} threads; {args.warmup} warm-up steps, "
             f"median of {args.steps}; variants alternated over {args.rounds} rounds", "",
             "| variant | tokens/s | vs TRL | peak RSS MB | first step s |", "|---|---|---|---|---|"]
    base = results.get("trl")
    base_s = statistics.median(r["step_s"] for r in base) if base and all("step_s" in r for r in base) else None
    for variant, runs in results.items():
        if any("error" in r for r in runs):
            lines.append(f"| {variant} | failed: {next(r['error'] for r in runs if 'error' in r)} | | | |")
            continue
        s = statistics.median(r["step_s"] for r in runs)
        ratio = f"{base_s / s:.2f}x" if base_s else "n/a"
        lines.append(f"| {variant} | {tokens / s:,.0f} | {ratio} | {max(r['peak_rss_mb'] for r in runs):,.0f} | "
                     f"{statistics.median(r['first_step_s'] for r in runs):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="W1")
    p.add_argument("--before", help="checkout of msllm before a change (git worktree add)")
    p.add_argument("--after", default=str(REPO))
    p.add_argument("--variants", default="msllm-after,trl")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="directory for the markdown table and JSON")
    p.add_argument("--shared-seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return print_result(worker_msllm(args) if args.worker.startswith("msllm") else worker_trl(args))
    variants = [v for v in args.variants.split(",") if not v.startswith("msllm-before") or args.before]
    args.before = args.before or args.after
    with tempfile.TemporaryDirectory() as tmp:
        write_inputs(args.shape, Path(tmp), args.pairs, args.seq)
        args.shared_seq = shared_row_length(Path(tmp) / "pairs.jsonl")
        results = alternate(variants, args.rounds, lambda variant: spawn(variant, args, Path(tmp)))
    text = report(args, results)
    print(text)
    save(args.out, f"dpo-{args.shape}", text, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
