"""DSec's semantic layer, running inside the sandbox's Python (standard library only).

It sees ``open``, process creation, ``socket.connect``/``getaddrinfo`` and HTTP requests
(``http.client`` — hence urllib, urllib3, requests — and httpx), applies the node agent's rules
(allow / redirect / log / deny) and reports every rule decision over a Unix datagram socket.

It *explains*; it does not enforce. Calls made through ``ctypes`` or by non-Python children
never reach it — Landlock, seccomp and the eBPF egress layer refuse those in the kernel.
"""

import _thread  # not threading: only its C thread-local is needed
import builtins
import io
import marshal
import os
import sys
import time

# (the C module: the collections package would load keyword, operator, reprlib and heapq, about
# 2.5 ms of a bare interpreter's start on the project's VM)
from _collections import deque

# Imported on first use, not here: this module runs at the start of every sandboxed interpreter,
# and json, fnmatch (hence re) and _socket together cost about as much as the rest of it. A
# workload that never trips a rule never loads them.
TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs start-up time in every sandboxed interpreter
    import _socket
    import socket
    from collections.abc import Callable
    from typing import Any

_guard = _thread._local()


class Rule:
    """One compiled rule (see ``dsec_nodeagent.semantic.models.SemanticRule``)."""

    __slots__ = ("action", "match", "message", "name", "on", "spec_line", "target")

    def __init__(self, raw: "dict[str, Any]") -> None:
        self.name: str = raw["name"]
        self.on: str = raw["on"]
        self.match: dict[str, Any] = {k: v for k, v in raw["match"].items() if v is not None}
        self.action: str = raw["action"]
        self.target: str | None = raw.get("target")
        self.message: str | None = raw.get("message")
        self.spec_line: int | None = raw.get("spec_line")

    def matches(self, on: str, facts: "dict[str, Any]") -> bool:
        """Whether every field of the rule's match fits the call's ``facts``."""
        if on != self.on:
            return False
        for key, pattern in self.match.items():
            value = facts.get(key)
            if value is None:
                return False
            if key == "argv":
                if not _argv_matches(value, pattern):
                    return False
            elif not _fnmatchcase(
                str(value).lower() if key == "host" else str(value),
                pattern.lower() if key == "host" else pattern,
            ):
                return False
        return True


def _argv_matches(argv: "list[str]", pattern: "list[str]") -> bool:
    wanted = " ".join(pattern)
    if _fnmatchcase(" ".join(argv), wanted):
        return True
    return bool(argv) and _fnmatchcase(" ".join([os.path.basename(argv[0]), *argv[1:]]), wanted)


class RateLimit:
    """A sliding-window request budget for hosts matching ``host``."""

    __slots__ = ("host", "name", "period", "quota", "spec_line", "stamps")

    def __init__(self, raw: "dict[str, Any]") -> None:
        self.name: str = raw["name"]
        self.host: str = raw["host"].lower()
        self.quota: int = raw["requests"]
        self.period: int = raw["period_s"]
        self.spec_line: int | None = raw.get("spec_line")
        self.stamps: deque[float] = deque()

    def over(self, host: str, now: float) -> bool:
        """Count one request to ``host``; True when it exceeds the budget."""
        if not _fnmatchcase(host.lower(), self.host):
            return False
        while self.stamps and self.stamps[0] <= now - self.period:
            self.stamps.popleft()
        if len(self.stamps) >= self.quota:
            return True
        self.stamps.append(now)
        return False


class Decision:
    """The outcome for one call: what to do and with which (possibly redirected) subject."""

    __slots__ = ("action", "rule", "subject")

    def __init__(self, action: str, subject: str, rule: "Rule | None") -> None:
        self.action = action
        self.subject = subject
        self.rule = rule


class Engine:
    """Rules + rate limits + reporting; one per interpreter."""

    def __init__(self, raw: "dict[str, Any]", socket_path: "str | None") -> None:
        self.rules = [Rule(r) for r in raw.get("rules", [])]
        self.limits = [RateLimit(r) for r in raw.get("rate_limits", [])]
        self.default: str = raw.get("default", "allow")
        self.spec_file: str = raw.get("spec_file", "sandbox.yaml")
        self.socket_path = socket_path
        self._sock: _socket.socket | None = None
        self.watched = {r.on for r in self.rules} | ({"http"} if self.limits else set())
        if self.default == "log":
            self.watched |= {"open", "subprocess", "connect", "http"}

    def decide(self, on: str, subject: str, facts: "dict[str, Any]") -> "Decision":
        """First matching rule wins; raise PermissionError for a deny (after reporting it)."""
        if on == "http" and facts.get("host"):
            self._count(subject, facts["host"])
        for rule in self.rules:
            if rule.matches(on, facts):
                return self._apply(rule, on, subject)
        if self.default == "log":
            self.report(on, "log", subject, None)
        return Decision("allow", subject, None)

    def _count(self, subject: str, host: str) -> None:
        now = time.monotonic()
        for limit in self.limits:
            if limit.over(host, now):
                detail = f"rate limit {limit.quota} requests per {limit.period}s ({limit.name})"
                self.report("http", "deny", subject, None, detail, limit.spec_line)
                where = self._where(limit.spec_line)
                raise PermissionError(
                    f"[dsec] http {subject!r} denied: {detail}; to allow more, raise rate_limit "
                    f"in {where}"
                )

    def _apply(self, rule: "Rule", on: str, subject: str) -> "Decision":
        self.report(on, rule.action, subject, rule)
        if rule.action == "deny":
            raise PermissionError(self.message(on, subject, rule))
        if rule.action == "redirect" and rule.target:
            return Decision("redirect", rule.target, rule)
        return Decision(rule.action, subject, rule)

    def _where(self, line: "int | None") -> str:
        return f"{self.spec_file} line {line}" if line else self.spec_file

    def message(self, on: str, subject: str, rule: "Rule") -> str:
        """A deny's text: what was refused, by which rule, and the spec line to change."""
        extra = f": {rule.message}" if rule.message else ""
        return (
            f"[dsec] {on} {subject!r} denied by rule '{rule.name}'{extra}; "
            f"to allow it, change that rule in {self._where(rule.spec_line)}"
        )

    def report(
        self,
        on: str,
        action: str,
        subject: str,
        rule: "Rule | None",
        detail: "str | None" = None,
        line: "int | None" = None,
    ) -> None:
        """Send one decision to the node agent; never blocks, never raises."""
        if not self.socket_path:
            return
        payload = {
            "on": on,
            "action": action,
            "subject": subject[:2048],
            "pid": os.getpid(),
            "time": time.time(),
            "rule": rule.name if rule else None,
            "spec_line": rule.spec_line if rule else line,
            "detail": detail,
        }
        _guard.active = True
        try:
            import json  # (while guarded: the audit hook does not judge the import's opens)

            if self._sock is None:
                import _socket

                self._sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(json.dumps(payload).encode(), self.socket_path)
        except OSError:
            pass
        finally:
            _guard.active = False


_engine: Engine | None = None


def _fnmatchcase(name: str, pattern: str) -> bool:
    """``fnmatch.fnmatchcase``, imported at the first rule match (it brings ``re``)."""
    global _fnmatchcase
    held = _busy()
    _guard.active = True  # the import opens files: the audit hook must not judge them (recurse)
    try:
        from fnmatch import fnmatchcase
    finally:
        _guard.active = held
    _fnmatchcase = fnmatchcase  # type: ignore[assignment]
    return fnmatchcase(name, pattern)


def _busy() -> bool:
    return bool(getattr(_guard, "active", False))


class _Held:
    """Marks the current thread while a wrapper already decided (the audit hook stays quiet)."""

    def __enter__(self) -> None:
        _guard.active = True

    def __exit__(self, *exc: object) -> None:
        _guard.active = False


def _path_subject(path: "Any") -> "str | None":
    if isinstance(path, int):
        return None
    try:
        return os.path.abspath(os.fsdecode(os.fspath(path)))
    except TypeError:
        return None


# ---------------------------------------------------------------------- wrappers


def _wrap_open(engine: "Engine") -> None:
    real_open = builtins.open
    real_os_open = os.open

    def dsec_open(file: "Any", mode: str = "r", *args: "Any", **kwargs: "Any") -> "Any":
        subject = _path_subject(file)
        if subject is None or _busy():
            return real_open(file, mode, *args, **kwargs)
        decision = engine.decide("open", subject, {"path": subject})
        target = decision.subject if decision.action == "redirect" else file
        with _Held():
            return real_open(target, mode, *args, **kwargs)

    def dsec_os_open(path: "Any", flags: int, mode: int = 0o777, *, dir_fd: "Any" = None) -> int:
        subject = _path_subject(path) if dir_fd is None else None
        if subject is None or _busy():
            return real_os_open(path, flags, mode, dir_fd=dir_fd)
        decision = engine.decide("open", subject, {"path": subject})
        target = decision.subject if decision.action == "redirect" else path
        with _Held():
            return real_os_open(target, flags, mode, dir_fd=dir_fd)

    builtins.open = dsec_open
    io.open = dsec_open
    os.open = dsec_os_open


def _wrap_connect(engine: "Engine") -> None:
    import socket  # only for sandboxes with connect rules

    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def route(sock: "socket.socket", address: "Any") -> "Any":
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or _busy():
            return address
        subject = f"{address[0]}:{address[1]}"
        decision = engine.decide("connect", subject, {"host": address[0], "port": address[1]})
        if decision.action == "redirect":
            host, _, port = decision.subject.rpartition(":")
            return (host, int(port))
        return address

    def connect(self: "socket.socket", address: "Any") -> None:
        target = route(self, address)
        with _Held():
            real_connect(self, target)

    def connect_ex(self: "socket.socket", address: "Any") -> int:
        target = route(self, address)
        with _Held():
            return real_connect_ex(self, target)

    socket.socket.connect = connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign,assignment]


def _wrap_http_client(engine: "Engine", module: "Any") -> None:
    real_putrequest = module.HTTPConnection.putrequest
    secure = getattr(module, "HTTPSConnection", ())  # absent without ssl

    def putrequest(self: "Any", method: str, url: str, *args: "Any", **kwargs: "Any") -> "Any":
        if _busy():
            return real_putrequest(self, method, url, *args, **kwargs)
        scheme = "https" if isinstance(self, secure) else "http"
        if url.startswith(("http://", "https://")):
            full = url
        else:
            default = 443 if scheme == "https" else 80
            port = "" if self.port == default else f":{self.port}"
            full = f"{scheme}://{self.host}{port}{url}"
        bare = full.split("?", 1)[0]
        decision = engine.decide("http", bare, {"url": bare, "host": self.host})
        if decision.action == "redirect":
            url = decision.subject
        return real_putrequest(self, method, url, *args, **kwargs)

    module.HTTPConnection.putrequest = putrequest


def _wrap_httpx(engine: "Engine", module: "Any") -> None:
    def guard(request: "Any") -> None:
        url = str(request.url).split("?", 1)[0]
        decision = engine.decide("http", url, {"url": url, "host": request.url.host})
        if decision.action == "redirect":
            request.url = module.URL(decision.subject)

    real_send = module.Client.send
    real_async_send = module.AsyncClient.send

    def send(self: "Any", request: "Any", *args: "Any", **kwargs: "Any") -> "Any":
        guard(request)
        return real_send(self, request, *args, **kwargs)

    async def async_send(self: "Any", request: "Any", *args: "Any", **kwargs: "Any") -> "Any":
        guard(request)
        return await real_async_send(self, request, *args, **kwargs)

    module.Client.send = send
    module.AsyncClient.send = async_send


class _AfterImport:
    """A meta-path finder that patches a module right after it is first imported."""

    def __init__(self, name: str, patch: "Callable[[Any], None]") -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: "Any", target: "Any" = None) -> "Any":
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        real_exec = loader.exec_module
        patch = self.patch

        def exec_module(module: "Any") -> None:
            real_exec(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# ---------------------------------------------------------------------- audit hook


_PROCESS_EVENTS = {
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "pty.spawn",
}


def _process_argv(event: str, args: "tuple[Any, ...]") -> "list[str] | None":
    if event == "subprocess.Popen":
        argv = args[1]
        if isinstance(argv, (str, bytes)):
            return [os.fsdecode(argv)]
        return [os.fsdecode(a) if isinstance(a, (str, bytes)) else str(a) for a in argv]
    if event == "os.system":
        return ["/bin/sh", "-c", os.fsdecode(args[0])]
    if event in ("os.exec", "os.posix_spawn", "os.spawn"):
        argv = args[1] if event != "os.spawn" else args[2]
        return [os.fsdecode(a) for a in argv]
    return None


def _audit(event: str, args: "tuple[Any, ...]") -> None:
    engine = _engine
    if engine is None or _busy():
        return
    if event == "open" and "open" in engine.watched:
        subject = _path_subject(args[0])
        if subject is not None:
            engine.decide("open", subject, {"path": subject})
    elif event in _PROCESS_EVENTS and "subprocess" in engine.watched:
        argv = _process_argv(event, args)
        if argv is not None:
            engine.decide("subprocess", " ".join(argv), {"argv": argv})
    elif event == "socket.getaddrinfo" and "connect" in engine.watched and args[0]:
        host = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        engine.decide("connect", f"{host}:{args[1] or 0}", {"host": host, "port": args[1]})
    elif event == "socket.connect" and "connect" in engine.watched:
        sock, address = args
        import _socket  # loaded already: the event comes from a socket

        if sock.family in (_socket.AF_INET, _socket.AF_INET6):
            engine.decide(
                "connect", f"{address[0]}:{address[1]}", {"host": address[0], "port": address[1]}
            )


def _wrap_when_imported(engine: "Engine", name: str, wrap: "Callable[[Engine, Any], None]") -> None:
    if name in sys.modules:
        wrap(engine, sys.modules[name])
        return

    def patch(module: "Any") -> None:
        wrap(engine, module)

    sys.meta_path.insert(0, _AfterImport(name, patch))


def install(rules_file: str, socket_path: "str | None") -> "Engine":
    """Load the rules and install wrappers + the audit hook (once per interpreter)."""
    global _engine
    # marshal (a builtin module, nothing to load): json would load its C scanner's shared
    # library, ~0.16 ms of every sandboxed interpreter's start. Written by the node agent
    # (format 4, which every Python 3 since 3.4 reads), bound read-only.
    with open(rules_file, "rb") as fh:
        raw = marshal.loads(fh.read())
    if not isinstance(raw, dict):
        raise TypeError(f"{rules_file}: not a rules mapping")
    engine = Engine(raw, socket_path)
    if "open" in engine.watched:
        _wrap_open(engine)
    if "connect" in engine.watched:
        _wrap_connect(engine)
    if "http" in engine.watched:
        # Patched once imported, not imported here: http.client (email, socket, re) would cost
        # milliseconds of every sandboxed interpreter's start, HTTP or not.
        _wrap_when_imported(engine, "http.client", _wrap_http_client)
        _wrap_when_imported(engine, "httpx", _wrap_httpx)
    _engine = engine
    sys.addaudithook(_audit)
    return engine
