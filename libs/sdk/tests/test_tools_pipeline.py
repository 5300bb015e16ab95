"""The tool pipeline without a broker or real sleeping: classification, bounded backoff with
full jitter, the breaker's transitions, the fallback order and what is reported."""

from __future__ import annotations

import errno
import io
import socket
import urllib.error
from email.message import Message
from typing import Any

import pytest
from dsec_sdk.errors import BadArguments, CallTimeout, PeerGone, RemoteError
from dsec_sdk.tools import (
    BreakerPolicy,
    CircuitBreaker,
    CircuitOpen,
    RetryPolicy,
    ToolFailure,
    ToolPolicy,
    ToolRunner,
    backoff,
    call_with_retries,
    classify,
)
from dsec_sdk.tools.policy import from_environment
from dsec_sdk.tools.report import Reporter

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count the pipeline's calls with tracing off, whatever tracer provider an
    earlier test of the process installed (OpenTelemetry's is set once per process)."""
    from dsec_sdk.tools import tracing

    monkeypatch.setattr(tracing, "_tracer", None)


class FakeTime:
    """A clock that only the fake sleep moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def http_error(status: int, retry_after: str | None = None) -> urllib.error.HTTPError:
    headers = Message()
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return urllib.error.HTTPError("https://api.test/v1", status, "x", headers, io.BytesIO())


@pytest.mark.parametrize(
    ("exc", "expected", "status"),
    [
        (TimeoutError("slow"), "timeout", None),
        (CallTimeout("b", "t", 1.0), "timeout", None),
        (urllib.error.URLError(TimeoutError("timed out")), "timeout", None),
        (http_error(504), "timeout", 504),
        (http_error(429), "rate_limited", 429),
        (http_error(401), "auth", 401),
        (http_error(403), "auth", 403),
        (http_error(400), "bad_arguments", 400),
        (http_error(422), "bad_arguments", 422),
        (http_error(500), "upstream_5xx", 500),
        (http_error(503), "upstream_5xx", 503),
        (PermissionError(errno.EPERM, "Operation not permitted"), "network_policy", None),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "network_policy", None),
        (socket.gaierror(socket.EAI_AGAIN, "try again"), "unavailable", None),
        (ConnectionRefusedError(), "unavailable", None),
        (PeerGone("b", "died"), "unavailable", None),
        (BadArguments("b", "t", "bad_arguments", "TypeError", "x", ""), "bad_arguments", None),
        (RemoteError("b", "t", "remote", "HTTPError", "HTTP Error 401: no", ""), "auth", 401),
        (
            RemoteError("b", "t", "remote", "ToolFailure", "[rate_limited] slow down", ""),
            "rate_limited",
            None,
        ),
        (ToolFailure("upstream_5xx", "down", status=502), "upstream_5xx", 502),
        (KeyError("x"), "tool_error", None),
    ],
)
def test_each_failure_gets_its_class(exc: BaseException, expected: str, status: int | None) -> None:
    failure = classify(exc)
    assert failure.failure_class == expected
    assert failure.status == status


def test_retry_after_is_read_as_seconds_or_http_date_and_capped() -> None:
    assert classify(http_error(429, "7")).retry_after == 7.0
    date = "Wed, 02 Dec 2026 00:00:30 GMT"
    now = 1796169600.0  # 2026-12-02T00:00:00Z
    assert classify(http_error(429, date), now=now).retry_after == pytest.approx(30.0)
    assert classify(http_error(429, "999999")).retry_after == 3600.0
    assert classify(http_error(429, "soon")).retry_after is None


def test_a_cause_deeper_in_the_chain_is_found() -> None:
    try:
        try:
            raise http_error(401)
        except urllib.error.HTTPError as inner:
            raise RuntimeError("search failed") from inner
    except RuntimeError as outer:
        assert classify(outer).failure_class == "auth"


def test_backoff_is_full_jitter_under_a_doubling_ceiling() -> None:
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [backoff(n, policy, lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff(3, policy, lambda: 0.0) == 0.0
    assert backoff(3, policy, lambda: 0.25) == 0.5


def test_retries_stop_at_the_attempt_bound() -> None:
    fake = FakeTime()
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        raise TimeoutError

    policy = RetryPolicy(attempts=4, max_time_s=1000, backoff_s=1.0, max_backoff_s=10.0)
    with pytest.raises(TimeoutError) as caught:
        call_with_retries(flaky, policy, sleep=fake.sleep, clock=fake.clock, rng=lambda: 1.0)
    assert calls == 4
    assert fake.slept == [1.0, 2.0, 4.0]
    assert caught.value.dsec_attempts == 4  # type: ignore[attr-defined]


def test_retries_stop_before_a_wait_that_would_pass_the_time_bound() -> None:
    fake = FakeTime()
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        fake.now += 1.0  # each try takes a second
        raise TimeoutError

    policy = RetryPolicy(attempts=10, max_time_s=6.0, backoff_s=1.0, max_backoff_s=10.0)
    with pytest.raises(TimeoutError):
        call_with_retries(flaky, policy, sleep=fake.sleep, clock=fake.clock, rng=lambda: 1.0)
    # try 1s, wait 1s, try 1s, wait 2s (=5s), try 1s (=6s): a 4s wait would end at 10s > 6s
    assert calls == 3
    assert fake.slept == [1.0, 2.0]
    assert fake.now - 1000.0 <= 6.0


def test_retry_after_is_honoured_and_never_undercut() -> None:
    fake = FakeTime()
    answers: list[Any] = [http_error(429, "3"), "ok"]

    def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return str(answer)

    result, attempts = call_with_retries(
        call, RetryPolicy(), sleep=fake.sleep, clock=fake.clock, rng=lambda: 1.0
    )
    assert (result, attempts) == ("ok", 2)
    assert fake.slept == [3.0]


@pytest.mark.parametrize(
    "exc",
    [
        http_error(400),
        PermissionError(errno.EPERM, "refused"),
        http_error(401),
        ValueError("a bug"),
    ],
)
def test_what_retrying_cannot_fix_is_tried_once(exc: BaseException) -> None:
    fake = FakeTime()
    calls = 0

    def call() -> None:
        nonlocal calls
        calls += 1
        raise exc

    with pytest.raises(type(exc)):
        call_with_retries(call, RetryPolicy(attempts=5), sleep=fake.sleep, clock=fake.clock)
    assert calls == 1
    assert fake.slept == []


def test_a_policy_cannot_retry_bad_arguments_or_policy_refusals() -> None:
    policies = from_environment(
        {"DSEC_TOOLS": '{"t": {"retries": {"on": ["bad_arguments", "network_policy", "auth"]}}}'}
    )
    assert policies["t"].retries.on == frozenset({"auth"})


def test_breaker_opens_half_opens_and_closes() -> None:
    fake = FakeTime()
    breaker = CircuitBreaker("web_search", BreakerPolicy(failures=3, reset_after_s=30), fake.clock)
    for _ in range(2):
        breaker.before()
        breaker.failure("timeout")
    assert breaker.state == "closed"
    breaker.before()
    breaker.failure("timeout")
    assert breaker.state == "open"
    with pytest.raises(CircuitOpen) as refused:
        breaker.before()
    assert refused.value.retry_in == pytest.approx(30.0)
    assert classify(refused.value).failure_class == "timeout"
    fake.now += 30
    assert breaker.state == "half_open"
    breaker.before()  # the one trial
    with pytest.raises(CircuitOpen):
        breaker.before()  # others wait for the trial's outcome
    breaker.failure("upstream_5xx")
    assert breaker.state == "open"  # the trial failed: open for another 30 s
    fake.now += 30
    breaker.before()
    breaker.success()
    assert breaker.state == "closed"
    breaker.before()


def test_the_caller_s_mistakes_do_not_open_the_breaker() -> None:
    breaker = CircuitBreaker("t", BreakerPolicy(failures=1))
    breaker.failure("bad_arguments")
    breaker.failure("network_policy")
    assert breaker.state == "closed"


def make_runner(fake: FakeTime, **policies: ToolPolicy) -> tuple[ToolRunner, Reporter, list[str]]:
    said: list[str] = []
    reporter = Reporter()
    runner = ToolRunner(
        policies,
        reporter=reporter,
        sleep=fake.sleep,
        clock=fake.clock,
        rng=lambda: 1.0,
        on_event=said.append,
    )
    return runner, reporter, said


def test_fallbacks_are_tried_in_order_and_reported() -> None:
    fake = FakeTime()
    runner, reporter, said = make_runner(
        fake,
        web_search=ToolPolicy(
            retries=RetryPolicy(attempts=2), fallback=("cached_search", "local_search")
        ),
        cached_search=ToolPolicy(retries=RetryPolicy(attempts=1)),
    )
    order: list[str] = []

    @runner.tool("web_search")
    def web_search(query: str) -> list[str]:
        order.append("web_search")
        raise http_error(503)

    @runner.tool("cached_search")
    def cached_search(query: str) -> list[str]:
        order.append("cached_search")
        raise KeyError(query)

    @runner.tool("local_search")
    def local_search(query: str) -> list[str]:
        order.append("local_search")
        return [f"local: {query}"]

    assert runner.call("web_search", query="memfd") == ["local: memfd"]
    assert order == ["web_search", "web_search", "cached_search", "local_search"]
    records = [(r[0], r[2], r[3], r[5], r[6], r[7]) for r in reporter.sent]
    assert records == [
        ("web_search", "error", "upstream_5xx", 2, 503, ""),
        ("cached_search", "error", "tool_error", 1, 0, "web_search"),
        ("local_search", "ok", "", 1, 0, "web_search"),
    ]
    assert "web_search failed (upstream_5xx): falling back to cached_search" in said


def test_bad_arguments_are_raised_without_a_fallback() -> None:
    fake = FakeTime()
    runner, reporter, _ = make_runner(fake, web_search=ToolPolicy(fallback=("local_search",)))
    runner.add_tool("web_search", lambda query: (_ for _ in ()).throw(http_error(400)))
    runner.add_tool("local_search", lambda query: ["never"])
    with pytest.raises(urllib.error.HTTPError):
        runner.call("web_search", query="")
    assert [r[0] for r in reporter.sent] == ["web_search"]


def test_all_failing_raises_the_primary_s_error() -> None:
    fake = FakeTime()
    runner, _, _ = make_runner(
        fake, web_search=ToolPolicy(retries=RetryPolicy(attempts=1), fallback=("local_search",))
    )
    runner.add_tool("web_search", lambda query: (_ for _ in ()).throw(http_error(401)))
    runner.add_tool("local_search", lambda query: (_ for _ in ()).throw(KeyError("index")))
    with pytest.raises(urllib.error.HTTPError):
        runner.call("web_search", query="x")


def test_an_open_breaker_sends_calls_straight_to_the_fallback_until_the_trial() -> None:
    fake = FakeTime()
    runner, reporter, _ = make_runner(
        fake,
        web_search=ToolPolicy(
            retries=RetryPolicy(attempts=1),
            breaker=BreakerPolicy(failures=2, reset_after_s=10),
            fallback=("local_search",),
        ),
    )
    healthy = False
    tried = 0

    @runner.tool("web_search")
    def web_search(query: str, timeout: float = 99.0) -> str:
        nonlocal tried
        tried += 1
        if not healthy:
            raise TimeoutError
        return f"web {timeout:g}"

    runner.add_tool("local_search", lambda query: "local")
    for _ in range(4):
        assert runner.call("web_search", query="q") == "local"
    assert tried == 2  # the breaker opened after two failures
    outcomes = [r[2] for r in reporter.sent if r[0] == "web_search"]
    assert outcomes == ["error", "error", "rejected", "rejected"]
    healthy = True
    fake.now += 10
    assert runner.call("web_search", query="q") == "web 99"
    assert runner.breaker("web_search").state == "closed"


def test_the_tool_s_timeout_is_handed_to_a_function_that_takes_one() -> None:
    fake = FakeTime()
    runner, _, _ = make_runner(fake, web_search=ToolPolicy(timeout_s=2.5))
    runner.add_tool("web_search", lambda query, timeout=None: timeout)
    assert runner.call("web_search", query="q") == 2.5
    assert runner.call("web_search", query="q", timeout=1) == 1


def test_a_transport_layer_sees_every_attempt() -> None:
    """The hook a recording or replay layer uses: between retry and the transport."""
    fake = FakeTime()
    runner, _, _ = make_runner(fake, t=ToolPolicy(retries=RetryPolicy(attempts=3)))
    runner.add_tool("t", lambda x: x * 2)
    seen: list[tuple[str, Any]] = []
    failures = [TimeoutError()]

    def recording(inner: Any) -> Any:
        def transport(call: Any) -> Any:
            seen.append((call.tool, dict(call.arguments)))
            if failures:
                raise failures.pop()
            return inner(call)

        return transport

    runner.wrap_transport(recording)
    assert runner.call("t", x=21) == 42
    assert seen == [("t", {"x": 21}), ("t", {"x": 21})]


def test_policies_come_from_the_node_agent_s_environment() -> None:
    raw = (
        '{"web_search": {"timeout_s": 2, "retries": {"attempts": 4, "max_time_s": 20}, '
        '"breaker": {"failures": 3, "reset_after_s": 5}, "fallback": ["local_search"], '
        '"degraded_after": 2, "family": "search", "secret": "WEB_SEARCH_KEY"}}'
    )
    policy = from_environment({"DSEC_TOOLS": raw})["web_search"]
    assert policy.timeout_s == 2.0
    assert (policy.retries.attempts, policy.retries.max_time_s) == (4, 20.0)
    assert (policy.breaker.failures, policy.breaker.reset_after_s) == (3, 5.0)
    assert policy.fallback == ("local_search",)
    assert (policy.degraded_after, policy.family, policy.secret) == (2, "search", "WEB_SEARCH_KEY")
    assert from_environment({"DSEC_TOOLS": "{not json"}) == {}


def test_a_served_tool_tells_a_signature_mismatch_from_its_own_type_error() -> None:
    runner, reporter, _ = make_runner(FakeTime())

    def tool(query: str) -> str:
        raise TypeError("inside the tool")

    served = runner.served("t", tool)
    with pytest.raises(TypeError) as mismatch:
        served(q="x")
    assert getattr(mismatch.value, "dsec_binding", False)  # the dispatcher: BadArguments
    with pytest.raises(TypeError) as own:
        served(query="x")
    assert not getattr(own.value, "dsec_binding", False)  # the tool's own: RemoteError
    assert [(r[1], r[3]) for r in reporter.sent] == [
        ("serve", "bad_arguments"),
        ("serve", "tool_error"),
    ]


async def test_acall_retries_with_an_async_sleep_and_falls_back() -> None:
    fake = FakeTime()
    slept: list[float] = []

    async def asleep(seconds: float) -> None:
        slept.append(seconds)
        fake.now += seconds

    reporter = Reporter()
    runner = ToolRunner(
        {"web_search": ToolPolicy(retries=RetryPolicy(attempts=3), fallback=("local_search",))},
        reporter=reporter,
        clock=fake.clock,
        rng=lambda: 1.0,
        asleep=asleep,
    )
    tries = 0

    @runner.tool("web_search")
    async def web_search(query: str) -> str:
        nonlocal tries
        tries += 1
        raise http_error(429, "2")

    @runner.tool("local_search")
    def local_search(query: str) -> str:  # a sync tool: run in a worker thread
        return f"local {query}"

    assert await runner.acall("web_search", query="q") == "local q"
    assert tries == 3
    assert slept == [2.0, 2.0]
    assert [(r[0], r[2], r[3], r[5]) for r in reporter.sent] == [
        ("web_search", "error", "rate_limited", 3),
        ("local_search", "ok", "", 1),
    ]


def test_reports_reach_the_broker_in_call_order_whoever_flushes() -> None:
    """The node agent counts failures in a row: batches must not overtake each other."""
    import threading

    from dsec_sdk.tools.report import BrokerReporter

    sent: list[list[Any]] = []
    reporter = BrokerReporter()
    reporter._thread = threading.current_thread()  # no background thread: flush by hand
    in_send = threading.Event()
    release = threading.Event()

    def send(message: dict[str, Any]) -> None:
        if not sent and not in_send.is_set():
            in_send.set()
            release.wait(5)  # the first flusher is slow to send its batch
        sent.append(message["calls"])

    reporter._send = send  # type: ignore[method-assign]
    reporter.record(("t", "call", "error", "auth", 1.0, 1, 401, "", ""))
    first = threading.Thread(target=reporter.flush)
    first.start()
    assert in_send.wait(5)
    reporter.record(("t", "call", "ok", "", 1.0, 1, 0, "", ""))
    second = threading.Thread(target=reporter.flush)
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    outcomes = [call[2] for batch in sent for call in batch]
    assert outcomes == ["error", "ok"]


async def test_calls_to_other_agents_go_through_the_transport_layers_too() -> None:
    """What a DSecClient's runner does: a replay layer answers without the live call."""
    runner, reporter, _ = make_runner(FakeTime())
    live: list[str] = []
    seen: list[tuple[str | None, str]] = []

    def replay(inner: Any) -> Any:
        def transport(call: Any) -> Any:
            seen.append((call.agent, call.tool))
            if call.tool == "recorded":
                return "from the recording"
            return inner(call)

        return transport

    def send(call: Any, trace: str | None) -> str:
        live.append(call.tool if call is not None else "(fast path: no Call built)")
        return "live"

    async def asend(trace: str | None) -> str:
        live.append("async")
        return "live"

    assert runner.call_remote("b", "t", {}, 1.0, send) == "live"  # no layer: straight through
    runner.wrap_transport(replay)
    assert runner.call_remote("b", "recorded", {"q": 1}, 1.0, send) == "from the recording"
    assert runner.call_remote("b", "other", {}, 1.0, send) == "live"
    assert await runner.acall_remote("b", "recorded", {}, 1.0, asend) == "from the recording"
    assert seen == [("b", "recorded"), ("b", "other"), ("b", "recorded")]
    assert live == ["(fast path: no Call built)", "other"]
    assert [r[0] for r in reporter.sent] == ["t", "recorded", "other", "recorded"]
