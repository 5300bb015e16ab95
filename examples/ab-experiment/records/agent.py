"""The records service of the A/B example: serves users' activity logs to the risk agents.

Tools: ``users()``, ``user_logs(user)``, ``shutdown()``. It is the *live* source a recording
session asks; the A/B trials replay what it answered and never reach it (it has exited by then).
"""

from __future__ import annotations

import threading
from typing import Any

from dsec_sdk import DSecClient

MAX_SECONDS = 120.0

LOGS: dict[str, list[dict[str, Any]]] = {
    "u1": [{"event": "login_failed"}] * 6 + [{"event": "transfer", "amount": 9800}],
    "u2": [{"event": "login"}, {"event": "transfer", "amount": 40}],
    "u3": [{"event": "login_failed"}] * 2 + [{"event": "login", "country": "foreign"}] * 3,
    "u4": [{"event": "login"}] * 4 + [{"event": "transfer", "amount": 12000}] * 2,
    "u5": [{"event": "login_failed"}] * 9,
    "u6": [{"event": "login"}, {"event": "login", "country": "foreign"}],
    "u7": [{"event": "login", "country": "foreign"}] * 2 + [{"event": "transfer", "amount": 7000}],
    "u8": [{"event": "login"}] * 3,
    "u9": [{"event": "login_failed"}] * 4 + [{"event": "transfer", "amount": 6000}],
    "u10": [{"event": "login", "country": "foreign"}] * 4,
    "u11": [{"event": "login_failed"}, {"event": "transfer", "amount": 300}],
    "u12": [{"event": "transfer", "amount": 9000}] * 3,
}

client = DSecClient()
served = 0


@client.tool("users")
def users() -> list[str]:
    global served
    served += 1
    return sorted(LOGS)


@client.tool("user_logs")
def user_logs(user: str) -> list[dict[str, Any]]:
    global served
    served += 1
    if user not in LOGS:
        raise KeyError(f"no user {user!r}")
    return LOGS[user]


@client.tool("shutdown")
def shutdown() -> dict[str, int]:
    client.stop()
    return {"served": served}


def main() -> None:
    deadline = threading.Timer(MAX_SECONDS, client.stop)
    deadline.daemon = True
    deadline.start()
    print(f"records: serving users, user_logs as {client.agent!r}", flush=True)
    client.serve()
    print(f"records: stopped after serving {served} calls", flush=True)


if __name__ == "__main__":
    main()
