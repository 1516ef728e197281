"""The layout checker's rules and `msllm plan`: closed forms for memory, the CLI's table and its
parallel: block (which must pass the checker), nothing-fits and --check. No MindSpore here."""
import dataclasses
import shlex
import subprocess
import sys

import pytest
import yaml

from msllm.config import ConfigError, ParallelConfig

from msllm.config_file import config_from_dict, load_config
from msllm.layout import table as L
from msllm.layout import plan as P
from msllm.layout.check import check_execution, check_parallel, global_batch_of
from tests.conftest import REPO, run_cli

LLAMA2 = REPO / "configs" / "llama2_7b.yaml"


# ---- checker -------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key, message", [
    (["parallel.tp=3"], "parallel.tp", "must divide model.num_heads (32 % 3 != 0)"),
    (["model.num_heads=28", "model.num_kv_heads=4", "model.hidden_size=3584", "parallel.tp=7"], "parallel.tp",
     "must divide model.num_kv_heads (4) or be a multiple of it"),
    (["model.ffn_size=11000", "parallel.tp=16"], "parallel.tp", "must divide model.ffn_size (11000 % 16 != 0)"),
    (["parallel.pp=33", "parallel.micro_batches=33"], "parallel.pp", "must be <= model.num_layers (32)"),
    (["parallel.pp=4", "parallel.micro_batches=2"], "parallel.micro_batches", "must be >= parallel.pp (4)"),
    (["parallel.dp=2", "parallel.micro_batches=2", "train.batch_size=3"], "parallel", "global batch 6"),
    (["parallel.micro_batches=2", "train.batch_size=2", "train.accum_steps=2"], "parallel.micro_batches",
     "and train.accum_steps both split the batch"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "needs tp > 1"),
    (["parallel.tp=8", "parallel.sequence_parallel=true", "data.seq_len=1020"], "parallel.sequence_parallel",
     "needs data.seq_len divisible by tp (1020 % 8 != 0)"),
    (["model.tie_embeddings=true", "parallel.pp=2", "parallel.micro_batches=2", "train.batch_size=2"],
     "parallel.pp", "tied embeddings"),
    (["parallel.dp=0"], "parallel.dp", "must be >= 1"),
])
def test_checker_names_the_key_in_one_line(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        load_config(LLAMA2, overrides)  # every config load runs the device-free checks
    assert err.value.key == key
    assert message in str(err.value) and "\n" not in str(err.value)


def test_checker_device_count_and_valid_layouts():
    cfg = load_config(LLAMA2, ["parallel.dp=2", "parallel.tp=4", "parallel.pp=2", "parallel.micro_batches=4",
                               "parallel.sequence_parallel=true", "train.batch_size=8"])
    check_parallel(cfg, 16)
    with pytest.raises(ConfigError, match=r"parallel: dp x tp x pp = 2 x 4 x 2 = 16 must equal the device count 8"):
        check_parallel(cfg, 8, source="c.yaml")
    # GQA with fewer KV heads than tp is valid (grouped), and a vocab tp does not divide falls back
    g = load_config(REPO / "configs" / "llama3_8b.yaml", ["parallel.tp=16", "model.vocab_size=128250"])
    check_parallel(g, 16)
    sh = L.sharding(g.model, g.parallel)
    assert (sh.tp_kv, sh.tp_rep, sh.vocab_split) == (8, 2, False)


def test_execution_profile_constraints():
    def cfg(**train):
        return config_from_dict({"train": train, "parallel": {"sink_size": train.pop("sink", 0)}})
    with pytest.raises(ConfigError, match="train.jit_level: O2 .* Ascend only"):
        check_execution(cfg(jit_level="O2"))
    with pytest.raises(ConfigError, match="train.sample_tokens: .*dynamic shapes"):
        check_execution(cfg(jit_level="O2", device="ascend"))
    with pytest.raises(ConfigError, match="train.eval_every: must be a multiple of parallel.sink_size"):
        check_execution(cfg(device="ascend", sink=20, log_every=20, eval_every=30, ckpt_every=200))
    check_execution(cfg(jit_level="O2", device="ascend", sample_tokens=0, sink=10, log_every=20,
                        eval_every=100, ckpt_every=200))


# ---- memory closed forms -------------------------------------------------------------------------

def test_states_are_16_bytes_per_parameter_and_zero1_is_4_plus_12_over_n():
    for precision in ("fp32", "bf16"):
        cfg = P.with_layout(load_config(LLAMA2, [f"train.precision={precision}"]), ParallelConfig(), global_batch=8)
        e = P.estimate(cfg, device="910b")
        psi = cfg.model.num_params()
        assert e["params"] == psi
        assert e["weights"] + e["grads"] + e["optimizer"] == 16 * psi
    n = 8
    cfg = P.with_layout(load_config(LLAMA2, ["train.precision=bf16"]), ParallelConfig(), global_batch=8)
    e = P.estimate(cfg, ParallelConfig(dp=n, optimizer_shard=True), "910b")
    assert e["weights"] + e["grads"] + e["optimizer"] == pytest.approx(4 * psi + 12 * psi / n)
    assert e["optimizer_by_zero1"] == {False: 12 * psi, True: pytest.approx(12 * psi / n)}


def test_tensor_parallel_holds_the_table_slice_of_each_weight():
    cfg = load_config(LLAMA2)
    for tp in (2, 8):
        sh = L.sharding(cfg.model, ParallelConfig(tp=tp))
        h, v, L_ = cfg.model.hidden_size, cfg.model.vocab_size, cfg.model.num_layers
        replicated = (2 * L_ + 1) * h   # the norms
        assert P.stage_parameters(cfg.model, sh) == [(cfg.model.num_params() - replicated) // tp + replicated]


@pytest.mark.parametrize("t, sp", [(1, False), (4, False), (4, True)])
def test_activations_follow_korthikanti_closed_forms(t, sp):
    """Per layer and micro-batch, bf16, MHA (kv = heads): Korthikanti et al.'s structure with this
    Llama's terms: s b h (8 + 8/t + 6f/(h t)) + 4 a s^2 b / t; every term / t under sequence
    parallel; full recompute keeps 2 s b h (/ t); flash attention turns the s^2 term into 4 a s b / t."""
    m = load_config(LLAMA2).model
    s, b, h, a, f = 4096, 2, m.hidden_size, m.num_heads, m.ffn_size
    sh = L.sharding(m, ParallelConfig(tp=t, sequence_parallel=sp))
    sp_div = t if sp else 1

    def act(recompute, flash=False):
        return P.layer_activations(m, sh, b, s, 2, recompute, flash)

    linear = s * b * h * (8 / sp_div + 8 / t + 6 * f / (h * t))
    assert act("none") == pytest.approx(linear + 4 * a * s * s * b / t)
    assert act("none", flash=True) == pytest.approx(linear + 4 * a * s * b / t)
    # FlashAttentionScore keeps softmax_max and softmax_sum, [b, a, s, 8] fp32 each, not one log-sum-exp
    assert P.layer_activations(m, sh, b, s, 2, "none", True, 64) == pytest.approx(linear + 64 * a * s * b / t)
    assert act("selective") == pytest.approx(s * b * h * (8 / sp_div + 8 / t))
    assert act("full") == pytest.approx(2 * s * b * h / sp_div)
    if sp:
        assert act("none") == pytest.approx(P.layer_activations(m, L.sharding(m, ParallelConfig()), b, s, 2, "none",
                                                                False) / t)


def test_the_attention_core_counted_is_the_one_train_attention_resolves_to():
    """No --flash: on 910b (Ascend) auto and flash count FlashAttentionScore whenever it takes the
    config (16-bit compute here), softmax the [s, t] probabilities; cpu as auto picks there (from
    1,024 tokens); h100 has no flash core in msllm."""
    def est(device, *sets):
        cfg = P.with_layout(load_config(LLAMA2, list(sets)), ParallelConfig(), global_batch=8)
        return P.uses_flash(cfg, P.DEVICES[device]), P.estimate(cfg, device=device)

    for sets, flash in ((["train.precision=bf16"], True), (["train.precision=bf16", "train.attention=flash"], True),
                        (["train.precision=bf16", "train.attention=softmax"], False), ([], False)):
        resolved, e = est("910b", *sets)
        assert resolved == flash, sets
        assert e["activations"] == e["activations_by_recompute"]["none", flash], sets
    assert est("910b", "train.precision=bf16")[1]["total"] < est("910b", "train.precision=bf16",
                                                                "train.attention=softmax")[1]["total"]
    assert est("cpu", "data.seq_len=512")[0] is False and est("cpu", "data.seq_len=2048")[0] is True
    assert est("h100", "train.precision=bf16")[0] is False


def test_pipeline_keeps_in_flight_micro_batches_on_the_first_stage():
    base = load_config(LLAMA2, ["train.precision=bf16"])
    p = ParallelConfig(pp=4, micro_batches=8)
    cfg = P.with_layout(base, p, recompute="full", global_batch=8)
    e = P.estimate(cfg, device="910b")
    sh = L.sharding(cfg.model, p)
    per_layer = P.layer_activations(cfg.model, sh, 1, 4096, 2, "full", False)
    rebuilt = P.layer_activations(cfg.model, sh, 1, 4096, 2, "none", False) - per_layer
    first = 8 * per_layer * 4 + rebuilt            # 8 layers, pp = 4 micro-batches in flight
    last = 8 * per_layer * 1 + rebuilt + 2 * 4 * 4096 * cfg.model.vocab_size
    assert e["activations_by_recompute"]["full", False] == pytest.approx(first if e["stage"] == 0 else last)
    assert e["bubble"] == pytest.approx(3 / 11)


def test_cpu_estimate_is_the_process_runtime_plus_closed_forms():
    """W1 of tools/bench_train.py, one process: runtime + 16 bytes per parameter + activations (4 layers
    of the Korthikanti count and 2 fp32 logits) + the CPU step's workspace, each in closed form; ZeRO-1
    at dp 2 halves the moments and adds its copies."""
    from msllm.config import Config, DataConfig, ModelConfig, TrainConfig
    m = ModelConfig(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8, ffn_size=1376,
                    max_seq_len=256)
    b, s, h, a, f, v, psi = 4, 256, 512, 8, 1376, 4096, m.num_params()
    cfg = Config(model=m, data=DataConfig(seq_len=s), train=TrainConfig(batch_size=b))
    e = P.estimate(cfg, device="cpu")
    tokens = b * s
    layer = tokens * (4 * h * 4 + 4 * h * 4 + 3 * f * 4 + 4 * a * s)  # norms, q/k/v/o, MLP, fp32 probabilities
    parts = {"runtime": 2 ** 29, "weights": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi,
             "activations": 4 * layer + 2 * 4 * tokens * v,
             "workspace": 4 * tokens * 4 * h * 4 + 2 * 4 * a * s * tokens + 4 * tokens * v}
    assert {k: e[k] for k in parts} == pytest.approx(parts)
    assert e["total"] == pytest.approx(sum(parts.values()))
    dp2 = P.estimate(cfg, ParallelConfig(dp=2), "cpu")
    zero1 = P.estimate(cfg, ParallelConfig(dp=2, optimizer_shard=True), "cpu")
    assert zero1["optimizer"] == pytest.approx(dp2["optimizer"] / 2) == pytest.approx(4 * psi)
    assert dp2["workspace"] - e["workspace"] == pytest.approx(P.DP_GRAD_COPIES * 4 * psi + P.COLLECTIVE_BUCKETS * 2 ** 25)
    assert zero1["workspace"] - dp2["workspace"] == pytest.approx(P.ZERO1_COPIES * 4 * psi)
    assert P.estimate(cfg, device="910b")["runtime"] == P.estimate(cfg, device="910b")["workspace"] == 0


def test_parse_bytes():
    assert P.parse_bytes("64GB") == 64 * 2 ** 30 == P.parse_bytes("64 GiB") == P.parse_bytes("64")
    assert P.parse_bytes("512MB") == 2 ** 29 and P.parse_bytes("1.5TB") == 1.5 * 2 ** 40
    with pytest.raises(P.PlanError, match="--device-mem"):
        P.parse_bytes("lots")


# ---- the CLI -------------------------------------------------------------------------------------

def plan_cli(capsys, *args):
    from msllm.cli import main
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def train_config(config, overrides_line: str):
    """The config `msllm train --config <config> <overrides_line>` trains with: the train command's own
    parser and the real loader."""
    from msllm.cli import build_parser

    args, extra = build_parser().parse_known_args(["train", "--config", str(config), *shlex.split(overrides_line)])
    assert extra == []
    return load_config(args.config, args.set)


def test_plan_prints_layouts_and_set_overrides_that_train_the_planned_layout(capsys):
    code, out, _ = plan_cli(capsys, "--config", str(LLAMA2), "--devices", "8", "--global-batch", "64",
                            "--set", "train.precision=bf16")
    assert code == 0
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["dp", "tp", "pp"])
    rows = [line.split() for line in lines[head + 1:] if line[:3].strip().isdigit()]
    assert len(rows) >= 5 and all(int(r[0]) * int(r[1]) * int(r[2]) == 8 for r in rows)
    step_times = [float(r[-3]) for r in rows]
    assert step_times == sorted(step_times)
    assert lines[-2] == (f"# as --set overrides: append them to `msllm train --config {LLAMA2}` (or to the train "
                         "command after `msllm launch ... --`):")
    assert "parallel:" not in out  # no YAML block: appended to the config it would repeat train:
    cfg = train_config(LLAMA2, lines[-1])  # the plan's own --set is in the line: bf16 without repeating it
    dp, tp, pp, micro, zero1, sp, recompute = rows[0][:7]  # the best layout, the table's first row
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.micro_batches) == (int(dp), int(tp), int(pp), int(micro))
    assert (p.optimizer_shard, p.sequence_parallel, cfg.train.recompute) == (zero1 == "y", sp == "y", recompute)
    assert cfg.train.precision == "bf16" and lines[-1].count("train.precision") == 1
    check_parallel(cfg, 8)
    assert global_batch_of(cfg) == 64
    e = P.estimate(cfg, device="910b")
    assert e["total"] <= 0.9 * 64 * 2 ** 30
    assert f"{e['time']['step']:.2f} s/step" in out


def test_plan_says_which_attention_core_it_counts_and_has_no_flash_option(capsys):
    args = ("--config", str(LLAMA2), "--devices", "8", "--global-batch", "64", "--set", "train.precision=bf16")
    code, out, _ = plan_cli(capsys, *args)
    assert code == 0 and "by estimated step time (flash attention):" in out
    code, out, _ = plan_cli(capsys, *args, "--set", "train.attention=softmax")
    assert code == 0 and "by estimated step time:" in out
    with pytest.raises(SystemExit) as exited:
        plan_cli(capsys, *args, "--flash")
    assert exited.value.code == 2 and "unrecognized arguments: --flash" in capsys.readouterr().err


def test_plan_overrides_replace_the_plans_own_layout_keys(capsys, tmp_path):
    """A --set the layout re-decides (parallel.dp here) is not repeated; other keys are; a config path
    with a space survives the shell."""
    config = tmp_path / "my config.yaml"
    config.write_text(LLAMA2.read_text())
    code, out, _ = plan_cli(capsys, "--config", str(config), "--devices", "8", "--global-batch", "64",
                            "--set", "parallel.dp=4", "--set", "train.precision=bf16", "--set", "optim.lr=1e-4")
    assert code == 0
    line = out.splitlines()[-1]
    assert line.count("parallel.dp=") == 1 and line.startswith("--set train.precision=bf16 --set optim.lr=1e-4 --set parallel.dp=")
    cfg = train_config(config, line)
    assert cfg.optim.lr == 1e-4 and cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp == 8
    assert f"`msllm train --config '{config}'`" in out


def test_plan_nothing_fits_exits_1_with_what_would(capsys):
    code, out, err = plan_cli(capsys, "--config", str(REPO / "configs" / "llama3_8b.yaml"), "--devices", "8",
                              "--device-mem", "16GB", "--set", "train.precision=bf16")
    assert code == 1 and out == ""
    [line] = err.splitlines()
    assert line.startswith("msllm plan: nothing fits 8 x 910b (16 GB")
    assert "GB per device" in line and "16 devices of 16 GB would fit" in line


def test_plan_check_mode(capsys, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(LLAMA2.read_text().replace("  batch_size: 1\n", "  batch_size: 8\n  precision: bf16\n"
                                               "  recompute: selective\n")
                    + "parallel: {dp: 2, tp: 4, sequence_parallel: true}\n")
    code, out, _ = plan_cli(capsys, "--config", str(good), "--devices", "8", "--check")
    assert code == 0 and out.startswith(f"msllm plan: {good}: dp 2 x tp 4 x pp 1") and "fits 8 x 910b" in out
    code, _, err = plan_cli(capsys, "--config", str(good), "--devices", "16", "--check")
    assert code == 2
    assert err.splitlines() == [f"msllm plan: error: {good}: parallel: dp x tp x pp = 2 x 4 x 1 = 8 "
                                "must equal the device count 16"]
    code, _, err = plan_cli(capsys, "--config", str(good), "--devices", "8", "--check", "--device-mem", "8GB")
    assert code == 1 and "does not fit 90% of 8 GB" in err


def test_plan_is_one_line_exit_2_on_bad_layout_and_never_imports_mindspore(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(LLAMA2.read_text() + "parallel: {tp: 3}\n")
    proc = run_cli("plan", "--config", str(bad), "--devices", "3", "--check")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"msllm plan: error: {bad}: parallel.tp: must divide model.num_heads "
                                        "(32 % 3 != 0)"]
    code = ("import sys; from msllm.cli import main; "
            f"rc = main(['plan', '--config', {str(LLAMA2)!r}, '--devices', '64', '--global-batch', '256']); "
            "assert rc == 0 and 'mindspore' not in sys.modules and 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- context parallel ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key, message", [
    (["parallel.cp=3"], "parallel.cp", "needs data.seq_len divisible by 2 x cp = 6 (4096 % 6 != 0)"),
    (["parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2"], "parallel.cp",
     "does not combine with parallel.pp on CPU"),
    (["parallel.cp=2", "parallel.tp=2"], "parallel.cp", "does not combine with parallel.tp on CPU"),
    (["parallel.cp=2", "train.debug_nonfinite=true"], "train.debug_nonfinite", "parallel.cp"),
    (["parallel.cp=0"], "parallel.cp", "must be >= 1"),
    # Ascend: ring attention (the table's), checked before anything is compiled
    (["train.device=ascend", "parallel.cp=3"], "parallel.cp", "must divide data.seq_len (4096 % 3 != 0)"),
    (["train.device=ascend", "parallel.cp=2", "train.attention=softmax"], "train.attention", "ring attention"),
    (["train.device=ascend", "parallel.cp=2", "train.precision=fp32"], "train.precision",
     "parallel.cp needs it (ring attention)"),
    (["train.device=ascend", "parallel.cp=2", "train.batch_size=2"], "parallel",
     "micro-batch must be one sequence (4 sequences over dp 2)"),
    (["train.device=ascend", "parallel.cp=2", "model.sliding_window=1024",
      ], "parallel.cp", "sliding-window layers"),
    (["train.device=gpu", "parallel.cp=2"], "parallel.cp", "runs on CPU and Ascend only"),
])
def test_checker_context_parallel(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        load_config(LLAMA2, ["train.device=cpu", "train.precision=bf16", "parallel.dp=2", *overrides])
    assert err.value.key == key
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [["parallel.cp=2"], ["parallel.ep=2", "model.num_experts=4"]])
def test_cpu_context_and_expert_parallel_load_with_dp_left_to_the_launch(overrides):
    """On CPU, parallel.dp 1 means every launched replica (resolved at launch); cp and ep there are
    msllm.parallel's exchanges over the workers, not table layouts: the config loads (ep 2 at dp 1
    once divided the layout table's dp by ep: ZeroDivisionError)."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["train.device=cpu", *overrides])
    assert cfg.parallel.dp == 1


def test_context_parallel_estimate_and_plan_output(capsys, tmp_path):
    """cp 2: each device computes half of every sequence but keeps its whole K and V (per layer the
    activations are half the one-device layer's plus one more copy of K/V: b s kv d e); the exchange
    sends the [2, b, kv, s, d] K/V buffer forward and backward per layer (ring factor 1 at 2 ranks);
    gradients are all-reduced over the 2 ranks; msllm plan prints the split and the exchange."""
    from msllm.config import Config, DataConfig, ModelConfig, TrainConfig
    m = ModelConfig(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, ffn_size=1376,
                    max_seq_len=16384)
    b, s, kv, d, e = 1, 16384, 4, 64, 4
    cfg = Config(model=m, data=DataConfig(seq_len=s), train=TrainConfig(batch_size=b, attention="flash"))
    one, two = P.estimate(cfg, ParallelConfig(), "cpu"), P.estimate(cfg, ParallelConfig(cp=2), "cpu")
    sh = L.sharding(m, ParallelConfig())
    layer = {cp: P.layer_activations(m, sh, b, s, e, "none", True, 4, cp) for cp in (1, 2)}
    assert layer[2] == pytest.approx(layer[1] / 2 + b * s * kv * d * e)
    assert two["comm"]["cp"] == pytest.approx(4 * 2 * (2 * b * kv * s * d * e)) and one["comm"]["cp"] == 0
    assert two["comm"]["dp"] == pytest.approx(m.num_params() * 4) and one["comm"]["dp"] == 0
    assert two["activations"] < 0.6 * one["activations"]
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump({"model": vars(m), "data": {"seq_len": s},
                                      "train": {"batch_size": b, "attention": "flash"}, "parallel": {"cp": 2}}))
    code, out, _ = plan_cli(capsys, "--config", str(config), "--devices", "2", "--device", "cpu")
    assert code == 0
    assert " dp  tp  pp cp micro" in out and "comm dp/tp/pp/cp GB" in out
    assert "context parallel 2: each device computes 8192 of every 16384 tokens" in out
    assert "--set parallel.cp=2" in out
    code, out, _ = plan_cli(capsys, "--config", str(config), "--devices", "2", "--device", "cpu", "--check")
    assert code == 0 and out.startswith(f"msllm plan: {config}: dp 1 x tp 1 x pp 1 x cp 2") and "exchanging it" in out


def test_ring_attention_estimate_on_ascend(capsys):
    """cp 4 on 910B, FlashAttentionScore's ring attention: a device keeps only its own chunk's K/V, so
    a layer's activations are exactly a quarter of the one-device layer's (on CPU the exchange keeps
    the whole sequence's); the ring passes 3 (cp-1)/cp of the sequence's K/V per layer and micro-batch
    (forward; backward with dK / dV); plan --check says so."""
    overrides = ["train.precision=bf16", "data.seq_len=32768", "model.max_seq_len=32768", "train.batch_size=1"]
    cfg = load_config(REPO / "configs" / "llama3_8b.yaml", overrides)
    m, s, e = cfg.model, 32768, 2
    layout = ParallelConfig(dp=2, cp=4, tp=8, sequence_parallel=True)
    sh = L.sharding(m, layout)
    whole = P.layer_activations(m, sh, 1, s, e, "none", True, 64)
    assert P.layer_activations(m, sh, 1, s, e, "none", True, 64, cp=4, ring=True) == pytest.approx(whole / 4)
    assert P.layer_activations(m, sh, 1, s, e, "none", True, 64, cp=4) > whole / 4   # CPU's: whole K/V kept
    est = P.estimate(cfg, layout, "910b")
    kv_buffer = 2 * s * (m.num_kv_heads // sh.tp_kv) * m.head_size * e
    assert est["comm"]["cp"] == pytest.approx(m.num_layers * 3 * 3 / 4 * kv_buffer)
    code, out, _ = plan_cli(capsys, "--config", str(REPO / "configs" / "llama3_8b.yaml"), "--devices", "64",
                            "--device", "910b", "--check", *[f"--set={o}" for o in overrides],
                            "--set=parallel.dp=2", "--set=parallel.cp=4", "--set=parallel.tp=8",
                            "--set=parallel.sequence_parallel=true")
    assert code in (0, 1) and "dp 2 x tp 8 x pp 1 x cp 4" in out
    assert "keeps its chunk's K/V, passing the others around the ring" in out


QWEN3_NEXT = REPO / "configs" / "qwen3_next_80b_a3b.yaml"


def test_qwen3_next_config_is_transformers_shape_and_plan_lays_it_out_with_expert_parallel(capsys):
    """configs/qwen3_next_80b_a3b.yaml is what `convert` reads from transformers' Qwen3NextConfig defaults ("the
    Qwen3-Next-80B-A3B style") but for the published checkpoint's RoPE base, context and aux loss, and as many
    parameters as transformers builds (on the meta device). `msllm plan` lays it out on 64 devices with the
    experts over ep, and its printed overrides pass the checker."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from interop.hf_config import to_model_config

    cfg = load_config(QWEN3_NEXT)
    m = cfg.model
    hf = {**Qwen3NextConfig().to_dict(), "architectures": ["Qwen3NextForCausalLM"]}
    published = dict(rope_theta=1e7, max_seq_len=262144, router_aux_loss_coef=0.001)
    assert m == dataclasses.replace(to_model_config(hf, "Qwen3NextConfig()"), **published)
    with torch.device("meta"):
        built = Qwen3NextForCausalLM(Qwen3NextConfig())
    assert m.num_params() == sum(p.numel() for p in built.parameters())
    assert m.layer_kinds().count("linear") == 36 and set(m.mlp_kinds()) == {"moe"}

    code, out, err = plan_cli(capsys, "--config", str(QWEN3_NEXT), "--devices", "64", "--device-mem", "64GB")
    best = [line for line in out.splitlines() if line.startswith("# best:")]
    assert code == 0 and best and "ep " in best[0], out + err
    laid = train_config(QWEN3_NEXT, out.splitlines()[-1])
    assert laid.parallel.ep > 1
    check_parallel(laid, 64)


# ---- mixture of experts --------------------------------------------------------------------------

QWEN3_MOE = REPO / "configs" / "qwen3_moe_30b_a3b.yaml"


def test_moe_memory_and_traffic_follow_expert_parallel():
    """Qwen3-30B-A3B at dp 64 with ep 8 on 910B: each device holds 1/8 of every layer's experts, their
    Adam states split over the 8 replicas holding the same experts (ZeRO-1), the rest over all 64; the
    gradients all-reduced over those groups; each MoE layer's rows moved 4 times per step by AllToAll."""
    cfg = load_config(QWEN3_MOE)
    m, h, f = cfg.model, 2048, 768
    experts = 48 * 128 * 3 * h * f
    dense = m.num_params() - experts
    assert (m.num_params() / 1e9, m.num_params(active=True) / 1e9) == (pytest.approx(30.53, abs=0.01),
                                                                       pytest.approx(3.35, abs=0.01))
    layout = ParallelConfig(dp=64, ep=8, optimizer_shard=True)
    laid = P.with_layout(cfg, layout, recompute="selective", global_batch=64)
    check_parallel(laid, 64)
    e = P.estimate(laid, device="910b")
    assert e["weights"] == e["grads"] == 2 * (dense + experts // 8)
    assert e["optimizer"] == pytest.approx(12 * dense / 64 + 12 * experts / 8 / 8)
    assert e["comm"]["dp"] == pytest.approx(2 * 63 / 64 * dense * 4 + 2 * 7 / 8 * experts / 8 * 4)
    rows = 1.25 * 8  # capacity factor x top-k rows per token
    assert e["comm"]["ep"] == pytest.approx(48 * 4 * 7 / 8 * 4096 * rows * h * 2)
    # without expert parallel every device holds every expert and sends nothing between MoE layers
    whole = P.estimate(P.with_layout(cfg, ParallelConfig(dp=64, optimizer_shard=True), "selective", 64), device="910b")
    assert whole["weights"] == 2 * m.num_params() and whole["comm"]["ep"] == 0


def test_moe_configs_are_laid_out_with_expert_parallel_or_told_how_many_devices_fit():
    """The shape references: Qwen3-30B-A3B fits 64 x 64 GB with ep and the printed overrides pass the
    checker; DeepSeek-V3 (671B, 16 bytes a parameter before activations) fits nowhere near 64 devices and
    the plan names how many would do."""
    proc = run_cli("plan", "--config", str(QWEN3_MOE), "--devices", "64", "--device-mem", "64GB")
    assert proc.returncode == 0, proc.stderr
    best = [line for line in proc.stdout.splitlines() if line.startswith("# best:")][0]
    assert "ep " in best, best
    sets = [s for s in shlex.split(proc.stdout.splitlines()[-1]) if s != "--set"]
    ep = int(next(s for s in sets if s.startswith("parallel.ep=")).split("=")[1])
    assert ep > 1
    check_parallel(load_config(QWEN3_MOE, sets), 64)
    proc = run_cli("plan", "--config", str(REPO / "configs" / "deepseek_v3.yaml"), "--devices", "64",
                   "--device-mem", "64GB")
    assert proc.returncode == 1 and "671.0" not in proc.stdout
    assert "nothing fits 64 x 910b" in proc.stderr and "devices of 64 GB would fit" in proc.stderr, proc.stderr
    assert load_config(REPO / "configs" / "deepseek_v3.yaml").model.num_params() / 1e9 == pytest.approx(671.0, abs=0.1)


def test_cpu_expert_parallel_traffic_is_the_all_gather_dispatcher():
    """On CPU (msllm.parallel.ep) each MoE layer all-reduces the ep group's tokens and then its outputs,
    [ep x tokens, h] each, forward and backward."""
    cfg = config_from_dict({"model": dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                                          ffn_size=128, num_experts=4, experts_per_token=2, max_seq_len=64),
                            "data": {"seq_len": 64}, "train": {"batch_size": 2}})
    laid = P.with_layout(cfg, ParallelConfig(dp=2, ep=2), global_batch=4)
    e = P.estimate(laid, device="cpu")
    tokens = 2 * 64
    assert e["comm"]["ep"] == pytest.approx(2 * 4 * (2 * 1 / 2) * 2 * tokens * 64 * 4)


# ---- hybrid linear attention ---------------------------------------------------------------------

QWEN3_5 = REPO / "configs" / "qwen3_5_9b.yaml"


def test_hybrid_plan_counts_the_linear_layers_rule_and_state(capsys):
    """configs/qwen3_5_9b.yaml is the published Qwen3.5-9B text shape: transformers' Qwen3_5TextConfig defaults
    (its "Qwen3.5-9B style") build as many parameters (on the meta device). Its 24 Gated DeltaNet layers cost
    per token what their chunked rule does, the same at any length: twice the context grows the FLOPs by the 8
    attention layers' scores alone, and the activations by those layers' only; a linear layer keeps no scores
    but its chunks' [c, c] matrices and the state entering each chunk. `msllm plan` lays it out (over dp and tp:
    a hybrid is not laid out over cp / pp)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = load_config(QWEN3_5)
    m = cfg.model
    with torch.device("meta"):
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig())
    assert m.num_params() == sum(p.numel() for p in hf.parameters())
    assert m.layer_kinds().count("linear") == 24 and m.rope_dim == 64

    attention_scores = 6 * m.num_heads * (m.head_size + m.value_size)   # per attention layer, per context token
    assert m.flops_per_token(8192) - m.flops_per_token(4096) == pytest.approx(8 * attention_scores * 4096)
    rule = m.linear_rule_flops(4096)
    assert rule == m.linear_rule_flops(65536) > 0
    without_rule = 6 * (m.num_params() - m.vocab_size * m.hidden_size) + 8 * attention_scores * 4096
    assert m.flops_per_token(4096) - without_rule == pytest.approx(3 * 24 * rule)

    sh = L.sharding(m, ParallelConfig())
    def layer(s, linear):  # noqa: E306
        return P.layer_activations(m, sh, 1, s, 2, "none", False, linear=linear) / s
    assert layer(4096, True) == pytest.approx(layer(65536, True))            # per token: no s^2 term
    assert layer(65536, False) - layer(4096, False) == pytest.approx(m.num_heads * 4 * (65536 - 4096))
    state = 4 * m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim / 64
    narrower = load_config(QWEN3_5, ["model.linear_value_head_dim=64"]).model
    assert P.linear_activations(m, 4096, 2) > P.linear_activations(narrower, 4096, 2) + state / 2
    e = P.estimate(P.with_layout(cfg, ParallelConfig(dp=8), "none", 8), device="910b", flash=False)
    e_bytes = 4 if cfg.train.precision == "fp32" else 2
    per_layer = {kind: P.layer_activations(m, sh, 1, 4096, e_bytes, "none", False, linear=kind) for kind in (True, False)}
    logits = 2 * 4 * 4096 * m.vocab_size
    assert e["activations"] == pytest.approx(24 * per_layer[True] + 8 * per_layer[False] + logits)
    # on CPU the linear layers keep what the C++ kernels keep (test_hybrid counts it), the graph form's with them off
    on_cpu = P.with_layout(cfg, ParallelConfig(dp=8), "none", 8)
    graph_cpu = dataclasses.replace(on_cpu, train=dataclasses.replace(on_cpu.train, fused_kernels="off"))
    kept = {k: P.layer_activations(m, sh, 1, 4096, e_bytes, "none", False, linear=True, kernels=k)
            for k in (True, False)}
    assert kept[True] < kept[False] / 2
    graph, kernels = (P.estimate(c, device="cpu", flash=False)["activations"] for c in (graph_cpu, on_cpu))
    assert graph - kernels == pytest.approx(24 * (kept[False] - kept[True]))

    tp2 = L.sharding(m, ParallelConfig(dp=4, tp=2))
    assert P.layer_activations(m, tp2, 1, 4096, 2, "selective", False, linear=True) == pytest.approx(
        4096 * (4 * m.hidden_size * 2 + P.linear_activations(m, 4096, 2) / 2))  # its heads over tp
    check_parallel(P.with_layout(cfg, ParallelConfig(dp=4, tp=2), global_batch=8), 8)
    with pytest.raises(ConfigError, match="parallel.pp: must be 1 with Gated DeltaNet"):
        check_parallel(P.with_layout(cfg, ParallelConfig(dp=4, pp=2, micro_batches=2), global_batch=8), 8)
    code, out, err = plan_cli(capsys, "--config", str(QWEN3_5), "--devices", "8", "--device-mem", "64GB")
    best = [line for line in out.splitlines() if line.startswith("# best:")]
    assert code == 0 and best and "dp 2 x tp 4 x pp 1" in best[0], out + err  # its heads over tp now fit
