#!/usr/bin/env bash
# Debian packages the project needs beyond Python: Prometheus (embedded stack), bubblewrap
# (sandbox benchmark peer). Fast no-op when already installed.
set -euo pipefail
pkgs=(prometheus bubblewrap)
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
