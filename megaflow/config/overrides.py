"""The syntax of a command-line override ``key.sub=value``: its dotted key and its value.

A key is dot-separated parts. The first is a section name (``trainer``, ``reward``, ...);
the others are names of letters, digits, ``_``, ``-`` and ``/`` (a data source such as
``openai/gsm8k`` needs no quoting), or any text inside double quotes, which may hold dots
and ``=`` (``reward.reward_kwargs."my.source".method=flexible``). The key ends at the first
``=`` outside double quotes. Through a shell (and ``make train``), write the whole word in
single quotes: ``'reward.reward_kwargs."my.source".method=flexible'``.

A value is YAML (JSON is YAML too). A mapping or list written in YAML's flow form
(``{method: flexible}``) is refused, naming the key, where YAML would read something else
than what was most likely meant: an entry without a value (``{method:flexible}``, without
the space YAML needs after ``:``, is the key ``"method:flexible"`` with a null value).
"""
from __future__ import annotations

import re
from typing import Any

import yaml

from megaflow.config.typed import ConfigError

_SECTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r"[A-Za-z0-9_/-]+")
_QUOTED = re.compile(r'"([^"]+)"')
_SHAPE = "expected key.sub=value (e.g. trainer.total_steps=10; quote a key part holding dots: a.\"b.c\".d=1)"


def split_override(item: str) -> tuple[str, list[str], str]:
    """``'a."b.c".d=1'`` -> ``('a."b.c".d', ['a', 'b.c', 'd'], '1')``: the key as written, its
    parts (quotes removed) and the raw value text.

    Raises:
        ConfigError: no ``=`` after the key, an empty part, a part with other characters
            than those above outside double quotes, or an unclosed quote.
    """
    parts: list[str] = []
    pos = 0
    while True:
        quoted = bool(parts) and pos < len(item) and item[pos] == '"'
        match = (_QUOTED if quoted else _NAME if parts else _SECTION).match(item, pos)
        if match is None:
            raise ConfigError("", f"override {item!r}: {_SHAPE}")
        parts.append(match.group(1) if quoted else match.group(0))
        pos = match.end()
        if item[pos:pos + 1] == ".":
            pos += 1
            continue
        if item[pos:pos + 1] == "=":
            return item[:pos].strip(), parts, item[pos + 1:]
        raise ConfigError("", f"override {item!r}: {_SHAPE}")


def key_parts(key: str) -> list[str]:
    """The parts of a dotted key as :func:`split_override` reads it (``'a."b.c"'`` -> ``['a', 'b.c']``).

    Raises:
        ConfigError: a malformed key.
    """
    return split_override(f"{key}=")[1]


def parse_value(key: str, raw: str) -> Any:
    """``raw`` read as YAML for the override of ``key``.

    Raises:
        ConfigError: at ``key``: invalid YAML, or a flow mapping entry without a value
            (``{method:flexible}``), naming the entry and the form to write.
    """
    try:
        node = yaml.compose(raw, Loader=yaml.SafeLoader)
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(key, f"override value {raw!r} is not valid YAML at {yaml_error_text(err, raw)}") from None
    _check_no_empty_entries(key, node)
    return value


def yaml_error_text(err: yaml.YAMLError, text: str, *, file: bool = False) -> str:
    """PyYAML's error about ``text`` on one line: where (1-based; the line too for a ``file``
    or a ``text`` of several lines) and what, e.g. ``line 4, column 6: expected ',' or ']', but
    got ':' (while parsing a flow sequence at line 3, column 8)``. PyYAML's own text spans
    several lines (each mark with a snippet of the input under it)."""
    with_line = file or "\n" in text.rstrip("\n")

    def where(line: int, column: int) -> str:
        return f"line {line + 1}, column {column + 1}" if with_line else f"column {column + 1}"

    if isinstance(err, yaml.reader.ReaderError):  # a character YAML does not take: a position, no marks
        line = text.count("\n", 0, err.position)
        column = err.position - (text.rfind("\n", 0, err.position) + 1)
        return f"{where(line, column)}: unacceptable character #x{err.character:04x}: {err.reason}"
    if not isinstance(err, yaml.MarkedYAMLError):
        return " ".join(str(err).split())
    mark = err.problem_mark or err.context_mark
    problem = err.problem or err.context or type(err).__name__
    context = err.context if err.problem else None
    out = f"{where(mark.line, mark.column)}: {problem}" if mark is not None else problem
    if context:
        cmark = err.context_mark
        out += f" ({context} at {where(cmark.line, cmark.column)})" if cmark is not None else f" ({context})"
    return out


def _check_no_empty_entries(key: str, node: yaml.Node | None) -> None:
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            _check_no_empty_entries(key, child)
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(v, yaml.ScalarNode) and v.tag == "tag:yaml.org,2002:null" and v.value == "":
                hint = (f"write '{k.value.replace(':', ': ', 1)}' with a space after ':'" if ":" in str(k.value)
                        else f"write '{k.value}: null' for null")
                raise ConfigError(key, f"mapping entry {k.value!r} has no value; {hint} (or write the mapping "
                                       'as JSON, e.g. {"method": "flexible"})')
            _check_no_empty_entries(key, v)


__all__ = ["split_override", "key_parts", "parse_value", "yaml_error_text"]
