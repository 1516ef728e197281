"""tools/bench_convert.py runs end to end (on a few MB; the 1 GB numbers are in the README)."""
import json
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
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] > 0 for r in runs.values())
    assert 3 < result["total_mb"] < 6 and result["largest_tensor_mb"] > 0
