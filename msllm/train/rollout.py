"""GRPO rollouts: group_size completions per prompt from msllm's compiled static-cache decoder
(msllm.inference.cell_engine, msllm.generate), laid out as GRPOLoss's inputs, and logged as JSONL.

Completions end at the model's EOS (kept, as TRL keeps it: its log-prob is trained) or after
max_new tokens. A rollout row is prompt + completion, padded to seq_len + 1; its mask marks the labels
that are completion tokens, so old log-probs and the loss see the same positions.

Each completion samples from its own random stream, seeded by (the sampler's seed, its row in the
global batch): under data parallel a worker samples its prompts' groups, and they are the ones one
worker sampling the whole batch would draw. `Rollouts.pack` lays a worker's rollouts out as one
array of fixed width, which msllm.parallel.dp.all_gather_exact gathers.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from msllm.generate import Sampling, generate


def sample_groups(engine, prompts: list[list[int]], group_size: int, max_new: int, sampling: Sampling,
                  eos_ids=(), first_row: int = 0) -> tuple[list[list[int]], float]:
    """(completions, seconds): group_size per prompt, each prompt's together, each ending with its EOS
    token when it stopped at one. Completion i samples from the stream (sampling.seed, first_row + i)."""
    rows = [p for p in prompts for _ in range(group_size)]
    started = time.perf_counter()
    out = generate(engine, rows, max_new, Sampling(sampling.top_k, sampling.top_p, sampling.temperature, sampling.seed,
                                                   sample=True), eos_ids=eos_ids,
                   row_seeds=[[sampling.seed, first_row + i] for i in range(len(rows))])
    seconds = time.perf_counter() - started
    eos = next(iter(eos_ids), None)
    completions = [ids + [eos] if why == "eos" else ids for ids, why in zip(out.ids, out.stopped)]
    return completions, seconds


@dataclass
class Rollouts:
    """A rollout batch's completions: each one's prompt (its row in the prompt file), token ids and every
    reward function's reward, and the seconds the worker that sampled it took for its part."""
    prompts: np.ndarray            # [n] int64
    completions: list[list[int]]
    rewards: np.ndarray            # [n, functions] float64
    seconds: np.ndarray            # [n] float64

    def pack(self, max_new: int) -> np.ndarray:
        """float64 [n, 3 + functions + max_new + 1]: prompt, seconds, rewards, length, ids (0-padded);
        every value exact (ids and rows are integers below 2^53)."""
        n, functions = self.rewards.shape
        out = np.zeros((n, 3 + functions + max_new + 1), np.float64)
        out[:, 0], out[:, 1], out[:, 2:2 + functions] = self.prompts, self.seconds, self.rewards
        for i, ids in enumerate(self.completions):
            out[i, 2 + functions] = len(ids)
            out[i, 3 + functions:3 + functions + len(ids)] = ids
        return out

    @classmethod
    def unpack(cls, packed: np.ndarray, functions: int) -> "Rollouts":
        lengths = packed[:, 2 + functions].astype(np.int64)
        ids = packed[:, 3 + functions:].astype(np.int64)
        return cls(packed[:, 0].astype(np.int64), [row[:k].tolist() for row, k in zip(ids, lengths)],
                   packed[:, 2:2 + functions].copy(), packed[:, 1].copy())

    def tokens(self) -> int:
        return sum(map(len, self.completions))


def rollout_rows(prompts: list[list[int]], completions: list[list[int]], group_size: int, seq_len: int,
                 pad: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [n, seq_len + 1] int32 and mask [n, seq_len] float32 of the n completions."""
    n = len(completions)
    tokens = np.full((n, seq_len + 1), pad, np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, completion in enumerate(completions):
        prompt = prompts[i // group_size]
        ids = prompt + completion
        if len(ids) > seq_len + 1:
            raise ValueError(f"rollout of {len(ids)} tokens does not fit seq_len {seq_len} + 1")
        tokens[i, :len(ids)] = ids
        mask[i, len(prompt) - 1:len(ids) - 1] = 1
    return tokens, mask


def log_rollouts(path: Path, step: int, prompts: list[str], completions: list[str], rewards: np.ndarray,
                 per_function: np.ndarray, names: list[str], advantages: np.ndarray, ids=None) -> None:
    """Append one JSON line per rollout to path (RUN_DIR/rollouts.jsonl); ids: the completions' token ids
    (with the EOS they stopped at), logged with their count so a step can be replayed exactly."""
    group = len(completions) // len(prompts)
    with open(path, "a", encoding="utf-8") as f:
        for i, text in enumerate(completions):
            row = {"step": step, "prompt": prompts[i // group], "completion": text, "reward": float(rewards[i]),
                   **({} if ids is None else {"completion_tokens": len(ids[i]),
                                              "completion_ids": list(map(int, ids[i]))}),
                   "rewards": {name: float(per_function[i, k]) for k, name in enumerate(names)},
                   "advantage": float(advantages[i])}
            f.write(json.dumps(row) + "\n")
