"""A minimal agent with one tool, ``web_search``, used by the DSec demo.

It registers the tool, runs one query and writes the result to ``/workspace/output``. Everything
the sandbox must grant is visible to `dsec policy infer`: the literal API host, the key it reads
from the environment, and the output directory.

Run: ``python agent.py "what is a sandbox"`` (inside a DSec sandbox built from ``dsec.yaml``).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import msgpack
from rich.console import Console

SEARCH_ENDPOINT = "https://api.websearch.test/v1/search"
OUTPUT_DIR = "/workspace/output"

console = Console()


class Agent:
    """Just enough of an agent: named tools and a way to call them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tools: dict[str, Callable[..., Any]] = {}

    def add_tool(self, name: str, func: Callable[..., Any]) -> None:
        self.tools[name] = func

    def call(self, tool: str, **kwargs: Any) -> Any:
        return self.tools[tool](**kwargs)


def web_search(query: str, limit: int = 5) -> dict[str, Any]:
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


def save(result: dict[str, Any]) -> None:
    """Write the answer as JSON (for people) and MessagePack (for the next agent)."""
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    with open("/workspace/output/result.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    with open("/workspace/output/result.msgpack", "wb") as fh:
        fh.write(msgpack.packb(result))


def main() -> int:
    agent = Agent("websearch-agent")
    agent.add_tool("web_search", web_search)
    query = " ".join(sys.argv[1:]) or "what is a sandbox"
    try:
        result = agent.call("web_search", query=query)
    except (OSError, RuntimeError, ValueError) as exc:
        console.print(f"[red]web_search failed:[/red] {exc}")
        save({"query": query, "error": str(exc)})
        return 1
    save({"query": query, "result": result})
    console.print(f"[green]ok[/green] {len(result.get('results', []))} results for {query!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
