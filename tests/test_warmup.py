"""optim.warmup_ratio: warmup as a fraction of train.steps (issue 31: a fixed 30 steps spent 75% of a
40-step LoRA run warming up), its validation, and the one-line warning when warmup is most of the run."""
import numpy as np
import pytest
from mindspore import Tensor

from msllm.config import ConfigError, OptimConfig

from msllm.config_file import load_config
from msllm.train.optim import LRSchedule, lr_at, warmup_steps, warmup_warning

LR, MIN_LR = 1e-3, 1e-4


def test_ratio_is_a_fraction_of_the_run_rounded_up():
    assert warmup_steps(OptimConfig(warmup_ratio=0.25), 40) == 10
    assert warmup_steps(OptimConfig(warmup_ratio=0.1), 45) == 5      # 4.5 -> 5, as HF's ceil
    assert warmup_steps(OptimConfig(warmup_ratio=0.0), 40) == 0
    assert warmup_steps(OptimConfig(), 40) == 30                      # unset: warmup_steps


def test_lr_follows_the_ratio_in_python_and_in_graph():
    # 40 steps, ratio 0.25: 10 warmup steps to 1e-3, then cosine over 30 steps to 1e-4.
    cfg = OptimConfig(lr=LR, min_lr=MIN_LR, warmup_ratio=0.25)
    steps = [1, 5, 10, 25, 40]
    want = [1e-4, 5e-4, 1e-3, MIN_LR + 0.5 * (LR - MIN_LR), MIN_LR]  # step 25: halfway down the cosine
    assert [lr_at(s, cfg, 40) for s in steps] == pytest.approx(want, rel=1e-12)
    schedule = LRSchedule(cfg, 40)
    got = [float(schedule(Tensor(np.float32(s))).asnumpy()) for s in steps]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # The same run with the fixed default (30 steps) is still warming up at step 25.
    assert lr_at(25, OptimConfig(lr=LR, min_lr=MIN_LR), 40) == pytest.approx(LR * 25 / 30)


@pytest.mark.parametrize("ratio", ["1.0", "-0.1", "1.5"])
def test_ratio_outside_0_1_is_one_line_naming_the_key(ratio):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"optim.warmup_ratio={ratio}"])
    assert str(err.value) == f"--set: optim.warmup_ratio: must be in [0, 1), got {float(ratio)!r}"


def test_ratio_and_a_changed_warmup_steps_are_refused(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("optim:\n  warmup_steps: 10\n")
    with pytest.raises(ConfigError, match=r"^--set: optim.warmup_ratio: set either optim.warmup_ratio or "
                                          r"optim.warmup_steps \(10\), not both$"):
        load_config(config, ["optim.warmup_ratio=0.1"])
    assert load_config(config, ["optim.warmup_steps=30", "optim.warmup_ratio=0.1"]).optim.warmup_ratio == 0.1


def test_warning_when_warmup_is_more_than_half_the_run():
    assert warmup_warning(OptimConfig(), 40) == ("warning: 30 of the 40 train.steps are LR warmup "
                                                 "(optim.warmup_steps): lower it, e.g. --set optim.warmup_ratio=0.1")
    assert warmup_warning(OptimConfig(), 60) is None                  # exactly half: fine
    assert warmup_warning(OptimConfig(), 20).startswith("warning: 20 of the 20 train.steps")
    assert warmup_warning(OptimConfig(warmup_ratio=0.6), 40).startswith("warning: 24 of the 40 train.steps "
                                                                        "are LR warmup (optim.warmup_ratio)")
    assert warmup_warning(OptimConfig(warmup_ratio=0.1), 40) is None
