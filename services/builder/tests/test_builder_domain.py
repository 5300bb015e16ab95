"""Pure decisions of the builder: hashing, locks, conflict wording, alternatives, known-bad."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from dsec_builder.domain import (
    LockFormatError,
    clean_resolver_output,
    conflicting_requirements,
    fingerprint,
    is_pin,
    lock_hash,
    match_known_bad,
    parse_known_bad,
    parse_pylock,
    propose,
    redact_url,
    relaxations,
    summarize_conflict,
    with_requirement,
)
from dsec_builder.models import Lock, LockedPackage, Requirement, Target
from dsec_builder.resolver import load_known_bad

pytestmark = pytest.mark.unit

# uv 0.13.8's derivation for the brief's example spec, verbatim: as piped (what the resolver
# sees) and as drawn on a terminal.
EXAMPLE_STDERR = """\
error: No solution found when resolving dependencies
  cause: Because vllm==0.6.1 depends on transformers>=4.43.2 and you require transformers>=4.40.0,<4.42.0, we can conclude that your requirements and vllm==0.6.1 are incompatible.
         And because you require vllm==0.6.1, we can conclude that your requirements are unsatisfiable.
"""  # noqa: E501
EXAMPLE_STDERR_TTY = """\
  × No solution found when resolving dependencies:
  ╰─▶ Because vllm==0.6.1 depends on transformers>=4.43.2 and you require transformers>=4.40.0,<4.42.0, we can conclude that your requirements and vllm==0.6.1 are incompatible.
      And because you require vllm==0.6.1, we can conclude that your requirements are unsatisfiable.
"""  # noqa: E501

EXAMPLE = [
    Requirement(name="transformers", specifier=">=4.40.0,<4.42.0", line=10),
    Requirement(name="langchain-core", specifier=">=0.2.0", line=12),
    Requirement(name="vllm", specifier="==0.6.1", line=14),
]


def _pkg(name: str, version: str, sha: str = "a", url: str = "https://x/") -> LockedPackage:
    return LockedPackage(
        name=name,
        version=version,
        filename=f"{name}-{version}-py3-none-any.whl",
        url=url + f"{name}-{version}-py3-none-any.whl",
        sha256=sha * 64,
    )


# --------------------------------------------------------------------------- hashing


@given(st.permutations([_pkg("six", "1.16.0", "1"), _pkg("idna", "3.7", "2"), _pkg("a", "1", "3")]))
def test_lock_hash_and_fingerprint_ignore_package_order(order: list[LockedPackage]) -> None:
    reference = Lock(target=Target(), packages=(order[2], order[0], order[1]))
    shuffled = Lock(target=Target(), packages=tuple(order))
    assert lock_hash(shuffled) == lock_hash(reference)
    assert fingerprint(shuffled.packages) == fingerprint(reference.packages)


def test_lock_hash_ignores_mirror_urls_but_not_content_or_target() -> None:
    base = Lock(target=Target(), packages=(_pkg("six", "1.16.0"),))
    mirrored = Lock(target=Target(), packages=(_pkg("six", "1.16.0", url="https://mirror/"),))
    other_bytes = Lock(target=Target(), packages=(_pkg("six", "1.16.0", sha="b"),))
    other_target = Lock(target=Target(platform="x86_64-manylinux_2_17"), packages=base.packages)
    assert lock_hash(mirrored) == lock_hash(base)
    assert len({lock_hash(base), lock_hash(other_bytes), lock_hash(other_target)}) == 3
    assert fingerprint(other_target.packages) == fingerprint(base.packages)


# --------------------------------------------------------------------------- lock reading

PYLOCK_TEMPLATE = """
lock-version = "1.0"
created-by = "uv"

[[packages]]
name = "msgpack"
version = "1.1.0"
sdist = { url = "https://f/msgpack-1.1.0.tar.gz", size = 3, hashes = { sha256 = "%(s)s" } }
wheels = [
  { url = "https://f/msgpack-1.1.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", size = 1, hashes = { sha256 = "%(a)s" } },
  { url = "https://f/msgpack-1.1.0-cp311-cp311-manylinux_2_28_x86_64.whl", size = 2, hashes = { sha256 = "%(b)s" } },
  { url = "https://f/msgpack-1.1.0-cp312-cp312-manylinux_2_28_x86_64.whl", size = 2, hashes = { sha256 = "%(c)s" } },
]

[[packages]]
name = "tomli"
version = "2.0.1"
marker = "python_full_version < '3.11'"
wheels = [{ url = "https://f/tomli-2.0.1-py3-none-any.whl", hashes = { sha256 = "%(a)s" } }]

[[packages]]
name = "pyairports"
version = "0.0.1"
sdist = { url = "https://f/pyairports-0.0.1.tar.gz", hashes = { sha256 = "%(s)s" } }
"""  # noqa: E501
PYLOCK = (
    PYLOCK_TEMPLATE.replace("%(a)s", "a" * 64)
    .replace("%(b)s", "b" * 64)
    .replace("%(c)s", "c" * 64)
    .replace("%(s)s", "d" * 64)
)


def test_parse_pylock_picks_the_best_wheel_for_the_target_and_skips_other_pythons() -> None:
    lock = parse_pylock(PYLOCK, Target())
    by_name = {p.name: p for p in lock.packages}
    assert set(by_name) == {"msgpack", "pyairports"}  # tomli is only for Python < 3.11
    assert by_name["msgpack"].filename == "msgpack-1.1.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert by_name["msgpack"].sha256 == "b" * 64
    assert (by_name["pyairports"].kind, by_name["pyairports"].filename) == (
        "sdist",
        "pyairports-0.0.1.tar.gz",
    )


def test_parse_pylock_respects_an_older_glibc_floor() -> None:
    lock = parse_pylock(PYLOCK, Target(platform="x86_64-manylinux_2_17"))
    msgpack = next(p for p in lock.packages if p.name == "msgpack")
    assert "manylinux2014" in msgpack.filename


def test_parse_pylock_names_the_package_without_an_installable_artifact() -> None:
    text = """
[[packages]]
name = "onlymac"
version = "1.0"
wheels = [{ url = "https://f/onlymac-1.0-cp311-cp311-macosx_11_0_arm64.whl", hashes = { sha256 = "%s" } }]
""".replace("%s", "a" * 64)  # noqa: E501
    with pytest.raises(LockFormatError, match=r"onlymac==1\.0: no wheel for this platform"):
        parse_pylock(text, Target())


# --------------------------------------------------------------------------- conflicts


@pytest.mark.parametrize("stderr", [EXAMPLE_STDERR, EXAMPLE_STDERR_TTY])
def test_conflict_summary_says_who_requires_what_in_plain_words(stderr: str) -> None:
    output = clean_resolver_output(stderr)
    assert output.startswith("Because vllm==0.6.1 depends on transformers>=4.43.2")
    assert output.endswith("your requirements are unsatisfiable.")
    assert "╰─▶" not in output and "No solution found" not in output and "cause:" not in output
    assert summarize_conflict(output, EXAMPLE) == (
        "vllm==0.6.1 requires transformers>=4.43.2, "
        "but the spec asks for transformers>=4.40.0,<4.42.0."
    )


def test_conflicting_requirements_are_those_the_derivation_names() -> None:
    output = clean_resolver_output(EXAMPLE_STDERR)
    assert [r.name for r in conflicting_requirements(output, EXAMPLE)] == ["vllm", "transformers"]


def test_summary_of_a_missing_version_or_package() -> None:
    output = (
        "Because there is no version of numpy==99 and you require numpy==99, we can conclude "
        "that your requirements are unsatisfiable."
    )
    reqs = [Requirement.parse("numpy==99")]
    assert summarize_conflict(output, reqs) == "No released version matches numpy==99."
    output = "Because nosuchpkg was not found in the package registry and you require nosuchpkg"
    assert "nosuchpkg is not in the package index." in summarize_conflict(output, [])


# --------------------------------------------------------------------------- alternatives


def test_a_range_is_probed_just_above_and_just_below() -> None:
    newer, older = relaxations(EXAMPLE[0])
    assert (newer.direction, str(newer.probe), newer.lowest) == (
        "newer",
        "transformers>=4.42.0",
        True,
    )
    assert (older.direction, str(older.probe), older.lowest) == (
        "older",
        "transformers<4.40.0",
        False,
    )


def test_a_pin_is_probed_on_both_sides_and_proposed_as_a_pin() -> None:
    newer, older = relaxations(EXAMPLE[2])
    assert (str(newer.probe), str(older.probe)) == ("vllm>0.6.1", "vllm<0.6.1")
    assert is_pin(EXAMPLE[2])
    assert str(propose(older, "0.5.0.post1")) == "vllm==0.5.0.post1"


def test_proposals_contain_the_version_that_resolved() -> None:
    newer, older = relaxations(EXAMPLE[0])
    assert str(propose(newer, "4.43.2")) == "transformers>=4.43.2,<4.44"
    assert str(propose(older, "4.39.3")) == "transformers<=4.39.3"
    assert propose(newer, "4.43.2").line == 10


@pytest.mark.parametrize(
    ("specifier", "probes"),
    [
        ("~=1.4.2", ["pkg>=1.5", "pkg<1.4.2"]),
        ("==2.1.*", ["pkg>=2.2", "pkg<2.1"]),
        (">1.0,<=3", ["pkg>3", "pkg<=1.0"]),
        (">=2", ["pkg<2"]),
        ("", []),
    ],
)
def test_relaxation_bounds(specifier: str, probes: list[str]) -> None:
    requirement = Requirement(name="pkg", specifier=specifier)
    assert [str(r.probe) for r in relaxations(requirement)] == probes


def test_with_requirement_replaces_in_place_or_appends() -> None:
    replaced = with_requirement(EXAMPLE, Requirement.parse("VLLM==0.5.0"))
    assert [str(r) for r in replaced][2] == "VLLM==0.5.0" and replaced[2].line == 14
    added = with_requirement(EXAMPLE, Requirement.parse("numpy<2"))
    assert [str(r) for r in added][-1] == "numpy<2" and len(added) == 4


# --------------------------------------------------------------------------- known-bad


def test_known_bad_matches_only_when_every_condition_holds() -> None:
    rules = load_known_bad()
    bad = Lock(target=Target(), packages=(_pkg("h5py", "3.10.0"), _pkg("numpy", "2.1.0")))
    fine = Lock(target=Target(), packages=(_pkg("h5py", "3.10.0"), _pkg("numpy", "1.26.4")))
    hit = match_known_bad(bad, rules)
    assert hit is not None and hit.rule_id == "numpy2-abi-h5py"
    assert hit.matched == ("h5py==3.10.0", "numpy==2.1.0")
    assert match_known_bad(fine, rules) is None


def test_every_shipped_rule_offers_an_alternative() -> None:
    rules = load_known_bad()
    assert rules and all(rule.alternatives for rule in rules)


def test_a_malformed_rule_is_named() -> None:
    text = '[[rule]]\nid = "x"\nwhen = ["numpy>>2"]\nreason = "r"\nalternatives = []\n'
    with pytest.raises(ValueError, match=r"known_bad\.toml: rule #1 \('x'\).*numpy>>2"):
        parse_known_bad(text)


# --------------------------------------------------------------------------- input checks


def test_bad_requirements_name_the_field() -> None:
    with pytest.raises(ValidationError, match="invalid version specifier '>>1'"):
        Requirement(name="numpy", specifier=">>1")
    with pytest.raises(ValidationError, match="must be a bare name"):
        Requirement(name="numpy>=1")
    with pytest.raises(ValueError, match="invalid requirement"):
        Requirement.parse("not a requirement!")
    assert str(Requirement.parse("httpx[http2]>=0.27")) == "httpx[http2]>=0.27"


def test_credentials_are_redacted_from_index_urls() -> None:
    url = "https://user:s3cret@pypi.example.com:8443/simple/x.whl"
    assert redact_url(url) == "https://***@pypi.example.com:8443/simple/x.whl"
    assert redact_url("https://pypi.org/simple") == "https://pypi.org/simple"
