"""Render inferred needs as a ready-to-paste spec block (``runtime_context`` + ``security_policy``).

Written by hand rather than dumped with PyYAML so that each grant carries a comment saying which
line of code needs it; the block is checked to load as a valid spec in the tests.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections import defaultdict

from dsec_rules.infer.needs import EgressNeed, EnvNeed, InferredNeeds, implicitly_readable

VAULT_PLACEHOLDER = "vault://secret/CHANGE-ME/{slug}"
"""Source proposed for a secret: a syntactically valid path the user must replace."""

_PLAIN = re.compile(r"[A-Za-z0-9_./@][A-Za-z0-9_./:@-]*")
_INTERNAL_SUFFIXES = (".internal", ".local", ".svc", ".cluster.local", ".prod", ".lan")


def scalar(text: str) -> str:
    """A YAML scalar: plain when unambiguous, else JSON-quoted (valid YAML)."""
    reserved = {"true", "false", "null", "~", "yes", "no", "on", "off"}
    if _PLAIN.fullmatch(text) and text.lower() not in reserved and not text[0].isdigit():
        return text
    return json.dumps(text)


def render_policy_yaml(needs: InferredNeeds, workdir: str = "/workspace") -> str:
    """The spec block granting exactly what the code was found to need, with evidence comments."""
    lines = [
        f"# Inferred by `dsec policy infer` from {len(needs.files)} Python file(s); review it."
    ]
    lines += _tool_comments(needs)
    lines += _unresolved_comments(needs)
    env = _env_lines(needs.env)
    if env:
        lines += ["runtime_context:", "  env_vars:", *env]
    lines.append("security_policy:")
    egress = _egress_lines(needs.egress)
    lines += ["  network:", "    egress:", *egress] if egress else ["  network:", "    egress: []"]
    lines += _filesystem_lines(needs, workdir)
    return "\n".join(lines) + "\n"


def _tool_comments(needs: InferredNeeds) -> list[str]:
    out = []
    for tool in needs.tools:
        sem = tool.semantics
        if sem is None:
            out.append(f"# tool {tool.name} ({tool.framework}, {tool.where}): not in the catalogue")
            continue
        extra = f", typical latency {sem.latency_ms}ms"
        if sem.rate_limit:
            extra += f", usual limit {sem.rate_limit}"
        out.append(f"# tool {tool.name} ({tool.framework}, {tool.where}): {sem.function}{extra}")
        if sem.ports and not sem.egress and not tool.local:
            where = "an internal host" if sem.internal else "a host chosen at run time"
            ports = ", ".join(map(str, sem.ports))
            out.append(f"#   connects to {where} on port(s) {ports}: add an egress rule for it")
    for command in needs.commands:
        out.append(f"# runs `{command.argv0}` ({', '.join(command.sources[:2])})")
    return out


def _unresolved_comments(needs: InferredNeeds) -> list[str]:
    out = [
        f"# could not parse {f.file}:{f.line}:{f.column}: {f.message}" for f in needs.parse_failures
    ]
    out += [f"# not resolved statically: {u.where} {u.detail}" for u in needs.unresolved]
    return out


def _env_lines(needs: tuple[EnvNeed, ...]) -> list[str]:
    out = []
    for need in needs:
        if need.has_default and not need.secret:
            continue
        out.append(f"    - name: {need.name}  # {need.sources[0]}")
        if need.secret:
            slug = need.name.lower().replace("_", "-")
            out.append(f"      source: {VAULT_PLACEHOLDER.format(slug=slug)}  # set the Vault path")
            out.append("      ttl: 1h")
        else:
            out.append('      value: ""  # set the value')
    return out


def _egress_lines(needs: tuple[EgressNeed, ...]) -> list[str]:
    ports: dict[str, list[int]] = defaultdict(list)
    first: dict[str, EgressNeed] = {}
    for need in needs:
        ports[need.host].append(need.port)
        first.setdefault(need.host, need)
    out = []
    for host, host_ports in ports.items():
        need = first[host]
        key, value, internal = _destination(host)
        out.append(f"      - {key}: {scalar(value)}  # {need.sources[0]}")
        out.append(f"        ports: [{', '.join(map(str, sorted(set(host_ports))))}]")
        rates = [n.rate_limit for n in needs if n.host == host and n.rate_limit]
        if rates:
            rate = min(rates, key=lambda r: r.per_second)
            out.append(f"        rate_limit: {rate}  # usual limit of tool {', '.join(need.tools)}")
        if internal:
            out.append("        allow_internal_only: true")
    return out


def _destination(host: str) -> tuple[str, str, bool]:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "domain", host, host.endswith(_INTERNAL_SUFFIXES)
    return "cidr", str(ipaddress.ip_network(address)), address.is_private


def _filesystem_lines(needs: InferredNeeds, workdir: str) -> list[str]:
    writes = sorted({n.grant(workdir) for n in needs.paths if n.write})
    reads = sorted(
        {
            n.grant(workdir)
            for n in needs.paths
            if not n.write and not implicitly_readable(n.grant(workdir), workdir)
        }
        - set(writes)
    )
    out = ["  filesystem:"]
    out.append(f"    write_allowed: [{', '.join(map(scalar, writes))}]")
    out.append(f"    read_allowed: [{', '.join(map(scalar, reads))}]")
    return out
