"""Bound expressions: a range bound may name earlier parameters of its branch (e.g. `high: max_bfs_breadth`).

Allowed: numbers, earlier parameter names, `+ - * //`, `min()` and `max()`; nothing else is evaluated.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any, Union

from pipeline.errors import ConfigError

Bound = Union[int, float, str]  # a number, or an expression over earlier parameters (e.g. "num_steps + 1")
FUNCTIONS = ("min", "max")

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
}


def names_in(expr: str) -> set[str]:
    """Parameter names an expression reads. Raises SyntaxError for text that is not an expression."""
    return {node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)} - set(FUNCTIONS)


def literal_zero_divisor(expr: str) -> bool:
    """Does the expression floor-divide by a literal 0 (wrong for every point of the space)?"""
    return any(isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)
               and isinstance(node.right, ast.Constant) and node.right.value == 0
               for node in ast.walk(ast.parse(expr, mode="eval")))


def evaluate_bound(expr: Bound, values: Mapping[str, Any], where: str = "bound") -> Any:
    """The value of a bound for the earlier parameters' `values`. Raises ConfigError naming `where` (the parameter
    key, e.g. "branches.ngram.min_bfs_breadth.high"), the expression and the values when it cannot be evaluated."""
    if not isinstance(expr, str):
        return expr

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS \
                and node.args and not node.keywords:
            return (min if node.func.id == "min" else max)(*(walk(a) for a in node.args))
        raise ValueError(f"'{ast.unparse(node)}' is not allowed (numbers, earlier parameters, + - * //, min(), max())")

    try:
        return walk(ast.parse(expr, mode="eval"))
    except (ValueError, TypeError, ZeroDivisionError, SyntaxError, RecursionError) as exc:
        used = {k: v for k, v in values.items() if isinstance(expr, str) and k in expr}
        raise ConfigError(f"{where}: {expr!r} cannot be evaluated ({exc})"
                          + (f" with {used}" if used else "")
                          + "; fix the expression in the search-space file") from None
