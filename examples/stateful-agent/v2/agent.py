"""The stateful agent, v2: what v1 does, and it proves it took over v1's whole conversation.

``dsec sandbox upgrade ID --code examples/stateful-agent/v2`` starts this version beside the
running v1; the node agent streams v1's state to it, freezes v1 for its last delta and switches
the tool name ``chat`` to v2: callers see at most one slower call, never an error. v2 then
checks the history it received: every turn is there, in order (``complete`` in each answer).

The rest is v1's docstring:

State (``dsec_sdk.state``; in a sandbox it goes through the node agent's state keeper, outside
one into a local directory):

- ``history``: an append-only message log (hot tier: every checkpoint);
- ``adapter``: a 256x256 float32 array (warm tier) that every chat nudges a little; only the
  changed elements travel (sparse deltas).

Tools (to the agents of its task group, over shared memory):

- ``chat(message)``: appends the message and a reply to the history, nudges the adapter,
  checkpoints (so the answer is only sent once the turn is durable), and returns
  ``{"turns": len(history), "version": "v1"}``;
- ``missing(ids)``: which of these message ids are *not* in the history (the caller checks that
  nothing it was answered for is lost);
- ``shutdown()``: ends the agent (exit 0: not a crash, so it is not restarted).

After a SIGKILL the node agent restarts the sandbox and ``AgentState.open()`` restores the last
checkpoint: the agent carries on at the turn it had acknowledged. ``v2/agent.py`` is the next
version, taken over live by ``dsec sandbox upgrade``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import numpy as np
from dsec_sdk import DSecClient
from dsec_sdk.state import AgentState

VERSION = "v2"
ADAPTER_SHAPE = (256, 256)
NUDGED = 64  # adapter elements changed per chat

state = AgentState.open()
history = state.log("history")
adapter = state.array("adapter", ADAPTER_SHAPE, "float32")
client = DSecClient()
# Serve with the state: in a live hand-over (`dsec sandbox upgrade`) the old version finishes
# the chat in progress and takes no new one before its final checkpoint (the broker sends those
# to the new version), and the new version tells the keeper `ready` once it serves.
if hasattr(client, "attach_state"):
    client.attach_state(state)


def reply_to(message: str, turn: int) -> str:
    """A deterministic stand-in for the model's answer."""
    words = message.split()
    return f"({VERSION}, turn {turn}) you said {len(words)} words; the last was {words[-1]!r}"


def nudge(message: str) -> None:
    """Change a few adapter elements, chosen by the message (a tiny "learning" step)."""
    seed = int.from_bytes(hashlib.blake2b(message.encode(), digest_size=8).digest(), "big")
    rng = np.random.default_rng(seed)
    idx = np.unique(rng.integers(0, adapter.view().size, NUDGED, dtype=np.int64))
    flat = adapter.view().reshape(-1)
    adapter.update(idx, flat[idx] + rng.standard_normal(len(idx), dtype=np.float32) * 0.01)


def warm_up() -> None:
    """Run nudge()'s numpy path once on scratch data, before serving: its first run in a
    fresh process takes ~18 ms (numpy's generators start cold), and in a hand-over the new
    version's first chat is the very call that crossed the switch."""
    rng = np.random.default_rng(0)
    np.unique(rng.integers(0, 16, 4, dtype=np.int64))
    rng.standard_normal(4, dtype=np.float32)
    hashlib.blake2b(b"", digest_size=8).digest()


warm_up()


@client.tool("chat")
def chat(message: str, id: str | None = None) -> dict[str, Any]:
    """One turn: remember the message and the reply, learn a little, checkpoint, answer."""
    turn = len(history)
    history.append({"role": "user", "id": id, "content": message, "turn": turn})
    history.append({"role": "assistant", "content": reply_to(message, turn), "turn": turn + 1})
    nudge(message)
    state.checkpoint()  # durable before the answer: an answered chat is never lost
    return {"turns": len(history), "version": VERSION, "complete": complete()}


def complete() -> bool:
    """Every turn of the conversation is there, in order (turn n is the n-th entry)."""
    return all(m.get("turn") == n for n, m in enumerate(history))


@client.tool("missing")
def missing(ids: list[str]) -> dict[str, Any]:
    """The ids among ``ids`` that no user message of the history carries."""
    seen = {m.get("id") for m in history if m.get("role") == "user"}
    return {"missing": [i for i in ids if i not in seen], "turns": len(history)}


@client.tool("shutdown")
def shutdown() -> dict[str, Any]:
    """Stop serving once this answer is sent (a clean exit: no restart)."""
    client.stop()
    return {"turns": len(history), "version": VERSION}


def take_over() -> None:
    """A hand-over's new version: once ``serve()`` has registered (the broker holds this
    server as a standby for the old version's name) the keeper is told it is ready; the old
    version is frozen, its last delta arrives, and the name switches here."""
    if not hasattr(client, "attach_state"):  # an SDK that does not say ready by itself
        deadline = time.monotonic() + 30
        while getattr(client, "_server", None) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        state.ready()
    switched = state.wait_switched(timeout=120)
    print(
        f"stateful-agent {VERSION}: took over at checkpoint {switched.seq} with {len(history)} "
        f"turns (complete: {complete()}); interruption {switched.interruption_ms:.2f} ms",
        flush=True,
    )


def main() -> None:
    info = state.restored
    if info is not None and info.seq:
        print(
            f"stateful-agent {VERSION}: restored checkpoint {info.seq} ({info.deltas} deltas, "
            f"from {info.source}) in {info.ms:.1f} ms: {len(history)} turns, adapter sum "
            f"{float(adapter.view().sum()):.4f}; history complete: {complete()}",
            flush=True,
        )
    else:
        print(f"stateful-agent {VERSION}: a new conversation", flush=True)
    if state.handover:  # started by `dsec sandbox upgrade`: take over from the running version
        threading.Thread(target=take_over, name="take-over", daemon=True).start()
    started = time.monotonic()
    try:
        client.serve()
    finally:
        state.close()
        client.close()
    print(
        f"stateful-agent {VERSION}: stopped after {time.monotonic() - started:.0f} s with "
        f"{len(history)} turns",
        flush=True,
    )


if __name__ == "__main__":
    main()
