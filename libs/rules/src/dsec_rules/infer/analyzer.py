"""Static analysis of agent code with :mod:`ast`: what it calls, reads, writes and registers.

Nothing is imported or executed. Values are followed only as far as literals go: string
constants, f-strings and ``+`` of known constants. A call whose destination is not literal is
recorded as :class:`~dsec_rules.infer.findings.Unresolved`, so the comparison can say what it
could not check.
"""

from __future__ import annotations

import ast
import shlex
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypedDict
from urllib.parse import urlsplit

from dsec_rules.infer.findings import (
    CodeFindings,
    EnvRead,
    FileAccess,
    HttpCall,
    ParseFailure,
    SocketConnect,
    SubprocessCall,
    ToolRegistration,
    Unresolved,
)

_HTTP_FUNCS = {
    f"{module}.{verb}"
    for module in ("requests", "httpx", "aiohttp", "urllib3")
    for verb in ("get", "post", "put", "patch", "delete", "head", "options", "request", "stream")
} | {"urllib.request.urlopen", "urllib.request.Request", "urllib.request.urlretrieve"}
_HTTP_METHODS = {
    "get",
    "post",
    "put",
    "patch",
    "delete",
    "head",
    "options",
    "request",
    "stream",
    "urlopen",
    "ws_connect",
    "fetch",
    "Request",
}
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_SUBPROCESS_FUNCS = {
    "subprocess.run",
    "subprocess.call",
    "subprocess.check_call",
    "subprocess.check_output",
    "subprocess.Popen",
    "subprocess.getoutput",
    "subprocess.getstatusoutput",
    "os.system",
    "os.popen",
    "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
    "os.execv",
    "os.execvp",
    "os.execl",
    "os.execlp",
    "os.spawnv",
    "os.spawnvp",
}
_ENV_GETTERS = {"os.getenv", "os.environ.get", "os.environ.setdefault", "os.environ.pop"}
_PATH_WRITERS = {"write_text", "write_bytes", "mkdir", "touch", "unlink", "rmdir", "rename"}
_PATH_READERS = {"read_text", "read_bytes", "iterdir", "glob", "rglob"}
_FS_WRITE_FUNCS = {
    "os.makedirs",
    "os.mkdir",
    "os.remove",
    "os.unlink",
    "os.rmdir",
    "shutil.rmtree",
    "os.rename",
    "os.replace",
}
_OS_OPEN_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
_TOOL_CONSTRUCTORS = {"Tool", "StructuredTool", "FunctionTool"}
_TOOL_FACTORIES = {"from_function", "from_defaults"}


def analyze_files(
    files: Mapping[str, bytes], known_tool_classes: Iterable[str] = ()
) -> CodeFindings:
    """Analyze every ``.py`` file of a code bundle (other files are ignored).

    Args:
        files: Relative path -> content.
        known_tool_classes: Class names of prebuilt tools (from the catalogue) whose
            instantiation counts as registering that tool, e.g. ``TavilySearchResults``.
    """
    known = frozenset(known_tool_classes)
    parts = [
        analyze_source(content, name, known)
        for name, content in sorted(files.items())
        if name.endswith(".py")
    ]
    return CodeFindings(
        files=tuple(name for part in parts for name in part.files),
        http=tuple(x for p in parts for x in p.http),
        sockets=tuple(x for p in parts for x in p.sockets),
        env=tuple(x for p in parts for x in p.env),
        subprocesses=tuple(x for p in parts for x in p.subprocesses),
        file_access=tuple(x for p in parts for x in p.file_access),
        tools=tuple(x for p in parts for x in p.tools),
        unresolved=tuple(x for p in parts for x in p.unresolved),
        parse_failures=tuple(x for p in parts for x in p.parse_failures),
        calls=tuple(x for p in parts for x in p.calls),
    )


def analyze_source(
    source: bytes | str, filename: str, known_tool_classes: frozenset[str] = frozenset()
) -> CodeFindings:
    """Analyze one Python file; a syntax error becomes a :class:`ParseFailure`."""
    try:
        with warnings.catch_warnings():
            # The user's code may have odd escapes; its warnings are not ours to print.
            warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
            tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None) or 1
        col = getattr(exc, "offset", None) or 1
        message = getattr(exc, "msg", None) or str(exc)
        failure = ParseFailure(file=filename, line=line, column=max(col, 1), message=message)
        return CodeFindings(files=(filename,), parse_failures=(failure,))
    visitor = _Visitor(filename, known_tool_classes)
    visitor.collect_constants(tree)
    visitor.visit(tree)
    return visitor.findings()


@dataclass(frozen=True)
class _Binding:
    """What a name is bound to, as far as literals go (all None: unknown)."""

    text: str | None = None
    path: str | None = None
    request: bool = False


class _Where(TypedDict):
    file: str
    line: int
    scope: str


class _Visitor(ast.NodeVisitor):
    """One pass over a module, collecting findings in source order."""

    def __init__(self, filename: str, known_tool_classes: frozenset[str]) -> None:
        self.filename = filename
        self.known_tools = known_tool_classes
        self.aliases: dict[str, str] = {}
        self.bindings: defaultdict[str, dict[str, _Binding]] = defaultdict(dict)
        self.scope: list[str] = []
        self.calls: defaultdict[str, set[str]] = defaultdict(set)
        self.http: list[HttpCall] = []
        self.sockets: list[SocketConnect] = []
        self.env: list[EnvRead] = []
        self.subprocesses: list[SubprocessCall] = []
        self.file_access: list[FileAccess] = []
        self.tools: list[ToolRegistration] = []
        self.unresolved: list[Unresolved] = []

    def findings(self) -> CodeFindings:
        return CodeFindings(
            files=(self.filename,),
            http=tuple(self.http),
            sockets=tuple(self.sockets),
            env=tuple(self.env),
            subprocesses=tuple(self.subprocesses),
            file_access=tuple(self.file_access),
            tools=tuple(self.tools),
            unresolved=tuple(self.unresolved),
            calls=tuple((k, tuple(sorted(v))) for k, v in sorted(self.calls.items())),
        )

    # -- names and values ------------------------------------------------------------------------

    def collect_constants(self, tree: ast.AST) -> None:
        """First pass: bind ``NAME = "literal"`` per scope, so use before definition works.

        Parameters, loop variables and names assigned twice are bound as unknown, so a
        function's ``url`` parameter never borrows another function's ``url = "https://..."``.
        """
        self._collect(tree)
        self.scope = []

    def _collect(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.scope.append(child.name)
                if not isinstance(child, ast.ClassDef):
                    table = self.bindings[".".join(self.scope)]
                    for arg in ast.walk(child.args):
                        if isinstance(arg, ast.arg):
                            table[arg.arg] = _Binding()
                self._collect(child)
                self.scope.pop()
            elif (
                isinstance(child, ast.Assign | ast.AnnAssign)
                and isinstance(
                    target := (child.targets[0] if isinstance(child, ast.Assign) else child.target),
                    ast.Name,
                )
                and child.value is not None
                and (not isinstance(child, ast.Assign) or len(child.targets) == 1)
            ):
                self._bind(target.id, child.value)
                self._collect(child.value)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                self._bind(child.id, None)
            else:
                self._collect(child)

    def _bind(self, name: str, value: ast.expr | None) -> None:
        binding = _Binding()
        if value is not None:
            text, complete = self.string_prefix(value)
            callee = self.qualname(value.func) if isinstance(value, ast.Call) else None
            binding = _Binding(
                text=text if complete else None,
                path=self.path_value(value),
                request=(callee or "").endswith("Request"),
            )
        table = self.bindings[".".join(self.scope)]
        table[name] = binding if table.get(name, binding) == binding else _Binding()

    def lookup(self, name: str) -> _Binding | None:
        """The binding of ``name`` seen from the current scope (innermost first)."""
        scope = list(self.scope)
        while True:
            table = self.bindings.get(".".join(scope))
            if table is not None and name in table:
                return table[name]
            if not scope:
                return None
            scope.pop()

    def qualname(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def string_prefix(self, node: ast.AST) -> tuple[str | None, bool]:
        """The literal text an expression starts with, and whether that is all of it."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value, True
        if isinstance(node, ast.Name):
            binding = self.lookup(node.id)
            text = binding.text if binding else None
            return text, text is not None
        if isinstance(node, ast.JoinedStr):
            return self._fstring_prefix(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, complete = self.string_prefix(node.left)
            if left is None or not complete:
                return left, False
            right, right_complete = self.string_prefix(node.right)
            return left + (right or ""), right is not None and right_complete
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left, _ = self.string_prefix(node.left)
            return (left.split("%", 1)[0] if left is not None else None), False
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
        ):
            text, _ = self.string_prefix(node.func.value)
            return (text.split("{", 1)[0] if text is not None else None), False
        return None, False

    def _fstring_prefix(self, node: ast.JoinedStr) -> tuple[str | None, bool]:
        out = ""
        for part in node.values:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                out += part.value
            elif (
                isinstance(part, ast.FormattedValue)
                and isinstance(part.value, ast.Name)
                and part.format_spec is None
                and (binding := self.lookup(part.value.id)) is not None
                and binding.text is not None
            ):
                out += binding.text
            else:
                return out, False
        return out, True

    def path_value(self, node: ast.AST) -> str | None:
        """A literal path from ``"..."``, ``Path("...")`` or ``Path(...) / "..."``."""
        if isinstance(node, ast.Name):
            binding = self.lookup(node.id)
            return binding.path if binding else None
        if isinstance(node, ast.Call) and self.qualname(node.func) in {"Path", "pathlib.Path"}:
            if len(node.args) == 1:
                text, complete = self.string_prefix(node.args[0])
                return text if complete else None
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base = self.path_value(node.left)
            tail, complete = self.string_prefix(node.right)
            if base is not None and tail is not None and complete:
                return f"{base.rstrip('/')}/{tail}"
        return None

    def where(self, node: ast.AST) -> _Where:
        return _Where(
            file=self.filename, line=getattr(node, "lineno", 1), scope=".".join(self.scope)
        )

    # -- imports and scopes ----------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases.setdefault(top, top)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module is None or node.level:
            return
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Decorators and defaults run in the enclosing scope; only the body is the function's.
        for decorator in node.decorator_list:
            self._decorator_tool(decorator, node)
            self.visit(decorator)
        self.visit(node.args)
        self.scope.append(node.name)
        for statement in node.body:
            self.visit(statement)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._class_tool(node)
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    # -- calls -----------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        name = self.qualname(node.func)
        last = _callable_name(node.func)
        if self.scope and last:
            self.calls[".".join(self.scope)].add(last)
        if name:
            self._classify(node, name)
        elif isinstance(node.func, ast.Attribute) and last is not None:
            # (OUT / "report.md").write_text(...): no dotted name, but maybe a path method.
            self._path_call(node, last)
        self.generic_visit(node)

    def _path_call(self, node: ast.Call, last: str) -> None:
        if last in _PATH_WRITERS | _PATH_READERS | {"open"}:
            self._path_method(node, last)

    def _classify(self, node: ast.Call, name: str) -> None:
        last = name.rsplit(".", 1)[-1]
        if name in _ENV_GETTERS or (
            last in {"get", "setdefault"} and name.endswith("environ." + last)
        ):
            self._env_call(node)
        elif name in _SUBPROCESS_FUNCS:
            self._subprocess(node, name)
        elif name in {"open", "io.open", "builtins.open"}:
            self._open(node)
        elif name == "os.open":
            self._os_open(node)
        elif name in _FS_WRITE_FUNCS or name in {"shutil.copy", "shutil.copyfile", "shutil.move"}:
            self._fs_func(node, name)
        elif name in {"socket.create_connection", "asyncio.open_connection"} or last in {
            "connect",
            "connect_ex",
        }:
            self._socket(node, name)
        elif isinstance(node.func, ast.Attribute):
            self._path_call(node, last)
        if name in _HTTP_FUNCS or last in _HTTP_METHODS:
            self._http(node, name)
        self._base_url(node, name)
        self._tool_call(node, name, last)

    def _http(self, node: ast.Call, name: str) -> None:
        if (
            node.args
            and isinstance(node.args[0], ast.Name)
            and (binding := self.lookup(node.args[0].id)) is not None
            and binding.request
        ):
            return  # urlopen(request): the Request(...) call itself was recorded
        candidates = [kw.value for kw in node.keywords if kw.arg == "url"] + list(node.args[:2])
        for arg in candidates:
            text, complete = self.string_prefix(arg)
            if text is None:
                continue
            call = self._http_call(text, complete, node, name)
            if call is not None:
                self.http.append(call)
                return
            if "://" in text:
                self.unresolved.append(
                    Unresolved(kind="http", detail=f"{name}({text}...)", **self.where(node))
                )
                return
        if name in _HTTP_FUNCS:
            self.unresolved.append(
                Unresolved(kind="http", detail=f"{name}(<dynamic URL>)", **self.where(node))
            )

    def _http_call(self, text: str, complete: bool, node: ast.AST, name: str) -> HttpCall | None:
        scheme, sep, rest = text.partition("://")
        if not sep or scheme.lower() not in _DEFAULT_PORTS:
            return None
        authority_done = complete or any(c in rest for c in "/?#")
        if not authority_done:
            return None
        try:
            parts = urlsplit(text)
            port = parts.port or _DEFAULT_PORTS[scheme.lower()]
        except ValueError:
            return None
        if not parts.hostname:
            return None
        return HttpCall(
            url=text, host=parts.hostname.lower(), port=port, client=name, **self.where(node)
        )

    def _base_url(self, node: ast.Call, name: str) -> None:
        for kw in node.keywords:
            if kw.arg == "base_url":
                text, complete = self.string_prefix(kw.value)
                call = self._http_call(text, complete, node, name) if text else None
                if call is not None:
                    self.http.append(call)

    def _env_call(self, node: ast.Call) -> None:
        if not node.args:
            return
        text, complete = self.string_prefix(node.args[0])
        has_default = len(node.args) > 1 or any(kw.arg == "default" for kw in node.keywords)
        if text is not None and complete:
            self.env.append(EnvRead(name=text, has_default=has_default, **self.where(node)))
        else:
            self.unresolved.append(
                Unresolved(kind="env", detail="os.getenv(<dynamic name>)", **self.where(node))
            )

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and self.qualname(node.value) in {
            "os.environ",
            "environ",
        }:
            text, complete = self.string_prefix(node.slice)
            if text is not None and complete:
                self.env.append(EnvRead(name=text, **self.where(node)))
        self.generic_visit(node)

    def _subprocess(self, node: ast.Call, name: str) -> None:
        if name == "asyncio.create_subprocess_exec":
            argv = [self._literal_or_star(a) for a in node.args]
        elif node.args and isinstance(node.args[0], ast.List | ast.Tuple):
            argv = [self._literal_or_star(a) for a in node.args[0].elts]
        elif node.args:
            text, complete = self.string_prefix(node.args[0])
            try:
                argv = shlex.split(text) if text else []
            except ValueError:
                argv = [text] if text else []
            if text and not complete:
                argv.append("*")
        else:
            argv = []
        if argv and argv[0] != "*":
            self.subprocesses.append(SubprocessCall(argv=tuple(argv), **self.where(node)))
        else:
            self.unresolved.append(
                Unresolved(
                    kind="subprocess", detail=f"{name}(<dynamic command>)", **self.where(node)
                )
            )

    def _literal_or_star(self, node: ast.AST) -> str:
        text, complete = self.string_prefix(node)
        return text if text is not None and complete else "*"

    def _record_path(self, node: ast.AST, path_node: ast.AST, write: bool) -> None:
        path = self.path_value(path_node)
        if path is None:
            text, complete = self.string_prefix(path_node)
            if text and complete:
                path = text
            elif text and "/" in text:
                # f"/workspace/output/{name}.json": the directory part is still literal.
                path = text.rsplit("/", 1)[0] or "/"
        if path:
            self.file_access.append(FileAccess(path=path, write=write, **self.where(node)))
        else:
            self.unresolved.append(
                Unresolved(kind="file", detail="open(<dynamic path>)", **self.where(node))
            )

    def _open(self, node: ast.Call) -> None:
        if not node.args:
            return
        mode_node = node.args[1] if len(node.args) > 1 else None
        for kw in node.keywords:
            if kw.arg == "mode":
                mode_node = kw.value
        mode, _ = self.string_prefix(mode_node) if mode_node is not None else ("r", True)
        write = mode is None or any(c in mode for c in "wax+")
        self._record_path(node, node.args[0], write)

    def _os_open(self, node: ast.Call) -> None:
        if len(node.args) < 2:
            return
        flags = {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
        flags |= {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        self._record_path(node, node.args[0], bool(flags & _OS_OPEN_WRITE_FLAGS))

    def _fs_func(self, node: ast.Call, name: str) -> None:
        if name.startswith("shutil.copy") or name == "shutil.move":
            if len(node.args) >= 2:
                self._record_path(node, node.args[0], name == "shutil.move")
                self._record_path(node, node.args[1], True)
        elif node.args:
            self._record_path(node, node.args[0], True)

    def _path_method(self, node: ast.Call, method: str) -> None:
        assert isinstance(node.func, ast.Attribute)
        receiver = node.func.value
        if self.path_value(receiver) is None or isinstance(receiver, ast.Constant):
            return
        if method == "open":
            mode = "r"
            if node.args:
                mode = self.string_prefix(node.args[0])[0] or "w"
            write = any(c in mode for c in "wax+")
        else:
            write = method in _PATH_WRITERS
        self._record_path(node, receiver, write)

    def _socket(self, node: ast.Call, name: str) -> None:
        if name == "asyncio.open_connection" and len(node.args) >= 2:
            host_node, port_node = node.args[0], node.args[1]
        elif node.args and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) >= 2:
            host_node, port_node = node.args[0].elts[0], node.args[0].elts[1]
        else:
            return
        host, complete = self.string_prefix(host_node)
        port = port_node.value if isinstance(port_node, ast.Constant) else None
        if host and complete and isinstance(port, int) and not isinstance(port, bool):
            self.sockets.append(SocketConnect(host=host.lower(), port=port, **self.where(node)))
        else:
            self.unresolved.append(
                Unresolved(kind="socket", detail=f"{name}(<dynamic address>)", **self.where(node))
            )

    # -- tools -----------------------------------------------------------------------------------

    def _tool(self, node: ast.AST, name: str, framework: str, target: str | None) -> None:
        self.tools.append(
            ToolRegistration(name=name, framework=framework, target=target, **self.where(node))
        )

    def _kw(self, node: ast.Call, *names: str) -> ast.expr | None:
        for kw in node.keywords:
            if kw.arg in names:
                return kw.value
        return None

    def _tool_call(self, node: ast.Call, name: str, last: str) -> None:
        if last == "add_tool":
            self._add_tool(node)
        elif last in _TOOL_CONSTRUCTORS or (
            last in _TOOL_FACTORIES and name.rsplit(".", 2)[-2] in _TOOL_CONSTRUCTORS
        ):
            self._tool_constructor(node, name)
        elif last == "register_function":
            func = node.args[0] if node.args else self._kw(node, "f", "func")
            self._named_tool(node, "autogen", func, self._kw(node, "name"))
        elif last == "load_tools" and node.args and isinstance(node.args[0], ast.List):
            for element in node.args[0].elts:
                text, complete = self.string_prefix(element)
                if text and complete:
                    self._tool(node, text, "langchain", None)
        elif last in self.known_tools:
            self._tool(node, last, "catalogue", last)

    def _add_tool(self, node: ast.Call) -> None:
        args = list(node.args)
        name_node = self._kw(node, "name", "tool_name")
        func = self._kw(node, "func", "fn", "function", "tool", "handler")
        if args and self.string_prefix(args[0])[0] is not None:
            name_node = name_node or args.pop(0)
        if args and func is None:
            func = args[0]
        self._named_tool(node, "agent", func, name_node)

    def _tool_constructor(self, node: ast.Call, name: str) -> None:
        framework = _framework(name)
        func = self._kw(node, "func", "fn", "coroutine")
        name_node = self._kw(node, "name")
        if node.args:
            first = node.args[0]
            if self.string_prefix(first)[0] is not None:
                name_node = name_node or first
            elif func is None:
                func = first
        if framework == "unknown":
            framework = (
                "autogen" if name.endswith("FunctionTool") and "llama" not in name else "langchain"
            )
            if name.endswith("from_defaults"):
                framework = "llamaindex"
        self._named_tool(node, framework, func, name_node)

    def _named_tool(
        self, node: ast.AST, framework: str, func: ast.expr | None, name_node: ast.expr | None
    ) -> None:
        target = _callable_name(func)
        name = self.string_prefix(name_node)[0] if name_node is not None else None
        name = name or target
        if name:
            self._tool(node, name, framework, target)

    def _decorator_tool(
        self, decorator: ast.expr, func: ast.FunctionDef | ast.AsyncFunctionDef
    ) -> None:
        call = decorator if isinstance(decorator, ast.Call) else None
        qualname = self.qualname(call.func if call else decorator) or ""
        last = qualname.rsplit(".", 1)[-1]
        if not (last.endswith("tool") or last == "register_for_llm"):
            return
        name = func.name
        if call is not None:
            name_node = self._kw(call, "name") or (call.args[0] if call.args else None)
            text = self.string_prefix(name_node)[0] if name_node is not None else None
            name = text or name
        framework = "autogen" if last == "register_for_llm" else _framework(qualname)
        self._tool(decorator, name, "decorator" if framework == "unknown" else framework, func.name)

    def _class_tool(self, node: ast.ClassDef) -> None:
        bases = [self.qualname(b) or "" for b in node.bases]
        tool_base = next((b for b in bases if b.rsplit(".", 1)[-1] == "BaseTool"), None)
        if tool_base is None:
            return
        name = node.name
        for statement in node.body:
            target: ast.expr | None = None
            if isinstance(statement, ast.AnnAssign):
                target = statement.target
            elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                target = statement.targets[0]
            value = getattr(statement, "value", None)
            if isinstance(target, ast.Name) and target.id == "name" and value is not None:
                name = self.string_prefix(value)[0] or name
        framework = _framework(tool_base)
        self._tool(node, name, "crewai" if framework == "unknown" else framework, node.name)


def _framework(qualname: str) -> str:
    top = qualname.split(".", 1)[0]
    for prefix, framework in (
        ("langchain", "langchain"),
        ("llama_index", "llamaindex"),
        ("crewai", "crewai"),
        ("autogen", "autogen"),
    ):
        if top.startswith(prefix):
            return framework
    return "unknown"


def _callable_name(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _callable_name(node.func)
    return None
