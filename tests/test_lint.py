"""msllm lint: the AST checks on a corpus of bad and clean Cells, msllm's own code, the CLI's exit
codes, and --compile turning a real MindSpore compile error into the user's file:line."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from graph_opt.lint import LintError, lint_paths, lint_source
from tests.conftest import REPO, run_cli

CORPUS = Path(__file__).parent / "lint_corpus"


def expected(path: Path) -> set:
    """(line, code) of every `# expect: CODE ...` marker in a corpus file."""
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(r"#\s*expect:\s*((?:GL\d+\s*)+)$", line)
        if m:
            found.update((number, code) for code in m.group(1).split())
    return found


def load(path: Path):
    """Import a file as a module; MindSpore's parser finds a Cell's globals through sys.modules."""
    name = f"lint_test_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_bad_cells_each_caught_on_its_line():
    path = CORPUS / "bad_cells.py"
    findings, functions = lint_source(path.read_text(), str(path))
    assert {(f.line, f.code) for f in findings} == expected(path)
    assert len(expected(path)) == 30 and functions == 18  # every Cell, helper, module function and jit function
    assert all(f.fix and f.message for f in findings)
    first = str(findings[0])
    assert first.startswith(f"{path}:14: GL101: `if x.sum() > 0` branches on a tensor value") and "; fix: " in first


def test_clean_cells_are_not_flagged_and_run_in_graph_mode():
    import mindspore as ms
    import numpy as np

    path = CORPUS / "clean_cells.py"
    findings, functions = lint_source(path.read_text(), str(path))
    assert findings == [] and functions == 5  # 4 constructs + the module function HyperMap is given

    from msllm import device

    device.setup("cpu", "graph")
    cells = load(path)
    x = ms.Tensor(np.arange(8, dtype=np.float32).reshape(2, 4) - 3)
    for cell in (cells.ShapeArithmetic(), cells.StaticLoops(), cells.Flags(), cells.PrintsNothing()):
        out = cell(x).asnumpy()
        assert np.isfinite(out).all()
    flags = cells.Flags()
    flags(x), flags(x)
    assert float(flags.count.asnumpy()) == 2.0  # the Parameter assignment the lint allows is an in-graph update


def test_msllm_lints_clean_and_noqa_is_needed_for_the_step_branch():
    done = run_cli("lint", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.fullmatch(r"msllm lint: clean \((\d+) files, (\d+) compiled functions\)\n", done.stdout)
    assert m and int(m.group(1)) >= 20 and int(m.group(2)) >= 30, done.stdout
    assert "mindspore" not in done.stderr.lower()

    step = REPO / "msllm" / "train" / "step.py"
    source = step.read_text()
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "# noqa: GL101" in text)
    findings, _ = lint_source(re.sub(r"  # noqa: GL101.*", "", source), "step.py")
    assert [(f.line, f.code) for f in findings] == [(line, "GL101")]


def test_cli_exit_codes_and_one_line_errors(tmp_path):
    bad = run_cli("lint", str(CORPUS / "bad_cells.py"), timeout=60)
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert len(lines) == 31 and lines[-1] == "msllm lint: 30 problems (1 file, 18 compiled functions)"
    assert re.match(r"\S*bad_cells\.py:\d+: GL1\d\d: .+; fix: .+", lines[0])

    assert run_cli("lint", str(CORPUS / "clean_cells.py"), "msllm.models", timeout=60).returncode == 0

    syntax = tmp_path / "broken.py"
    syntax.write_text("class A:\n    def construct(self, x)\n        return x\n")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    cases = {
        str(tmp_path / "missing.py"): "missing.py: no such file, directory or module",
        str(text): "notes.txt: not a Python file (.py), directory or module",
        str(syntax): "broken.py:2: syntax error: expected ':'",
    }
    for arg, message in cases.items():
        done = run_cli("lint", arg, timeout=60)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith("msllm lint: error: ") and done.stderr.count("\n") == 1, done.stderr
        assert message in done.stderr
    with pytest.raises(LintError, match="no such file"):
        lint_paths(["no.such.module"])


BAD_FEED_FORWARD = '''def construct(self, x):
    h = self.w1(x)
    return self.w2(self.w1(h))  # w1 takes hidden_size inputs, h has ffn_size
'''


def test_compile_error_points_at_the_users_line(tmp_path, monkeypatch):
    """A user's construct with a shape bug, swapped into the model: the finding names the user's
    line (not MindSpore's or msllm's frames), the op's own line, and MindSpore's IR dump."""
    from graph_opt.compile_check import compile_train_step
    from msllm.config_file import load_config
    from msllm.models import layers

    (tmp_path / "user_ffn.py").write_text(BAD_FEED_FORWARD)
    monkeypatch.setattr(layers.FeedForward, "construct", load(tmp_path / "user_ffn.py").construct)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.ffn_size=48",
                             "model.vocab_size=64", "model.max_seq_len=16", "data.seq_len=8", "train.batch_size=2"])
    finding = compile_train_step(cfg, log=lambda line: None)
    assert (finding.path, finding.line, finding.code) == ("user_ffn.py", 3, "compile")
    assert finding.message.startswith("For 'MatMul' the input dimensions must be equal, but got 'x1_col': 48 and "
                                      "'x2_row': 32.")
    assert re.search(r"\(inside .*msllm/models/layers\.py:\d+\)$", finding.message)
    ir = Path(finding.fix.split(": ", 1)[1])
    assert ir.name == "analyze_fail.ir" and ir.exists()
    assert not (tmp_path / "rank_0").exists()  # MindSpore's dump went to the scratch dir, not the cwd


def test_compile_error_and_lint_agree_on_the_line():
    """MindSpore's own rejection of try/except lands on the line the lint flags as GL107."""
    import mindspore as ms
    import numpy as np

    from graph_opt.compile_check import compile_error_finding
    from msllm import device

    device.setup("cpu", "graph")
    path = CORPUS / "bad_cells.py"
    lint_line = next(f.line for f in lint_source(path.read_text(), str(path))[0] if f.code == "GL107")
    with pytest.raises(RuntimeError) as error:
        load(path).Fallible().compile(ms.Tensor(np.ones(4, np.float32)))
    finding = compile_error_finding(error.value)
    assert finding.path.endswith("bad_cells.py") and finding.line == lint_line
    assert finding.message == "Unsupported statement 'Try'."


def test_lint_compile_cli_compiles_the_train_step():
    done = run_cli("lint", "--compile", "--set", "model.num_layers=2", "--set", "train.batch_size=2",
                   "--set", "data.seq_len=16", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"compiled the train step \(2 layers, batch 2 x 1, seq 16, fp32\) in \d+\.\d s", done.stdout)
    assert done.stdout.splitlines()[-1].startswith("msllm lint: clean")
