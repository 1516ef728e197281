#!/usr/bin/env python
"""Generate docs/config-reference.md from the config dataclasses in msllm/config.py.

    python tools/gen_config_docs.py            # rewrite docs/config-reference.md
    python tools/gen_config_docs.py --check    # exit 1 if the committed file is stale
    python tools/gen_config_docs.py --out F    # write somewhere else (tests/test_docs.py)

The source is read as text (ast + tokenize), never imported, so this needs neither
MindSpore nor msllm's dependencies. For every field of every section class it takes the
name, the annotation, the default as written in the source, and the comments:
a trailing `# ...` on the field's line, comment-only lines that continue it (their `#`
in the same column), and comment-only lines directly above the field. Allowed values
come from the `CHOICES` table in the same file.
"""
from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "msllm" / "config.py"
OUTPUT = REPO / "docs" / "config-reference.md"


@dataclass
class Comment:
    line: int
    col: int
    text: str
    trailing: bool  # code precedes it on its line


@dataclass
class Field:
    name: str
    type: str
    default: str
    doc: str


def _comments(text: str) -> dict[int, Comment]:
    out: dict[int, Comment] = {}
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            line, col = tok.start
            body = tok.string[1:].strip()
            out[line] = Comment(line, col, body, bool(lines[line - 1][:col].strip()))
    return out


def _default(node: ast.AnnAssign, text: str) -> str:
    value = node.value
    if value is None:
        return ""
    # field(default_factory=X) / field(default=X)
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.get_source_segment(text, kw.value)
            if kw.arg == "default_factory":
                if isinstance(kw.value, ast.Lambda):  # lambda: [..]: the value it makes
                    return ast.get_source_segment(text, kw.value.body)
                return f"{ast.get_source_segment(text, kw.value)}()"
    return ast.get_source_segment(text, value)


def _fields(cls: ast.ClassDef, text: str, comments: dict[int, Comment]) -> list[Field]:
    fields = []
    claimed: set[int] = set()
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts = []
        # comment-only lines directly above, not already claimed as a continuation
        above, line = [], node.lineno - 1
        while line in comments and not comments[line].trailing and line not in claimed:
            above.append(comments[line].text)
            line -= 1
        parts.extend(reversed(above))
        # trailing comment on the field's last line, and its aligned continuation lines
        end = node.end_lineno
        if end in comments and comments[end].trailing:
            col = comments[end].col
            parts.append(comments[end].text)
            line = end + 1
            while line in comments and not comments[line].trailing and comments[line].col == col:
                parts.append(comments[line].text)
                claimed.add(line)
                line += 1
        fields.append(Field(node.target.id, ast.get_source_segment(text, node.annotation),
                            _default(node, text), " ".join(p for p in parts if p)))
    return fields


def _choices(tree: ast.Module) -> dict[str, tuple]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "CHOICES" for t in targets):
            return ast.literal_eval(node.value)
    return {}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(source: Path = SOURCE) -> str:
    text = source.read_text()
    tree = ast.parse(text)
    comments = _comments(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    choices = _choices(tree)
    if "Config" not in classes:
        raise SystemExit(f"{source}: no class Config")
    # the sections, in order: Config's fields, each a default_factory of a section class
    sections = []
    for node in classes["Config"].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            cls_name = ast.get_source_segment(text, node.annotation)
            if cls_name in classes:
                sections.append((node.target.id, classes[cls_name]))
    rel = source.relative_to(REPO) if source.is_relative_to(REPO) else source
    out = [
        "# Config reference",
        "",
        f"<!-- Generated by tools/gen_config_docs.py from {rel}. Do not edit by hand:",
        "     change the dataclass field or its comment, then run the script. "
        "tests/test_docs.py fails when this file is stale. -->",
        "",
        f"A run config is YAML with the sections {', '.join(f'`{name}`' for name, _ in sections)}. "
        "Every key is optional; a missing key takes the default below. An unknown key, a value of the "
        "wrong type or an impossible value stops `msllm train` with one line naming the file and the key "
        "(exit code 2). On the command line, `--set SECTION.KEY=VALUE` overrides any key; the value is "
        "read as YAML.",
        "",
        "Defaults are shown as written in the source. *Allowed* lists the values accepted for keys "
        "that take one of a fixed set. Further checks (e.g. `model.num_heads` must divide "
        "`model.hidden_size`) are in `_check()` in `msllm/config_file.py`.",
        "",
    ]
    for name, cls in sections:
        out += [f"## `{name}` ({cls.name})", ""]
        doc = ast.get_docstring(cls)
        if doc:
            out += [doc, ""]
        out += ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
        for f in _fields(cls, text, comments):
            allowed = ", ".join(f"`{c}`" for c in choices.get(f"{name}.{f.name}", ()))
            out.append(f"| `{name}.{f.name}` | `{_cell(f.type)}` | `{_cell(f.default)}` | {_cell(allowed)} | "
                       f"{_cell(f.doc)} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=SOURCE)
    p.add_argument("--out", type=Path, default=OUTPUT)
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = p.parse_args(argv)
    doc = render(args.source)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != doc:
            print(f"{args.out} is stale: run python tools/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
