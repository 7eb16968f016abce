"""Lists every command-line flag of upstream Megatron-LM's training parser.

    python tools/upstream_flags.py UPSTREAM_GIT_DIR [--out tests/unit_tests/training/census/upstream_flags.txt]

Upstream's ``megatron/training/arguments.py`` adds flags two ways: by hand
(``add_argument('--flag', ...)``) and generated from config dataclasses
(``ArgumentGroupFactory(SomeConfig, exclude=[...])``: each field ``name`` becomes
``--name`` with dashes, a bool field that defaults to True becomes ``--no-name`` and
``--disable-name``, a field's ``argparse_meta`` ``arg_names`` win, and ``init=False``
fields have none). Both are read
from the source at the upstream HEAD, without importing it (it needs CUDA packages).
Each line is a flag and how it parses (``switch``, ``value`` or ``list``). The list feeds
``test_upstream_flags.py``: each flag must parse here, with Megatron's meaning, as a
no-op that says so, or with an error naming it.
"""

import argparse
import ast
import os
import re
import subprocess

ARGUMENTS = "megatron/training/arguments.py"


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def _kebab(name: str, prefix: str = "") -> str:
    return "--" + (prefix + "_" + name if prefix else name).replace("_", "-")


def _string_list(node: ast.AST) -> list[str]:
    return [e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _factory_uses(tree: ast.Module) -> list[tuple[str, set[str]]]:
    """(config class name, excluded fields) of every ``ArgumentGroupFactory(...)`` call."""
    lists: dict[str, list[str]] = {}  # list variables, for exclude=<name>
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    lists[target.id] = _string_list(node.value)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ArgumentGroupFactory":
            excluded: list[str] = []
            for kw in node.keywords:
                if kw.arg == "exclude":
                    excluded = lists.get(kw.value.id, []) if isinstance(kw.value, ast.Name) else _string_list(kw.value)
            uses.append((node.args[0].id, set(excluded)))
    return uses


def _class_source(git_dir: str, name: str) -> ast.ClassDef | None:
    found = subprocess.run(
        ["git", "--git-dir", git_dir, "grep", "-l", f"^class {name}\\b", "HEAD", "--", "megatron"],
        capture_output=True,
        text=True,
    ).stdout.split()
    for hit in found:
        tree = ast.parse(_git(git_dir, "show", hit.replace("HEAD:", "HEAD:", 1)))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
    return None


def _fields(git_dir: str, name: str, seen: set[str]) -> list[tuple[str, str, str | None, list[str] | None]]:
    """(name, annotation, default source, arg_names) of a dataclass's fields, base classes first."""
    node = _class_source(git_dir, name)
    if node is None or name in seen:
        return []
    seen.add(name)
    out = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            out += _fields(git_dir, base.id, seen)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = ast.unparse(stmt.annotation)
        if annotation.startswith("ClassVar") or stmt.target.id.startswith("_"):
            continue
        default, names = None, None
        if isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func).endswith("field"):
            if any(kw.arg == "init" and ast.unparse(kw.value) == "False" for kw in stmt.value.keywords):
                continue  # not a constructor argument: no flag
            for kw in stmt.value.keywords:
                if kw.arg == "default":
                    default = ast.unparse(kw.value)
                if kw.arg == "metadata":
                    m = re.search(r"'arg_names':\s*\[([^\]]*)\]", ast.unparse(kw.value))
                    names = re.findall(r"'(--[^']+)'", m.group(1)) if m else None
        elif stmt.value is not None:
            default = ast.unparse(stmt.value)
        out.append((stmt.target.id, annotation, default, names))
    return out


def _kind_of_call(args: str) -> str:
    if re.search(r"action\s*=\s*(['\"]store_(true|false)['\"]|argparse\.BooleanOptionalAction)", args):
        return "switch"
    return "list" if re.search(r"nargs\s*=\s*['\"][+*]['\"]", args) else "value"


def _kind_of_field(annotation: str) -> str:
    bare = annotation.replace("Optional[", "").replace("typing.", "")
    if bare.startswith("bool"):
        return "switch"
    return "list" if bare.startswith(("list", "List")) else "value"


def upstream_flags(git_dir: str) -> dict[str, str]:
    """Every flag of upstream's training parser -> ``switch``, ``value`` or ``list`` (how it parses)."""
    source = _git(git_dir, "show", f"HEAD:{ARGUMENTS}")
    flags = {}
    for m in re.finditer(r"add_argument\(\s*['\"](--[A-Za-z0-9_-]+)['\"](.*?)\)\s*\n", source, re.S):
        flags[m.group(1)] = _kind_of_call(m.group(2))
        if "BooleanOptionalAction" in m.group(2):  # argparse adds the negative switch
            flags["--no-" + m.group(1)[2:]] = "switch"
    for cls, excluded in _factory_uses(ast.parse(source)):
        for name, annotation, default, names in _fields(git_dir, cls, set()):
            if name in excluded:
                continue
            kind = _kind_of_field(annotation)
            if names:
                flags.update(dict.fromkeys(names, kind))
            elif kind == "switch" and default == "True":
                flags.update(dict.fromkeys((_kebab(name, "no"), _kebab(name, "disable")), kind))
            else:
                flags[_kebab(name)] = kind
    return dict(sorted(flags.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream_git_dir")
    parser.add_argument("--out", default="tests/unit_tests/training/census/upstream_flags.txt")
    a = parser.parse_args()
    commit = _git(a.upstream_git_dir, "rev-parse", "HEAD").strip()
    flags = upstream_flags(a.upstream_git_dir)
    with open(a.out, "w") as f:
        f.write(f"# Generated by tools/upstream_flags.py from NVIDIA/Megatron-LM {commit} ({ARGUMENTS}).\n")
        f.write("".join(f"{flag} {kind}\n" for flag, kind in flags.items()))
    print(f"{len(flags)} flags -> {os.path.relpath(a.out)}")


if __name__ == "__main__":
    main()
