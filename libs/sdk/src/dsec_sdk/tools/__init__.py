"""Tools at run time: every call observed, failures classified, retried, broken, fallen back.

Example (inside a DSec sandbox, policies come from the spec's ``tools:`` section)::

    from dsec_sdk.tools import ToolRunner

    tools = ToolRunner(on_event=print)

    @tools.tool("web_search")
    def web_search(query: str, timeout: float = 10) -> dict: ...

    @tools.tool("local_search")
    def local_search(query: str) -> dict: ...

    tools.call("web_search", query="memfd")   # retried, then local_search if it keeps failing

The node agent turns the calls' reports into ``dsec_tool_*`` metrics and, after
``degraded_after`` failures in a row, a ``tool.degraded`` event with a diagnosis
(``tool.recovered`` when the tool answers again). See docs/tools.md.
"""

from dsec_sdk.tools.breaker import CircuitBreaker
from dsec_sdk.tools.classify import (
    CLASSES,
    CircuitOpen,
    Failure,
    FailureClass,
    ToolFailure,
    classify,
)
from dsec_sdk.tools.pipeline import Call, ToolRunner, Transport
from dsec_sdk.tools.policy import BreakerPolicy, RetryPolicy, ToolPolicy
from dsec_sdk.tools.retry import backoff, call_with_retries

__all__ = [
    "CLASSES",
    "BreakerPolicy",
    "Call",
    "CircuitBreaker",
    "CircuitOpen",
    "Failure",
    "FailureClass",
    "RetryPolicy",
    "ToolFailure",
    "ToolPolicy",
    "ToolRunner",
    "Transport",
    "backoff",
    "call_with_retries",
    "classify",
]
