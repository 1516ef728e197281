"""The house in layers (docs/architecture.md): no import cycle among the project's modules, function-level
imports included, and the light commands stay light.

Fast: the first tests read the sources with ast; the last runs one fresh interpreter.
"""
import ast
import subprocess
import sys

from tests.conftest import REPO

PACKAGES = ("msllm", "interop", "graph_opt")


def modules() -> dict[str, ast.Module]:
    """Every module of the project by dotted name (a package by its own name), parsed."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = (ast.parse(path.read_text(), str(path)), path.name == "__init__.py")
    return found


def _type_checking(node) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imported(name: str, tree: ast.Module, is_package: bool, known) -> set[str]:
    """The project modules `name` imports anywhere in its file (module level, functions, methods), and
    the packages whose __init__ each import runs (importing a.b.c runs a.b and a, except the importer's
    own packages, already running)."""
    out = set()
    nodes = [tree]
    while nodes:
        node = nodes.pop()
        if _type_checking(node):
            continue  # annotations only, never executed
        nodes.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            own = name.split(".")
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module in known and module != name and own[:i] != parts[:i]:
                    out.add(module)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, tree, is_package, found) for name, (tree, is_package) in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_closed_by_a_function_level_import():
    """The check below can fail: a late import that closes a loop, through a package's __init__, is found."""
    known = {"p": None, "p.a": None, "p.b": None, "q": None}
    a = ast.parse("from p.b import x\n")
    b = ast.parse("def f():\n    from q import y\n")
    q = ast.parse("import p.a\n")
    graph = {"p": set(), "p.a": imported("p.a", a, False, known), "p.b": imported("p.b", b, False, known),
             "q": imported("q", q, True, known)}
    assert cycles(graph) == [["p.a", "p.b", "q"]]
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from q import y\n")
    assert imported("p.b", typed, False, known) == set()


def test_no_import_cycle_among_the_project_modules():
    graph = import_graph()
    assert len(graph) > 80  # every module was read
    found = cycles(graph)
    assert not found, "import cycles (function-level imports included): " + "; ".join(
        " <-> ".join(component) for component in found)


def test_the_layers_import_only_downward():
    """The bottom layer (schema, rules, layout) imports no MindSpore-side layer; models never import the
    backends, the parallel runtime, train or the CLI; nothing below the CLI imports interop or graph_opt."""
    graph = import_graph()
    bottom = [m for m in graph if m in ("msllm.errors", "msllm.config", "msllm.rules", "msllm.params")
              or m.startswith("msllm.layout")]
    runtime = ("msllm.models", "msllm.backends", "msllm.kernels", "msllm.parallel", "msllm.train", "msllm.lora")
    for module in bottom:
        up = [t for t in graph[module] if t.startswith(runtime) or t.startswith(("interop", "graph_opt"))]
        assert not up, f"{module} imports {up}"
    for module in (m for m in graph if m.startswith("msllm.models")):
        up = [t for t in graph[module] if t.startswith(("msllm.backends", "msllm.parallel", "msllm.train", "msllm.cli"))]
        assert not up, f"{module} imports {up}"
    for module in (m for m in graph if m.startswith("msllm.models.mixers") or m == "msllm.models.moe"):
        assert "msllm.models.decoder" not in graph[module], f"{module} imports the decoder"
    for module in (m for m in graph if m.startswith("msllm") and m != "msllm.cli"):
        up = [t for t in graph[module] if t.startswith(("interop", "graph_opt"))]
        assert not up, f"{module} imports {up}"


LIGHT = """
import sys
from msllm.config_file import load_config
from msllm.cli import main
cfg = load_config("configs/tiny.yaml", ["parallel.dp=2"])
rc = main(["plan", "--config", "configs/llama3_8b.yaml", "--devices", "16", "--top", "2"])
heavy = sorted(m for m in ("mindspore", "tokenizers", "torch") if m in sys.modules)
print(rc, heavy)
"""


def test_no_module_defines_a_name_twice():
    """A second top-level def or class of one name silently replaces the first for every caller (a second
    `rope_tables` once broke the layout oracle's, which only a 30-test file noticed)."""
    twice = []
    for name, (tree, _) in modules().items():
        seen = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in seen:
                    twice.append(f"{name}.{node.name} (line {node.lineno})")
                seen.add(node.name)
    assert not twice, f"defined twice: {twice}"


def test_config_loading_and_plan_import_neither_mindspore_nor_tokenizers():
    proc = subprocess.run([sys.executable, "-c", LIGHT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 []", proc.stdout[-2000:]
