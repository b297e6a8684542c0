"""Typed, frozen config sections: coercion of raw values, errors that name the dotted key.

A config section is a frozen dataclass deriving from :class:`Section`. Its
``__post_init__`` coerces every field to its annotated type (YAML gives lists where a
section wants tuples, ints where it wants floats, nested mappings where it wants a
sub-section), then runs the section's own :meth:`Section.validate`. Errors are
:class:`ConfigError` (a ``ValueError``) carrying the key *relative to the section*; while
a parent section builds a child from a mapping it prefixes the child's name, so the error
that reaches the user names the full dotted key (``actor.optim.lr``).

Supported annotations: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]`` of strings,
``X | None``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``Mapping[str, X]``, ``Any`` (frozen
as is) and nested :class:`Section` subclasses. Containers are frozen on construction
(tuples, :class:`types.MappingProxyType`), so nothing mutates a built config. The only
conversions: int -> float, a float literal string -> float (PyYAML reads ``1e-6`` as a
string; inf and nan are refused), int -> str (names YAML read as numbers), one string -> a 1-tuple for
``tuple[str, ...]``. Anything else of the wrong type is a :class:`ConfigTypeError`.

Kept rather than replaced by pydantic v2 (``frozen=True, extra="forbid"``) or OmegaConf
structured configs: both would still need this module's :class:`ConfigError` with prefixed
sibling keys for cross-field checks (their validator errors name the section, not the field),
and pydantic also a default-section layering hook, deep freezing and typo suggestions, so
neither is less code for the same errors (measured on a prototype of the optim/actor/critic
slice; the comparison is in the commit that added this paragraph).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar, Union

__all__ = ["ConfigError", "ConfigTypeError", "Section", "build_section", "freeze", "thaw", "join_key", "NAME_MAX",
           "split_host_port"]


def join_key(prefix: str, key: str) -> str:
    """``join_key("actor", "optim.lr") == "actor.optim.lr"``; empty parts are dropped."""
    return ".".join(part for part in (prefix, key) if part)


class ConfigError(ValueError):
    """An invalid configuration value.

    Attributes:
        key: the offending key, dotted (``"actor.tp"``); relative to the section that
            raised until a parent prefixes it.
        message: what is wrong; ``{0}``, ``{1}``... stand for the ``related`` keys, which
            are prefixed together with ``key`` so sibling references stay exact.
        related: other keys the message refers to.
    """

    def __init__(self, key: str, message: str, related: tuple[str, ...] = ()):
        self.key, self.message, self.related = key, message, tuple(related)
        text = message
        for i, rel in enumerate(self.related):
            text = text.replace(f"{{{i}}}", rel)
        super().__init__(f"{key}: {text}" if key else text)

    def __reduce__(self):  # picklable across processes (Ray) despite the custom __init__
        return type(self), (self.key, self.message, self.related)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` in front of ``key`` and of every related key."""
        return type(self)(join_key(prefix, self.key), self.message,
                          tuple(join_key(prefix, rel) for rel in self.related))


class ConfigTypeError(ConfigError, TypeError):
    """A value of the wrong type (also a ``TypeError``)."""


def _type_name(hint: Any) -> str:
    if isinstance(hint, str):  # already a name
        return hint
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("collections.abc.", "")


def _wrong_type(key: str, hint: Any, value: Any) -> ConfigTypeError:
    return ConfigTypeError(key, f"expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def freeze(value: Any) -> Any:
    """Deep-freeze plain data: dicts -> read-only mappings, lists -> tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of :func:`freeze` (and of sections): plain dicts and lists, YAML-safe."""
    if isinstance(value, Section):
        return {f.name: thaw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def _suggest(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


#: The words YAML 1.1 (PyYAML) reads as False and as True.
_YAML11_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _coerce_scalar(value: Any, hint: type, key: str, nullable: bool = False) -> Any:
    """``value`` as ``hint`` (bool, int, float, str); ``nullable``: the key also takes null (said in the error)."""
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 (PyYAML) reads "1e-6" as a string: accept any float literal.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            # No knob means anything by inf or nan (limits that can be off are "X | None"):
            # such a value (".inf", "nan", "1e999") is a typo or an overflow, not a setting.
            if not math.isfinite(number):
                raise ConfigError(key, f"must be a finite number, got {value!r}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # names and paths that YAML read as integers (run "2024")
    raise _wrong_type(key, f"{hint.__name__} or null" if nullable else hint, value)


def _coerce_union(value: Any, args: tuple, key: str, base: Any) -> Any:
    non_none = [a for a in args if a is not type(None)]
    if value is None and len(non_none) < len(args):
        return None
    if len(non_none) != 1:
        raise TypeError(f"{key}: unions other than 'X | None' are not supported in sections")
    if len(non_none) < len(args) and non_none[0] in (bool, int, float, str):
        return _coerce_scalar(value, non_none[0], key, nullable=True)
    return coerce(value, non_none[0], key, base)


def _coerce_tuple(value: Any, args: tuple, key: str) -> tuple:
    if isinstance(value, str) and len(args) == 2 and args[1] is Ellipsis:
        value = (value,)  # a single path where a list of paths is expected
    if not isinstance(value, (list, tuple)):
        raise _wrong_type(key, types.GenericAlias(tuple, args) if args else tuple, value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigTypeError(key, f"expected {len(args)} values, got {len(value)}: {value!r}")
    return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))


def _coerce_mapping(value: Any, args: tuple, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigTypeError(key, f"expected a mapping, got {type(value).__name__} {value!r}")
    _, value_hint = args if args else (str, Any)
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise ConfigTypeError(key, f"mapping keys must be strings, got {k!r}")
        out[k] = coerce(v, value_hint, join_key(key, k))
    return MappingProxyType(out)


def coerce(value: Any, hint: Any, key: str, base: Any = None) -> Any:
    """Convert ``value`` to the annotation ``hint`` or raise a :class:`ConfigError` at ``key``.

    ``base`` (for a section-typed field) is the field's default section: a mapping given
    for it is layered over ``base`` rather than over the class defaults, so a field such
    as ``critic.optim`` keeps its own default learning rate when only ``betas`` is set.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return freeze(value)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, args, key, base)
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans: take the choice spelled so
            spelled = [a for a in args if isinstance(a, str) and a.lower() in _YAML11_BOOL_WORDS[value]]
            value = spelled[0] if len(spelled) == 1 else value
        if isinstance(value, str) and value in args:
            return value
        raise ConfigError(key, f"invalid value {value!r}; expected one of "
                               f"{', '.join(map(repr, args))}{_suggest(str(value), args)}")
    if isinstance(hint, type) and issubclass(hint, Section):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return build_section(hint, value, key, base=base)
        raise ConfigTypeError(key, f"expected a mapping (section {hint.__name__}), "
                                   f"got {type(value).__name__} {value!r}")
    if origin is tuple:
        return _coerce_tuple(value, args, key)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return _coerce_mapping(value, args, key)
    if hint in (bool, int, float, str):
        return _coerce_scalar(value, hint, key)
    raise TypeError(f"{key}: unsupported annotation {hint!r}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, computed once per class."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


S = TypeVar("S", bound="Section")


def build_section(cls: type[S], data: Mapping, key: str = "", base: S | None = None) -> S:
    """Build section ``cls`` from a mapping, rejecting unknown keys with suggestions.

    Args:
        cls: the section class.
        data: raw values (YAML); keys must be field names of ``cls``.
        key: dotted key of the section (prefixed to every error).
        base: values to layer ``data`` over (default: the class defaults).

    Raises:
        ConfigError: unknown key (with close matches), or any invalid value below.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    for name in data:
        if name not in names:
            close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
            if close:
                raise ConfigError(join_key(key, str(name)), "unknown key; did you mean "
                                  + " or ".join(f"{{{i}}}" for i in range(len(close))) + "?",
                                  tuple(join_key(key, c) for c in close))
            raise ConfigError(join_key(key, str(name)), f"unknown key; valid keys here: {', '.join(names)}")
    try:
        if base is not None:
            return dataclasses.replace(base, **dict(data))
        return cls(**dict(data))
    except ConfigError as err:
        raise err.with_prefix(key) from None


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of every config section: typed coercion then :meth:`validate` on construction."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            base = _field_default(field) if isinstance(value, Mapping) else None
            base = base if isinstance(base, Section) else None
            object.__setattr__(self, field.name, coerce(value, hints[field.name], field.name, base))
        self.validate()

    def validate(self) -> None:
        """Checks across this section's fields; raise :class:`ConfigError` with relative keys."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-safe: dicts, lists, scalars)."""
        return thaw(self)


#: Longest file or directory name (bytes) of Linux file systems (``NAME_MAX``).
NAME_MAX = 255


def split_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``"HOST:PORT"`` (``"[IPv6]:PORT"`` for an IPv6 address), or None
    when ``address`` is not of that form or the port is not in 1-65535."""
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or ":" in host and not address.strip().startswith("[") or any(c.isspace() for c in host):
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def check(condition: bool, key: str, message: str, *related: str) -> None:
    """Raise ``ConfigError(key, message, related)`` unless ``condition``."""
    if not condition:
        raise ConfigError(key, message, related)


def check_positive(section: Section, *names: str, allow_zero: bool = False) -> None:
    """Each named numeric field must be > 0 (>= 0 with ``allow_zero``)."""
    for name in names:
        value = getattr(section, name)
        if value is None:
            continue
        ok = value >= 0 if allow_zero else value > 0
        check(ok, name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
