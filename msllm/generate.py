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


# The inverse CDF sums the weights by blocks of this many tokens, then searches the one block the uniform falls in:
# a running sum over the whole vocabulary was most of a batch's sampling time.
CDF_BLOCK = 64


def pick_tokens(logits: np.ndarray, sampling: Sampling, rngs: list[np.random.Generator]) -> np.ndarray:
    """The next token of each row from logits [n, vocab], row i drawing one uniform from rngs[i] (rows may
    share a generator: they draw in row order). The whole batch in a few numpy calls: a per-row Python
    sampler cost ~15% of a batch-16 rollout's decode step. Without top_k / top_p nothing is sorted: the
    inverse CDF runs in vocabulary order (the same distribution as over sorted tokens). exp in fp32 (the fp64
    sampler took 1.4-3x as long on a loaded 2-core AVX2 machine), summed in fp64; the CDF is left unnormalised (u
    scales by its total), so each probability is off by fp32 rounding alone."""
    if sampling.greedy:
        return np.argmax(logits, -1)
    n, vocab = logits.shape
    order = None
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        order = np.argsort(-logits, -1, kind="stable")
        logits = np.take_along_axis(logits, order, -1)
    blocks = -(-vocab // CDF_BLOCK)
    z = np.full((n, blocks * CDF_BLOCK), -np.inf, np.float32)  # whole blocks: the padding weighs 0
    z[:, :vocab] = logits
    if sampling.top_k > 0:
        z[:, sampling.top_k:] = -np.inf
    if sampling.temperature != 1.0:
        z /= max(sampling.temperature, 1e-6)
    z -= z.max(-1, keepdims=True)
    weights = np.exp(z, out=z).reshape(n, blocks, CDF_BLOCK)
    block_cdf = np.cumsum(weights.sum(-1, dtype=np.float64), -1)
    total = block_cdf[:, -1]
    if sampling.top_p < 1.0:  # the smallest set of most likely tokens reaching top_p: what they weigh
        total = inverse_cdf(weights, block_cdf, sampling.top_p * total, strict=True)[1]
    u = np.array([rng.random() for rng in rngs]) * total
    picked = np.minimum(inverse_cdf(weights, block_cdf, u)[0], vocab - 1)
    return picked if order is None else np.take_along_axis(order, picked[:, None], -1)[:, 0]


def inverse_cdf(weights: np.ndarray, block_cdf: np.ndarray, targets: np.ndarray, strict: bool = False):
    """Per row of weights [n, blocks, CDF_BLOCK] with block_cdf [n, blocks], their blocks' running sums (fp64):
    (the first token whose running sum passes target, reaches it when strict; that running sum)."""
    below = np.less if strict else np.less_equal
    n, blocks, size = weights.shape
    rows = np.arange(n)
    block = np.minimum(below(block_cdf, targets[:, None]).sum(-1), blocks - 1)
    cdf = np.cumsum(weights[rows, block], -1, dtype=np.float64)
    cdf += np.where(block > 0, block_cdf[rows, block - 1], 0.0)[:, None]
    inside = np.minimum(below(cdf, targets[:, None]).sum(-1), size - 1)
    return block * size + inside, cdf[rows, inside]


def pick_next(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from the logits of one position."""
    return int(pick_tokens(logits[None], sampling, [rng])[0])


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
        going = [row for row, why in enumerate(stopped) if why == "length"]
        tokens = pick_tokens(logits[going], sampling, [rngs[row] for row in going])
        for row, token in zip(going, tokens.tolist()):
            ids = out[row]
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
