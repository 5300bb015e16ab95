"""YAML parsing that remembers where every key and value was written.

PyYAML's ``compose()`` gives a node tree whose nodes carry start marks; we build the plain Python
data from that tree ourselves, recording a :class:`SourceMap` from field path to position. We chose
PyYAML's composer over ruamel.yaml because PyYAML is already a dependency of the workspace and its
node marks are all a compiler-style locator needs; ruamel's round-trip types would add a second
YAML library without adding information.

Booleans follow YAML 1.2 (only ``true``/``false``): under PyYAML's YAML 1.1 rules the key ``on``
of a semantic rule would silently become ``True`` and ``yes``/``no``/``off`` would turn strings
into booleans.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from dsec_core.spec.errors import Severity, SpecError, format_path

FieldPath = tuple[str | int, ...]
_BOOL_TAG = "tag:yaml.org,2002:bool"

MAX_DOCUMENT_BYTES = 256 * 1024
"""Largest spec or org policy accepted (256 KiB; real specs are a few KiB)."""
MAX_NODES = 20_000
"""Most values (scalars, lists, mappings) one document may expand to, aliases counted each time."""
MAX_ALIAS_EXPANSIONS = 1_000
"""Most alias uses (``*name``, ``<<: *name``) in one document."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings."""
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type stubs
    """SafeLoader with YAML 1.2 booleans (``on``/``yes``/``off`` stay strings)."""

    yaml_implicit_resolvers: ClassVar[dict[Any, list[tuple[str, re.Pattern[str]]]]] = {
        first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)\Z"), list("tTfF")
)


@dataclass(frozen=True)
class Position:
    """A 1-based line and column."""

    line: int
    column: int


_START = Position(1, 1)


@dataclass
class SourceMap:
    """Positions of the keys and values of one YAML document, by field path."""

    filename: str
    keys: dict[FieldPath, Position] = field(default_factory=dict)
    values: dict[FieldPath, Position] = field(default_factory=dict)

    def locate(self, path: FieldPath, at: Literal["key", "value"] = "value") -> Position:
        """Position of ``path``'s key or value, or of its nearest ancestor that was written."""
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            tables = (
                (self.keys, self.values)
                if at == "key" and end == len(path)
                else (
                    self.values,
                    self.keys,
                )
            )
            for table in tables:
                if prefix in table:
                    return table[prefix]
        return _START

    def error(
        self,
        path: FieldPath,
        message: str,
        *,
        rule_id: str,
        hint: str | None = None,
        severity: Severity = Severity.ERROR,
        at: Literal["key", "value"] = "value",
        anchor: FieldPath | None = None,
    ) -> SpecError:
        """A diagnostic about ``path``, located there (or at ``anchor`` when given).

        When the place is not in the file (a defaulted field), the nearest written ancestor is used.
        """
        pos = self.locate(path if anchor is None else anchor, at)
        return SpecError(
            file=self.filename,
            line=pos.line,
            column=pos.column,
            path=format_path(path),
            message=message,
            hint=hint,
            severity=severity,
            rule_id=rule_id,
        )

    def move(self, old: FieldPath, new: FieldPath) -> None:
        """Record that the subtree at ``old`` now lives at ``new`` (used by migrations)."""
        for table in (self.keys, self.values):
            for path in [p for p in table if p[: len(old)] == old]:
                table[new + path[len(old) :]] = table[path]


def _position(mark: yaml.Mark | None) -> Position:
    if mark is None:
        return _START
    return Position(mark.line + 1, mark.column + 1)


def _offset_position(text: str, offset: int) -> Position:
    before = text[:offset]
    return Position(before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1)


def decode(data: bytes, filename: str) -> tuple[str | None, SpecError | None]:
    """Decode UTF-8 (with or without BOM); on failure, an error at the first bad byte."""
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        pos = _offset_position(data[: exc.start].decode("utf-8", "replace"), exc.start)
        return None, SpecError(
            file=filename,
            line=pos.line,
            column=pos.column,
            path="",
            message=f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x})",
            hint="save the spec as UTF-8",
            rule_id="encoding",
        )


def parse_yaml(text: str, filename: str) -> tuple[Any, SourceMap, list[SpecError]]:
    """Parse one YAML document into plain data and a source map.

    Returns:
        ``(data, source_map, errors)``; when ``errors`` is not empty ``data`` must not be used.
    """
    smap = SourceMap(filename)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_DOCUMENT_BYTES:
        return None, smap, [_limit_error(smap, "the document is too large", "document size")]
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:
        return None, smap, [_reader_error(exc, _offset_position(text, exc.position), filename)]
    try:
        node = loader.get_single_node()
        if node is None:
            return None, smap, [smap.error((), "the spec is empty", rule_id="empty", hint=_TOP)]
        builder = _Builder(loader, smap)
        data = builder.build(node, ())
        return data, smap, builder.errors
    except yaml.MarkedYAMLError as exc:
        return None, smap, [_syntax_error(exc, filename)]
    except yaml.reader.ReaderError as exc:
        pos = _offset_position(text, exc.position)
        return None, smap, [_reader_error(exc, pos, filename)]
    except yaml.YAMLError as exc:
        return None, smap, [smap.error((), f"YAML error: {exc}", rule_id="yaml-syntax")]
    except _LimitExceeded as exc:
        return None, smap, [exc.error]
    except RecursionError:
        return None, smap, [_limit_error(smap, "the YAML is nested too deeply", "depth")]
    finally:
        loader.dispose()


_LIMITS = {
    "document size": f"{MAX_DOCUMENT_BYTES} bytes",
    "depth": f"{MAX_DEPTH} levels of nesting",
    "node count": f"{MAX_NODES} values",
    "alias expansions": f"{MAX_ALIAS_EXPANSIONS} alias uses",
}


class _LimitExceeded(Exception):
    """A parser bound was hit; carries the located diagnostic."""

    def __init__(self, error: SpecError) -> None:
        super().__init__(error.message)
        self.error = error


def _limit_error(
    smap: SourceMap, what: str, limit: str, node: Node | None = None, path: FieldPath = ()
) -> SpecError:
    pos = _position(node.start_mark) if node is not None else _START
    return SpecError(
        file=smap.filename,
        line=pos.line,
        column=pos.column,
        path=format_path(path),
        message=f"{what}: over the parser's {limit} limit of {_LIMITS[limit]}",
        hint="a spec is a few KiB of plain YAML; expand anchors by hand instead of nesting aliases",
        rule_id="yaml-limit",
    )


_TOP = 'start with:\nversion: "1.2"\nname: my-agent\nbase: dsec/python311:latest'


def _syntax_error(exc: yaml.MarkedYAMLError, filename: str) -> SpecError:
    mark = exc.problem_mark or exc.context_mark
    pos = _position(mark)
    problem = exc.problem or "invalid YAML"
    if exc.context and exc.context_mark is not None and exc.context_mark is not mark:
        problem += f" ({exc.context} at line {exc.context_mark.line + 1})"
    elif exc.context:
        problem = f"{exc.context}: {problem}"
    hint = None
    if "\\t" in problem or "\t" in problem:
        hint = "indent with spaces; YAML does not allow tabs for indentation"
    elif "mapping values are not allowed" in problem:
        hint = "put a space after ':' and quote values that contain ': '"
    return SpecError(
        file=filename,
        line=pos.line,
        column=pos.column,
        path="",
        message=f"YAML syntax error: {problem}",
        hint=hint,
        rule_id="yaml-syntax",
    )


def _reader_error(exc: yaml.reader.ReaderError, pos: Position, filename: str) -> SpecError:
    char = exc.character
    code = ord(char) if isinstance(char, str) else char
    shown = f"#x{code:04x}" if isinstance(code, int) else repr(code)
    return SpecError(
        file=filename,
        line=pos.line,
        column=pos.column,
        path="",
        message=f"YAML syntax error: unacceptable character {shown}",
        hint="remove control characters from the file",
        rule_id="yaml-syntax",
    )


class _Builder:
    """Turns composed nodes into dicts/lists/scalars while filling the source map."""

    def __init__(self, loader: _Loader, smap: SourceMap) -> None:
        self._loader = loader
        self._smap = smap
        self._active: set[int] = set()
        self._built: set[int] = set()
        self._nodes = 0
        self._aliases = 0
        self.errors: list[SpecError] = []

    def _count(self, node: Node, path: FieldPath) -> None:
        # An alias is the same node object composed once and reached again: building it again is
        # what makes a "billion laughs" document explode, so every reach counts.
        self._nodes += 1
        if id(node) in self._built and not isinstance(node, ScalarNode):
            self._aliases += 1
            if self._aliases > MAX_ALIAS_EXPANSIONS:
                raise _LimitExceeded(
                    _limit_error(self._smap, "too many alias uses", "alias expansions", node, path)
                )
        self._built.add(id(node))
        if self._nodes > MAX_NODES:
            raise _LimitExceeded(
                _limit_error(
                    self._smap, "the YAML expands to too many values", "node count", node, path
                )
            )
        if len(path) > MAX_DEPTH:
            raise _LimitExceeded(
                _limit_error(self._smap, "the YAML is nested too deeply", "depth", node, path)
            )

    def build(self, node: Node, path: FieldPath) -> Any:
        self._count(node, path)
        self._smap.values.setdefault(path, _position(node.start_mark))
        if isinstance(node, ScalarNode):
            return self._loader.construct_object(node, deep=True)
        if id(node) in self._active:
            self._error(node, path, "an alias refers to itself", "remove the recursive alias")
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return self._sequence(node, path)
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
        finally:
            self._active.discard(id(node))
        return None

    def _sequence(self, node: SequenceNode, path: FieldPath) -> list[Any] | None:
        if node.tag != _SEQ_TAG:
            self._error(node, path, f"unsupported YAML tag {node.tag!r}", "remove the tag")
            return None
        return [self.build(child, (*path, i)) for i, child in enumerate(node.value)]

    def _mapping(self, node: MappingNode, path: FieldPath) -> dict[str, Any] | None:
        if node.tag != _MAP_TAG:
            self._error(node, path, f"unsupported YAML tag {node.tag!r}", "remove the tag")
            return None
        own = len(node.value) - sum(1 for k, _ in node.value if k.tag == _MERGE_TAG)
        if _flattened_size(node, {}) > MAX_NODES:
            raise _LimitExceeded(
                _limit_error(
                    self._smap, "merge keys expand to too many entries", "node count", node, path
                )
            )
        self._loader.flatten_mapping(node)
        merged = len(node.value) - own
        out: dict[str, Any] = {}
        first_seen: dict[str, Position] = {}
        for index, (key_node, value_node) in enumerate(node.value):
            key = self._key(key_node, path)
            if key is None:
                continue
            key_path = (*path, key)
            key_pos = _position(key_node.start_mark)
            if index >= merged and key in first_seen:
                where = first_seen[key]
                self._error(
                    key_node,
                    key_path,
                    f"duplicate key {key!r} (first at line {where.line})",
                    "keep one of the two entries",
                    rule_id="duplicate-key",
                )
                continue
            if index >= merged:
                first_seen[key] = key_pos
            self._smap.keys[key_path] = key_pos
            self._smap.values.pop(key_path, None)
            out[key] = self.build(value_node, key_path)
        return out

    def _key(self, node: Node, path: FieldPath) -> str | None:
        # Field names are plain words: a key is the text the user typed, so `on:` stays "on"
        # and `1:` becomes "1" (then reported as an unknown field rather than crashing).
        if isinstance(node, ScalarNode):
            return str(node.value)
        self._error(node, path, "a key must be a plain name, not a list or mapping", None)
        return None

    def _error(
        self, node: Node, path: FieldPath, message: str, hint: str | None, rule_id: str = "yaml"
    ) -> None:
        pos = _position(node.start_mark)
        self.errors.append(
            SpecError(
                file=self._smap.filename,
                line=pos.line,
                column=pos.column,
                path=format_path(path),
                message=message,
                hint=hint,
                rule_id=rule_id,
            )
        )


def _flattened_size(node: MappingNode, memo: dict[int, int]) -> int:
    """An upper bound of the key/value pairs ``flatten_mapping`` produces, computed without
    producing them: merge keys copy merged pairs, and PyYAML before 6.0.2 kept duplicates, so
    nested merges could grow exponentially. Defence in depth; aliases are counted in ``build``."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_NODES + 1  # a merge cycle counts as too big
    total = 0
    for key, value in node.value:
        if key.tag != _MERGE_TAG:
            total += 1
            continue
        merged = value.value if isinstance(value, SequenceNode) else [value]
        for item in merged:
            total += _flattened_size(item, memo) if isinstance(item, MappingNode) else 1
        if total > MAX_NODES:
            break
    memo[id(node)] = total
    return total


def walk(data: Any, loc: Iterable[object]) -> FieldPath:
    """Follow a pydantic ``loc`` through ``data``, keeping only the steps that exist in it.

    Pydantic inserts tags (union members, validator names) into ``loc``; those do not name a
    place in the YAML and are dropped.
    """
    path: list[str | int] = []
    node = data
    for step in loc:
        if _has_child(node, step):
            assert isinstance(step, str | int)
            path.append(step)
            node = node[step]
        elif isinstance(step, str | int) and not isinstance(step, bool) and _is_field(step):
            # A missing or defaulted field: keep it so the message names it.
            path.append(step)
            node = None
    return tuple(path)


def _has_child(node: Any, step: object) -> bool:
    if isinstance(node, dict):
        return isinstance(step, str) and step in node
    if isinstance(node, list):
        return isinstance(step, int) and not isinstance(step, bool) and 0 <= step < len(node)
    return False


def _is_field(step: str | int) -> bool:
    return isinstance(step, int) or bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", step))
