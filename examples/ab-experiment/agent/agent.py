"""A risk agent (examples/ab-experiment): scores each user's activity log from 0 to 1.

Variant ``a`` counts failed logins; variant ``b`` also weighs foreign logins and large
transfers. Both ask the records service the same calls (``users``, ``user_logs``, ``shutdown``),
so a session recorded once answers both in replay. Each run adds a little noise seeded by its
trial (a model sampled at a temperature), so repeats differ.
"""

from __future__ import annotations

import os
import random
from typing import Any

from dsec_sdk import DSecClient
from dsec_sdk.experiment import result, trial
from dsec_sdk.recording import ReplayMiss

VARIANT = os.environ.get("VARIANT", "a")


def risk_a(logs: list[dict[str, Any]]) -> float:
    failed = sum(1 for e in logs if e["event"] == "login_failed")
    return min(1.0, failed / 10)


def risk_b(logs: list[dict[str, Any]]) -> float:
    failed = sum(1 for e in logs if e["event"] == "login_failed")
    foreign = sum(1 for e in logs if e.get("country") == "foreign")
    large = sum(1 for e in logs if e["event"] == "transfer" and e.get("amount", 0) > 5000)
    return min(1.0, 0.08 * failed + 0.15 * foreign + 0.3 * large)


def main() -> None:
    label = trial() or ("record", 0)
    noise = random.Random(f"{VARIANT}:{label[1]}")
    client = DSecClient()
    score = risk_b if VARIANT == "b" else risk_a
    users = client.call_tool("records", "users")
    for user in users:
        logs = client.call_tool("records", "user_logs", user=user)
        value = score(logs) + noise.gauss(0, 0.03)
        result(user, round(min(1.0, max(0.0, value)), 4))
    if os.environ.get("PROBE_MISS"):
        try:
            client.call_tool("records", "user_logs", user="never-recorded")
        except ReplayMiss as exc:
            print(f"replay miss: {exc}", flush=True)
    client.call_tool("records", "shutdown")
    client.close()
    print(f"variant {VARIANT}: scored {len(users)} users", flush=True)


if __name__ == "__main__":
    main()
