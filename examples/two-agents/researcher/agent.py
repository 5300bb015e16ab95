"""The researcher: serves ``lookup`` (and ``shutdown``) to the agents of its task group.

Its name and task group come from the sandbox (the spec's ``name`` and ``task_group``); the
node agent's broker would refuse any other. It serves until a caller asks it to shut down, or
for at most a minute.
"""

from __future__ import annotations

import threading
from typing import Any

from dsec_sdk import DSecClient

MAX_SECONDS = 60.0

NOTES = {
    "memfd": "memfd_create gives an anonymous file that lives in RAM; pass its fd over a Unix "
    "socket (SCM_RIGHTS) and both processes can mmap the same pages.",
    "eventfd": "an eventfd is a 64-bit counter with a file descriptor: write to wake a sleeper, "
    "poll or read to wait; one syscall per wake-up.",
    "msgpack": "MessagePack is a binary JSON: small frames, fast to pack and unpack, no schema.",
    "landlock": "Landlock lets an unprivileged process restrict its own file and TCP access; "
    "the rules bind it and every child it starts.",
}

client = DSecClient()
served = 0


@client.tool("lookup")
def lookup(query: str) -> dict[str, Any]:
    """What the researcher's notes say about ``query`` (about 200 bytes)."""
    global served
    served += 1
    topic = query.lower().strip()
    return {
        "query": query,
        "found": topic in NOTES,
        "summary": NOTES.get(topic, f"no notes on {query!r} yet"),
        "by": client.agent,
    }


@client.tool("shutdown")
def shutdown() -> dict[str, int]:
    """Stop serving once this answer is sent; reports how many lookups were served."""
    client.stop()
    return {"served": served}


def main() -> None:
    """Serve until ``shutdown`` or :data:`MAX_SECONDS`."""
    deadline = threading.Timer(MAX_SECONDS, client.stop)
    deadline.daemon = True
    deadline.start()
    print(
        f"researcher: serving lookup and shutdown as {client.agent!r} "
        f"in task group {client.group!r}",
        flush=True,
    )
    try:
        client.serve()
    finally:
        deadline.cancel()
        client.close()
    print(f"researcher: stopped after serving {served} lookups", flush=True)


if __name__ == "__main__":
    main()
