#!/usr/bin/env bash
# CRIU for the migration path `criu` (docs/migration.md). Idempotent: a fast no-op when a CRIU
# that works on this kernel is installed.
#   1. Debian packages: criu, iptables (CRIU's tools; the sandbox's network is never locked).
#   2. When `criu check` fails with Debian's CRIU (3.17 cannot parse the [vvar_vclock] mapping of
#      kernels >= 6.13), a newer CRIU (>= 4.1 knows that mapping) is built from its upstream
#      source with one patch (scripts/criu/rlimits-from-proc.patch: read another user's rlimits
#      from /proc/<pid>/limits where prlimit64 needs CAP_SYS_RESOURCE, which containers often
#      drop) and installed as /usr/local/sbin/criu (found before /usr/sbin/criu; DSEC_CRIU
#      overrides both). The source comes from, in order: CRIU_TARBALL (a local tarball); the
#      Debian archive's newer suite (CRIU_DEBIAN_SUITE, default trixie: its upstream .orig
#      tarball, checked against the archive's SHA-256, read through a private apt list so the
#      machine's own sources stay as they are); github.com's release CRIU_VERSION (default 4.2).
# Needs root. Environment: CRIU_TARBALL, CRIU_DEBIAN_SUITE, DEBIAN_MIRROR
# (default http://deb.debian.org/debian), CRIU_VERSION.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${CRIU_VERSION:-4.2}"
PACKAGES=(criu iptables)
BUILD_DEPS=(build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler
  protobuf-compiler python3-protobuf libnl-3-dev libnl-route-3-dev libcap-dev libnet1-dev
  libbsd-dev libaio-dev libnftables-dev libgnutls28-dev uuid-dev xz-utils)

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

command -v dpkg-query >/dev/null 2>&1 || { log "not Debian: install CRIU >= 4.1 yourself"; exit 0; }
install_packages "${PACKAGES[@]}"
if [[ -x /usr/local/sbin/criu ]] && works /usr/local/sbin/criu; then exit 0; fi
if works /usr/sbin/criu; then exit 0; fi
log "Debian's CRIU cannot run on kernel $(uname -r); building a newer CRIU from source"
install_packages "${BUILD_DEPS[@]}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# CRIU's upstream tarball from the Debian archive's newer suite, verified by its SHA-256; prints
# its path, or fails quietly (the caller then tries github.com).
debian_tarball() {
  local suite="${CRIU_DEBIAN_SUITE:-trixie}" mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  local apt="$work/apt" line url name sum
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
  echo "deb-src $mirror $suite main" > "$apt/sources.list"
  local opts=(-o Dir::Etc::sourcelist="$apt/sources.list" -o Dir::Etc::sourceparts=/dev/null
    -o Dir::State::Lists="$apt/lists" -o Dir::Cache="$apt/cache")
  apt-get "${opts[@]}" update -qq >/dev/null 2>&1 || return 1
  line="$(apt-get "${opts[@]}" source --print-uris criu 2>/dev/null \
    | grep -E "\.orig\.tar\.(xz|gz|bz2)' " | head -1)" || return 1
  url="$(cut -d"'" -f2 <<<"$line")"
  name="$(awk '{print $2}' <<<"$line")"
  sum="$(grep -oE 'SHA256:[0-9a-f]{64}' <<<"$line" | cut -d: -f2)"
  [[ -n "$url" && -n "$sum" ]] || return 1
  curl -fsSL --max-time 120 -o "$work/$name" "$url" || return 1
  echo "$sum  $work/$name" | sha256sum -c --quiet - >/dev/null 2>&1 \
    || { log "warning: $name does not match the archive's SHA-256"; return 1; }
  log "source: $url (Debian $suite)"
  echo "$work/$name"
}

# The source is unpacked into its own directory (the apt lists of a failed Debian attempt stay
# beside it in $work, never mistaken for it).
unpacked="$work/src"
mkdir "$unpacked"
if [[ -n "${CRIU_TARBALL:-}" ]]; then
  [[ -f "$CRIU_TARBALL" ]] || die "CRIU_TARBALL=$CRIU_TARBALL: no such file (a CRIU source tarball: .tar.gz, .tar.xz)"
  tar -xf "$CRIU_TARBALL" -C "$unpacked" || die "CRIU_TARBALL=$CRIU_TARBALL: not a tar archive tar can read"
elif tarball="$(debian_tarball)"; then
  tar -xf "$tarball" -C "$unpacked"
elif ! curl -fsSL --max-time 120 \
    "https://github.com/checkpoint-restore/criu/archive/refs/tags/v$VERSION.tar.gz" \
    | tar -xz -C "$unpacked"; then
  # Not fatal: everything but the migration path `criu` works without it (and says so).
  log "warning: could not download CRIU's source from the Debian archive or github.com; the"
  log "migration path criu will refuse with 'CRIU unusable'. Fetch a tarball elsewhere and run:"
  log "  CRIU_TARBALL=criu-$VERSION.tar.gz bash scripts/setup-criu.sh"
  exit 0
fi
src="$(find "$unpacked" -maxdepth 1 -mindepth 1 -type d | head -1)"
[[ -n "$src" && -f "$src/Makefile" ]] || die "the tarball holds no CRIU source tree (a top directory with a Makefile)"
patch -s -d "$src" -p1 < "$REPO/scripts/criu/rlimits-from-proc.patch"
make -C "$src" -j"$(nproc)" criu >/dev/null
install -m 755 "$src/criu/criu" /usr/local/sbin/criu
works /usr/local/sbin/criu || die "the CRIU built still fails 'criu check': $(/usr/local/sbin/criu check 2>&1 | tail -2)"
log "installed /usr/local/sbin/criu ($(/usr/local/sbin/criu --version | head -1))"
