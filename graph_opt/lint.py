"""msllm lint: what GRAPH_MODE rejects or silently slows, read from the source before any compile.

MindSpore compiles a Cell's `construct` (and `bprop`, and what they call) into one graph. Python
that works eagerly can fail there, fall back to the interpreter every step (JIT fallback: a host
round trip, rejected under jit_syntax_level STRICT), or run once at compile time only. This module
reads the source with `ast`, follows which values are tensors, and reports each such line as
`file:line: CODE: message; fix: rewrite`.

Compiled code = `construct` / `bprop` of every class defining `construct`, functions decorated
with `jit`, and, with what is known about their arguments at each call, the methods of the same
class and the functions of the same module they call (or pass to HyperMap / partial / map).

A value is a tensor when it comes from an argument of `construct`, an op call, a sub-Cell call,
a Tensor / Parameter attribute of the class, or arithmetic on a tensor. Static (decided at compile
time, never flagged): literals, `x.shape` / `x.ndim` / `x.dtype`, `len()`, `is None` tests, other
`self` attributes (flags, sizes, sub-Cells), `construct` arguments with a literal default, and
loop variables over `range` or a CellList. Where it cannot tell, it assumes static: a finding
should be a real one.

A line can opt out of a code with a reason: `if finite:  # noqa: GL101 (skip the update)`.
"""
from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass
from pathlib import Path

from msllm.errors import UserError


class LintError(UserError, ValueError):
    """A path that cannot be linted (missing, not Python, syntax error). One line."""


# code -> (message, suggested rewrite); {name} is filled in per finding.
CODES = {
    "GL101": ("{name} branches on a tensor value: the choice moves to run time, each side compiled as its own "
              "sub-graph",
              "ops.select(cond, a, b) on both results, or branch on a static value (a self flag, x.shape, x.ndim, "
              "`is None`)"),
    "GL102": ("{name} turns a tensor into a Python value: a device-to-host sync every step, or JIT fallback to "
              "the interpreter",
              "keep it a tensor (ops.* on it), or return it from construct and convert outside the graph"),
    "GL103": ("{name} in a graph prints Python values once, at compile time; tensors get a Print op that syncs "
              "every step",
              "remove it, or debug with train.mode: pynative (msllm train --mode pynative)"),
    "GL104": ("{name} mutates Python state in the graph: it runs through JIT fallback every step or only at "
              "compile time, and changes to containers are lost",
              "keep state in a Parameter (ops.assign), or return the value from construct"),
    "GL105": ("{name} on a tensor is not a graph op: JIT fallback to the interpreter (rejected under STRICT "
              "syntax)",
              "the ops equivalent (ops.sort, ops.any, ops.all, ops.argmax, ...)"),
    "GL106": ("{name} iterates over a tensor or a tuple of tensors: unrolled into the graph, one copy per element",
              "one batched op over the axis (broadcasting, ops.split / ops.stack, vmap); ops.HyperMap over a "
              "tuple of tensors"),
    "GL107": ("try/except is not supported in a graph (MindSpore: Unsupported statement 'Try')",
              "check inputs before calling the Cell; ops.isfinite / ops.select for bad values"),
    "GL108": ("{name} in a graph: module state is not part of it",
              "pass the value as an argument, or keep it on self (static) or in a Parameter"),
    "GL109": ("{name} in construct: built once at compile time, its weights frozen as graph constants "
              "(not trained)",
              "create it in __init__ (self.layer = ...) and call it here"),
    "GL110": ("{name} is numpy in a graph: folded at compile time on constants, fails on tensors",
              "the ops / mint equivalent, or compute the constant in __init__"),
}
# GL103 for a debugger instead of print.
DEBUGGER = ("{name} cannot stop inside a compiled graph",
            "debug with train.mode: pynative (msllm train --mode pynative)")

# Tensor attributes that are compile-time values.
STATIC_ATTRS = {"shape", "ndim", "dtype", "size", "itemsize", "nbytes", "strides"}
TENSOR_FACTORIES = {"zeros", "ones", "full", "fill", "arange", "eye", "linspace", "zeros_like", "ones_like",
                    "full_like", "rand", "randn", "normal", "uniform", "tensor", "from_numpy"}
# Submodules of mindspore whose lowercase functions compute tensors.
OP_NAMESPACES = {"ops", "mint", "numpy", "functional", "operations", "composite", "nn", "amp", "communication"}
# Calls that return compile-time values (shapes, dtypes, ranks, type tests).
STATIC_CALLS = {"shape", "Shape", "dtype", "DType", "rank", "Rank", "typeof", "issubclass_", "isinstance",
                "is_sequence_value_unknown", "is_sequence_shape_unknown", "is_floating_point", "is_complex",
                "is_tensor", "get_context"}
TO_PYTHON_METHODS = {"asnumpy", "numpy", "item", "tolist"}
TO_PYTHON_BUILTINS = {"int", "float", "bool", "complex"}
MUTATING_METHODS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add",
                    "discard", "popitem", "sort", "reverse"}
# Built-ins the graph compiler maps to graph operations (mindspore/graph/_parse/resources.py).
GRAPH_BUILTINS = {"abs", "round", "len", "bool", "map", "filter", "zip", "enumerate", "isinstance", "max", "min",
                  "sum", "getattr", "hasattr", "iter", "next", "range", "print", "int", "float", "str", "list",
                  "tuple", "pow", "super", "partial", "setattr", "delattr"}
STATIC_BUILTINS = {"len", "isinstance", "issubclass", "hasattr", "callable", "type", "id", "hash", "range", "str",
                   "repr", "format", "print", "int", "float", "bool", "complex"}
NEVER_IN_GRAPH = {"open", "input", "eval", "exec", "compile", "globals", "locals", "vars", "exit", "quit", "help"}
ALL_BUILTINS = {name for name in dir(builtins) if not name.startswith("_")}
NOQA = re.compile(r"#\s*noqa:\s*([A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    code: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code}: {self.message}; fix: {self.fix}"


def finding(path: str, line: int, code: str, name: str = "", messages: tuple | None = None) -> Finding:
    message, fix = messages or CODES[code]
    return Finding(path, line, code, message.format(name=name), fix)


def _dotted(node) -> str:
    """'np.random.rand' for an Attribute chain rooted at a Name; '' otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _self_rooted(node) -> bool:
    """self.a, self.a.b, self.a[i] ..."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def is_method(func: ast.FunctionDef, cls) -> bool:
    return cls is not None and not any(_dotted(d) == "staticmethod" for d in func.decorator_list)


def parameters(func: ast.FunctionDef, method: bool) -> list[ast.arg]:
    """Positional parameters, without self."""
    params = func.args.posonlyargs + func.args.args
    return params[1:] if method else params


def _is_literal_default(node) -> bool:
    return isinstance(node, ast.Constant) or (isinstance(node, (ast.Tuple, ast.List)) and not node.elts)


class Module:
    """What one file's imports, module functions and classes tell the analysis."""

    def __init__(self, tree: ast.Module):
        self.numpy: set[str] = set()        # names bound to numpy or one of its functions
        self.mindspore: set[str] = set()    # mindspore and its op namespaces (ops, mint, F, P, ...)
        self.nn: set[str] = set()
        self.pdb: set[str] = set()
        self.creators: set[str] = set()     # Parameter / nn.X names imported directly
        self.tensor_makers: set[str] = {"Tensor", "Parameter", "initializer"}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.containers: set[str] = set()   # module-level lists / dicts / sets
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._import(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.Assign) and _is_container(node.value):
                self.containers.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.cell_classes = {name for name, c in self.classes.items() if self._is_cell(c)}
        # @constexpr / @_primexpr functions run at compile time on constants: their results are static.
        self.compile_time = {name for name, f in self.functions.items()
                             if any(_dotted(d.func if isinstance(d, ast.Call) else d).split(".")[-1]
                                    in ("constexpr", "primexpr", "_primexpr", "_constexpr") for d in f.decorator_list)}

    def _import(self, node) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                root = alias.name.split(".")[0]
                if root == "numpy":
                    self.numpy.add(local)
                elif root == "mindspore":
                    self.mindspore.add(local)
                    if alias.name == "mindspore.nn" and alias.asname:
                        self.nn.add(local)
                elif root == "pdb":
                    self.pdb.add(local)
            return
        module = node.module or ""
        for alias in node.names:
            local = alias.asname or alias.name
            if module.split(".")[0] == "numpy":
                self.numpy.add(local)
            elif module == "mindspore" and alias.name == "nn":
                self.nn.add(local)
            elif module.split(".")[0] == "mindspore":
                if alias.name in OP_NAMESPACES:
                    self.mindspore.add(local)
                if alias.name in ("Parameter", "Tensor"):
                    self.tensor_makers.add(local)
                if alias.name == "Parameter" or module in ("mindspore.nn", "mindspore.nn.layer"):
                    self.creators.add(local)
            elif module == "pdb":
                self.pdb.add(local)

    def _is_cell(self, cls: ast.ClassDef, seen=()) -> bool:
        if any(isinstance(n, ast.FunctionDef) and n.name == "construct" for n in cls.body):
            return True
        for base in cls.bases:
            name = _dotted(base)
            if name.split(".")[-1] == "Cell" or (name in self.classes and name not in seen
                                                 and self._is_cell(self.classes[name], (*seen, name))):
                return True
        return False

    def methods(self, cls: ast.ClassDef, seen=()) -> dict[str, ast.FunctionDef]:
        """Methods of cls and of its bases defined in this module (cls's own win)."""
        found = {}
        for base in cls.bases:
            name = _dotted(base)
            if name in self.classes and name not in seen and self.classes[name] is not cls:
                found.update(self.methods(self.classes[name], (*seen, cls.name)))
        found.update({n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)})
        return found

    def makes_tensor(self, node) -> bool:
        """Parameter(...), Tensor(...), ms.Tensor(...), ops.zeros(...): a tensor attribute."""
        if isinstance(node, ast.IfExp):
            return self.makes_tensor(node.body) or self.makes_tensor(node.orelse)
        if not isinstance(node, ast.Call):
            return False
        name = _dotted(node.func)
        last = name.split(".")[-1]
        return last in self.tensor_makers or (name.split(".")[0] in self.mindspore and last in TENSOR_FACTORIES)

    def makes_parameter(self, node) -> bool:
        if isinstance(node, ast.IfExp):
            return self.makes_parameter(node.body) or self.makes_parameter(node.orelse)
        return isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] == "Parameter"


def _is_sequence(node) -> bool:
    """(a, b), [a, b], t + (x,), tuple(...), list(...)."""
    if isinstance(node, ast.BinOp):
        return _is_sequence(node.left) or _is_sequence(node.right)
    return isinstance(node, (ast.Tuple, ast.List, ast.ListComp)) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("tuple", "list"))


def _is_container(node) -> bool:
    return isinstance(node, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "dict", "set"))


class ClassInfo:
    def __init__(self, module: Module, cls: ast.ClassDef | None):
        self.cls = cls
        self.methods = module.methods(cls) if cls else {}
        self.tensors, self.parameters, self.containers = set(), set(), set()
        self.assigned, self.static_callables = set(), set()  # all self.X; X = P.Shape() and the like
        for method in self.methods.values():
            for node in ast.walk(method):
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                        if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id == "self"):
                            continue
                        value = node.value
                        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                                and len(value.elts) == len(target.elts):
                            value = value.elts[target.elts.index(t)]
                        self.assigned.add(t.attr)
                        if isinstance(value, ast.Call) and _dotted(value.func).split(".")[-1] in STATIC_CALLS:
                            self.static_callables.add(t.attr)
                        if module.makes_tensor(value):
                            self.tensors.add(t.attr)
                        if module.makes_parameter(value):
                            self.parameters.add(t.attr)
                        if _is_container(value):
                            self.containers.add(t.attr)


class Analysis:
    """Follows tensor-ness through the compiled functions of one file and records findings."""

    def __init__(self, path: str, source: str, tree: ast.Module):
        self.path = path
        self.lines = source.splitlines()
        self.module = Module(tree)
        self.findings: dict[tuple, Finding] = {}
        self.done: dict[tuple, tuple] = {}     # (function, class, argument tensor-ness) -> analyse()
        self.active: set[tuple] = set()
        self.compiled: set[int] = set()        # ids of the functions analysed
        self.class_info: dict[int, ClassInfo] = {}

    # --- entry points -------------------------------------------------------------------------
    def run(self) -> list[Finding]:
        for name in sorted(self.module.cell_classes):
            cls = self.module.classes[name]
            methods = self.module.methods(cls)
            for entry in ("construct", "bprop"):
                if entry in methods:
                    self.analyse(methods[entry], cls, self.root_taint(methods[entry], bprop=entry == "bprop"))
        for func in self.module.functions.values():
            if any(_dotted(d.func if isinstance(d, ast.Call) else d).split(".")[-1] == "jit"
                   for d in func.decorator_list):
                self.analyse(func, None, self.root_taint(func, bprop=False, method=False))
        return sorted(self.findings.values(), key=lambda f: (f.line, f.code))

    @staticmethod
    def root_taint(func: ast.FunctionDef, bprop: bool, method: bool = True) -> tuple:
        """Arguments of a graph entry are tensors, except ones with a literal default (flags)."""
        params = parameters(func, method)
        defaults = [None] * (len(params) - len(func.args.defaults)) + list(func.args.defaults)
        return tuple(bprop or d is None or not _is_literal_default(d) for d in defaults)

    def analyse(self, func: ast.FunctionDef, cls: ast.ClassDef | None, taint: tuple) -> tuple:
        """Analyse func (a method of cls, or a module function) with its parameters' tensor-ness
        (in order, after self). Returns (returns a tensor, per element when it returns tuples)."""
        key = (id(func), id(cls), taint)
        if key in self.done:
            return self.done[key]
        if key in self.active:  # recursion: assume a tensor comes back
            return True, None
        self.active.add(key)
        self.compiled.add(id(func))
        method = is_method(func, cls)
        env = {"self": False} if method else {}
        env.update((p.arg, t) for p, t in zip(parameters(func, method), taint))
        for extra in (func.args.vararg, func.args.kwarg):
            if extra is not None:
                env[extra.arg] = True
        for arg, default in zip(func.args.kwonlyargs, func.args.kw_defaults):
            env[arg.arg] = default is None
        scope = Scope(self, self.info(cls), env, cls)
        if func.args.vararg is not None:  # *args: a tuple as long as the call made it
            scope.sequences.add(func.args.vararg.arg)
        scope.block(func.body)
        self.active.discard(key)
        self.done[key] = scope.returns, scope.return_parts or None
        return self.done[key]

    def info(self, cls) -> ClassInfo:
        key = id(cls)
        if key not in self.class_info:
            self.class_info[key] = ClassInfo(self.module, cls)
        return self.class_info[key]

    def report(self, node, code: str, name: str = "", messages: tuple | None = None) -> None:
        line = node.lineno
        text = self.lines[line - 1] if line - 1 < len(self.lines) else ""
        match = NOQA.search(text)
        if match and code in {c.strip() for c in match.group(1).split(",")}:
            return
        self.findings.setdefault((line, code), finding(self.path, line, code, name, messages))


class Scope:
    """One analysis of one function body: env maps local names to 'is a tensor'."""

    def __init__(self, analysis: Analysis, info: ClassInfo, env: dict, cls):
        self.a, self.info, self.env, self.cls = analysis, info, env, cls
        self.m = analysis.module
        self.returns = False
        self.return_parts: list | None = None  # [tensor per element] while every return is a tuple display
        self.parts: dict[int, tuple] = {}       # id(call node) -> its callee's return_parts
        self.taints: dict[int, bool] = {}  # id(expression node) -> tensor, as last evaluated
        self.sequences: set[str] = set()   # locals holding a tuple / list built here

    # --- statements ---------------------------------------------------------------------------
    def block(self, body) -> None:
        for stmt in body:
            self.stmt(stmt)

    def branch(self, *bodies) -> None:
        """Run each body from the current env; a name is a tensor after if it is in any branch."""
        start, merged = dict(self.env), {}
        for body in bodies:
            self.env = dict(start)
            self.block(body)
            for k, v in self.env.items():
                merged[k] = merged.get(k, False) or v
        self.env = merged

    def stmt(self, node) -> None:
        if isinstance(node, ast.Assign):
            value = self.expr(node.value)
            for target in node.targets:
                self.bind(target, value, node.value)
        elif isinstance(node, ast.AugAssign):
            value = self.expr(node.value)
            if isinstance(node.target, ast.Name):
                self.env[node.target.id] = self.env.get(node.target.id, False) or value
                if not _is_sequence(node.value):
                    self.sequences.discard(node.target.id)
            else:
                self.bind(node.target, value, node.value, augmented=True)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.bind(node.target, self.expr(node.value), node.value)
        elif isinstance(node, ast.If):
            self.check_test(node)
            self.branch(node.body, node.orelse)
        elif isinstance(node, ast.While):
            self.repeat(node.body, test=node)
            self.block(node.orelse)
        elif isinstance(node, ast.For):
            self.loop(node)
        elif isinstance(node, (ast.Try, ast.TryStar)):
            self.a.report(node, "GL107")
            self.branch(node.body, *[h.body for h in node.handlers], node.orelse)
            self.block(node.finalbody)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            self.a.report(node, "GL108", f"`{'global' if isinstance(node, ast.Global) else 'nonlocal'} "
                                         f"{', '.join(node.names)}`")
        elif isinstance(node, ast.Return):
            self.returns |= self.expr(node.value)
            parts = [self.taints[id(e)] for e in node.value.elts] if isinstance(node.value, ast.Tuple) else []
            if self.return_parts is None or len(self.return_parts) == len(parts):
                self.return_parts = [a or b for a, b in zip(self.return_parts or parts, parts)]
            else:
                self.return_parts = []
        elif isinstance(node, ast.Expr):
            self.expr(node.value)
        elif isinstance(node, ast.Assert):
            if self.expr(node.test):
                self.a.report(node, "GL101", f"`assert {ast.unparse(node.test)}`")
        elif isinstance(node, ast.With):
            for item in node.items:
                self.expr(item.context_expr)
            self.block(node.body)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if _self_rooted(target) or self.is_global(target):
                    self.a.report(node, "GL104", f"`del {ast.unparse(target)}`")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name.split(".")[0] == "pdb" for alias in node.names) or \
                    (isinstance(node, ast.ImportFrom) and node.module == "pdb"):
                self.a.report(node, "GL103", "`import pdb`", DEBUGGER)
                self.m.pdb.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.env[node.name] = False
        elif isinstance(node, ast.Raise):
            if node.exc is not None:
                self.expr(node.exc)

    def check_test(self, node) -> None:
        if self.expr(node.test):
            keyword = "if" if isinstance(node, ast.If) else "while"
            self.a.report(node, "GL101", f"`{keyword} {ast.unparse(node.test)}`")

    def repeat(self, body, test=None) -> None:
        """A loop body: run twice (values made in one iteration feed the next), then merge with
        the state before the loop (zero iterations)."""
        start = dict(self.env)
        for _ in range(2):
            if test is not None:
                self.check_test(test)
            self.block(body)
        for k, v in start.items():
            self.env[k] = self.env.get(k, False) or v

    def loop(self, node: ast.For) -> None:
        iter_tensor = self.expr(node.iter)
        if iter_tensor and not self.is_static_iterable(node.iter):
            self.a.report(node, "GL106", f"`for {ast.unparse(node.target)} in {ast.unparse(node.iter)}`")
        self.bind_element(node.target, node.iter, iter_tensor)
        self.repeat(node.body)
        self.block(node.orelse)

    def is_static_iterable(self, node) -> bool:
        """A tuple / list this code built itself, or zip / enumerate / range: a Python sequence of a
        length the code chose, not a tensor's rows (or a gradient tuple)."""
        return _is_sequence(node) or (isinstance(node, ast.Name) and node.id in self.sequences) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("zip", "enumerate", "range"))

    def bind_element(self, target, iterable, tensor: bool) -> None:
        """A loop or comprehension target: range gives ints, zip / enumerate one value per argument."""
        call = iterable if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) else None
        kind = call.func.id if call is not None and call.func.id not in self.env else ""
        if kind == "range":
            return self.bind(target, False, None)
        if kind in ("zip", "enumerate") and isinstance(target, (ast.Tuple, ast.List)) and call.args \
                and not any(isinstance(a, ast.Starred) for a in call.args):
            parts = [self.taints.get(id(a), tensor) for a in call.args]
            parts = [False, parts[0]] if kind == "enumerate" else parts
            if len(parts) == len(target.elts):
                for t, part in zip(target.elts, parts):
                    self.bind(t, part, None)
                return
        self.bind(target, tensor, None)

    def bind(self, target, value: bool, value_node, augmented: bool = False) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
            if _is_sequence(value_node):
                self.sequences.add(target.id)
            else:
                self.sequences.discard(target.id)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, value, value_node)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value_node, (ast.Tuple, ast.List)):
                elts = value_node.elts
                parts = [self.taints.get(id(e), value) for e in elts]
            else:
                parts = self.parts.get(id(value_node)) or ()
                elts = [None] * len(parts)
            for i, t in enumerate(target.elts):
                if len(parts) == len(target.elts):
                    self.bind(t, parts[i], elts[i])
                else:
                    self.bind(t, value, None)
        elif isinstance(target, ast.Attribute):
            self.expr(target.value)
            if _self_rooted(target) and not (isinstance(target.value, ast.Name)
                                             and target.attr in self.info.parameters):
                self.a.report(target, "GL104", f"`{ast.unparse(target)} {'+' if augmented else ''}= ...`")
        elif isinstance(target, ast.Subscript):
            self.expr(target.value)
            self.expr(target.slice)
            if _self_rooted(target) or self.is_global(target):
                self.a.report(target, "GL104", f"`{ast.unparse(target)} = ...`")

    def is_global(self, node) -> bool:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return isinstance(node, ast.Name) and node.id not in self.env and node.id in self.m.containers

    # --- expressions: return whether the value is a tensor ------------------------------------
    def expr(self, node) -> bool:
        tensor = self._expr(node)
        self.taints[id(node)] = tensor
        return tensor

    def _expr(self, node) -> bool:
        if node is None or isinstance(node, (ast.Constant, ast.Lambda, ast.JoinedStr)):
            return False
        if isinstance(node, ast.Name):
            return self.env.get(node.id, False)
        if isinstance(node, ast.Attribute):
            base = self.expr(node.value)
            if node.attr in STATIC_ATTRS:
                return False
            if isinstance(node.value, ast.Name) and node.value.id == "self" and "self" in self.env:
                return node.attr in self.info.tensors
            return base
        if isinstance(node, ast.Subscript):
            base = self.expr(node.value)
            self.expr(node.slice)
            return base
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.BinOp):
            return self.expr(node.left) | self.expr(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.expr(node.operand)
        if isinstance(node, ast.BoolOp):
            return any([self.expr(v) for v in node.values])
        if isinstance(node, ast.Compare):
            tensors = [self.expr(v) for v in [node.left, *node.comparators]]
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) or any(
                    isinstance(v, ast.Constant) and isinstance(v.value, str) for v in [node.left, *node.comparators]):
                return False  # identity tests and comparisons with a string are decided at compile time
            return any(tensors)
        if isinstance(node, ast.IfExp):
            if self.expr(node.test):
                self.a.report(node, "GL101", f"`... if {ast.unparse(node.test)} else ...`")
            return self.expr(node.body) | self.expr(node.orelse)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any([self.expr(e) for e in node.elts])
        if isinstance(node, ast.Dict):
            return any([self.expr(v) for v in node.values if v is not None] + [self.expr(k) for k in node.keys])
        if isinstance(node, ast.Starred):
            return self.expr(node.value)
        if isinstance(node, ast.Slice):
            return any([self.expr(node.lower), self.expr(node.upper), self.expr(node.step)])
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self.comprehension(node)
        if isinstance(node, ast.NamedExpr):
            value = self.expr(node.value)
            self.env[node.target.id] = value
            return value
        return False

    def comprehension(self, node) -> bool:
        saved = dict(self.env)
        tensor = False
        for gen in node.generators:
            iter_tensor = self.expr(gen.iter)
            if iter_tensor and not self.is_static_iterable(gen.iter):
                kind = {ast.GeneratorExp: "generator"}.get(type(node), "comprehension")
                self.a.report(node, "GL106", f"the {kind} `{ast.unparse(node)[:60]}`")
            self.bind_element(gen.target, gen.iter, iter_tensor)
            for cond in gen.ifs:
                if self.expr(cond):
                    self.a.report(cond, "GL101", f"the comprehension filter `if {ast.unparse(cond)}`")
        if isinstance(node, ast.DictComp):
            tensor = self.expr(node.key) | self.expr(node.value)
        else:
            tensor = self.expr(node.elt)
        self.env = saved
        return tensor

    def call(self, node: ast.Call) -> bool:
        args = [self.expr(a) for a in node.args]
        keywords = {k.arg: self.expr(k.value) for k in node.keywords}  # k.arg None: **kwargs
        any_tensor = any(args) or any(keywords.values())
        func = node.func
        name = _dotted(func)
        root = name.split(".")[0] if name else ""
        text = f"`{ast.unparse(func)}()`"
        callee = _dotted(func.func if isinstance(func, ast.Call) else func).split(".")[-1]
        if callee in STATIC_CALLS:
            self.expr(func)
            return False  # ops.shape(x), self.shape(x), P.Shape()(x), ops.rank(x) ...: compile-time values
        if callee == "scalar_cast":
            return any_tensor

        if isinstance(func, ast.Name) and func.id not in self.env:
            fid = func.id
            if fid in self.m.compile_time:
                return False
            if fid in self.m.functions:
                self.functions_passed(node)
                return self.returned(node, self.m.functions[fid], None, args, keywords)
            if fid in self.m.pdb:
                self.a.report(node, "GL103", text, DEBUGGER)
                return False
            if fid in self.m.numpy:
                self.a.report(node, "GL110", text)
                return any_tensor
            if fid in self.m.creators or fid in self.m.cell_classes:
                self.a.report(node, "GL109", text)
                return False
            if fid in self.m.tensor_makers:
                return True
            if fid in ALL_BUILTINS and fid not in self.m.functions:
                return self.builtin(node, fid, args, any_tensor)
            self.functions_passed(node)
            return any_tensor

        if isinstance(func, ast.Attribute):
            base = self.expr(func.value)
            if root in self.m.numpy and root not in self.env:
                self.a.report(node, "GL110", text)
                return any_tensor
            if root in self.m.pdb and root not in self.env:
                self.a.report(node, "GL103", text, DEBUGGER)
                return False
            if root not in self.env and (root in self.m.nn and func.attr[:1].isupper()
                                         or root in self.m.mindspore and func.attr == "Parameter"
                                         or root in self.m.mindspore and ".nn." in f".{name}."
                                         and func.attr[:1].isupper()):
                self.a.report(node, "GL109", text)
                return False
            if func.attr in TO_PYTHON_METHODS and (base or func.attr == "asnumpy"):
                self.a.report(node, "GL102", f"`{ast.unparse(node)}`")
                return False
            if func.attr in MUTATING_METHODS and self.is_container(func.value):
                self.a.report(node, "GL104", f"`{ast.unparse(node)[:60]}`")
                return False
            if isinstance(func.value, ast.Name) and func.value.id == "self" and "self" in self.env:
                method = self.info.methods.get(func.attr)
                if method is not None:
                    self.functions_passed(node)
                    return self.returned(node, method, self.cls, args, keywords)
                if func.attr in self.info.static_callables:
                    return False
                # a sub-Cell or primitive set in this class; else a method inherited from another file
                return func.attr in self.info.assigned or any_tensor
            self.functions_passed(node)
            if root in self.m.mindspore and root not in self.env:
                # ops.add(...) and ms.Tensor(...) are tensors, ops.MatMul() a primitive
                return func.attr[:1].islower() or func.attr in self.m.tensor_makers
            return base or any_tensor

        self.expr(func)
        return any_tensor

    def returned(self, node: ast.Call, func: ast.FunctionDef, cls, args: list, keywords: dict) -> bool:
        """Analyse a call of a function of this file; keep what each element of a returned tuple is."""
        tensor, parts = self.a.analyse(func, cls, self.bind_call(node, func, is_method(func, cls), args, keywords))
        if parts:
            self.parts[id(node)] = parts
        return tensor

    @staticmethod
    def bind_call(node: ast.Call, func: ast.FunctionDef, method: bool, args: list, keywords: dict) -> tuple:
        """Tensor-ness of func's parameters at this call: positional, by keyword, or the default
        (static) when not passed; anything after a *args / **kwargs at the call is a tensor."""
        starred = next((i for i, a in enumerate(node.args) if isinstance(a, ast.Starred)), len(node.args))
        params = parameters(func, method)
        return tuple(args[i] if i < starred else
                     True if i < len(node.args) or None in keywords else
                     keywords.get(p.arg, False) for i, p in enumerate(params))

    def builtin(self, node: ast.Call, fid: str, args: list, any_tensor: bool) -> bool:
        first = args[0] if args else False
        if fid in ("print", "breakpoint"):
            self.a.report(node, "GL103", f"`{fid}()`", None if fid == "print" else DEBUGGER)
            return False
        if fid in ("setattr", "delattr") and node.args and isinstance(node.args[0], ast.Name) \
                and node.args[0].id == "self":
            self.a.report(node, "GL104", f"`{fid}(self, ...)`")
            return False
        if fid in TO_PYTHON_BUILTINS and first:
            self.a.report(node, "GL102", f"`{ast.unparse(node)}`")
            return False
        if fid == "range" and any_tensor:
            self.a.report(node, "GL101", f"the loop bound `{ast.unparse(node)}`")
            return False
        if fid in NEVER_IN_GRAPH or (fid not in GRAPH_BUILTINS and any_tensor):
            self.a.report(node, "GL105", f"`{ast.unparse(node)[:60]}`")
        self.functions_passed(node)
        if fid in STATIC_BUILTINS:
            return False
        return any_tensor

    def functions_passed(self, node: ast.Call) -> None:
        """A module function passed as an argument (HyperMap, partial, map) is compiled too."""
        for arg in node.args:
            if isinstance(arg, ast.Name) and arg.id not in self.env and arg.id in self.m.functions:
                func = self.m.functions[arg.id]
                self.a.analyse(func, None, (True,) * len(parameters(func, False)))

    def is_container(self, node) -> bool:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr in self.info.containers
        return isinstance(node, ast.Name) and node.id not in self.env and node.id in self.m.containers


# --- files ------------------------------------------------------------------------------------
def python_files(paths) -> list[Path]:
    """The .py files named by paths: files, directories (recursively) or importable module names."""
    files = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            path = _module_path(str(raw))
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
            if not found:
                raise LintError(f"{raw}: no .py files in this directory")
            files.extend(found)
        elif path.suffix != ".py":
            raise LintError(f"{raw}: not a Python file (.py), directory or module")
        else:
            files.append(path)
    return list(dict.fromkeys(files))


def _module_path(name: str) -> Path:
    import importlib.util

    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        raise LintError(f"{name}: no such file, directory or module")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        raise LintError(f"{name}: no such file, directory or module")
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


def display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def lint_source(source: str, path: str = "<string>") -> tuple[list[Finding], int]:
    """(findings, number of compiled functions analysed) for one file's source."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise LintError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    analysis = Analysis(path, source, tree)
    found = analysis.run()
    return found, len(analysis.compiled)


def lint_paths(paths) -> tuple[list[Finding], int, int]:
    """(findings, files read, compiled functions analysed)."""
    files = python_files(paths)
    findings, functions = [], 0
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LintError(f"{display(path)}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        found, n = lint_source(source, display(path))
        findings.extend(found)
        functions += n
    return findings, len(files), functions
