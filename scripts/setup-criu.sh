#!/usr/bin/env bash
# CRIU for the migration path `criu` (docs/migration.md). Idempotent: a fast no-op when a CRIU
# that works on this kernel is installed.
#   1. Debian packages: criu, iptables (CRIU's tools; the sandbox's network is never locked).
#   2. When `criu check` fails with Debian's CRIU (3.17 cannot parse the [vvar_vclock] mapping of
#      kernels >= 6.13), CRIU v4.2 is built from its release tarball with one patch
#      (scripts/criu/rlimits-from-proc.patch: read another user's rlimits from /proc/<pid>/limits
#      where prlimit64 needs CAP_SYS_RESOURCE, which containers often drop) and installed as
#      /usr/local/sbin/criu (found before /usr/sbin/criu; DSEC_CRIU overrides both).
# Needs root. Environment: CRIU_VERSION (default 4.2), CRIU_TARBALL (a local tarball instead of
# the download).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${CRIU_VERSION:-4.2}"
PACKAGES=(criu iptables)
BUILD_DEPS=(build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler
  protobuf-compiler python3-protobuf libnl-3-dev libnl-route-3-dev libcap-dev libnet1-dev
  libbsd-dev libaio-dev libnftables-dev libgnutls28-dev uuid-dev)

log() { echo "setup-criu: $*" >&2; }
die() { log "error: $*"; exit 1; }

pkg_installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}

install_packages() {
  local missing=() p
  for p in "$@"; do pkg_installed "$p" || missing+=("$p"); done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ $EUID -eq 0 ]] || die "installing ${missing[*]} needs root"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

works() { "$1" check >/dev/null 2>&1; }

command -v dpkg-query >/dev/null 2>&1 || { log "not Debian: install CRIU >= 4.2 yourself"; exit 0; }
install_packages "${PACKAGES[@]}"
if [[ -x /usr/local/sbin/criu ]] && works /usr/local/sbin/criu; then exit 0; fi
if works /usr/sbin/criu; then exit 0; fi
log "Debian's CRIU cannot run on kernel $(uname -r); building CRIU v$VERSION"
install_packages "${BUILD_DEPS[@]}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [[ -n "${CRIU_TARBALL:-}" ]]; then
  tar -xzf "$CRIU_TARBALL" -C "$work"
elif ! curl -fsSL --max-time 120 \
    "https://github.com/checkpoint-restore/criu/archive/refs/tags/v$VERSION.tar.gz" \
    | tar -xz -C "$work"; then
  # Not fatal: everything but the migration path `criu` works without it (and says so).
  log "warning: could not download CRIU v$VERSION from github.com; the migration path criu"
  log "will refuse with 'CRIU unusable'. Fetch the tarball elsewhere and run:"
  log "  CRIU_TARBALL=criu-$VERSION.tar.gz bash scripts/setup-criu.sh"
  exit 0
fi
src="$(find "$work" -maxdepth 1 -mindepth 1 -type d | head -1)"
patch -d "$src" -p1 < "$REPO/scripts/criu/rlimits-from-proc.patch"
make -C "$src" -j"$(nproc)" criu >/dev/null
install -m 755 "$src/criu/criu" /usr/local/sbin/criu
works /usr/local/sbin/criu || die "the CRIU built still fails 'criu check': $(/usr/local/sbin/criu check 2>&1 | tail -2)"
log "installed /usr/local/sbin/criu ($(/usr/local/sbin/criu --version | head -1))"
