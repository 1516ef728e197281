"""DPO (train.objective: dpo): preference rows tokenized as TRL does, the compiled step's loss and gradients
equal TRL's DPOTrainer on the same tiny model and pairs, LoRA's in-step reference is the base, a short
`msllm train` run learns the preferences, and bad rows are refused in one line."""
import json

import mindspore as ms
import numpy as np
import pytest
import torch

from interop.convert import plan
from interop.verify import max_rel, msllm_model, open_hf
from interop.verify_train import TENSOR_GATE, RecordGradients, to_msllm
from msllm import kernels
from msllm.config import Config, DPOConfig, LoraConfig, OptimConfig, TrainConfig
from msllm.data import preference
from msllm.data.corpus import DataError
from msllm.lora import switch_of
from msllm.models import layers
from msllm.train.build import build_train_step
from msllm.train.dpo import METRICS, precompute_reference
from tests.conftest import assert_same_files
from tests.hf_models import build, save_tokenizer
from tests.numerics import (FP16_RTOL, REORDER_RTOL, assert_close_to_scale, assert_overflow_is_skipped, step_variants,
                            weights)

SEQ = 31  # rows of 32 tokens
TEXT_ROWS = [{"prompt": "def add(x, y):", "chosen": " return x + y", "rejected": " print(1)"},
             {"prompt": "hello", "chosen": " world", "rejected": " the quick brown fox"},
             {"prompt": "print(", "chosen": "1 + 2)", "rejected": "x)"},
             {"prompt": "the quick", "chosen": " brown fox", "rejected": " hello"}]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": "add 1 2"}], "chosen": [{"role": "assistant", "content": "3"}],
              "rejected": [{"role": "assistant", "content": "12"}]},
             {"prompt": [{"role": "user", "content": "hello"}], "chosen": [{"role": "assistant", "content": "world"}],
              "rejected": [{"role": "assistant", "content": "fox"}]}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("dpo"))


def write_models(root):
    """A tiny Llama policy and a different reference (HF dirs), a tokenizer with a chat template, the rows."""
    root.mkdir(parents=True, exist_ok=True)
    texts = ["def add(x, y): return x + y", "hello world, the quick brown fox", "print(1 + 2)"] * 5
    for name, seed in (("policy", 0), ("ref", 1)):
        build("llama2_mha", seed=seed).save_pretrained(root / name)
        save_tokenizer(root / name, texts)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TEXT_ROWS + CHAT_ROWS))
    return root


def trl_trainer(root, rows, loss_type, out):
    """DPOTrainer in fp32 (bf16=False: TRL's default runs the reference model under bf16 autocast)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig as TRLConfig, DPOTrainer

    config = json.loads((root / "policy" / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "policy" / "tokenizer.json"), eos_token=config["eos_token"])
    tok.chat_template = config["chat_template"]
    policy, ref = (AutoModelForCausalLM.from_pretrained(root / n).float() for n in ("policy", "ref"))
    args = TRLConfig(output_dir=str(out), beta=0.1, loss_type=[loss_type], report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(rows))
    return DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tok)


def test_pairs_are_tokenized_as_trl_does(models, tmp_path):
    _, tokens, mask = preference.encode(models / "pairs.jsonl", models / "policy" / "tokenizer.json", SEQ)
    ours = [tokens[k] for k in range(len(tokens))]
    at = 0
    for rows in (TEXT_ROWS, CHAT_ROWS):
        theirs = trl_trainer(models, rows, "sigmoid", tmp_path).train_dataset
        for ex in theirs:
            for side in ("chosen_ids", "rejected_ids"):
                want = ex["prompt_ids"] + ex[side]
                np.testing.assert_array_equal(ours[at][:len(want)], want)
                # the mask marks exactly the completion's labels (its EOS / end of turn included)
                assert mask[at].sum() == len(ex[side]) and mask[at][len(ex["prompt_ids"]) - 1] == 1
                at += 1
    assert at == len(tokens)


@pytest.mark.parametrize("loss_type,head", [("sigmoid", "logits"), ("ipo", "kernel")])
def test_step_loss_and_gradients_equal_trl(models, tmp_path, monkeypatch, loss_type, head):
    """Full fine-tune with precomputed reference log-probs (another model's) against DPOTrainer with
    that model as ref_model: the compiled step's loss and every gradient within TENSOR_GATE (1e-4
    relative; interop/verify_train.py derives it). head=kernel: the log-probs come from the fused
    head kernel's (lse, target), as for a vocabulary too large for whole logits."""
    if head == "kernel":
        monkeypatch.setattr(layers, "HEAD_CHUNK_BYTES", 0)  # no logits are "small": the kernel's branch
    rows = TEXT_ROWS
    trl = trl_trainer(models, rows, loss_type, tmp_path)
    batch = trl.data_collator([trl.train_dataset[i] for i in range(len(rows))])
    their_loss = trl._compute_loss(trl.model, batch, False)
    their_loss.backward()
    their_grads = to_msllm(plan(open_hf(models / "policy")), {n: p.grad for n, p in trl.model.named_parameters()})

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, tokens, mask = preference.encode(path, models / "policy" / "tokenizer.json", SEQ)
    tokens, mask = tokens.reshape(-1, 2, SEQ + 1), mask.reshape(-1, 2, SEQ).astype(np.float32)
    ref = precompute_reference(msllm_model(open_hf(models / "ref")), True, list(zip(tokens, mask)), len(rows))
    model = msllm_model(open_hf(models / "policy"))
    cfg = Config(model=model.cfg, optim=OptimConfig(grad_clip=0.0),
                 train=TrainConfig(objective="dpo", batch_size=len(rows), steps=1),
                 dpo=DPOConfig(loss=loss_type, beta=0.1, precompute_ref=True))
    built = build_train_step(cfg, model, wrap_optimizer=RecordGradients)
    assert built.train_step.loss_cell.logps.tokens.head is not None  # the CPU kernels are on: HEAD_CHUNK_BYTES decides
    loss, *_, stats = built.train_step(*(ms.Tensor(x) for x in (tokens, mask, ref)))
    assert float(loss.asnumpy()) == pytest.approx(their_loss.item(), rel=1e-4)  # measured 3e-7
    ours = built.train_step.optimizer.raw_gradients()
    worst = max(max_rel(ours[n], g)[1] for n, g in their_grads.items())
    assert worst <= TENSOR_GATE, worst  # measured 8e-7
    logged = dict(zip(METRICS, stats.asnumpy()))
    theirs = {k: v[-1] for k, v in (trl._metrics["train"] or trl._metrics["eval"]).items()}
    for key in METRICS:
        assert logged[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def both_layouts(path, tokenizer_json, seq_len=SEQ):
    """The pairs of a JSONL file as two rows each [(tokens [2, L+1], mask [2, L])] and as one
    (dpo.share_prompt) [(tokens [L+1], mask [L], segments, positions)], as PairRows yields them."""
    _, tokens, mask = preference.encode(path, tokenizer_json, seq_len)
    two = list(zip(tokens.reshape(-1, 2, seq_len + 1), mask.reshape(-1, 2, seq_len).astype(np.float32)))
    _, tokens, mask = preference.encode(path, tokenizer_json, seq_len, share_prompt=True)
    one = [(t, m.astype(np.float32), *preference.branch_tables(m)) for t, m in zip(tokens, mask)]
    return two, one


def lora_step(model, pairs, share_prompt=False, attention="auto"):
    """One LoRA DPO step at lr 0 (reference: the adapters off, in the step) on `pairs` with adapters that
    change the model (B ~ N(0, 0.5)) -> (loss, metrics, the LoRA gradients)."""
    cfg = Config(model=model.cfg, optim=OptimConfig(lr=0.0, grad_clip=0.0),
                 train=TrainConfig(objective="dpo", batch_size=len(pairs), steps=1, attention=attention),
                 lora=LoraConfig(rank=4, targets=["q", "v", "down"]),
                 dpo=DPOConfig(beta=0.5, share_prompt=share_prompt))
    built = build_train_step(cfg, model, wrap_optimizer=RecordGradients)
    rng = np.random.default_rng(0)
    for p in model.trainable_params():
        if p.name.endswith("lora_b"):
            p.set_data(ms.Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    out = built.train_step(*(ms.Tensor(np.stack(column)) for column in zip(*pairs)))
    return float(out[0].asnumpy()), out[-1].asnumpy(), built.train_step.optimizer.raw_gradients()


@pytest.fixture(scope="module")
def lora_pairs(models):
    """The first 4 pairs in both layouts, the base model's log-probs of them (two rows a pair), the
    LoRA step on them (two rows a pair) and its adapted model's log-probs."""
    two, one = (pairs[:4] for pairs in both_layouts(models / "pairs.jsonl", models / "policy" / "tokenizer.json"))
    base = precompute_reference(msllm_model(open_hf(models / "policy")), True, two, 4)
    model = msllm_model(open_hf(models / "policy"))
    step = lora_step(model, two)
    adapted = precompute_reference(model, True, two, 4)
    return {"two": two, "one": one, "base": base, "step": step, "adapted": adapted, "switch": switch_of(model)}


def test_lora_reference_is_the_base_with_adapters_off_in_the_step(lora_pairs):
    """With LoRA and no precomputed log-probs the step's reference is the base model: the logged
    rewards give back the reference's log-probs, equal to the plain converted model's, while the
    policy's (adapters on again, nonzero B) are the adapted model's."""
    base, adapted = lora_pairs["base"], lora_pairs["adapted"]
    assert np.abs(adapted - base).max() > 0.1
    got = dict(zip(METRICS, lora_pairs["step"][1]))
    assert got["logps/chosen"] == pytest.approx(adapted[:, 0].mean(), rel=1e-5)
    assert got["logps/rejected"] == pytest.approx(adapted[:, 1].mean(), rel=1e-5)
    assert got["logps/chosen"] - got["rewards/chosen"] / 0.5 == pytest.approx(base[:, 0].mean(), rel=1e-5)
    assert got["logps/rejected"] - got["rewards/rejected"] / 0.5 == pytest.approx(base[:, 1].mean(), rel=1e-5)
    assert float(lora_pairs["switch"].on.asnumpy()) == 1.0


def test_shared_prompt_row_gives_each_completion_its_own_log_prob(models, lora_pairs):
    """dpo.share_prompt: a pair's one row holds each completion's labels at the positions its own row
    has them, and the log-probs summed over a branch equal those of the completion's row alone (the
    same attention: the rejected branch sees the prompt and itself, not the chosen tokens). Were
    both completions ordinary tokens of the prompt's segment, the rejected ones would see the chosen
    ones: other log-probs."""
    two, one = lora_pairs["two"], lora_pairs["one"]
    for (tokens, mask), (row, sides, segments, positions) in zip(two, one):
        for side in (0, 1):
            at, theirs = np.flatnonzero(sides == side + 1), np.flatnonzero(mask[side])
            np.testing.assert_array_equal(row[at + 1], tokens[side][theirs + 1])  # the labels
            np.testing.assert_array_equal(positions[at], theirs)                # at their own positions
    model = msllm_model(open_hf(models / "policy"))
    got = precompute_reference(model, True, one, 4, share_prompt=True)
    np.testing.assert_allclose(got, lora_pairs["base"], rtol=1e-6)  # measured: equal
    seeing_chosen = [(t, m, np.where(g < -1, 0, g), p) for t, m, g, p in one]
    wrong = precompute_reference(model, True, seeing_chosen, 4, share_prompt=True)
    assert np.array_equal(wrong[:, 0], got[:, 0]) and np.abs(wrong[:, 1] - got[:, 1]).min() > 1e-3


@pytest.mark.parametrize("attention,core", [("softmax", kernels.FusedSoftmaxAttention), ("flash", kernels.FlashAttention)])
def test_shared_prompt_step_equals_the_two_row_step(models, lora_pairs, attention, core):
    """The LoRA step on the pairs as one row each, through the fused CPU rope and the fused softmax (each
    row's own [1, s, d] and [1, s, t] tables) or the flash kernel, against the two-row step through the
    softmax core, the same adapters: loss, TRL metrics and every LoRA gradient within fp32 rounding (the
    two-row step equals TRL's: test_step_loss_and_gradients_equal_trl)."""
    want_loss, want_stats, want_grads = lora_pairs["step"]
    model = msllm_model(open_hf(models / "policy"))
    loss, stats, grads = lora_step(model, lora_pairs["one"], True, attention)
    cells = [cell for _, cell in model.cells_and_names()]
    assert any(isinstance(cell, kernels.FusedRope) for cell in cells)
    assert any(isinstance(getattr(cell, "softmax_attention", None), core) for cell in cells)
    assert abs(want_stats[3]) > 0.05  # the policy is not the reference: margins, a loss with gradients
    assert loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(stats, want_stats, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() and len(grads) == 3 * 2 * 2  # 2 layers, 3 targets, A and B
    worst = max(max_rel(grads[n], g)[1] for n, g in want_grads.items())
    assert worst <= 1e-5, worst


@pytest.fixture(scope="module")
def precision_steps(models):
    """One DPO step (full fine-tune, sigmoid, beta 0.1, precomputed reference log-probs: a uniform model's,
    -ln(vocab) a completion token) on the 6 pairs of pairs.jsonl from the policy's weights: fp32, fp32 with
    selective recompute, fp16 with a loss scale of 2^16 (tests.numerics.step_variants); and the step's inputs."""
    _, tokens, mask = preference.encode(models / "pairs.jsonl", models / "policy" / "tokenizer.json", SEQ)
    tokens, mask = tokens.reshape(-1, 2, SEQ + 1), mask.reshape(-1, 2, SEQ).astype(np.float32)
    ref = (-np.log(300.0) * mask.sum(-1)).astype(np.float32)
    policy = msllm_model(open_hf(models / "policy"))
    cfg = Config(model=policy.cfg, optim=OptimConfig(grad_clip=0.0),
                 train=TrainConfig(objective="dpo", batch_size=len(tokens), steps=2, loss_scale=2.0 ** 16),
                 dpo=DPOConfig(beta=0.1, precompute_ref=True))
    inputs = [tokens, mask, ref]
    return step_variants(cfg, weights(policy.trainable_params()), inputs, fp32={},
                         recompute={"recompute": "selective"}, fp16={"precision": "fp16"}), inputs


def test_dpo_recompute_is_the_plain_step(precision_steps):
    """Selective recompute runs the same forward kernels again in backward: the plain step's loss, metrics and
    gradients."""
    (plain, plain_grads, _), (got, grads, _) = (precision_steps[0][k] for k in ("fp32", "recompute"))
    assert got == plain
    assert all(np.array_equal(grads[n], g) for n, g in plain_grads.items())


def test_dpo_fp16_is_fp32_within_fp16_rounding_and_an_overflow_is_skipped(precision_steps):
    """fp16 compute with loss scaling: the scale is divided out, each log-prob is fp32's within FP16_RTOL of
    its magnitude (tests.numerics: the 2-layer model's fp16 roundings), so each sequence's sum within FP16_RTOL
    of the sum of magnitudes (logps/*) and the loss, whose slope in a pair's margin is at most beta, within
    beta x FP16_RTOL x (|logps/chosen| + |logps/rejected|); the gradients within FP16_RTOL of their scale.
    Then a scale of 2^40 overflows fp16 in backward: the step is skipped (weights untouched), the scale halves."""
    steps, inputs = precision_steps
    (want, want_grads, _), (got, grads, built) = steps["fp32"], steps["fp16"]
    loss, norm, lr, finite, scale, *stats = got
    assert finite == 1.0 and scale == 2.0 ** 16 and lr == want[2]
    metrics, fp32 = dict(zip(METRICS, stats)), dict(zip(METRICS, want[5:]))
    for key in ("logps/chosen", "logps/rejected"):
        assert metrics[key] == pytest.approx(fp32[key], rel=FP16_RTOL), key
    magnitude = abs(fp32["logps/chosen"]) + abs(fp32["logps/rejected"])
    assert abs(loss - want[0]) <= 0.1 * FP16_RTOL * magnitude
    assert norm == pytest.approx(want[1], rel=FP16_RTOL)
    assert_close_to_scale(grads, want_grads, FP16_RTOL)

    assert_overflow_is_skipped(built, inputs)


@pytest.mark.parametrize("row,complaint", [
    ({"prompt": "hi", "chosen": " there"}, "missing rejected"),
    ({"prompt": "hi", "chosen": " there", "rejected": 3}, "expected strings"),
    ({"prompt": "hi " * 40, "chosen": " there", "rejected": " you"}, "does not fit data.seq_len"),
])
def test_bad_pairs_are_one_line_naming_file_and_line(models, tmp_path, row, complaint):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TEXT_ROWS[0]) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        preference.prepare(path, str(models / "policy" / "tokenizer.json"), tmp_path / "shard", SEQ, 0.1, 300,
                           print)
    assert f"{path}:3:" in str(e.value) and complaint in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "shard").exists()


def test_a_shard_is_read_only_the_way_it_was_made(models, tmp_path):
    """A shard of two rows a pair read with dpo.share_prompt (or one row a pair without) is one line naming
    the key; a pair too long for one row is one line naming the row and the option."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in TEXT_ROWS))
    tokenizer = str(models / "policy" / "tokenizer.json")
    for made in (False, True):
        shard = preference.prepare(rows, tokenizer, tmp_path / f"shard_{made}", SEQ, 0.25, 300, print, made)
        index = json.loads((shard / "index.json").read_text())
        assert len(preference.PairRows(shard, "train", index, share_prompt=made)) == 3
        with pytest.raises(DataError) as e:
            preference.PairRows(shard, "train", index, share_prompt=not made)
        assert "dpo.share_prompt" in str(e.value) and "\n" not in str(e.value)
    rows.write_text(json.dumps({"prompt": "hello " * 6, "chosen": " world" * 4, "rejected": " fox" * 4}) + "\n")
    with pytest.raises(DataError, match="1 pair; need at least 2"):  # two rows fit: 18 + 9 tokens (one + 5 + 1 do not)
        preference.encode(rows, models / "policy" / "tokenizer.json", SEQ)
    with pytest.raises(DataError) as e:
        preference.prepare(rows, tokenizer, tmp_path / "long", SEQ, 0.25, 300, print, True)
    assert f"{rows}:1:" in str(e.value) and "dpo.share_prompt: false" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "long").exists()


def test_shared_prompts_are_refused_where_a_prompt_cannot_branch():
    """dpo.share_prompt on Ascend (its packed attention takes whole samples), with Gated DeltaNet layers
    (a recurrent state does not branch) or sliding-window layers (a window counts slots, not positions):
    one line naming the key."""
    from types import SimpleNamespace

    from msllm.config import ConfigError, ModelConfig
    from msllm.config_file import load_config
    from msllm.train.dpo import DPOLoss

    with pytest.raises(ConfigError, match="dpo.share_prompt: runs on the CPU only"):
        load_config(None, ["train.objective=dpo", "dpo.share_prompt=true", "dpo.precompute_ref=true",
                           "train.device=ascend"])
    for kind, complaint in (("linear", "needs attention layers"), ("sliding", "not built for sliding-window")):
        model = SimpleNamespace(cfg=ModelConfig(num_layers=2, layer_types=[kind, "full"], sliding_window=8))
        with pytest.raises(ConfigError, match=f"dpo.share_prompt: (is )?{complaint}"):
            DPOLoss(model, DPOConfig(share_prompt=True, precompute_ref=True))
        DPOLoss(model, DPOConfig(precompute_ref=True))  # two rows a pair: any layer


def sets(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def train_here(*args):
    """msllm train in this process (the test session's MindSpore runtime): no second start-up."""
    from msllm.cli import main

    assert main([str(a) for a in args]) == 0


def records(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def preference_rows(models):
    return write_preference_rows(models)


def write_preference_rows(models):
    """Pairs whose chosen completion follows one rule (the sum) and rejected another."""
    rows = []
    for i in range(40):
        a, b = i % 7, i % 5
        rows.append({"prompt": f"add {a} {b} =", "chosen": f" {a + b}", "rejected": f" {a * b + 10}"})
    path = models / "train_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_args(models, rows, run, **extra):
    values = {"data.path": rows, "data.seq_len": 16, "train.run_dir": run, "train.objective": "dpo",
              "train.steps": 8, "train.batch_size": 4, "train.log_every": 1, "train.eval_every": 8,
              "train.ckpt_every": 8, "train.sample_tokens": 0, "optim.lr": 5e-2, "optim.warmup_steps": 0,
              "optim.decay": "constant", **extra}
    return ["train", "--init-from", str(models / "policy"), *sets(values)]


LORA_RUN = {"lora.rank": 8, "lora.targets": "[q, v, down]", "dpo.beta": 0.5, "train.ckpt_every": 4}


@pytest.fixture(scope="module")
def lora_run(models, preference_rows, tmp_path_factory):
    """8 DPO steps with LoRA, 4 pairs a step, a checkpoint at steps 4 and 8."""
    run = tmp_path_factory.mktemp("dpo_lora") / "run"
    train_here(*run_args(models, preference_rows, run, **LORA_RUN))
    return run


def test_msllm_train_dpo_with_lora_learns_the_preferences(models, lora_run, tmp_path):
    """`msllm train` with train.objective dpo and LoRA (reference: the base, adapters off in the step):
    starts at ln 2 (the adapters start at B = 0, so policy = reference), the loss falls and the reward
    accuracy rises, every row carries TRL's metric names, and the adapters export as PEFT."""
    run = lora_run
    rows = records(run, "train")
    first = records(run, "compile")[0]["loss"]
    assert first == pytest.approx(np.log(2), abs=1e-6)
    assert all(set(METRICS) <= set(r) for r in rows) and [r["step"] for r in rows] == list(range(2, 9))
    assert np.mean([r["loss"] for r in rows[-3:]]) < first - 0.1
    assert np.mean([r["rewards/margins"] for r in rows[-3:]]) > 0.2
    assert records(run, "eval")[-1]["val_loss"] < first
    # the DPO adapters merge and export like SFT ones: PEFT on the HF base computes the merged model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from interop.convert import convert
    from interop.pretrained import export_peft, merge

    convert(merge(run, tmp_path / "merged"), tmp_path / "merged_hf", to="hf", progress=False)
    export_peft(run, tmp_path / "peft")
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 300, (2, 12)))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged_hf").float().eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(models / "policy").float().eval()
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(ids).logits
    assert (adapted - merged).abs().max() <= 1e-5 * merged.abs().max() < (before - merged).abs().max()


def test_msllm_train_with_shared_prompts_is_the_two_row_run(models, preference_rows, lora_run, tmp_path):
    """`msllm train` with dpo.share_prompt (one row a pair, through the softmax core's mask): the shard
    says so, and steps 2 and 3 (after the LoRA updates) log lora_run's losses, gradient norms and TRL
    metrics within fp32 rounding carried through the AdamW updates (as the two-worker test: 1e-4)."""
    run = tmp_path / "shared"
    train_here(*run_args(models, preference_rows, run, **{**LORA_RUN, "dpo.share_prompt": "true", "train.steps": 3,
                                                          "train.ckpt_every": 3, "train.eval_every": 3}))
    index = json.loads((run / "data" / "index.json").read_text())
    assert index["share_prompt"] and (run / "data" / "train.bin").stat().st_size == index["train_pairs"] * 17 * 2
    want, got = records(lora_run, "train")[:2], records(run, "train")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 3]
    for key in ("loss", "grad_norm", *METRICS):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-4, atol=1e-6, err_msg=key)


def test_dpo_run_stopped_and_resumed_is_the_whole_run(lora_run, tmp_path):
    """The LoRA run stopped after step 4 (its checkpoint and metrics rows up to there) and resumed with
    --resume: steps 5..8 read the same pairs, and the step-8 adapters and optimizer state are bitwise the
    whole run's, as are each step's loss, gradient norm and TRL metrics. (The loss differed in float32's last
    bit at steps 6..8 while MindSpore's CPU Softplus kernel computed it: its rounding follows a thread split
    that varies over a graph's first launches, the whole run's 6th to 15th and the resumed run's 2nd to 11th;
    msllm.train.dpo.softplus.)"""
    import shutil

    from safetensors.numpy import load_file

    stopped = tmp_path / "stopped"
    shutil.copytree(lora_run, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step_0000008")
    rows = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows
                                                   if r.get("step", 0) <= 4 and r["kind"] in ("compile", "train")))
    train_here("train", "--resume", stopped)
    for name in ("model.safetensors", "optim.safetensors"):
        whole, resumed = (load_file(str(r / "checkpoints" / "step_0000008" / name)) for r in (lora_run, stopped))
        assert whole.keys() == resumed.keys() and all(np.array_equal(whole[k], resumed[k]) for k in whole), name

    def after_4(run):  # a resumed run's first step is its compile row: a loss, no other metrics
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if r["kind"] in ("compile", "train") and r["step"] > 4]
    whole, resumed = after_4(lora_run), after_4(stopped)
    assert [r["step"] for r in whole] == [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    for key in ("grad_norm", *METRICS):
        assert [r[key] for r in resumed[1:]] == [r[key] for r in whole[1:]], key


def test_full_fine_tune_reads_precomputed_reference_logps(models, preference_rows, tmp_path):
    """dpo.precompute_ref: the starting model's log-probs are stored beside the shard once, so the
    first step (policy = reference) has margin 0 and loss ln 2, and a full fine-tune then learns."""
    run = tmp_path / "full"
    train_here(*run_args(models, preference_rows, run, **{"dpo.precompute_ref": "true", "train.steps": 3,
                                                         "optim.lr": 3e-3, "train.eval_every": 3,
                                                         "train.ckpt_every": 3}))
    shard = run / "data"
    index = json.loads((shard / "index.json").read_text())
    ref = np.fromfile(shard / "train.ref.bin", np.float32).reshape(index["train_pairs"], 2)
    assert (ref < 0).all() and json.loads((shard / preference.REF_INDEX).read_text())["init_from"]
    assert records(run, "compile")[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert records(run, "train")[-1]["loss"] < np.log(2)


def two_worker_commands(out):
    """lora_run's settings on 2 workers at train.batch_size 2 (the same global batch of 4 pairs a step), with the
    reference in the step (adapters off) and with dpo.precompute_ref (each worker computing half the pairs'
    reference log-probs), into OUT/in_step and OUT/precomputed: run in conftest's shared msrun launch, from
    models written to OUT/models as the module's fixtures write theirs."""
    models = write_models(out / "models")
    rows = write_preference_rows(models)
    two = {**LORA_RUN, "train.batch_size": 2, "train.threads": 1}
    return [run_args(models, rows, out / "in_step", **two),
            run_args(models, rows, out / "precomputed", **two, **{"dpo.precompute_ref": "true"})]


@pytest.fixture(scope="module")
def two_workers(models, msrun_workers):
    """name -> run dir of two_worker_commands' runs, from the same models as lora_run's."""
    out = msrun_workers / "train_worker" / "test_dpo"
    assert_same_files(out / "models", models)
    return {name: out / name for name in ("in_step", "precomputed")}


@pytest.mark.parametrize("name", ["in_step", "precomputed"])
def test_two_workers_train_as_one_on_the_same_global_batch(lora_run, two_workers, name):
    """Each worker takes 2 of the step's 4 pairs; the all-reduced loss and gradients, and the metrics
    averaged over the workers (TRL's rewards/*, logps/*: means over the pairs), are the one-worker run's
    at every step, and so is the held-out loss. The first step differs only in summation order
    (tests.numerics.REORDER_RTOL); later steps carry that through 8 AdamW updates at lr 5e-2, hence
    1e-4 (measured: losses within 7e-8 and log-probs 9e-8 relative, rewards, accuracies and gradient
    norms bitwise; rank 0's metrics alone would be the means over other pairs, another split of the
    pairs other losses). With
    dpo.precompute_ref the stored reference log-probs (each worker computed half) are the base model's,
    which the one-worker run computes in the step: the same losses."""
    one, two = lora_run, two_workers[name]
    first = [records(run, "compile")[0]["loss"] for run in (one, two)]
    assert first[1] == pytest.approx(first[0], rel=REORDER_RTOL)
    want, got = records(one, "train"), records(two, "train")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(2, 9))
    for key in ("loss", "grad_norm", *METRICS):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-4, atol=1e-6, err_msg=key)
    assert records(two, "eval")[-1]["val_loss"] == pytest.approx(records(one, "eval")[-1]["val_loss"], rel=1e-4)
    if name == "precomputed":
        index = json.loads((two / "data" / "index.json").read_text())
        ref = np.fromfile(two / "data" / "train.ref.bin", np.float32).reshape(index["train_pairs"], 2)
        assert (ref < 0).all()  # every pair's, both workers' shares
