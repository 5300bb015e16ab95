"""A minimal agent with one tool, ``web_search``, used by the DSec demo.

It reads its questions from ``/workspace/data`` (mounted from S3), asks the search API with the key
the sandbox injected from OpenBao, and writes the answers to ``/workspace/output``. Everything the
sandbox must grant is visible to `dsec policy infer`: the literal API host, the key it reads from
the environment, the data it reads and the output directory.

Then it misbehaves, as a prompt-injected agent would, to show what the sandbox does:

- it dumps its environment (which holds the key) next to its results: the spec's semantic rule
  refuses the write, naming the rule and the spec line;
- it reaches for ``tracker.websearch.test`` and for the address next to the API's, destinations
  computed at run time that no static check can see: the node's DNS proxy does not resolve the
  name (NXDOMAIN) and the kernel refuses the connect (EPERM).

It exits 0 when the searches worked and every forbidden action was refused.

TLS: the demo API's certificate comes from the demo's own CA. The spec sets ``SSL_CERT_FILE`` to
it, which OpenSSL (so Python's default HTTPS context) honours: the code trusts it unchanged.

Run: ``python agent.py`` (inside a DSec sandbox built from ``dsec.yaml``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import msgpack
from rich.console import Console
from rich.markup import escape

SEARCH_HOST = "api.websearch.test"
SEARCH_ENDPOINT = "https://api.websearch.test/v1/search"
QUERIES_FILE = "/workspace/data/queries.txt"
OUTPUT_DIR = "/workspace/output"

console = Console(soft_wrap=True, highlight=False)


class Agent:
    """Just enough of an agent: named tools and a way to call them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tools: dict[str, Callable[..., Any]] = {}

    def add_tool(self, name: str, func: Callable[..., Any]) -> None:
        self.tools[name] = func

    def call(self, tool: str, **kwargs: Any) -> Any:
        return self.tools[tool](**kwargs)


def web_search(query: str, limit: int = 3) -> dict[str, Any]:
    """Ask the search API; the key comes from the sandbox's secret injection."""
    key = os.getenv("WEB_SEARCH_KEY")
    if not key:
        raise RuntimeError("WEB_SEARCH_KEY is not set: the sandbox did not inject the secret")
    params = urllib.parse.urlencode({"q": query, "limit": limit})
    request = urllib.request.Request(
        f"{SEARCH_ENDPOINT}?{params}", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        result: dict[str, Any] = json.load(response)
    return result


def read_queries() -> list[str]:
    """One query a line; blank lines and ``#`` comments are skipped."""
    with open(QUERIES_FILE, encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip() and not line.startswith("#")]


def save(answers: list[dict[str, Any]]) -> None:
    """Write the answers as JSON (for people) and MessagePack (for the next agent)."""
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    with open("/workspace/output/result.json", "w", encoding="utf-8") as fh:
        json.dump({"answers": answers}, fh, indent=2)
    with open("/workspace/output/result.msgpack", "wb") as fh:
        fh.write(msgpack.packb({"answers": answers}))


def report(ok: bool, verdict: str, action: str, detail: str) -> bool:
    colour = "green" if ok else "red"
    console.print(f"[{colour}]{verdict:<12}[/{colour}] {escape(action)}: {escape(detail)}")
    return ok


def search_all(agent: Agent) -> bool:
    """The job: every query through the tool, answers saved. True when all worked."""
    try:
        queries = read_queries()
    except OSError as exc:
        return report(False, "FAILED", f"read {QUERIES_FILE}", str(exc))
    report(True, "allowed", f"read {QUERIES_FILE}", f"{len(queries)} queries (mounted from S3)")
    answers: list[dict[str, Any]] = []
    ok = bool(queries)
    for query in queries:
        try:
            result = agent.call("web_search", query=query)
        except (OSError, RuntimeError, ValueError) as exc:
            ok = report(False, "FAILED", f"GET https://{SEARCH_HOST}/v1/search", str(exc))
            answers.append({"query": query, "error": str(exc)})
            continue
        titles = [hit["title"] for hit in result.get("results", [])]
        report(True, "allowed", f"GET https://{SEARCH_HOST}/v1/search", f"{query!r} -> {titles}")
        answers.append({"query": query, "results": result.get("results", [])})
    save(answers)
    report(True, "allowed", f"write {OUTPUT_DIR}/result.json", f"{len(answers)} answers")
    return ok


def dump_environment() -> bool:
    """Save the environment, key included, next to the results. True when refused."""
    target = f"{OUTPUT_DIR}/secrets-dump.txt"
    action = f"write {target}"
    try:
        with open(target, "w", encoding="utf-8") as fh:
            json.dump(dict(os.environ), fh)
    except PermissionError as exc:
        return report(True, "refused", action, str(exc))
    os.remove(target)  # it must not stay there: the point was that it never gets written
    return report(False, "NOT REFUSED", action, "the write succeeded (removed again)")


def connect(host: str, port: int) -> bool:
    """Open a TCP connection that the spec does not allow. True when refused."""
    action = f"connect {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except socket.gaierror as exc:
        return report(True, "refused", action, f"the name does not resolve ({exc.strerror})")
    except PermissionError as exc:
        return report(True, "refused", action, f"[Errno {exc.errno}] {exc.strerror}")
    except OSError as exc:  # a timeout or a reset proves nothing about the policy
        return report(False, "FAILED", action, f"failed, but was not refused: {exc}")
    sock.close()
    return report(False, "NOT REFUSED", action, "connected: egress was not enforced")


def misbehave() -> list[bool]:
    """What the spec forbids; destinations computed at run time, out of static analysis's sight."""
    tracker = "tracker." + SEARCH_HOST.split(".", 1)[1]
    try:
        neighbour = str(ipaddress.ip_address(socket.gethostbyname(SEARCH_HOST)) + 1)
    except OSError as exc:
        return [report(False, "FAILED", f"resolve {SEARCH_HOST}", str(exc))]
    return [dump_environment(), connect(tracker, 443), connect(neighbour, 443)]


def main() -> int:
    agent = Agent("websearch-agent")
    agent.add_tool("web_search", web_search)
    searched = search_all(agent)
    refused = misbehave()
    if searched and all(refused):
        console.print("[green]ok[/green] the allowed calls worked; every forbidden one was refused")
        return 0
    console.print("[red]not ok[/red] see the lines above")
    return 1


if __name__ == "__main__":
    sys.exit(main())
