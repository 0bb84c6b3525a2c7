# Copyright 2026 The verl-sat Authors
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Exact text edits of verl's source and extraction of verl-sat's own definitions, for the upstream patch generator.

Every edit names the one place it changes by an anchor that must occur exactly once, so a verl release that moved
the code makes generation fail with the file and the anchor instead of producing a patch that does not apply.
"""

import ast
import inspect
import textwrap
from types import ModuleType


class UpstreamDriftError(RuntimeError):
    """verl's source (or verl-sat's) no longer has the shape the generator edits."""


def replace_once(text: str, old: str, new: str, where: str) -> str:
    """``text`` with the single occurrence of ``old`` replaced by ``new``; ``where`` names the file in errors."""
    count = text.count(old)
    if count != 1:
        raise UpstreamDriftError(
            f"{where}: expected exactly one occurrence of {old!r}, found {count}; the verl source is not the 0.9.1 "
            "the generator was written for"
        )
    return text.replace(old, new)


def insert_before(text: str, anchor: str, block: str, where: str) -> str:
    """``block`` inserted right before the single occurrence of ``anchor``."""
    return replace_once(text, anchor, block + anchor, where)


def insert_after(text: str, anchor: str, block: str, where: str) -> str:
    """``block`` inserted right after the single occurrence of ``anchor``."""
    return replace_once(text, anchor, anchor + block, where)


def standalone_source(module: ModuleType) -> str:
    """The whole source of a verl-sat module that is copied into verl as it is, which it can only be if it imports
    neither verl nor verl-sat."""
    source = inspect.getsource(module)
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
    if imported & {"verl", "verl_sat"} or "verl_sat" in source:
        raise UpstreamDriftError(
            f"{module.__name__} must import neither verl nor verl_sat: it is copied into verl as is"
        )
    return source


def definitions_source(module: ModuleType, names: list[str] | None = None) -> str:
    """The source of ``module``'s top-level functions and classes (decorators included), in file order, separated by
    two blank lines: all of them, or ``names`` (each must exist)."""
    source = inspect.getsource(module)
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    if names is not None:
        missing = sorted(set(names) - {n.name for n in nodes})
        if missing:
            raise UpstreamDriftError(f"{module.__name__} has no top-level definition named {missing}")
        nodes = [n for n in nodes if n.name in names]
    return "\n\n\n".join(_segment(source, n) for n in nodes)


def methods_source(cls: type, names: list[str]) -> str:
    """The source of methods ``names`` of ``cls``, in the order given, indented as class members (4 spaces) and
    separated by one blank line."""
    class_source = textwrap.dedent(inspect.getsource(cls))
    body = {n.name: n for n in ast.parse(class_source).body[0].body if isinstance(n, ast.FunctionDef)}
    missing = [name for name in names if name not in body]
    if missing:
        raise UpstreamDriftError(f"{cls.__qualname__} has no method named {missing}")
    return "\n\n".join(textwrap.indent(_segment(class_source, body[name], dedent=True), "    ") for name in names)


def module_imports(module: ModuleType) -> list[str]:
    """The top-level import statements of ``module``, one source line each (as written)."""
    source = inspect.getsource(module)
    return [_segment(source, n) for n in ast.parse(source).body if isinstance(n, ast.Import | ast.ImportFrom)]


def top_level_names(source: str) -> set[str]:
    """The names a module's source binds at top level: functions, classes, imports and plain assignments."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _segment(source: str, node: ast.AST, dedent: bool = False) -> str:
    lines = source.splitlines()
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    segment = "\n".join(lines[first - 1 : node.end_lineno])
    return textwrap.dedent(segment) if dedent else segment
