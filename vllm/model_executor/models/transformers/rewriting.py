# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A class's forward as source: read it, splice it, compile it again.

`ForwardRewrite` is a copy of a class's forward source to splice (insert a statement,
replace an expression) and compile again in the original module's globals. What
cannot be recompiled safely raises `FusionDeclined`. Rewritten forwards carry no
annotations, so a forward annotated with names its module imports only for type
checkers (`from __future__ import annotations` plus `TYPE_CHECKING`) recompiles too.
"""

import ast
import copy
import functools
import inspect
import os
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

class FusionDeclined(Exception):
    """A pattern that almost matched, or a rewrite that cannot be applied safely."""


Span = tuple[int, int, int, int]
"""`(line, column, end line, end column)` of an expression in its file."""

@dataclass(frozen=True)
class ForwardSource:
    """The parsed source of a class's `forward`, and where it was read from."""

    tree: ast.FunctionDef
    filename: str
    first_line: int
    indent: int = 0
    """Columns removed by dedenting, to map the tree's positions back to the file."""

    def location(self, node: ast.AST) -> str:
        """`file:line` of `node` in the original file."""
        return f"{self.filename}:{self.first_line + getattr(node, 'lineno', 1) - 1}"

    def expression_at(
        self, span: Span | None, tree: ast.AST | None = None
    ) -> ast.expr | None:
        """The expression at `span` (a graph node's) in `tree` (a copy of this
        forward's, default: its own), if any."""
        if span is None:
            return None
        return next(
            (
                n
                for n in ast.walk(tree or self.tree)
                if isinstance(n, ast.expr)
                and hasattr(n, "end_lineno")
                and self.span(n) == span
            ),
            None,
        )

    def span(self, node: ast.AST) -> Span:
        """Where `node` sits in its file, comparable with a graph node's span."""
        offset = self.first_line - 1
        return (
            node.lineno + offset,
            node.col_offset + self.indent,
            node.end_lineno + offset,
            node.end_col_offset + self.indent,
        )


@functools.cache
def forward_source(cls: type[nn.Module]) -> ForwardSource | None:
    """The source of `cls.forward`, or `None` where Python cannot recover it."""
    forward = inspect.unwrap(cls.forward)
    try:
        lines, first_line = inspect.getsourcelines(forward)
        filename = inspect.getsourcefile(forward) or "?"
    except (OSError, TypeError):
        return None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        return None
    indent = len(lines[0]) - len(lines[0].lstrip())
    return ForwardSource(function, filename, first_line, indent)


_builds_reading = 0
_builds_reading_lock = threading.Lock()


@contextmanager
def sources_read_by_build() -> Iterator[None]:
    """Around a model's build: when the last build in progress ends, forget the
    parsed forward sources. Their syntax trees are thousands of objects that every
    later full garbage collection would visit for the life of the process (vLLM
    starts the engine right after the build), while what the class analysis
    decided from them stays in its own cache; a later build parses again the few
    it reads, in milliseconds. Fusers keep source positions (`Span`), never nodes
    they compare with a later parse, so a fresh parse reads the same."""
    global _builds_reading
    with _builds_reading_lock:
        _builds_reading += 1
    try:
        yield
    finally:
        with _builds_reading_lock:
            _builds_reading -= 1
            if not _builds_reading:
                forward_source.cache_clear()


def _is_private(name: str) -> bool:
    """Names Python mangles inside a class body, which recompiling outside would not."""
    return name.startswith("__") and not name.endswith("__")


def stored_names(tree: ast.AST, name: str | None = None) -> list[ast.Name]:
    """Every name `tree` binds or deletes (only `name`, where given)."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Name)
        and not isinstance(n.ctx, ast.Load)
        and name in (None, n.id)
    ]


def loaded_names(tree: ast.AST, name: str) -> list[ast.Name]:
    """Every read of `name` in `tree`."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
    ]


def _writes_in_place(tree: ast.AST) -> bool:
    """Whether `tree` may modify a tensor in place: an in-place method (`x.mul_(2)`),
    `out=` or `inplace=True`, an augmented assignment (`x += y`), or an assignment
    to a subscript or attribute of a value (`x[0] = y`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            function = node.func
            if (
                isinstance(function, ast.Attribute)
                and function.attr.endswith("_")
                and not function.attr.startswith("_")
            ):
                return True
            for keyword in node.keywords:
                if keyword.arg == "out" or (
                    keyword.arg == "inplace"
                    and not (
                        isinstance(keyword.value, ast.Constant)
                        and keyword.value.value is False
                    )
                ):
                    return True
        elif isinstance(node, ast.AugAssign):
            return True
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(
                isinstance(t, ast.Subscript | ast.Attribute)
                for target in targets
                for t in ast.walk(target)
            ):
                return True
    return False


def self_attribute_path(node: ast.AST) -> str | None:
    """`a.b` where `node` reads `self.a.b`, else `None`."""
    path = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if path and isinstance(node, ast.Name) and node.id == "self":
        return ".".join(reversed(path))
    return None


def is_self_attribute(node: ast.AST, name: str | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (name is None or node.attr == name)
    )


class ForwardRewrite:
    """A copy of a class's forward source to splice, then compile in the globals of the
    module that defines it (so it sees that module's imports, as the original did).

    Raises `FusionDeclined` for a forward that cannot be recompiled safely: no source,
    free variables (a closure, `super()`), name-mangled private names, or a wrapper
    that its source does not reproduce."""

    def __init__(self, cls: type[nn.Module]):
        self.function = inspect.unwrap(cls.forward)
        source = forward_source(cls)
        name = f"{cls.__name__}.forward"
        if source is None:
            raise FusionDeclined(f"{name} has no source to rewrite")
        if free := self.function.__code__.co_freevars:
            raise FusionDeclined(
                f"{name} uses free variables {list(free)} (a closure or super())"
            )
        private = sorted(
            {
                n.id
                for n in ast.walk(source.tree)
                if isinstance(n, ast.Name) and _is_private(n.id)
            }
            | {
                n.attr
                for n in ast.walk(source.tree)
                if isinstance(n, ast.Attribute) and _is_private(n.attr)
            }
        )
        if private:
            raise FusionDeclined(f"{name} uses name-mangled private names {private}")
        if cls.forward is not self.function and not source.tree.decorator_list:
            raise FusionDeclined(
                f"{name} is wrapped by something its source does not show"
            )
        self.source = source
        self.tree = copy.deepcopy(source.tree)

    def expression_at(self, span: Span | None) -> ast.expr | None:
        """The expression of this forward at `span` (a graph node's), if any."""
        return self.source.expression_at(span, self.tree)

    def self_call(self, span: Span | None, name: str) -> ast.Call:
        """The call `self.<name>(x)` at `span`, with one positional argument."""
        node = self.expression_at(span)
        if not (
            isinstance(node, ast.Call)
            and is_self_attribute(node.func, name)
            and len(node.args) == 1
            and not node.keywords
            and not isinstance(node.args[0], ast.Starred)
        ):
            raise FusionDeclined(
                f"self.{name} is not called as `self.{name}(x)` in forward"
            )
        return node

    def references(self, name: str) -> list[ast.Attribute]:
        """Every `self.<name>` in the forward."""
        return [n for n in ast.walk(self.tree) if is_self_attribute(n, name)]

    def expect_single_use(self, name: str) -> None:
        """Raise unless `self.<name>` appears once: the fused module replaces it."""
        if (uses := len(self.references(name))) != 1:
            raise FusionDeclined(f"forward uses self.{name} {uses} times, not once")

    def calls_on_one_name(self, spans: dict[str, Span]) -> tuple[list[ast.Call], str]:
        """The calls `self.<child>(x)` at `spans` (child -> span), each child used
        nowhere else in forward, all of the same local `x` holding one value across
        them; and `x`."""
        calls = [self.self_call(span, name) for name, span in spans.items()]
        for name in spans:
            self.expect_single_use(name)
        x = calls[0].args[0]
        if not isinstance(x, ast.Name) or any(
            ast.dump(c.args[0]) != ast.dump(x) for c in calls
        ):
            raise FusionDeclined(
                f"{', '.join(spans)} are not applied to one local name"
            )
        if not self.holds_one_value(x.id, calls):
            raise FusionDeclined(f"`{x.id}` changes between {', '.join(spans)}")
        return calls, x.id

    def fresh_name(self, base: str) -> str:
        """`base`, with underscores appended until no name of the forward is it."""
        taken = {n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name)}
        taken |= {a.arg for a in ast.walk(self.tree) if isinstance(a, ast.arg)}
        while base in taken:
            base += "_"
        return base

    def stores(self, name: str) -> list[ast.Name]:
        return stored_names(self.tree, name)

    def loads(self, name: str) -> list[ast.Name]:
        return loaded_names(self.tree, name)

    def _parents(self) -> dict[int, ast.AST]:
        """Each node's parent, by the node's `id`: one walk, made afresh for each
        question because the rewrite changes the tree between them."""
        return {id(c): p for p in ast.walk(self.tree) for c in ast.iter_child_nodes(p)}

    def _blocks(self, node: ast.AST) -> list[tuple[list[ast.stmt], int]]:
        """The statement lists enclosing `node`, innermost first, each with the index
        of the statement that holds `node`."""
        parents = self._parents()
        chain = []
        while (parent := parents.get(id(node))) is not None:
            for field in ("body", "orelse", "finalbody"):
                block = getattr(parent, field, None)
                if isinstance(block, list) and any(s is node for s in block):
                    chain.append(
                        (block, next(i for i, s in enumerate(block) if s is node))
                    )
            node = parent
        return chain

    def statement(self, node: ast.AST) -> ast.stmt:
        """The innermost statement holding `node`."""
        block, index = self._blocks(node)[0]
        return block[index]

    def region(self, nodes: list[ast.AST]) -> tuple[list[ast.stmt], int, int]:
        """The innermost block holding all `nodes`, and the first and last index of
        its statements that hold one of them."""
        chains = [self._blocks(n) for n in nodes]
        for block, _ in chains[0]:
            indices = [next((i for b, i in c if b is block), None) for c in chains]
            if all(i is not None for i in indices):
                return block, min(indices), max(indices)
        raise AssertionError("nodes of one function share its body")

    def holds_one_value(self, name: str, nodes: list[ast.AST]) -> bool:
        """Whether the local `name` is bound before the statements holding `nodes`,
        not rebound among them and nothing is written in place there, so an
        expression reading it means the same there as at each of `nodes`."""
        block, first, last = self.region(nodes)
        # The last statement may assign the name: its value is computed first.
        end = block[last]
        end_value = (
            end.value
            if isinstance(end, ast.Assign | ast.AnnAssign | ast.AugAssign)
            else end
        )
        if any(
            stored_names(tree, name)
            for tree in (*block[first:last], end_value)
            if tree is not None
        ):
            return False
        # A write through any name may be a write to this value (an alias).
        if any(_writes_in_place(statement) for statement in block[first : last + 1]):
            return False
        arguments = {a.arg for a in ast.walk(self.tree.args) if isinstance(a, ast.arg)}
        if name in arguments:
            return True
        # Bound by a statement that runs before the region, at its level or above.
        return any(
            stored_names(s, name)
            for b, index in [(block, first), *self._blocks(block[first])[1:]]
            for s in b[:index]
        )

    def existence_guards(self) -> dict[str, list[ast.Compare]]:
        """`self.<name> is None` and `self.<name> is not None` in the forward, by
        name, for the names the forward also calls (`self.<name>(...)`): a child
        that some instances have and others hold as `None`."""
        called = {
            n.func.attr
            for n in ast.walk(self.tree)
            if isinstance(n, ast.Call) and is_self_attribute(n.func)
        }
        guards: dict[str, list[ast.Compare]] = {}
        for node in ast.walk(self.tree):
            if (
                isinstance(node, ast.Compare)
                and len(node.ops) == 1
                and isinstance(node.ops[0], ast.Is | ast.IsNot)
                and is_self_attribute(node.left)
                and node.left.attr in called
                and isinstance(node.comparators[0], ast.Constant)
                and node.comparators[0].value is None
            ):
                guards.setdefault(node.left.attr, []).append(node)
        return guards

    def fold_guards(self, guards: list[ast.Compare], present: bool) -> None:
        """Replace the `existence_guards` `guards` by what they are when the child
        they test is `present`."""
        for guard in guards:
            value = present if isinstance(guard.ops[0], ast.IsNot) else not present
            self.replace(guard, ast.copy_location(ast.Constant(value), guard))

    def stack_calls(self, spans: dict[str, Span], fused: str) -> None:
        """Replace the calls `self.<child>(x)` at `spans` (child -> span) by the parts
        of one call `self.<fused>(x)`, split by its per-rank output sizes in the order
        of `spans`, placed before the first of them. Output sizes past those parts
        must be empty (a QKV layer whose key is also its value has no value part)."""
        calls, x = self.calls_on_one_name(spans)
        block, first, _ = self.region(calls)
        outputs = [self.fresh_name(f"{name}_out") for name in spans]
        split = ast.parse(
            f"{', '.join(outputs)} = self.{fused}({x})"
            f".split(self.{fused}.output_partition_sizes[:{len(outputs)}], dim=-1)"
        )
        self.insert_before(block[first], split.body[0])
        for call, output in zip(calls, outputs):
            self.replace(call, ast.Name(output, ast.Load()))

    def replace(self, old: ast.AST, new: ast.AST) -> None:
        """Put `new` where `old` is."""
        parent = self._parents()[id(old)]
        for field, current in ast.iter_fields(parent):
            if current is old:
                setattr(parent, field, new)
                return
            if isinstance(current, list) and any(c is old for c in current):
                current[next(i for i, c in enumerate(current) if c is old)] = new
                return

    def insert_before(self, anchor: ast.stmt, statement: ast.stmt) -> None:
        block, index = self._blocks(anchor)[0]
        block.insert(index, statement)

    def remove(self, statement: ast.stmt) -> None:
        block, index = self._blocks(statement)[0]
        del block[index]

    def compile(self) -> Callable:
        """The rewritten forward, as a plain function (decorators applied again).

        Without its signature's annotations: compiled outside its module's
        `from __future__ import annotations`, they would be evaluated, and may name
        what the module imports only for type checkers."""
        for argument in ast.walk(self.tree.args):
            if isinstance(argument, ast.arg):
                argument.annotation = None
        self.tree.returns = None
        module = ast.Module(body=[self.tree], type_ignores=[])
        ast.fix_missing_locations(module)
        ast.increment_lineno(module, self.source.first_line - 1)
        namespace: dict[str, Any] = {}
        exec(
            compile(module, self.source.filename, "exec"),
            self.function.__globals__,
            namespace,
        )
        return namespace[self.tree.name]


def parse_expression(source: str) -> ast.expr:
    """The expression `source` (fusers build their replacements from source text)."""
    return ast.parse(source, mode="eval").body


def merged_name(names: list[str], module: nn.Module) -> str:
    """A name for the fusion of `names`: their common prefix and suffix around the
    parts that differ (`q_proj`, `k_proj`, `v_proj` -> `qkv_proj`; `gate_proj`,
    `up_proj` -> `gate_up_proj`), made unique among `module`'s attributes."""
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix) :][::-1] for n in names])[::-1]
    parts = [n[len(prefix) : len(n) - len(suffix)] for n in names]
    joiner = "" if all(len(p) == 1 for p in parts) else "_"
    return fresh_attribute(module, f"{prefix}{joiner.join(parts)}{suffix}")


def fresh_attribute(module: nn.Module, name: str) -> str:
    """`name`, suffixed until `module` has no attribute of that name."""
    while hasattr(module, name):
        name += "_fused"
    return name
