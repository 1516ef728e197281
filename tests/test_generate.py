"""msllm generate: EOS ids from the model's files, stop strings, chat templates rendered as
transformers renders them, streaming text, top-p, batches; on a tiny converted HF model."""
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from interop.convert import convert
from msllm import chat, device
from msllm.checkpoint import load_run
from msllm.generate import Sampling, TextStream, generate, generate_ids, pick_next, pick_tokens
from msllm.inference import cell_engine
from tests.conftest import run_cli
from tests.hf_models import build

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with the 256 byte tokens, a few merges and the chat special tokens (ids 256..)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama converted from HF, with a chat template and <|im_end|> as its EOS."""
    root = tmp_path_factory.mktemp("chat")
    hf = root / "hf"
    build("llama3_gqa_rope_scaling").save_pretrained(hf)
    tok = byte_tokenizer()
    tok.save(str(hf / "tokenizer.json"))
    im_end = tok.token_to_id("<|im_end|>")
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None,
                                                          "chat_template": TEMPLATE}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 0]}))
    convert(hf, root / "msllm", progress=False)
    return root


def test_conventions_come_from_the_model_files(chat_model):
    device.setup("cpu", "pynative")
    _, _, tokenizer, conventions = load_run(chat_model / "msllm")
    assert conventions.eos_ids == [tokenizer.token_to_id("<|im_end|>"), 0]  # generation_config.json, a list
    assert conventions.chat_template == TEMPLATE and conventions.special_tokens == {"eos_token": "<|im_end|>"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = chat.render(conventions, messages, "x")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    from transformers import PreTrainedTokenizerFast  # the ids transformers' apply_chat_template gives

    hf = PreTrainedTokenizerFast(tokenizer_file=str(chat_model / "hf" / "tokenizer.json"), chat_template=TEMPLATE)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode(text, add_special_tokens=False).ids == list(
        hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    with pytest.raises(chat.ChatError, match="the model has no chat template"):
        chat.render(chat.TextConventions([0]), messages, "x")


def test_eos_and_stop_end_generation(chat_model):
    device.setup("cpu", "pynative")
    cfg, model, tokenizer, _ = load_run(chat_model / "msllm")
    prompt = tokenizer.encode("the cat", add_special_tokens=False).ids
    full = generate_ids(model, prompt, 12)[len(prompt):]
    engine = cell_engine(model)
    assert generate(engine, [prompt], 12).ids == [full]
    k = next(i for i in range(2, 12) if full[i] not in full[:i])  # a token first produced at step k
    result = generate(engine, [prompt], 12, eos_ids=[full[k]])
    assert result.ids == [full[:k]] and result.stopped == ["eos"] and len(result.step_s) == k
    # a stop string: the text is cut before it, and generation ends once it is complete
    text = tokenizer.decode(full, skip_special_tokens=False)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stream = TextStream(tokenizer, [stop])
    pieces = []

    def on_token(row, token):
        pieces.append(stream.add(token))
        return stream.stopped

    result = generate(engine, [prompt], 12, on_token=on_token)
    assert "".join(pieces) + stream.flush() == text[:text.find(stop)] == stream.text
    assert result.stopped == ["stop"] and len(result.ids[0]) < 12


def test_text_stream_holds_back_partial_characters_and_stops():
    tok = byte_tokenizer()
    ids = tok.encode("a é b", add_special_tokens=False).ids  # é is two byte tokens
    stream = TextStream(tok)
    pieces = [stream.add(i) for i in ids]
    assert pieces == ["a", " ", "", "é", " ", "b"]  # nothing printed in the middle of é
    stream = TextStream(tok, ["<|im_end|>", " b"])
    pieces = [stream.add(i) for i in tok.encode("xy b", add_special_tokens=False).ids]
    assert pieces == ["x", "y", "", ""] and stream.stopped and stream.text == "xy"
    stream = TextStream(tok, [" bc"])  # " b" held back until it turns out not to be the stop
    pieces = [stream.add(i) for i in tok.encode("a bd", add_special_tokens=False).ids]
    assert pieces == ["a", "", "", " bd"] and not stream.stopped


def test_top_p_samples_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    picks = [pick_next(logits, Sampling(top_p=0.75), rng) for _ in range(2000)]
    counts = np.bincount(picks, minlength=4) / 2000
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 reaches 0.75 (0.8 itself is a rounding tie: exp differs by CPU)
    assert abs(counts[0] - 0.625) < 0.04  # 0.5 / 0.8
    picks = [pick_next(logits, Sampling(top_p=0.81, top_k=2), rng) for _ in range(200)]
    assert set(picks) == {0, 1}  # top_k applies first
    assert pick_next(logits, Sampling(top_p=0.3), rng) == 0  # the most likely token alone reaches 0.3



@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7, sample=True), Sampling(top_p=0.9, top_k=3)],
                         ids=["whole-vocabulary", "top-k-top-p"])
def test_a_batch_samples_each_rows_distribution_from_its_own_stream(sampling):
    """pick_tokens over 3 rows at once: each row's frequencies over 6000 draws are its softmax(logits / T)
    (restricted to the top_k and renormalised over the nucleus), within 5 standard errors; and a row draws
    the same tokens alone as beside the others (each from its own generator: RL rollouts over workers)."""
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.06, 0.04], [0.05, 0.05, 0.1, 0.2, 0.6], [0.2] * 5]))
    draws = 6000
    rngs = [np.random.default_rng(seed) for seed in (1, 2, 3)]
    picks = np.stack([pick_tokens(logits, sampling, rngs) for _ in range(draws)])  # [draws, 3]
    z = logits / sampling.temperature
    for row in range(3):
        order = np.argsort(-logits[row], kind="stable")
        p = np.exp(z[row] - z[row].max())
        if sampling.top_k:
            p[order[sampling.top_k:]] = 0.0
        p /= p.sum()
        if sampling.top_p < 1.0:
            keep = int((np.cumsum(p[order]) < sampling.top_p).sum()) + 1
            p[order[keep:]] = 0.0
            p /= p.sum()
        seen = np.bincount(picks[:, row], minlength=5) / draws
        assert np.all(np.abs(seen - p) <= 5 * np.sqrt(p * (1 - p) / draws) + 1e-12), (row, seen, p)
    alone = np.random.default_rng(2)
    assert [int(pick_tokens(logits[1:2], sampling, [alone])[0]) for _ in range(50)] == picks[:50, 1].tolist()

def test_the_sampler_draws_the_fp64_inverse_cdf_tokens_up_to_fp32_rounding():
    """pick_tokens (exp in fp32, summed in fp64) against the fp64 inverse CDF drawing the same uniforms, on 16
    rows of 4099 logits (a rollout step's, and a last CDF block of 3 tokens), at temperature 0.7: a draw can
    differ only where its uniform falls between the two CDFs, a mass of sum |cdf - cdf64| per row; the
    mismatches stay within that expectation over the draws + 5 standard deviations."""
    logits = (np.random.default_rng(0).normal(size=(16, 4099)) * 3).astype(np.float32)
    sampling, draws = Sampling(temperature=0.7, sample=True), 500
    z = logits.astype(np.float64) / 0.7
    p = np.exp(z - z.max(-1, keepdims=True))
    cdf64 = np.cumsum(p / p.sum(-1, keepdims=True), -1)
    z32 = logits / np.float32(0.7)
    cdf = np.cumsum(np.exp(z32 - z32.max(-1, keepdims=True)), -1, dtype=np.float64)
    disagree = np.abs(cdf / cdf[:, -1:] - cdf64).sum()  # over the rows: the expected mismatches of one draw each
    ours, theirs = [np.random.default_rng(seed) for seed in range(16)], [np.random.default_rng(s) for s in range(16)]
    mismatches = 0
    for _ in range(draws):
        u = np.array([rng.random() for rng in theirs])
        want = np.minimum((cdf64 <= u[:, None]).sum(-1), 4098)
        mismatches += int((pick_tokens(logits, sampling, ours) != want).sum())
    expected = draws * disagree
    assert mismatches <= expected + 5 * np.sqrt(expected) + 1e-9, (mismatches, expected)


def test_cli_chat_streams_the_reply_and_stops(chat_model):
    device.setup("cpu", "pynative")
    _, model, tokenizer, conventions = load_run(chat_model / "msllm")
    text = chat.render(conventions, [{"role": "user", "content": "hello"}], "x")
    prompt = tokenizer.encode(text, add_special_tokens=False).ids
    full = generate_ids(model, prompt, 10)[len(prompt):]
    reply = tokenizer.decode(full, skip_special_tokens=False)
    stop = reply[6:8]
    cache = chat_model / "compile_cache"
    proc = run_cli("generate", "--ckpt", str(chat_model / "msllm"), "--chat", "hello", "--stop", stop,
                   "--max-new-tokens", "10", "--compile-cache", str(cache))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == reply[:reply.find(stop)] + "\n"
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"msllm generate: {len(prompt)} prompt tokens, ") and "(stop)" in summary

    # Another model with the same compile cache dir: MindSpore would reuse the first model's graphs
    # (same code) and compute garbage; each model gets its own sub-dir.
    other = chat_model / "other"
    build("llama2_mha", seed=1).save_pretrained(other / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / "hf" / name).write_bytes((chat_model / "hf" / name).read_bytes())
    convert(other / "hf", other / "msllm", progress=False)
    _, model, _, _ = load_run(other / "msllm")
    full = generate_ids(model, prompt, 6)[len(prompt):]
    proc = run_cli("generate", "--ckpt", str(other / "msllm"), "--chat", "hello", "--max-new-tokens", "6",
                   "--compile-cache", str(cache))
    assert proc.stdout == tokenizer.decode(full, skip_special_tokens=False) + "\n", proc.stderr[-2000:]
    assert len(list(cache.iterdir())) == 2
