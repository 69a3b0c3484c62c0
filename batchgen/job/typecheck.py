"""An option's value against its field's type hint: a job spec's `overwrite: "false"` (a
string) must not count as true, nor `max_new_tokens: 3.5` as 3."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from batchgen.choices import Choice
from batchgen.errors import ConfigError
from batchgen.job.shard import Shard


def check_types(cfg: Any) -> None:
    """Every field's value of a dataclass against its type hint (RunConfig's options): a job
    spec's `overwrite: "false"` (a string) must not count as true, nor `max_new_tokens: 3.5`
    as 3. Ints pass as floats."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        ok, value = _conform(value, hints[f.name])
        if not ok:
            raise ConfigError(
                f"{f.name}: got {value!r} ({type(value).__name__}), expected "
                f"{_describe(hints[f.name])}"
            )
        setattr(cfg, f.name, value)


def _conform(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether value is a `hint`, value converted where that loses nothing)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            ok, converted = _conform(value, arg)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if origin is dict:
        kt, vt = typing.get_args(hint)
        if not isinstance(value, dict):
            return False, value
        items = [(_conform(k, kt), _conform(v, vt)) for k, v in value.items()]
        return all(k[0] and v[0] for k, v in items), {k[1]: v[1] for k, v in items}
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            return False, value
        items = [_conform(v, item) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False, value
        return True, float(value)
    if hint is str or hint is Shard or issubclass(hint, Choice):  # these come as strings too,
        return isinstance(value, str | hint), value  # checked later
    raise TypeError(f"no type check for {hint}; add one to _conform")


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is dict:
        k, v = typing.get_args(hint)
        return f"a mapping of {_describe(k)} to {_describe(v)}"
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    names = {
        type(None): "null",
        bool: "bool (true or false, unquoted)",
        int: "int",
        float: "float",
        str: "str",
        Shard: "str I/N",
    }
    return "str" if issubclass(hint, Choice) else names[hint]
