"""The node agent's DNS proxy: domain rules become kernel allow entries, one answer at a time."""

from dsec_nodeagent.dns.policy import NameMatch, QueryAction, decide_query, match_name
from dsec_nodeagent.dns.proxy import DnsProxy, Grant, GrantSink
from dsec_nodeagent.dns.upstream import UpstreamClient, UpstreamError, parse_upstream

__all__ = [
    "DnsProxy",
    "Grant",
    "GrantSink",
    "NameMatch",
    "QueryAction",
    "UpstreamClient",
    "UpstreamError",
    "decide_query",
    "match_name",
    "parse_upstream",
]
