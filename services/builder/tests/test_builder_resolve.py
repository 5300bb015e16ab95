"""Resolution against the real package index (PyPI): locks, conflicts, alternatives, known-bad.

uv fetches only metadata here (no wheels), cached for the session, so these stay fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _dsec_builder_testkit import run_in_sandbox_python
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from dsec_builder.adapters.uv import Uv
from dsec_builder.builder import EnvironmentBuilder
from dsec_builder.domain import with_requirement
from dsec_builder.errors import ResolverUnavailableError
from dsec_builder.models import Conflict, Requirement, Resolved
from dsec_builder.resolver import Resolver

pytestmark = pytest.mark.integration

# The `dependencies` of the brief's example spec (shared/spec-examples/agent-train-sandbox.yaml).
BRIEF_EXAMPLE = [
    Requirement(name="transformers", specifier=">=4.40.0,<4.42.0", line=9),
    Requirement(name="langchain-core", specifier=">=0.2.0", line=11),
    Requirement(name="vllm", specifier="==0.6.1", line=13),
]


@pytest.fixture(scope="session")
def uv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uv-cache")


@pytest.fixture
def resolver(uv_cache: Path) -> Resolver:
    return Resolver(Uv(cache_dir=uv_cache), alternatives_budget_s=90)


def _version_of(outcome: Resolved, name: str) -> str:
    key = canonicalize_name(name)
    return next(p.version for p in outcome.lock.packages if canonicalize_name(p.name) == key)


@pytest.mark.slow
async def test_brief_example_is_blocked_with_alternatives_that_resolve(resolver: Resolver) -> None:
    outcome = await resolver.resolve(BRIEF_EXAMPLE)

    assert isinstance(outcome, Conflict), outcome
    assert outcome.kind == "unsatisfiable"
    assert outcome.summary == (
        "vllm==0.6.1 requires transformers>=4.43.2, "
        "but the spec asks for transformers>=4.40.0,<4.42.0."
    )
    assert set(outcome.packages) == {"vllm==0.6.1", "transformers>=4.40.0,<4.42.0"}
    offered = {a.requirement: a for a in outcome.alternatives}
    # The nearest transformers that vllm 0.6.1 accepts, pointing at the spec's line.
    assert offered["transformers>=4.43.2,<4.44"].line == 9
    older_vllm = [a for a in outcome.alternatives if a.requirement.startswith("vllm==")]
    assert older_vllm and Version(older_vllm[0].resolved_version) < Version("0.6.1")

    # Proof: each alternative, applied to the spec, resolves.
    for alternative in outcome.alternatives:
        change = Requirement.parse(alternative.requirement)
        proof = await resolver.resolve(with_requirement(BRIEF_EXAMPLE, change))
        assert isinstance(proof, Resolved), (alternative.requirement, proof)
        assert SpecifierSet(change.specifier).contains(_version_of(proof, change.name))


async def test_known_bad_combination_is_blocked_with_a_resolving_alternative(
    resolver: Resolver,
) -> None:
    spec = [Requirement(name="h5py", specifier="==3.10.0", line=4)]

    outcome = await resolver.resolve(spec)

    assert isinstance(outcome, Conflict), outcome
    assert outcome.kind == "known-bad"
    assert outcome.known_bad is not None and outcome.known_bad.rule_id == "numpy2-abi-h5py"
    assert "known to break at run time" in outcome.summary
    numpy_pin = next(a for a in outcome.alternatives if a.requirement == "numpy<2")
    assert numpy_pin.replaces is None  # added, not replacing anything the user wrote
    proof = await resolver.resolve([*spec, Requirement.parse("numpy<2")])
    assert isinstance(proof, Resolved)
    assert Version(_version_of(proof, "numpy")) < Version("2")


async def test_unknown_package_is_a_conflict_that_names_it(resolver: Resolver) -> None:
    outcome = await resolver.resolve([Requirement.parse("dsec-no-such-package-4f1c==1.0")])

    assert isinstance(outcome, Conflict)
    assert "dsec-no-such-package-4f1c is not in the package index." in outcome.summary
    assert outcome.alternatives == ()


async def test_unreachable_index_is_no_verdict(tmp_path: Path) -> None:
    uv = Uv(cache_dir=tmp_path, index_url="http://127.0.0.1:9/simple", http_retries=0)

    with pytest.raises(ResolverUnavailableError, match=r"127\.0\.0\.1:9"):
        await Resolver(uv).resolve([Requirement.parse("six")])


async def test_a_valid_spec_resolves_and_builds_a_usable_environment(
    resolver: Resolver, tmp_path: Path
) -> None:
    spec = [Requirement.parse("six==1.16.0"), Requirement.parse("idna>=3.6,<4")]

    outcome = await resolver.resolve(spec)

    assert isinstance(outcome, Resolved), outcome
    six = next(p for p in outcome.lock.packages if p.name == "six")
    assert six.filename == "six-1.16.0-py2.py3-none-any.whl"
    assert six.url.startswith("https://files.pythonhosted.org/")
    assert len(six.sha256) == 64
    builder = EnvironmentBuilder(tmp_path / "home", uv=resolver.uv)
    try:
        env = await builder.build(outcome.lock)
    finally:
        await builder.close()
    assert env.fingerprint == outcome.fingerprint and env.lock_hash == outcome.lock_hash
    assert env.bytes_from.index == sum(p.size or 0 for p in outcome.lock.packages)
    assert run_in_sandbox_python(env.path, "import six, idna; print(six.__version__)") == "1.16.0"
    assert (env.path / "six.py").stat().st_mode & 0o222 == 0
