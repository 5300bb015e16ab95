#!/usr/bin/env bash
# Check that DSec installs and works on other Python versions than the workspace's (3.11):
#
#     bash scripts/check-python.sh 3.12 3.13
#
# For each version: a throwaway venv under ${TMPDIR:-/tmp}, every workspace package installed
# from this checkout (the SDK's C extension compiled for that Python), every module of the
# libraries and services imported (BCC, a system package, is imported by the node agent only
# when it loads its programs: not checked), `dsec --version`, `dsec --help` and `dsec spec
# check` run, then the unit tests of the CLI, core, rules, snapstore and SDK (`-m unit`; no
# servers, no root). Needs the interpreter (pyenv, or one `uv python find` knows) and network
# access to PyPI (or a warm uv cache), so it is not part of the default test run. Exit status:
# the number of versions that failed.
set -uo pipefail

cd "$(dirname "$0")/.."
root=$(pwd)
failed=0
[ $# -eq 0 ] && set -- 3.12 3.13
for version in "$@"; do
    echo "=== Python $version"
    python=$(ls -d /root/.pyenv/versions/"$version"*/bin/python 2>/dev/null | tail -1)
    python=${python:-$(uv python find "$version" 2>/dev/null)}
    if [ -z "$python" ]; then
        echo "no Python $version here (pyenv install $version, or uv python install $version)"
        failed=$((failed + 1))
        continue
    fi
    venv="${TMPDIR:-/tmp}/dsec-py$version"
    rm -rf "$venv"
    packages=(libs/core libs/rules libs/snapstore libs/sdk libs/cli libs/testing)
    [ -d libs/client ] && packages+=(libs/client)
    packages+=(services/*/)
    if ! { uv venv -q -p "$python" "$venv" \
        && uv pip install -q --python "$venv" "${packages[@]}" \
            pytest==9.0.3 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 hypothesis==6.155.2; }; then
        echo "FAILED: install on Python $version"
        failed=$((failed + 1))
        continue
    fi
    home=$(mktemp -d)
    if DSEC_HOME="$home" "$venv/bin/python" - <<'EOF' \
        && DSEC_HOME="$home" "$venv/bin/dsec" --version \
        && DSEC_HOME="$home" "$venv/bin/dsec" --help >/dev/null \
        && DSEC_HOME="$home" "$venv/bin/dsec" spec check examples/eval-agent/dsec.yaml \
        && (cd "$root" && DSEC_HOME="$home" "$venv/bin/python" -m pytest -q -m unit -p no:cacheprovider \
            --basetemp="$home/pytest" --rootdir="$root" -c "$root/pyproject.toml" \
            libs/cli/tests libs/core/tests libs/rules/tests libs/snapstore/tests libs/sdk/tests)
import importlib, pkgutil, sys

names = ["dsec_core", "dsec_rules", "dsec_snapstore", "dsec_sdk", "dsec_cli", "dsec_testing"]
names += ["dsec_policy", "dsec_builder", "dsec_snapshot", "dsec_scheduler", "dsec_nodeagent"]
names += ["dsec_fleetsim"]
count = 0
for package in map(importlib.import_module, names):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        count += 1
print(f"Python {sys.version.split()[0]}: imported {count} modules of the libraries and services")
EOF
    then
        echo "OK: Python $version"
    else
        echo "FAILED: Python $version"
        failed=$((failed + 1))
    fi
    rm -rf "$home"
done
exit "$failed"
