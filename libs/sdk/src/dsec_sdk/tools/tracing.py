"""OpenTelemetry spans of tool calls, with W3C trace context across agent-to-agent calls.

Off unless asked, and then the hot path pays one ``is None`` test per call:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set: spans are
  exported over OTLP/HTTP (needs ``opentelemetry-sdk`` and
  ``opentelemetry-exporter-otlp-proto-http`` in the sandbox's dependencies);
* ``DSEC_TRACING=console``: spans are printed to stderr (debugging);
* or the application configured its own ``TracerProvider``: its spans are used as they are.

Every span carries ``dsec.sandbox_id``, ``dsec.agent``, ``dsec.tool`` and, on failure,
``dsec.failure_class``: the sandbox's events (``tool.degraded`` carries the ``trace_id`` of
the failing call) and its spans point at each other. A call to another agent carries the
``traceparent`` in its request frame (``[tool, arguments, timeout_ms, traceparent]``); the
serving agent's span is the child of the caller's.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from typing import Any, Final

log = logging.getLogger(__name__)

INCOMING: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "dsec_incoming_traceparent", default=None
)
"""The ``traceparent`` of the request being served (set by the dispatcher)."""

_UNSET: Final = object()
_tracer: Any = _UNSET


def tracer() -> Any:
    """The tracer to use, or ``None`` when tracing is off (decided once per process)."""
    global _tracer
    found = _tracer
    if found is _UNSET:
        found = _tracer = _make_tracer()
    return found


def reset() -> None:
    """Decide again on the next :func:`tracer` (tests)."""
    global _tracer
    _tracer = _UNSET


def _make_tracer() -> Any:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    mode = os.environ.get("DSEC_TRACING", "").lower()
    if not endpoint and not mode and "opentelemetry.trace" not in sys.modules:
        return None  # nothing asked for it and nothing set a provider up: no import (memory)
    try:
        from opentelemetry import trace
    except ImportError:
        if endpoint or mode:
            log.warning("tracing asked for, but opentelemetry-api is not installed: spans are off")
        return None
    provider = trace.get_tracer_provider()
    configured = type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider")
    if configured:
        return trace.get_tracer("dsec_sdk.tools")
    if not endpoint and mode not in ("console", "otlp"):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError:
        log.warning("tracing asked for, but opentelemetry-sdk is not installed: spans are off")
        return None
    resource = Resource.create(
        {
            "service.name": os.environ.get("DSEC_AGENT_NAME", "dsec-agent"),
            "dsec.sandbox_id": os.environ.get("DSEC_SANDBOX_ID", ""),
        }
    )
    sdk_provider = TracerProvider(resource=resource)
    if mode == "console":
        sdk_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set, but opentelemetry-exporter-otlp-proto-http "
                "is not installed: spans are off"
            )
            return None
        sdk_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(sdk_provider)
    return trace.get_tracer("dsec_sdk.tools")


def base_attributes(tool: str) -> dict[str, str]:
    return {
        "dsec.sandbox_id": os.environ.get("DSEC_SANDBOX_ID", ""),
        "dsec.agent": os.environ.get("DSEC_AGENT_NAME", ""),
        "dsec.tool": tool,
    }


def start_span(tracer_: Any, name: str, tool: str, *, server: bool = False) -> Any:
    """A span for one tool call; a served call's parent is the caller's ``traceparent``."""
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    context = None
    if server:
        incoming = INCOMING.get()
        if incoming:
            context = extract({"traceparent": incoming})
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.CLIENT
    return tracer_.start_span(name, context=context, kind=kind, attributes=base_attributes(tool))


def use(span: Any) -> Any:
    """A context manager making ``span`` current (nested calls become its children)."""
    from opentelemetry import trace

    return trace.use_span(span, end_on_exit=False)


def traceparent() -> str | None:
    """The current span's W3C ``traceparent`` (to put in a request frame)."""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")


def trace_id(span: Any) -> str:
    """The span's trace id as 32 hex digits ("" when not recording)."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.trace_id else ""


def end(span: Any, failure_class: str | None, attempts: int, via: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("dsec.attempts", attempts)
    if via:
        span.set_attribute("dsec.fallback_for", via)
    if failure_class is not None:
        span.set_attribute("dsec.failure_class", failure_class)
        span.set_status(Status(StatusCode.ERROR, failure_class))
    span.end()
