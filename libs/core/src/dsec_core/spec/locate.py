"""Turn pydantic validation errors into located, human-worded :class:`SpecError` objects."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from dsec_core.spec.errors import INVALID, SpecError, format_path
from dsec_core.spec.source import FieldPath, SourceMap, walk
from dsec_core.spec.units import type_name


def errors_from_validation(
    exc: ValidationError, data: Any, smap: SourceMap, root: type[BaseModel]
) -> list[SpecError]:
    """One located :class:`SpecError` per pydantic error (deduplicated by place and message)."""
    out: dict[tuple[str, str], SpecError] = {}
    for detail in exc.errors(include_url=False):
        error = _convert(detail, data, smap, root)
        out.setdefault((error.path, error.message), error)
    return list(out.values())


def _convert(detail: ErrorDetails, data: Any, smap: SourceMap, root: type[BaseModel]) -> SpecError:
    ctx = detail.get("ctx") or {}
    path = walk(data, detail["loc"])
    kind = detail["type"]
    if kind == INVALID:
        path = path + tuple(ctx.get("loc") or ())
        return smap.error(path, str(ctx["message"]), hint=ctx.get("hint"), rule_id="invalid-value")
    if kind == "extra_forbidden":
        return _unknown_field(path, smap, root)
    if kind == "missing":
        return _missing_field(path, smap, root)
    value = detail.get("input")
    message, hint = _wording(kind, detail["msg"], value, _model_at(root, path), ctx)
    return smap.error(path, message, hint=hint, rule_id="invalid-value")


def _unknown_field(path: FieldPath, smap: SourceMap, root: type[BaseModel]) -> SpecError:
    key = str(path[-1])
    model = _model_at(root, path[:-1])
    hint = None
    if model is not None:
        fields = [info.alias or name for name, info in model.model_fields.items()]
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
        valid = f"valid fields here: {', '.join(fields)}"
        hint = f"did you mean {close[0]!r}? {valid}" if close else valid
    return smap.error(path, f"unknown field {key!r}", hint=hint, rule_id="unknown-field", at="key")


def _missing_field(path: FieldPath, smap: SourceMap, root: type[BaseModel]) -> SpecError:
    name = str(path[-1])
    model = _model_at(root, path[:-1])
    hint = None
    fields = {
        info.alias or key: info for key, info in (model.model_fields if model else {}).items()
    }
    if name in fields:
        info = fields[name]
        if info.examples:
            hint = f"add `{name}: {info.examples[0]}`"
        elif info.description:
            hint = f"add `{name}:` ({info.description})"
    parent = path[:-1]
    where = f" in {format_path(parent)}" if parent else ""
    return smap.error(
        path,
        f"missing required field {name!r}{where}",
        hint=hint,
        rule_id="missing-field",
        at="key",
        anchor=parent,
    )


def _wording(
    kind: str, msg: str, value: object, model: type[BaseModel] | None, ctx: dict[str, Any]
) -> tuple[str, str | None]:
    """Reword pydantic's message for YAML users and say what would be valid."""
    got = f", got {type_name(value)}"
    if kind in {"model_type", "model_attributes_type", "dict_type"} and model is not None:
        return f"expected a mapping{got}", f"fields: {', '.join(model.model_fields)}"
    if kind == "string_type":
        hint = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            hint = f'quote it: "{value}"'
        return f"expected a string{got}", hint
    if kind in {"tuple_type", "list_type"}:
        hint = None
        if isinstance(value, str | int):
            hint = f"write a list: [{value}]"
        return f"expected a list{got}", hint
    if kind == "literal_error":
        return f"{value!r} is not allowed", f"one of: {ctx.get('expected', '')}"
    if kind in {"int_parsing", "int_type", "int_from_float"}:
        return f"expected an integer{got}", None
    if kind in {"float_parsing", "float_type"}:
        return f"expected a number{got}", None
    if kind in {"bool_parsing", "bool_type"}:
        return f"expected true or false{got}", "true or false"
    if kind.startswith(("greater_than", "less_than")) or kind in {"too_short", "too_long"}:
        return f"{msg[0].lower()}{msg[1:]} (got {value!r})", None
    return msg, None


def _model_at(root: type[BaseModel], path: FieldPath) -> type[BaseModel] | None:
    """The model class that describes the mapping at ``path``, if the path leads to one."""
    current: Any = root
    for step in path:
        current = _unwrap(current)
        if isinstance(step, int):
            args = typing.get_args(current)
            if typing.get_origin(current) not in (tuple, list) or not args:
                return None
            current = args[0]
        elif isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(step)
            if info is None:
                return None
            current = info.annotation
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(options) != 1:
                return tp
            tp = options[0]
        else:
            return tp


def cross_check_raw(data: Any, smap: SourceMap, root: type[BaseModel]) -> list[SpecError]:
    """Run every model's ``cross_checks`` on the raw YAML mappings it describes.

    Pydantic skips a model's after-validators when one of its fields fails; this pass reports
    the between-field problems of those mappings too.
    """
    out: list[SpecError] = []
    _visit(data, root, (), smap, out)
    return out


def _visit(
    node: Any, model: type[BaseModel], path: FieldPath, smap: SourceMap, out: list[SpecError]
) -> None:
    if not isinstance(node, dict):
        return
    checks = getattr(model, "cross_checks", None)
    if checks is not None:
        for problem in checks({k: v for k, v in node.items() if v is not None}):
            ctx = problem.context or {}
            where = path + tuple(ctx.get("loc") or ())
            out.append(
                smap.error(where, problem.message(), hint=ctx.get("hint"), rule_id="invalid-value")
            )
    for key, value in node.items():
        info = model.model_fields.get(key)
        if info is None:
            continue
        child = _unwrap(info.annotation)
        if isinstance(child, type) and issubclass(child, BaseModel):
            _visit(value, child, (*path, key), smap, out)
        elif typing.get_origin(child) in (tuple, list) and isinstance(value, list):
            item = _unwrap(typing.get_args(child)[0]) if typing.get_args(child) else None
            if isinstance(item, type) and issubclass(item, BaseModel):
                for index, element in enumerate(value):
                    _visit(element, item, (*path, key, index), smap, out)
