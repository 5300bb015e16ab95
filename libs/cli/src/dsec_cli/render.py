"""Human rendering of events: one line each, secret-free by construction (payload fields only),
every field escaped (:func:`dsec_cli.common.safe_text`): a sandbox writes some of this text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsec_cli.common import err_console, print_json, safe_text

if TYPE_CHECKING:
    from dsec_core.envelope import Envelope

_STYLE = {
    "spec.rejected": "bold red",
    "deps.conflict": "bold red",
    "sandbox.failed": "bold red",
    "policy.violation": "yellow",
    "policy.violation_summary": "yellow",
    "policy.reported": "magenta",
    "sandbox.exited": "bold",
    "sandbox.ready": "green",
    "sandbox.restarted": "yellow",
    "spec.validated": "green",
    "env.built": "green",
}


def _summary(env: Envelope) -> str:
    p: dict[str, Any] = env.payload
    t = env.type
    if t == "spec.submitted":
        return f"{p.get('filename')} by {p.get('submitted_by') or '?'}"
    if t == "spec.validated":
        return f"{p.get('name')} ({len(p.get('warnings', []))} warnings)"
    if t == "spec.rejected":
        return f"{len(p.get('errors', []))} errors"
    if t == "deps.resolved":
        return f"{len(p.get('lock', []))} packages, lock {str(p.get('lock_hash'))[:12]}"
    if t == "deps.conflict":
        return str(p.get("explanation", "")).splitlines()[0][:120] if p.get("explanation") else ""
    if t == "env.built":
        reuse = "reused" if p.get("reused") else "built"
        size = p.get("size_bytes")
        stored = f", archive {human_size(int(size))}" if isinstance(size, int) else ""
        return f"{reuse} {str(p.get('fingerprint'))[:12]}{stored}"
    if t == "sandbox.ready":
        line = f"node_id={p.get('node_id')} pid {p.get('pid')}"
        latency = (p.get("start_latency_ms") or {}).get("total")
        if latency is not None:
            line += f", ready in {latency} ms"
        warnings = p.get("warnings") or []
        if warnings:  # each names a path or setting of the spec that did not take effect
            line += "; warning: " + "; warning: ".join(str(w) for w in warnings)
        return line
    if t == "sandbox.exited":
        line = f"exit {p.get('exit_code')} ({p.get('reason')}) after {p.get('duration_s')} s"
        if p.get("reason") == "disk" and p.get("detail"):
            line += f": {p['detail']}"
        dropped = p.get("log_dropped_bytes") or {}
        if dropped:
            cut = ", ".join(f"{k} {v} bytes" for k, v in sorted(dropped.items()))
            line += f"; logs truncated (resources.log_bytes): {cut} dropped from the middle"
        return line
    if t == "sandbox.restarted":
        died = (
            f"killed by signal {p.get('signal')}"
            if p.get("signal") is not None
            else f"exit {p.get('exit_code')}"
        )
        restart = f"restart {p.get('restarts')} after it died"
        return f"{restart} ({died}, {p.get('reason')}); pid {p.get('pid')}"
    if t == "sandbox.failed":
        return f"{p.get('stage')}: {p.get('reason')}"
    if t == "policy.violation":
        return (
            f"{p.get('layer')} {p.get('action')} {p.get('operation')} {p.get('target')} "
            f"[rule {p.get('rule_id')}]"
        )
    if t == "policy.violation_summary":
        return (
            f"{p.get('layer')} {p.get('operation')} x{p.get('count')} "
            f"[rule {p.get('rule_id')}] e.g. {p.get('sample_target')}"
        )
    if t == "policy.reported":
        return (
            f"reported by the sandbox: {p.get('action')} {p.get('operation')} {p.get('target')} "
            f"[rule {p.get('rule_id')}]"
        )
    if t == "context.injected":
        return f"{p.get('kind')} {p.get('name')} from {p.get('source')}"
    if t == "state.checkpointed":
        many = p.get("checkpoints") or 1
        return (
            f"{p.get('agent')} {p.get('tier')} #{p.get('seq')}"
            + (f" ({many} checkpoints)" if many != 1 else "")
            + f": {human_size(p.get('bytes') or 0)}, pause {p.get('pause_ms')} ms, "
            f"durable in {p.get('durable_ms')} ms"
        )
    if t == "state.recovered":
        return (
            f"{p.get('agent')} #{p.get('seq')} from {p.get('source')}: "
            f"{p.get('deltas_applied')} deltas in {p.get('duration_ms')} ms"
        )
    if t == "state.handed_over":
        return (
            f"{p.get('agent')} from {p.get('from_sandbox')} at #{p.get('seq')}: "
            f"interruption {p.get('interruption_ms')} ms"
        )
    keys = ("node_id", "snapshot", "producer", "reason")
    return " ".join(f"{k}={p[k]}" for k in keys if k in p)


#: What a sandbox waits for after each event of its lifecycle (the spinner of ``dsec submit``).
_NEXT = {
    "spec.submitted": "validating the spec",
    "spec.validated": "resolving the dependencies",
    "deps.resolved": "building the environment",
    "env.built": "placing the sandbox on a node",
    "unit.placed": "starting the sandbox",
    "sandbox.scheduled": "starting the sandbox",
    "sandbox.pending": "waiting for a node that fits",
    "sandbox.started": "waiting for the sandbox to be ready",
    "sandbox.ready": "running",
    "snapshot.restored": "running",
}


def waiting_for(last_type: str | None) -> str:
    """What comes next after an event of type ``last_type`` (``None``: nothing seen yet)."""
    if last_type is None:
        return "waiting for the policy service"
    return _NEXT.get(last_type, "running")


def decode_or_warn(seq: int, data: bytes) -> Envelope | None:
    """Decode one message of the log; a malformed one is reported on stderr and skipped, so
    a single bad message (anyone with publish rights can write one) cannot crash a command."""
    from dsec_core.envelope import MalformedEnvelope, decode

    try:
        return decode(data)
    except MalformedEnvelope as exc:
        err_console.print(f"[red]seq {seq}: malformed event skipped: {safe_text(exc)}[/]")
        return None


def event_line(seq: int, env: Envelope) -> str:
    """Rich markup for one event."""
    style = _STYLE.get(env.type, "cyan")
    when = env.time.strftime("%H:%M:%S.%f")[:-3]
    return (
        f"[dim]{seq:>6} {when}[/] [{style}]{safe_text(env.type):<20}[/] "
        f"[dim]{safe_text(env.aggregate_id)}[/] {safe_text(_summary(env))} "
        f"[dim]({safe_text(env.producer)})[/]"
    )


def event_json(seq: int, env: Envelope) -> dict[str, Any]:
    """The JSON view of one event with its stream sequence."""
    return {"seq": seq, **env.to_json_dict()}


def human_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class JsonChunks:
    """``--json`` output of a byte stream (``sandbox logs``/``exec``): one
    ``{"stream", "data"}`` object per line of stdout for each chunk, UTF-8 decoded across
    chunk boundaries (invalid bytes as U+FFFD). A sink like :class:`dsec_cli.remote.Sink`."""

    def __init__(self, stream: str) -> None:
        import codecs

        self.stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if text:
            print_json({"stream": self.stream, "data": text})
