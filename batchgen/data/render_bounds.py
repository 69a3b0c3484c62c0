"""The bounds on a prompt template's render: a template is code run on every row, so a row's
render may take at most MAX_TEMPLATE_STEPS loop steps, MAX_RENDER_SECONDS (checked at every
step and every output chunk) and no value larger than MAX_PROMPT_CHARS.

Size is checked *before* a value is built wherever one operation can multiply it: `*` and `+`,
`~` (its Concat nodes become calls of `_concat`), the `replace`, `join`, `center`, `indent`,
`format`, `sum`, `batch`, `slice` filters and the str/list methods of the same kinds
(`s.replace`, `sep.join`, `s.center`, `l.extend`, ...), and any value about to be printed or
turned into a string (a list of a thousand references to one long string prints as a billion
characters). Every filter's and call's result is checked after, so a chain of doublings stops
at twice the bound. Sizes are counted without building anything: a nested list is walked only
until it passes the bound.

Jinja's sandbox already caps range() at MAX_RANGE (100k) items, but not two nested loops of it
(10**10 steps) nor "x" * 10**10, nor `{% set ns.s = ns.s ~ ns.s %}` 29 times (512M characters).
"""

from __future__ import annotations

import functools
import operator
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2 import nodes, pass_eval_context
from jinja2.nodes import EvalContext
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import SandboxedEnvironment
from jinja2.visitor import NodeTransformer

# Far past any prompt bucket (a token is a few characters), yet small enough to render in
# milliseconds; a longer rendering is a runaway template, not a prompt. Lists count items.
MAX_PROMPT_CHARS = 1 << 20
MAX_TEMPLATE_STEPS = 1_000_000
MAX_RENDER_SECONDS = 2.0
MAX_INT_BITS = 64 * 1024
# A width or precision of 7 digits or more in a %- or {}-format: a million-character field.
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{7}|%[-+ #0]*\d*\.\d{7}|\{[^{}]*:[^{}]*\d{7}[^{}]*\}")


class RenderLimit(Exception):
    pass


def size(value: Any, limit: int = MAX_PROMPT_CHARS) -> int:
    """About how many characters `value` prints as, counted only until the count passes
    `limit`: nothing is built to be measured."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if not isinstance(value, list | tuple | set | frozenset | dict):
        return 1  # a float, None, a namespace: prints at its fields' sizes, checked when set
    if len(value) > limit:
        return len(value)
    total = 2
    for item in value.items() if isinstance(value, dict) else value:
        total += 2 + size(item, limit - total)
        if total > limit:
            break
    return total


def _length(value: Any) -> int:
    """What `value` holds in memory, in characters, items or (an int) about 3-bit digits."""
    if isinstance(value, str | list | tuple | set | frozenset | dict):
        return len(value)
    return value.bit_length() // 3 + 1 if isinstance(value, int) else 0


def check(value: Any, what: str = "a value") -> Any:
    """value, unless it prints as more than the bound."""
    if size(value) > MAX_PROMPT_CHARS:
        raise RenderLimit(f"template built {what} of over {MAX_PROMPT_CHARS} characters or items")
    return value


def check_length(value: Any, what: str) -> Any:
    """value, unless it holds more than the bound (a list's items are not walked)."""
    _check_total(_length(value), what)
    return value


def _check_total(n: int, what: str) -> None:
    if n > MAX_PROMPT_CHARS:
        raise RenderLimit(f"template would build {what} of {n} characters or items")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise RenderLimit("template formats a field of a million characters or more")


class Budget:
    """One row's allowance of loop steps and time."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"template render took over {MAX_RENDER_SECONDS:g} s")

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """What every {% for %} of the template loops over (see bound_template)."""
        for item in iterable:
            self.steps += 1
            if self.steps > MAX_TEMPLATE_STEPS:
                raise RenderLimit(f"template ran over {MAX_TEMPLATE_STEPS} loop steps")
            self.check_time()
            yield item


@pass_eval_context
def _concat(eval_ctx: EvalContext, *items: Any) -> str:
    """`a ~ b ~ c`, its result's size checked before it is joined."""
    _check_total(sum(size(i) for i in items), "a string")
    return markup_join(items) if eval_ctx.autoescape else str_join(items)


class _Bound(NodeTransformer):
    """Every `{% for x in seq %}` loops over `_bounded(seq)`; every `a ~ b` is `_concat(a, b)`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("_bounded", "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.Name("_concat", "load"), node.nodes, [], None, None)


def bound_template(ast: nodes.Template) -> nodes.Template:
    return _Bound().visit(ast)


def _replaced_size(s: str, old: str, new: str, count: int = -1) -> int:
    n = len(s) + 1 if old == "" else s.count(old)
    n = n if count is None or count < 0 else min(n, count)
    return len(s) + n * (len(new) - len(old))


def _joined_size(items: list[Any], sep: Any) -> int:
    total = size(sep) * max(len(items) - 1, 0)
    for i in items:
        total += size(i)
        if total > MAX_PROMPT_CHARS:
            break
    return total


def _width(n: Any) -> int:
    return n if isinstance(n, int) else size(n)


class BoundedEnvironment(SandboxedEnvironment):
    """The sandbox, with every operation that can multiply a value's size checked first (see
    the module docstring). Intercepted operators are also never folded at compile time."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, budget: Budget, **kw: Any) -> None:
        super().__init__(finalize=lambda v: check(v, "an output"), **kw)
        self.budget = budget
        self.globals.update(_bounded=budget.iterate, _concat=_concat)
        del self.globals["lipsum"]  # lipsum(10**6): a prompt has no use for filler text
        for name, f in list(self.filters.items()):
            self.filters[name] = _checked_filter(name, f)

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _check_total(len(seq) * n, "a sequence")
            ints = isinstance(left, int) and isinstance(right, int)
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise RenderLimit("template multiplied two numbers into one too large")
            return operator.mul(left, right)
        if op == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                _check_total(len(left) + len(right), "a sequence")
            return operator.add(left, right)
        if op == "%":
            if isinstance(left, str):
                _check_format(left)
                check(right, "a format's arguments")
            return operator.mod(left, right)
        ints = isinstance(left, int) and isinstance(right, int) and abs(left) > 1
        if ints and right * abs(left).bit_length() > MAX_INT_BITS:
            raise RenderLimit("template raised a number to a power too large")
        return operator.pow(left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.budget.check_time()  # a macro that calls itself twice loops without a for
        method = getattr(__obj, "__wrapped__", __obj)  # str.format: the sandbox's wrapper
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str) and name == "join" and args:
            args = (list(args[0]), *args[1:])  # a generator, read once: here, then by join
        if isinstance(owner, str | list | dict):
            _check_method(owner, name, args, kwargs)
        return check_length(super().call(__context, __obj, *args, **kwargs), "a call's result")


def _check_method(owner: Any, name: str, args: tuple, kwargs: dict) -> None:
    """The result of str.replace/join/center/..., list.extend or dict.update, before it is
    built."""
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        _check_total(_replaced_size(owner, *args[:2], *args[2:3]), "a string")
    elif name == "join" and args:
        _check_total(_joined_size(args[0], owner), "a string")
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check_total(args[0], "a string")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_total(len(owner) * max(tab, 1) if isinstance(tab, int) else 0, "a string")
    elif name in ("format", "format_map"):
        _check_format(owner)
    elif name in ("extend", "update") and args:
        extra = args[0]
        _check_total(len(owner) + (len(extra) if hasattr(extra, "__len__") else 0), "a list")


def _checked_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """f with its result's size checked; the filters that can multiply a size are checked
    before they run too. The wrapper keeps f's attributes (how Jinja passes it a context)."""
    pre = _PRE_CHECKS.get(name)
    passes_ctx = hasattr(f, "jinja_pass_arg")

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if pre is not None:
            pre(*args[passes_ctx:], **kwargs)
        return check_length(f(*args, **kwargs), f"the {name} filter's result")

    return checked


def _pre_replace(s: Any, old: Any, new: Any, count: int | None = None) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        _check_total(_replaced_size(s, old, new, count if count is not None else -1), "a string")
    else:
        _check_total(_replaced_size(str(check(s)), str(old), str(new)), "a string")


def _pre_join(value: Any, d: Any = "", attribute: Any = None) -> None:
    if attribute is None and isinstance(value, list | tuple):
        _check_total(_joined_size(list(value), d), "a string")
    else:
        check(value, "a joined value")


def _pre_indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    _check_total(size(s) + (str(s).count("\n") + 1) * _width(width), "an indented string")


def _pre_format(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_format(value)
    check(args or kwargs, "a format's arguments")


def _pre_sum(iterable: Any, attribute: Any = None, start: Any = 0) -> None:
    if attribute is None and isinstance(iterable, list | tuple):
        total = sum(len(i) for i in iterable if isinstance(i, str | list | tuple))
        _check_total(total, "a sum")


_PRE_CHECKS: dict[str, Callable[..., None]] = {
    "replace": _pre_replace,
    "join": _pre_join,
    "center": lambda s, width=80: _check_total(_width(width), "a string"),
    "batch": lambda v, linecount, fill_with=None: _check_total(_width(linecount), "a batch"),
    "slice": lambda v, slices, fill_with=None: _check_total(_width(slices), "a slice count"),
    "indent": _pre_indent,
    "format": _pre_format,
    "sum": _pre_sum,
    "string": lambda v: check(v),
    "pprint": lambda v: check(v),
    "tojson": lambda v, indent=None: check(v),
    "list": lambda v: check(v) if isinstance(v, str | list | tuple | dict) else None,
}
