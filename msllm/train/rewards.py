"""GRPO's reward functions: `path.py:function` callables with TRL's signature,
reward(completions, prompts=..., **columns) -> list[float], extra dataset columns passed through.

Every failure is one line naming the function: a file or function that does not load, a call that
raises, a result of the wrong length, or a value that is not a finite number.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from msllm.errors import UserError


class RewardError(UserError, ValueError):
    pass


def load_reward(spec: str):
    """'path/to/file.py:function' -> the callable."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise RewardError(f"grpo.reward: {spec!r}: expected path/to/file.py:function")
    file = Path(path).expanduser()
    if not file.is_file():
        raise RewardError(f"grpo.reward: {spec}: no file {file}")
    module_spec = importlib.util.spec_from_file_location(f"msllm_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's module failing to import
        raise RewardError(f"grpo.reward: {spec}: importing {file} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"grpo.reward: {spec}: {file} defines no function {name}")
    return fn


def score(rewards: dict, weights: list[float], prompts: list, completions: list, columns: dict) -> tuple:
    """(weighted sum [n], each function's rewards [n, functions]) of n completions; `rewards` maps a
    name (its spec) to a callable, `columns` the dataset's other columns, one value per completion."""
    per_function = np.empty((len(completions), len(rewards)), np.float64)
    for k, (name, fn) in enumerate(rewards.items()):
        try:
            got = fn(completions, prompts=prompts, **columns)
        except Exception as e:  # the user's function failing
            raise RewardError(f"grpo.reward: {name} raised {type(e).__name__}: {e}") from None
        if not isinstance(got, (list, tuple, np.ndarray)) or len(got) != len(completions):
            size = len(got) if hasattr(got, "__len__") else type(got).__name__
            raise RewardError(f"grpo.reward: {name} returned {size} rewards for {len(completions)} completions; "
                              f"it must return a list with one float per completion")
        for i, value in enumerate(got):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise RewardError(f"grpo.reward: {name} returned {value!r} for completion {i}; rewards must be "
                                  f"finite numbers")
        per_function[:, k] = got
    return per_function @ np.asarray(weights, np.float64), per_function
