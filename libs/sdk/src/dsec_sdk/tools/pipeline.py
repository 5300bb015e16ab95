"""The tool-call pipeline: composable layers around a transport.

One call of tool ``T`` goes through::

    fallback ─┬─ observe(T) → breaker(T) → retry(T) → transport   (T, then each fallback)
              └─ observe(F) → breaker(F) → retry(F) → transport

* **fallback** (outermost): ``T``, then ``T``'s fallback chain in order (spec ``tools.T.fallback``
  or the catalogue's, e.g. ``web_search → local_search``), until one succeeds. A
  ``bad_arguments`` failure of ``T`` itself is the caller's mistake: raised, no fallback.
* **observe**: one record per tool per call (latency, outcome, failure class, attempts) to the
  node agent, and an OpenTelemetry span when tracing is on.
* **breaker**: the tool's circuit breaker; open, it refuses at once (``CircuitOpen``, outcome
  ``rejected``) and the fallback takes over.
* **retry**: backoff with full jitter for the retryable classes, bounded by attempts and time.
* **transport**: runs one attempt. By default a registered local function (given the tool's
  ``timeout`` if it takes one) or, for :meth:`ToolRunner.call_remote`, the communication plane.

**The transport hook.** :meth:`ToolRunner.wrap_transport` puts a layer between retry and the
transport: it sees every attempt as a :class:`Call` and returns its result or raises. A recording
layer (``dsec_sdk.recording``) records what the inner transport answered; a replay layer answers
from the recording without calling the inner one (and raises on a call it has no recording of).
Failures it raises are classified like live ones, so retries, the breaker and fallbacks behave
the same under replay.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dsec_sdk.tools import tracing
from dsec_sdk.tools.breaker import CircuitBreaker
from dsec_sdk.tools.classify import CircuitOpen, Failure, ToolFailure, classify
from dsec_sdk.tools.policy import DEFAULT, ToolPolicy, from_environment, with_overrides
from dsec_sdk.tools.report import Record, Reporter, default_reporter
from dsec_sdk.tools.retry import acall_with_retries, call_with_retries

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_now = time.perf_counter


def _served_failure(exc: BaseException) -> Failure:
    """A served tool's failure; a ``TypeError`` raised by binding the arguments (the caller's
    signature mistake, not the tool's) is ``bad_arguments``, and is marked so that the
    dispatcher still answers ``BadArguments`` through this wrapper."""
    if isinstance(exc, TypeError) and _raised_by_binding(exc):
        exc.dsec_binding = True  # type: ignore[attr-defined]
        return Failure("bad_arguments")
    return classify(exc)


def _raised_by_binding(exc: TypeError) -> bool:
    """Raised in the wrapper's own frame by the call (no frame of the tool ran)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name in _WRAPPERS


_WRAPPERS = frozenset({"observed", "_served_async", "<lambda>"})


def _ms_since(started: float) -> float:
    return round((_now() - started) * 1000.0, 3)


@dataclass(frozen=True)
class Call:
    """One attempt as a transport sees it."""

    tool: str
    arguments: Mapping[str, Any]
    timeout_s: float | None = None
    agent: str | None = None  # the serving agent, for calls over the communication plane
    extra: dict[str, Any] = field(default_factory=dict)


Transport = Callable[[Call], Any]


class ToolRunner:
    """Runs tools through observe → breaker → retry → fallback.

    Args:
        policies: per-tool policies (override ``$DSEC_TOOLS``, the node agent's effective ones).
        reporter: where call records go (default: the node agent, inside a sandbox).
        sleep, asleep, clock, rng: injected for tests (no real sleeping).
        on_event: told, in plain words, about retries, fallbacks and open breakers (e.g. print).
    """

    def __init__(
        self,
        policies: Mapping[str, ToolPolicy] | None = None,
        *,
        reporter: Reporter | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
        on_event: Callable[[str], None] | None = None,
        asleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._policies: dict[str, ToolPolicy] = {**from_environment(), **(policies or {})}
        self._functions: dict[str, Callable[..., Any]] = {}
        self._takes_timeout: set[str] = set()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()
        self.reporter = reporter if reporter is not None else default_reporter()
        self._sleep = sleep
        self._clock = clock
        self._rng = rng
        self._on_event = on_event
        self._asleep = asleep
        self._transport: Transport = self._local
        self._wrappers: list[Callable[[Transport], Transport]] = []

    # ------------------------------------------------------------------ registration
    def tool(self, name: str | None = None, **policy: Any) -> Callable[[F], F]:
        """Register the decorated function as tool ``name``; keywords override its policy
        (``timeout_s``, ``fallback``, ``degraded_after``, ``retries``, ``breaker``)."""

        def register(function: F) -> F:
            self.add_tool(name or function.__name__, function, **policy)
            return function

        return register

    def add_tool(self, name: str, function: Callable[..., Any], **policy: Any) -> None:
        self._functions[name] = function
        try:
            if "timeout" in inspect.signature(function).parameters:
                self._takes_timeout.add(name)
        except (TypeError, ValueError):
            pass
        if policy:
            self._policies[name] = with_overrides(self.policy(name), **policy)

    def policy(self, tool: str) -> ToolPolicy:
        return self._policies.get(tool, DEFAULT)

    def breaker(self, tool: str) -> CircuitBreaker:
        with self._lock:
            found = self._breakers.get(tool)
            if found is None:
                found = CircuitBreaker(tool, self.policy(tool).breaker, self._clock)
                self._breakers[tool] = found
            return found

    def wrap_transport(self, wrapper: Callable[[Transport], Transport]) -> None:
        """Insert a layer between retry and the transport (recording, replay, fault injection):
        ``wrapper(inner) -> transport``. It wraps local tools and, for a ``DSecClient``'s runner
        (``client.tool_runner``), its calls to other agents too (``Call.agent`` set)."""
        self._wrappers.append(wrapper)
        self._transport = wrapper(self._transport)

    def _wrapped(self, base: Transport) -> Transport:
        for wrapper in self._wrappers:
            base = wrapper(base)
        return base

    # ------------------------------------------------------------------ calls
    def call(self, tool: str, /, **arguments: Any) -> Any:
        """Call ``tool`` (then its fallbacks) and return the first result."""
        chain = [tool, *(name for name in self.policy(tool).fallback if name != tool)]
        first: BaseException | None = None
        for index, name in enumerate(chain):
            via = tool if index else ""
            try:
                return self._observed(name, arguments, via, self._transport, None)
            except Exception as exc:
                failure = classify(exc)
                if index == 0:
                    first = exc
                    if failure.failure_class == "bad_arguments":
                        raise
                nxt = chain[index + 1] if index + 1 < len(chain) else None
                if nxt is not None:
                    self._say(f"{name} failed ({failure.failure_class}): falling back to {nxt}")
        assert first is not None
        raise first

    async def acall(self, tool: str, /, **arguments: Any) -> Any:
        """``async`` twin of :meth:`call`: waits with ``asyncio.sleep``; a sync tool function
        runs in a worker thread (it may block on the network)."""
        chain = [tool, *(name for name in self.policy(tool).fallback if name != tool)]
        first: BaseException | None = None
        for index, name in enumerate(chain):
            via = tool if index else ""
            try:
                return await self._aguarded(name, arguments, via)
            except Exception as exc:
                failure = classify(exc)
                if index == 0:
                    first = exc
                    if failure.failure_class == "bad_arguments":
                        raise
                nxt = chain[index + 1] if index + 1 < len(chain) else None
                if nxt is not None:
                    self._say(f"{name} failed ({failure.failure_class}): falling back to {nxt}")
        assert first is not None
        raise first

    async def _aguarded(self, tool: str, arguments: Mapping[str, Any], via: str) -> Any:
        policy = self.policy(tool)
        call = Call(tool, arguments, policy.timeout_s)
        breaker = self.breaker(tool)
        transport = self._transport
        tracer = tracing.tracer()
        span = tracing.start_span(tracer, f"tool {tool}", tool) if tracer is not None else None
        started = time.perf_counter()

        async def attempt() -> Any:
            breaker.before()
            try:
                if transport == self._local:
                    result = await self._alocal(call)
                else:
                    result = transport(call)
                    if inspect.isawaitable(result):
                        result = await result
            except Exception as exc:
                breaker.failure(classify(exc).failure_class)
                raise
            breaker.success()
            return result

        def retried(number: int, failure: Failure, wait: float) -> None:
            self._say(
                f"{tool}: attempt {number} failed ({failure.failure_class}); "
                f"retrying in {wait:.2f} s"
            )

        try:
            result, attempts = await acall_with_retries(
                attempt,
                policy.retries,
                sleep=self._asleep,
                clock=self._clock,
                rng=self._rng,
                on_retry=retried,
                retry_if=lambda exc: not isinstance(exc, CircuitOpen),
            )
        except Exception as exc:
            attempts = int(getattr(exc, "dsec_attempts", 1))
            outcome = "rejected" if isinstance(exc, CircuitOpen) else "error"
            self._record(tool, "call", outcome, classify(exc), started, attempts, via, span)
            raise
        self._record(tool, "call", "ok", None, started, attempts, via, span)
        return result

    async def _alocal(self, call: Call) -> Any:
        function = self._functions.get(call.tool)
        if function is None:
            raise ToolFailure("bad_arguments", f"no tool named {call.tool!r} is registered")
        arguments = dict(call.arguments)
        takes = call.tool in self._takes_timeout and "timeout" not in arguments
        if takes and call.timeout_s is not None:
            arguments["timeout"] = call.timeout_s
        if inspect.iscoroutinefunction(function):
            if call.timeout_s is not None and call.tool not in self._takes_timeout:
                return await asyncio.wait_for(function(**arguments), call.timeout_s)
            return await function(**arguments)
        return await asyncio.to_thread(function, **arguments)

    def call_remote(
        self,
        agent: str,
        tool: str,
        arguments: Mapping[str, Any],
        timeout_s: float | None,
        send: Callable[[Call | None, str | None], Any],
    ) -> Any:
        """One call over the communication plane, observed (no retry: a remote tool may not be
        idempotent; use :meth:`call` with a transport for that). ``send(call, traceparent)``;
        ``call`` is ``None`` when tracing is off (nothing needs it: the hot path builds none)."""
        tracer = tracing.tracer()
        if tracer is None and not self._wrappers:
            started = _now()
            try:
                result = send(None, None)
            except Exception as exc:
                self._record(tool, "call", "error", classify(exc), started, 1, "", None)
                raise
            self.reporter.record((tool, "call", "ok", "", _ms_since(started), 1, 0, "", ""))
            return result
        call = Call(tool, arguments, timeout_s, agent)
        if tracer is None:
            transport = self._wrapped(lambda c: send(c, None))
            return self._timed(call, lambda: transport(call), "call", "", None)
        span = tracing.start_span(tracer, f"call {agent}.{tool}", tool)
        with tracing.use(span):
            parent = tracing.traceparent()
            transport = self._wrapped(lambda c: send(c, parent))
            return self._timed(call, lambda: transport(call), "call", "", span)

    async def acall_remote(
        self,
        agent: str,
        tool: str,
        arguments: Mapping[str, Any],
        timeout_s: float | None,
        send: Callable[[str | None], Awaitable[Any]],
    ) -> Any:
        """``async`` twin of :meth:`call_remote`; ``send(traceparent)``."""
        tracer = tracing.tracer()
        span = None
        parent = None
        if tracer is not None:
            span = tracing.start_span(tracer, f"call {agent}.{tool}", tool)
            with tracing.use(span):
                parent = tracing.traceparent()
        started = time.perf_counter()
        try:
            if self._wrappers:
                transport = self._wrapped(lambda _call: send(parent))
                result = transport(Call(tool, arguments, timeout_s, agent))
                if inspect.isawaitable(result):
                    result = await result
            else:
                result = await send(parent)
        except Exception as exc:
            self._record(tool, "call", "error", classify(exc), started, 1, "", span)
            raise
        self._record(tool, "call", "ok", None, started, 1, "", span)
        return result

    def served(self, tool: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` observed as a tool this agent serves (``DSecClient.tool`` uses it)."""
        if inspect.iscoroutinefunction(function):

            async def observed_async(**arguments: Any) -> Any:
                return await self._served_async(tool, function, arguments)

            return observed_async

        record = self.reporter.record

        def observed(**arguments: Any) -> Any:
            if tracing.tracer() is None:  # the hot path: time, call, one tuple to the reporter
                started = _now()
                try:
                    result = function(**arguments)
                except Exception as exc:
                    self._record(tool, "serve", "error", _served_failure(exc), started, 1, "", None)
                    raise
                record((tool, "serve", "ok", "", _ms_since(started), 1, 0, "", ""))
                return result
            call = Call(tool, arguments)
            span = tracing.start_span(tracing.tracer(), f"serve {tool}", tool, server=True)
            with tracing.use(span):
                return self._timed(call, lambda: function(**arguments), "serve", "", span)

        return observed

    async def _served_async(
        self, tool: str, function: Callable[..., Any], arguments: dict[str, Any]
    ) -> Any:
        started = time.perf_counter()
        try:
            result = await function(**arguments)
        except Exception as exc:
            failure = _served_failure(exc)
            self._record(tool, "serve", "error", failure, started, 1, "", None)
            raise
        self._record(tool, "serve", "ok", None, started, 1, "", None)
        return result

    # ------------------------------------------------------------------ layers
    def _observed(
        self, tool: str, arguments: Mapping[str, Any], via: str, transport: Transport, span: Any
    ) -> Any:
        """observe → breaker → retry → transport, for one tool."""
        policy = self.policy(tool)
        call = Call(tool, arguments, policy.timeout_s)
        tracer = tracing.tracer()
        if tracer is not None:
            span = tracing.start_span(tracer, f"tool {tool}", tool)
            with tracing.use(span):
                return self._guarded(call, policy, via, transport, span)
        return self._guarded(call, policy, via, transport, None)

    def _guarded(
        self, call: Call, policy: ToolPolicy, via: str, transport: Transport, span: Any
    ) -> Any:
        breaker = self.breaker(call.tool)
        started = time.perf_counter()
        attempts = 0

        def attempt() -> Any:
            breaker.before()  # an open breaker: CircuitOpen, never retried
            try:
                result = transport(call)
            except Exception as exc:
                breaker.failure(classify(exc).failure_class)
                raise
            breaker.success()
            return result

        def retried(number: int, failure: Failure, wait: float) -> None:
            self._say(
                f"{call.tool}: attempt {number} failed ({failure.failure_class}"
                + (f", HTTP {failure.status}" if failure.status else "")
                + f"); retrying in {wait:.2f} s"
            )

        retry_policy = policy.retries
        try:
            result, attempts = call_with_retries(
                attempt,
                retry_policy,
                sleep=self._sleep,
                clock=self._clock,
                rng=self._rng,
                on_retry=retried,
                retry_if=lambda exc: not isinstance(exc, CircuitOpen),
            )
        except Exception as exc:
            attempts = int(getattr(exc, "dsec_attempts", 1))
            failure = classify(exc)
            outcome = "rejected" if isinstance(exc, CircuitOpen) else "error"
            if isinstance(exc, CircuitOpen):
                self._say(
                    f"{call.tool}: circuit open after repeated {exc.last_class} failures; "
                    f"next trial in {exc.retry_in:.1f} s"
                )
            self._record(call.tool, "call", outcome, failure, started, attempts, via, span)
            raise
        self._record(call.tool, "call", "ok", None, started, attempts, via, span)
        return result

    def _timed(self, call: Call, run: Callable[[], Any], side: str, via: str, span: Any) -> Any:
        started = time.perf_counter()
        try:
            result = run()
        except Exception as exc:
            failure = _served_failure(exc) if side == "serve" else classify(exc)
            self._record(call.tool, side, "error", failure, started, 1, via, span)
            raise
        self._record(call.tool, side, "ok", None, started, 1, via, span)
        return result

    def _local(self, call: Call) -> Any:
        """The default transport: the registered function."""
        function = self._functions.get(call.tool)
        if function is None:
            raise ToolFailure("bad_arguments", f"no tool named {call.tool!r} is registered")
        takes = call.tool in self._takes_timeout and "timeout" not in call.arguments
        if takes and call.timeout_s is not None:
            return function(**call.arguments, timeout=call.timeout_s)
        return function(**call.arguments)

    def _record(
        self,
        tool: str,
        side: str,
        outcome: str,
        failure: Failure | None,
        started: float,
        attempts: int,
        via: str,
        span: Any,
    ) -> None:
        trace_id = ""
        if span is not None:
            trace_id = tracing.trace_id(span)
            tracing.end(span, failure.failure_class if failure else None, attempts, via)
        record: Record = (
            tool,
            side,
            outcome,
            failure.failure_class if failure else "",
            _ms_since(started),
            attempts,
            (failure.status or 0) if failure else 0,
            via,
            trace_id,
        )
        self.reporter.record(record)

    def _say(self, text: str) -> None:
        log.info("%s", text)
        if self._on_event is not None:
            self._on_event(text)
