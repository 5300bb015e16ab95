# mypy: ignore-errors
# Test fixture: analysed statically by dsec_rules.infer, never imported or run.
"""LlamaIndex idioms (test fixture)."""

import socket

import requests
from llama_index.core.tools import FunctionTool


def lookup(question: str) -> str:
    reply = requests.post("https://kb.internal.test:8443/query", json={"q": question})
    return reply.text


def db_ping() -> None:
    with socket.create_connection(("10.0.0.5", 5432)) as conn:
        conn.sendall(b"ping")


kb_tool = FunctionTool.from_defaults(fn=lookup, name="kb_lookup")
ping_tool = FunctionTool.from_defaults(db_ping)
