#!/usr/bin/env bash
# Debian packages the project needs beyond Python: Prometheus (embedded stack), bubblewrap
# (sandbox benchmark peer), a C compiler (the SDK's ring extension), libseccomp2 (the node agent
# reads syscall numbers from its tables), Node.js (the wire-contract test's verifier, written
# without DSec code: tests/wire_verifier). Fast no-op when already installed.
set -euo pipefail
# gcc + libc headers build the SDK's ring extension (dsec_sdk.ipc._fastring), which also needs the
# interpreter's own headers (Debian's python3.X-dev when Python came from apt).
pkgs=(prometheus bubblewrap gcc libc6-dev libseccomp2)
command -v node >/dev/null 2>&1 || pkgs+=(nodejs)  # any Node.js >= 18 will do
py=$(command -v python3.11 || command -v python3 || true)
if [ -n "$py" ]; then
  inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
  ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null || true)
  if [ -n "$inc" ] && [ ! -f "$inc/Python.h" ] && [ -n "$ver" ]; then pkgs+=("python$ver-dev"); fi
fi
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-system: need root to install: ${missing[*]}" >&2; exit 1
  fi
  echo "setup-system: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian's package may start a system Prometheus on :9090; the stack runs its own.
  systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
