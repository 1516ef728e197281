"""tools/bench_convert.py runs end to end (on a few MB; the 1 GB numbers are in the README)."""
import json
import math
import subprocess
import sys

from tests.conftest import REPO


def test_bench_convert_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "tools/bench_convert.py", "--size-mb", "4", "--repeat", "1",
                           "--modes", "raw,stream,naive", "--caches", "warm", "--dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = result["results"]
    assert set(runs) == {"raw warm", "stream warm", "naive warm"}
    # Each run's peak RSS is a high-water mark over the run, so it includes the RSS it started at.
    assert all(0 < r["seconds"] < 60 and 0 < r["start_rss_mb"] <= r["peak_rss_mb"] for r in runs.values())
    # The sizes it reports are those of the checkpoint it generated: every tensor of the Llama
    # table for its config in bf16, plus the safetensors headers; the largest is the embedding
    # (vocab 16 * 128 x hidden 128).
    sys.path.insert(0, str(REPO / "tools"))
    from bench_convert import shape
    from interop.hf_config import to_model_config
    from interop.maps import FAMILIES
    from interop.table import entries
    sizes = [2 * math.prod(e.shape) for e in entries(FAMILIES["LlamaForCausalLM"].table, to_model_config(shape(4), "t"))]
    assert sum(sizes) <= result["total_mb"] * 1e6 <= sum(sizes) + 64_000
    assert result["largest_tensor_mb"] * 1e6 == max(sizes) == 2 * (16 * 128) * 128
