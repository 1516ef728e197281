"""Generation over any engine (msllm Cells, MindIR, onnxruntime): sampling, stopping at the model's
EOS tokens or at a stop string, and text streamed as it is produced.

`generate` drives an engine's start (prefill) and step (one-token decode) calls for a batch of
prompts; `TextStream` turns one row's new tokens into printable text. `generate_ids` recomputes
the whole prefix every token with the plain model: the reference the cached path must reproduce.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np


@dataclasses.dataclass
class Sampling:
    """Greedy when top_k == 0 and top_p == 1 (unless `sample`); otherwise a temperature sample from the
    top_k most likely tokens (all if 0) whose probabilities add up to top_p (at least one). `sample`:
    sample from the whole distribution at top_k 0, top_p 1 too (RL rollouts, msllm.train.rollout)."""
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 0
    sample: bool = False

    @property
    def greedy(self) -> bool:
        return not self.sample and self.top_k <= 0 and self.top_p >= 1.0


def pick_next(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from the logits of one position."""
    if sampling.greedy:
        return int(np.argmax(logits))
    top = np.argsort(-logits, kind="stable")
    if sampling.top_k > 0:
        top = top[:sampling.top_k]
    z = logits[top].astype(np.float64) / max(sampling.temperature, 1e-6)
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), sampling.top_p) + 1)  # the smallest set reaching top_p
    p = p[:keep] / p[:keep].sum()
    return int(rng.choice(top[:keep], p=p))


@dataclasses.dataclass
class Generation:
    ids: list[list[int]]     # new tokens of each prompt, without the EOS token that ended it
    stopped: list[str]       # why each row ended: "eos", "stop" or "length"
    first_token_s: float     # from the call to the first token's logits (prefill, and any compile)
    step_s: list[float]      # each one-token decode step after it (the first one compiles, in GRAPH_MODE)

    def decode_tok_s(self) -> float | None:
        """Tokens per second of the decode steps after the first (all rows), None if there are none."""
        steady = self.step_s[1:]
        return len(steady) * len(self.ids) / sum(steady) if steady else None


def generate(engine, prompts: list[list[int]], max_new: int, sampling: Sampling = Sampling(),
             eos_ids=(), on_token: Callable[[int, int], bool] | None = None, row_seeds=None) -> Generation:
    """Up to max_new tokens after each prompt (the prompts may differ in length). A row ends at one
    of eos_ids, or when on_token(row, token) returns True (a stop string was found). The rows sample
    from one random stream (sampling.seed), or with row_seeds each from its own, so that what a row
    samples does not depend on the rows beside it (RL rollouts split over workers)."""
    if row_seeds is None:
        rngs = [np.random.default_rng(sampling.seed)] * len(prompts)
    else:
        rngs = [np.random.default_rng(seed) for seed in row_seeds]
    started = time.perf_counter()
    logits = engine.start(prompts, max_new)
    first_token_s = time.perf_counter() - started
    out = [[] for _ in prompts]
    stopped = ["length"] * len(prompts)
    step_s = []
    for step in range(max_new):
        for row, ids in enumerate(out):
            if stopped[row] != "length":
                continue
            token = pick_next(logits[row], sampling, rngs[row])
            if token in eos_ids:
                stopped[row] = "eos"
                continue
            ids.append(token)
            if on_token is not None and on_token(row, token):
                stopped[row] = "stop"
        if step == max_new - 1 or all(s != "length" for s in stopped):
            break
        started = time.perf_counter()
        logits = engine.step([ids[-1] if ids else 0 for ids in out])  # finished rows feed a placeholder
        step_s.append(time.perf_counter() - started)
    return Generation(out, stopped, first_token_s, step_s)


class TextStream:
    """One row's new tokens as printable text. Text is held back while it ends in an unfinished
    UTF-8 character or could be the start of a stop string; at a stop string it ends, before it."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids, self.printed, self.stopped, self.text = [], 0, False, ""  # text: all of it emitted so far

    def add(self, token: int) -> str:
        """Append a token; returns the text that became printable."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        cut = min((i for i in (text.find(s, max(0, self.printed - len(s))) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(text, cut)
        if text.endswith("\ufffd"):
            return ""
        held = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return self._emit(text, len(text) - held)

    def flush(self) -> str:
        """The held-back rest, once generation has ended without a stop string."""
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=False))

    def _emit(self, text: str, end: int | None = None) -> str:
        end = len(text) if end is None else end
        new, self.printed = text[self.printed:end], max(self.printed, end)
        self.text += new
        return new


def generate_ids(model, ids: list[int], max_new: int, sampling: Sampling = Sampling()) -> list[int]:
    """Reference: the prompt and the tokens so far through the plain model for every new token."""
    import mindspore as ms

    rng = np.random.default_rng(sampling.seed)
    ids = list(ids)
    for _ in range(max_new):
        logits = model(ms.Tensor(np.array([ids], np.int32))).asnumpy()[0, -1]
        ids.append(pick_next(logits, sampling, rng))
    return ids


def generate_text(engine, tokenizer, prompt: str, max_new: int, max_len: int) -> str:
    """The prompt and its greedy continuation (as many tokens as fit in max_len), e.g. a sample after training."""
    ids = tokenizer.encode(prompt).ids[-(max_len - 1):] or [0]
    result = generate(engine, [ids], min(max_new, max_len - len(ids)))
    return tokenizer.decode(ids + result.ids[0])
