"""Subject convention: ``dsec.<aggregate>.<aggregate_id>.<event>``.

The event part is the event type with a leading ``<aggregate>.`` removed, so ``sandbox.ready`` of
sandbox ``sbx_1`` is ``dsec.sandbox.sbx_1.ready`` while ``spec.submitted`` is
``dsec.sandbox.sbx_1.spec.submitted``. One stream, ``DSEC_EVENTS``, captures ``dsec.>``.
"""

from __future__ import annotations

import re

from dsec_core.eventtypes import aggregate_of

STREAM = "DSEC_EVENTS"
ROOT = "dsec"
ALL_EVENTS = f"{ROOT}.>"
STATE_STREAM = "DSEC_STATE"
"""Agents' state deltas (docs/state.md): encrypted chunks, never events; outside ``dsec.>``."""
STATE_ROOT = "dsec_state"
STATE_SUBJECTS = f"{STATE_ROOT}.>"

_TOKEN = re.compile(r"[A-Za-z0-9_\-]+")  # (fullmatch: "$" let a trailing newline through)


class InvalidSubjectToken(ValueError):
    """An aggregate id that cannot be one NATS subject token."""


def event_suffix(aggregate: str, event_type: str) -> str:
    """Return the subject suffix of ``event_type`` within ``aggregate``."""
    prefix = f"{aggregate}."
    return event_type[len(prefix) :] if event_type.startswith(prefix) else event_type


def token_problem(aggregate_id: str) -> str | None:
    """Why ``aggregate_id`` cannot be one NATS subject token; ``None`` when it can."""
    if _TOKEN.fullmatch(aggregate_id):
        return None
    return f"aggregate id {aggregate_id!r} must match [A-Za-z0-9_-]+ (one subject token)"


def _aggregate(event_type: str) -> str:
    """The aggregate of ``event_type`` (from :mod:`dsec_core.eventtypes`' table: a reader of the
    stream routes without loading the event models)."""
    return aggregate_of(event_type)


def subject_for(event_type: str, aggregate_id: str) -> str:
    """Return the subject of an event of ``event_type`` about ``aggregate_id``."""
    problem = token_problem(aggregate_id)
    if problem is not None:
        raise InvalidSubjectToken(problem)
    aggregate = _aggregate(event_type)
    return f"{ROOT}.{aggregate}.{aggregate_id}.{event_suffix(aggregate, event_type)}"


def filter_for(event_type: str, aggregate_id: str = "*") -> str:
    """Return the subscription filter for ``event_type`` (all aggregates by default)."""
    aggregate = _aggregate(event_type)
    return f"{ROOT}.{aggregate}.{aggregate_id}.{event_suffix(aggregate, event_type)}"


def aggregate_filter(aggregate: str, aggregate_id: str) -> str:
    """Return the filter for every event of one aggregate, e.g. one sandbox
    (:class:`InvalidSubjectToken` for an id that cannot be one subject token)."""
    problem = token_problem(aggregate_id)
    if problem is not None:
        raise InvalidSubjectToken(problem)
    return f"{ROOT}.{aggregate}.{aggregate_id}.>"
