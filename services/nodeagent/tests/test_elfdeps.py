"""Shared-library discovery without running the loader (``dsec_nodeagent.sandbox.elfdeps``).

The runtime's closure must be the loader's (``ldd``'s) answer; a built environment's files are a
tenant's, so nothing they name may add a host directory outside the system's library
directories to the sandbox's view, and a malformed file must cost nothing but itself.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsec_nodeagent.sandbox import discovery, elfdeps

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the helper
from _mkelf import mkelf

CC = shutil.which("cc") or shutil.which("gcc")


def _cc(*args: str) -> None:
    assert CC, "a C compiler (the project's extensions need one too)"
    subprocess.run([CC, *args], check=True, capture_output=True)


def _lib(path: Path, *link: str, calls: tuple[str, ...] = (), defines: str = "f") -> Path:
    """A shared library at ``path`` defining ``defines()`` and calling each of ``calls()`` (so
    the linker keeps what they come from: Debian links ``--as-needed``), linked with ``link``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.with_suffix(".c")
    body = "".join(f"{c}();" for c in calls)
    decls = "".join(f"extern const char *{c}(void);" for c in calls)
    src.write_text(f"{decls}\nint {defines}(void) {{ {body} return 1; }}\n")
    _cc("-shared", "-fPIC", "-o", str(path), str(src), *link)
    src.unlink()
    return path


def _real(paths: set[str]) -> set[str]:
    return {os.path.realpath(p) for p in paths}


def test_the_runtimes_libraries_are_the_loaders_answer_without_running_it() -> None:
    info = discovery._probe(Path(sys.executable))
    files = [str(info["executable"]), *discovery._elf_files(Path(str(info["dynload"])))]
    resolver = elfdeps.Resolver()
    found = resolver.closure(files)
    assert resolver.unresolved == []
    assert _real(found) == _real(discovery._ldd(files))
    assert any(os.path.basename(p).startswith("libc.so") for p in found)


def test_an_environments_library_finds_its_own_and_the_systems(tmp_path: Path) -> None:
    env = tmp_path / "env"
    # a vendored library named by its SONAME, found through $ORIGIN, as auditwheel writes them
    vendored = _lib(
        env / "pkg.libs" / "libvendored.so",
        "-Wl,-soname,libvendored.so",
        "-lz",
        calls=("zlibVersion",),
        defines="vendored",
    )
    ext = _lib(
        env / "pkg" / "ext.so",
        str(vendored),
        "-Wl,-rpath,$ORIGIN/../pkg.libs",
        "-Wl,--enable-new-dtags",
        calls=("vendored",),
    )
    resolver = elfdeps.Resolver()
    found = resolver.closure([str(ext)], tree=str(env.resolve()))
    assert resolver.unresolved == []
    assert os.path.realpath(vendored) in _real(found)
    assert any(os.path.basename(p).startswith("libz.so") for p in found)  # the system's
    assert _real(found) == _real(discovery._ldd([str(ext)]))


def test_a_tenants_library_cannot_steer_a_host_directory_into_the_view(tmp_path: Path) -> None:
    host = tmp_path / "host-secrets"  # a host directory holding a loadable library
    secret = _lib(host / "libsecret.so", "-Wl,-soname,libsecret.so", defines="secret")
    other = _lib(host / "libother.so", defines="other")  # no SONAME: DT_NEEDED is its path
    env = tmp_path / "env"
    (env / "pkg").mkdir(parents=True)
    (env / "pkg" / "lnk").symlink_to(host)  # a search path inside the tree that leads out
    evil = _lib(
        env / "pkg" / "evil.so",
        str(secret),
        str(other),
        f"-Wl,-rpath,{host}:$ORIGIN/lnk",
        "-Wl,--enable-new-dtags",
        calls=("secret", "other"),
    )
    # (the loader, run on it, follows all of that: what discovery did before)
    assert {str(secret), str(other)} <= _real(discovery._ldd([str(evil)]))
    resolver = elfdeps.Resolver()
    found = resolver.closure([str(evil)], tree=str(env.resolve()))
    assert not any(str(host) in p for p in _real(found))
    assert {name for _, _, name in resolver.unresolved} == {"libsecret.so", str(other)}
    view = discovery.discover(Path(sys.executable), [env])
    assert not any(str(host) in d for d in [*view.ro_dirs, *view.ro_files])


def test_a_program_in_an_environment_names_no_loader_of_its_own(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.mkdir()
    src = tmp_path / "main.c"
    src.write_text("int main(void) { return 0; }\n")
    program = env / "tool.so"  # (discovery reads every *.so* of a tree)
    _cc("-o", str(program), str(src), f"-Wl,--dynamic-linker={tmp_path}/loader/ld.so")
    info = elfdeps.read_dynamic(str(program))
    assert info is not None and info.interp == f"{tmp_path}/loader/ld.so"
    assert not any("loader" in p for p in elfdeps.Resolver().closure([str(program)], tree=str(env)))
    trusted = elfdeps.Resolver().closure([str(program)])
    assert f"{tmp_path}/loader/ld.so" in trusted  # the node's own program: followed


def test_a_library_of_another_kind_does_not_satisfy_a_need(tmp_path: Path) -> None:
    env = tmp_path / "env"
    lib = _lib(env / "libs" / "libk.so", "-Wl,-soname,libk.so", defines="k")
    ext = _lib(
        env / "ext.so",
        str(lib),
        "-Wl,-rpath,$ORIGIN/libs",
        "-Wl,--enable-new-dtags",
        calls=("k",),
    )
    data = bytearray(lib.read_bytes())
    data[18:20] = struct.pack("<H", 183)  # e_machine: aarch64
    lib.write_bytes(bytes(data))
    resolver = elfdeps.Resolver()
    assert os.path.realpath(lib) not in _real(resolver.closure([str(ext)], tree=str(env)))
    assert "libk.so" in {name for _, _, name in resolver.unresolved}


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:40],  # truncated in the header
        lambda b: b[:56] + struct.pack("<H", 65535) + b[58:],  # e_phnum past the file
        lambda b: b[:32] + struct.pack("<Q", 1 << 60) + b[40:],  # e_phoff far away
        lambda b: b"\x7fELF" + bytes([9]) + b[5:],  # no such class
        lambda b: b"not an ELF file at all, but named .so" * 4,
        lambda b: b"",
    ],
)
def test_a_malformed_file_needs_nothing_and_raises_nothing(tmp_path: Path, mangle: object) -> None:
    good = _lib(tmp_path / "good.so", "-lz", calls=("zlibVersion",))
    bad = tmp_path / "bad.so"
    bad.write_bytes(mangle(good.read_bytes()))  # type: ignore[operator]
    assert elfdeps.read_dynamic(str(bad)) is None
    assert elfdeps.Resolver().closure([str(bad)], tree=str(tmp_path)) == set()


def test_a_string_table_pointing_outside_the_file_is_refused(tmp_path: Path) -> None:
    lib = _lib(tmp_path / "lib.so", "-lz", calls=("zlibVersion",))
    info = elfdeps.read_dynamic(str(lib))
    assert info is not None and any(n.startswith("libz.so") for n in info.needed)
    data = bytearray(lib.read_bytes())
    # every DT_STRTAB's value moved past the end of the file (64-bit little-endian entries)
    tag = struct.pack("<q", elfdeps.DT_STRTAB)
    at = data.find(tag)
    while at >= 0:
        if at % 8 == 0:
            data[at + 8 : at + 16] = struct.pack("<Q", 1 << 40)
        at = data.find(tag, at + 1)
    lib.write_bytes(bytes(data))
    assert elfdeps.read_dynamic(str(lib)) is None


def test_a_symlink_and_dotdots_inside_an_environment_do_not_show_the_hosts_root(
    tmp_path: Path,
) -> None:
    env = tmp_path / "env"
    pkg = env / "pkg"
    (env / "a/b/c/d/e/f/g/h/i/j").mkdir(parents=True)
    pkg.mkdir()
    (pkg / "s").symlink_to("../a/b/c/d/e/f/g/h/i/j")
    # by the kernel, pkg/l is the tree's own root; read as text after the link, it is "/"
    (pkg / "l").symlink_to("s/" + "/".join([".."] * 10))
    assert os.path.realpath(pkg / "l") == str(env)
    _lib(env / "libq.so", "-Wl,-soname,libq.so", defines="q")
    _lib(pkg / "ext.so", str(env / "libq.so"), "-Wl,-rpath,$ORIGIN/l", calls=("q",))
    view = discovery.discover(Path(sys.executable), [env])
    assert "/" not in view.ro_dirs
    assert all(d == "/" or not str(env).startswith(d + "/") for d in view.ro_dirs)
    real, links = discovery.resolve_chain(str(pkg / "l" / "libq.so"))
    assert real == os.path.realpath(pkg / "l" / "libq.so") == str(env / "libq.so")
    assert (str(pkg / "l"), "s/" + "/".join([".."] * 10)) in links


def test_a_file_that_names_too_much_needs_nothing_and_a_tree_past_the_budget_is_refused(
    tmp_path: Path,
) -> None:
    names = [f"-Wl,--no-as-needed,-l:libx{i}.so" for i in range(elfdeps.MAX_NEEDED + 1)]
    libs = tmp_path / "libs"
    libs.mkdir()
    for i in range(elfdeps.MAX_NEEDED + 1):
        _lib(libs / f"libx{i}.so", f"-Wl,-soname,libx{i}.so", defines=f"x{i}")
    many = _lib(tmp_path / "many.so", f"-L{libs}", *names)
    assert elfdeps.read_dynamic(str(many)) is None  # (the loader's real files name a few dozen)
    env = tmp_path / "env"
    for i in range(20):
        _lib(env / f"m{i}.so", "-lz", calls=("zlibVersion",), defines=f"m{i}")
    with pytest.raises(elfdeps.BudgetExceeded):
        elfdeps.Resolver(max_lookups=1).closure(discovery._elf_files(env), tree=str(env))
    with pytest.raises(elfdeps.BudgetExceeded):
        elfdeps.Resolver(max_files=5).closure(discovery._elf_files(env), tree=str(env))


def test_a_tenants_need_found_through_a_link_in_a_system_directory_is_refused(
    tmp_path: Path,
) -> None:
    system, elsewhere, env = tmp_path / "sys", tmp_path / "bin", tmp_path / "env"
    _lib(system / "libok.so", "-Wl,-soname,libok.so", defines="ok")
    _lib(elsewhere / "libtool.so", "-Wl,-soname,libtool.so", defines="tool")
    (system / "libtool.so").symlink_to(elsewhere / "libtool.so")  # like /usr/lib/cpp
    _lib(env / "ext.so", str(system / "libok.so"), str(elsewhere / "libtool.so"))
    ext = _lib(
        env / "ext.so",
        f"-L{system}",
        "-l:libok.so",
        f"-L{elsewhere}",
        "-l:libtool.so",
        calls=("ok", "tool"),
    )
    resolver = elfdeps.Resolver(cache={})
    resolver.system = (str(system),)
    found = resolver.closure([str(ext)], tree=str(env))
    assert found == {str(system / "libok.so")}
    assert [name for _, _, name in resolver.unresolved] == ["libtool.so"]
    trusted = elfdeps.Resolver(cache={})
    trusted.system = (str(system),)
    assert str(system / "libtool.so") in trusted.closure([str(ext)])  # the node's own: as ld.so


def test_a_candidate_outside_the_tree_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_text("not a library, and not the tenant's to read")
    env = tmp_path / "env"
    env.mkdir()
    (env / "libx.so").symlink_to(host / "secret")
    ext = _lib(env / "ext.so", "-Wl,-rpath,$ORIGIN", "-Wl,--enable-new-dtags")
    info = elfdeps.read_dynamic(str(ext))
    assert info is not None
    opened: list[str] = []
    real_read = elfdeps.read_dynamic

    def spy(path: str) -> elfdeps.Dynamic | None:
        opened.append(os.path.realpath(path))
        return real_read(path)

    monkeypatch.setattr(elfdeps, "read_dynamic", spy)
    forged = elfdeps.Dynamic(info.kind, True, ("libx.so",), (), (str(env),))
    resolver = elfdeps.Resolver(cache={})
    assert resolver._resolve("libx.so", forged, ((str(env), str(env)),), str(env)) is None
    assert str(host / "secret") not in opened


def test_a_trusted_programs_rpath_serves_the_libraries_it_loads(tmp_path: Path) -> None:
    x, y = tmp_path / "x", tmp_path / "y"
    libb = _lib(y / "libB.so", "-Wl,-soname,libB.so", defines="b")
    liba = _lib(x / "libA.so", "-Wl,-soname,libA.so", str(libb), calls=("b",), defines="a")
    src = tmp_path / "main.c"
    src.write_text("int a(void); int main(void) { return a(); }\n")
    program = tmp_path / "program"
    _cc(
        "-o",
        str(program),
        str(src),
        str(liba),
        f"-Wl,-rpath,{x}:{y}",
        "-Wl,--disable-new-dtags",
        "-Wl,--allow-shlib-undefined",
    )
    resolver = elfdeps.Resolver()
    found = resolver.closure([str(program)])
    assert {str(x / "libA.so"), str(y / "libB.so")} <= found
    assert _real(found) >= _real(discovery._ldd([str(program)])) - {"linux-vdso.so.1"}
    assert resolver.unresolved == []


def test_resolve_chain_goes_up_from_where_a_link_led(tmp_path: Path) -> None:
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "er")
    real, links = discovery.resolve_chain(f"{tmp_path}/link/../x")
    assert real == os.path.realpath(f"{tmp_path}/link/../x") == f"{tmp_path}/deep/x"
    assert links == [(f"{tmp_path}/link", str(tmp_path / "deep" / "er"))]


def test_a_tenants_file_loaded_by_a_system_library_stays_the_tenants(tmp_path: Path) -> None:
    # e.so's RPATH is inherited by the system's libz, whose libc.so.6 the loader then finds in
    # the environment: that file is the tenant's, whoever asked for it (its PT_INTERP "/" once
    # bound the host's root)
    env = tmp_path / "env"
    (env / "a").mkdir(parents=True)
    (env / "z").mkdir()
    (env / "z" / "e.so").write_bytes(mkelf(["libz.so.1"], rpath="$ORIGIN/../a"))
    (env / "a" / "libc.so.6").write_bytes(mkelf(["/etc/passwd"], interp="/", runpath="/etc"))
    view = discovery.discover(Path(sys.executable), [env])
    for path in [*view.ro_dirs, *view.ro_files, *(link for link, _ in view.symlinks)]:
        assert path != "/" and not path.startswith("/etc/passwd"), path
    assert "/etc" not in view.ro_dirs


def test_search_paths_along_a_chain_are_counted_and_links_resolved_by_the_kernel(
    tmp_path: Path,
) -> None:
    env = tmp_path / "env"
    env.mkdir()
    chain = env / "l0"
    chain.mkdir()
    for i in range(1, 60):  # a chain of links past the kernel's 40: no Python recursion
        (env / f"l{i}").symlink_to(f"l{i - 1}")
    (env / "ext.so").write_bytes(mkelf(["libnope.so"], runpath="$ORIGIN/l59"))
    assert elfdeps.real_path(str(env / "l59")) is None  # ELOOP: nothing found there
    assert elfdeps.Resolver().closure([str(env / "ext.so")], tree=str(env)) == set()
    # a long chain of libraries, each with search paths of its own: bounded work
    for i in range(40):
        rpath = ":".join(["$ORIGIN", *(f"$ORIGIN/d{i}-{j}" for j in range(30))])
        need = [f"libc{i + 1}.so"] if i < 39 else []
        (env / f"libc{i}.so").write_bytes(mkelf(need, rpath=rpath))
    with pytest.raises(elfdeps.BudgetExceeded):
        elfdeps.Resolver(max_lookups=500).closure([str(env / "libc0.so")], tree=str(env))
