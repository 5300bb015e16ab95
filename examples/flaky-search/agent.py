"""The web-search agent against a flaky search API: its tools go through ``dsec_sdk.tools``.

``web_search`` asks the demo world's API (the key injected from OpenBao); ``local_search``
searches a small index kept in the sandbox. The spec's ``tools:`` section says what happens when
``web_search`` fails: a 1 s timeout a try, retries with backoff and full jitter (429's
``Retry-After`` honoured), a breaker that opens after 3 failures in a row, the fallback to
``local_search``, and ``tool.degraded`` after 2 failed calls. The node agent publishes
``tool.degraded`` (with its diagnosis) and ``tool.recovered``; this agent only prints what its
pipeline did and which tool answered each query.

Run: ``python agent.py`` (inside a DSec sandbox built from ``dsec.yaml``; the demo scene
``examples/flaky-search/demo.sh`` makes the world's API time out, rate limit and refuse the key).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request

from dsec_sdk.tools import ToolRunner

SEARCH_ENDPOINT = "https://api.websearch.test/v1/search"
QUERIES_FILE = "/workspace/data/queries.txt"
CALLS = int(os.environ.get("FLAKY_CALLS", "14"))
PAUSE_S = float(os.environ.get("FLAKY_PAUSE_S", "0.8"))

tools = ToolRunner(on_event=lambda line: print(f"      [tools] {line}", flush=True))


@tools.tool("web_search")
def web_search(query: str, timeout: float = 10.0) -> list[str]:
    """The search API; ``timeout`` comes from the spec (tools.web_search.timeout)."""
    key = os.environ["WEB_SEARCH_KEY"]
    params = urllib.parse.urlencode({"q": query, "limit": 2})
    request = urllib.request.Request(
        f"{SEARCH_ENDPOINT}?{params}", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return [hit["title"] for hit in json.load(response)["results"]]


LOCAL_INDEX = {
    "memfd_create(2): anonymous files in memory": "memfd memory file anonymous",
    "Landlock: unprivileged access control": "landlock sandbox access control",
    "eBPF cgroup hooks for egress": "ebpf cgroup egress network",
    "seccomp filters in practice": "seccomp syscall filter sandbox",
}


@tools.tool("local_search")
def local_search(query: str) -> list[str]:
    """A small index kept in the sandbox: no network, always answers."""
    words = set(query.lower().split())
    ranked = sorted(LOCAL_INDEX, key=lambda title: -len(words & set(LOCAL_INDEX[title].split())))
    return [f"(local) {title}" for title in ranked[:2]]


def queries() -> list[str]:
    try:
        with open(QUERIES_FILE, encoding="utf-8") as fh:
            found = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    except OSError:
        found = []
    return found or ["memfd anonymous memory", "landlock sandbox"]


def main() -> int:
    asked = queries()
    served = {"web": 0, "local": 0}
    for index in range(CALLS):
        query = asked[index % len(asked)]
        started = time.monotonic()
        answer = tools.call("web_search", query=query)
        ms = (time.monotonic() - started) * 1000
        by = "local_search" if answer and answer[0].startswith("(local)") else "web_search"
        served["local" if by == "local_search" else "web"] += 1
        print(f"{index + 1:3d}. {query!r} -> {by} ({ms:.0f} ms): {answer[:1]}", flush=True)
        time.sleep(PAUSE_S)
    tools.reporter.close()  # the last reports reach the node agent before the sandbox ends
    print(
        f"answered {CALLS} queries: {served['web']} by web_search, {served['local']} by "
        f"local_search",
        flush=True,
    )
    return 0 if served["web"] and served["local"] else 1


if __name__ == "__main__":
    sys.exit(main())
