"""Argument checks used by the options dataclasses and the layers.

Each layer's options are written and validated once, in its options dataclass
(``MoEConfig``, ``RoutingConfig``, ``EarlyExitConfig``, ``Arch``), whose ``field_prefix``
names them: ``model.moe.`` when a config builds it, "" when a layer builds it from its
keyword arguments; so a message names the argument or the config field, the bad value and
what is allowed. This module is a leaf: it imports nothing of ours.
"""

from __future__ import annotations

import difflib
import json
import math
import pathlib
from collections.abc import Iterable
from numbers import Real


class ConfigError(ValueError):
    """An invalid argument or config value; the message names it, the value and the fix."""


def fail(name: str, value: object, allowed: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def closest(value: object, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest of ``choices``, or '' when none is near."""
    choices = list(choices)
    swapped = [c for c in choices if sorted(c) == sorted(str(value))]  # a transposition: 'mdo' -> 'mod'
    match = swapped or difflib.get_close_matches(str(value), choices, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def is_file_name(name: object) -> bool:
    """``name`` is a plain file name: a string naming a file inside a directory, with no
    directory part, no ``..`` and not absolute (what a file may name of its neighbours)."""
    return isinstance(name, str) and pathlib.PurePath(name).name == name and name not in ("", ".", "..")


JSON_MAX_BYTES = 1 << 24  # a config file of ours or Hugging Face's is far smaller


def read_json_object(
    file: pathlib.Path, fix: str = "", error: type[Exception] = ValueError, max_bytes: int = JSON_MAX_BYTES
) -> dict:
    """The JSON object in ``file`` (an untrusted file); ``error`` naming the file, and ``fix``
    after a colon, when it is larger than ``max_bytes``, not UTF-8 JSON, or not an object."""
    then = f": {fix}" if fix else ""
    size = file.stat().st_size
    if size > max_bytes:
        raise error(f"{file} is {size} bytes: too large for a config file{then}")
    try:
        fields = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{file} is not JSON ({e}){then}") from e
    if not isinstance(fields, dict):
        raise error(f"{file} holds a {type(fields).__name__}, not an object{then}")
    return fields


def options_object(cls: type, opts: object | None, options: dict, what: str, defaults: dict | None = None):
    """A layer's options object: ``opts`` as given, or ``cls(**defaults, **options)`` built from
    the layer's keywords (errors name the keyword: ``field_prefix=""``); ``TypeError`` when
    both are given (one source, never a silent choice)."""
    if opts is None:
        return cls(**{**(defaults or {}), **options}, field_prefix="")
    if options:
        raise TypeError(f"give the {what} options as opts or as keywords, not both: {sorted(options)}")
    return opts


def check_number(name: str, value: object) -> None:
    """A real number (not a bool, a string or NaN)."""
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value):
        fail(name, value, "must be a number")


def check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, value, "must be an integer")


def check_range(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    check_number(name, value)
    ok = (value > lo if lo_open else value >= lo) and value <= hi  # type: ignore[operator]
    if not ok:
        fail(name, value, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        fail(name, value, f"choose one of {list(choices)}{closest(value, choices)}")


def check_positive(name: str, value: object, allow_zero: bool = False) -> None:
    check_number(name, value)
    if value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        fail(name, value, "must be >= 0" if allow_zero else "must be > 0")


def check_hidden(x: object, d_model: int, name: str = "x", ranks: tuple[int, ...] = (3,)) -> None:
    """A floating-point activation tensor whose rank is in ``ranks`` and last dim ``d_model``
    (``[batch, seq, d_model]`` for blocks; an empty batch is allowed: a rank may hold none)."""
    import torch  # noqa: PLC0415  (keeps this module importable without torch for configs)

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ranks or x.shape[-1] != d_model:
        want = " or ".join({3: "[batch, seq, d_model]", 2: "[tokens, d_model]"}[r] for r in ranks)
        raise ValueError(f"{name} has shape {tuple(x.shape)}: expected {want} with d_model={d_model}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (activations), got {x.dtype}: embed token ids first")
