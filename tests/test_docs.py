"""docs/config-reference.md is generated from msllm/config.py and must not go stale.

Fast: the generator reads the source with ast/tokenize in a fresh interpreter and never imports
MindSpore (checked).
"""
import subprocess
import sys

from tests.conftest import REPO

GENERATE = """
import runpy, sys
main = runpy.run_path("tools/gen_config_docs.py")["main"]
rc = main(["--out", sys.argv[1]])
assert "mindspore" not in sys.modules, "the config doc generator imported mindspore"
sys.exit(rc)
"""


def test_config_reference_is_current(tmp_path):
    out = tmp_path / "config-reference.md"
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(out)], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert out.read_text() == committed, (
        "docs/config-reference.md is stale: run `python tools/gen_config_docs.py` and commit the result")
