#!/usr/bin/env bash
# Prepare this machine for the node agent's eBPF egress hooks (see docs/architecture.md):
#   1. Debian packages: BCC (python3-bpfcc, libbpfcc, bpfcc-tools), bpftool, kernel headers.
#   2. Header shim: the running kernel ships no headers, so /lib/modules/$(uname -r)/{build,source}
#      point at the nearest Debian header package (safe: our programs read UAPI contexts only).
#   3. bpffs mounted at /sys/fs/bpf (maps are pinned under /sys/fs/bpf/dsec/).
#   4. A .pth in the uv venv naming a directory that holds only `bcc -> Debian's bcc`, so the venv
#      sees BCC without the rest of Debian's dist-packages.
# Idempotent: a fast no-op when everything is already in place. Needs root for steps 1-3.
# Environment: DSEC_VENV (default: <repo>/.venv).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSEC_VENV:-$REPO/.venv}"
BCC_SRC=/usr/lib/python3/dist-packages/bcc
PACKAGES=(python3-bpfcc libbpfcc bpfcc-tools bpftool)
KREL="$(uname -r)"

log() { echo "setup-kernel: $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
  [[ $EUID -eq 0 ]] || die "$1 needs root (run as root, e.g. sudo $0)"
}

pkg_installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}

# Newest Debian generic amd64 header tree (not -cloud/-rt), e.g. /usr/src/linux-headers-6.1.0-57-amd64.
newest_headers() {
  local d best=""
  while IFS= read -r d; do
    [[ -d $d && -d "${d%-amd64}-common" ]] && best="$d"
  done < <(compgen -G '/usr/src/linux-headers-*-amd64' | grep -vE -- '-(cloud|rt)-amd64$' | sort -V)
  printf '%s' "$best"
}

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do pkg_installed "$p" || missing+=("$p"); done
  [[ -n "$(newest_headers)" ]] || missing+=(linux-headers-amd64)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  need_root "installing ${missing[*]}"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

header_shim() {
  local mod="/lib/modules/$KREL" hdr
  # Real headers for this kernel (or a shim already made) are left alone.
  [[ -e "$mod/build/Makefile" ]] && return 0
  hdr="$(newest_headers)"
  [[ -n $hdr ]] || die "no /usr/src/linux-headers-*-amd64 after install"
  need_root "linking $mod/build"
  mkdir -p "$mod"
  ln -sfn "$hdr" "$mod/build"
  ln -sfn "${hdr%-amd64}-common" "$mod/source"
  log "linked $mod/build -> $hdr"
}

mount_bpffs() {
  [[ "$(stat -f -c %T /sys/fs/bpf 2>/dev/null || true)" == bpf_fs ]] && return 0
  need_root "mounting bpffs"
  mount -t bpf bpf /sys/fs/bpf
  log "mounted bpffs at /sys/fs/bpf"
}

venv_pth() {
  [[ -x "$VENV/bin/python" ]] || die "no virtualenv at $VENV (run 'uv sync' first or set DSEC_VENV)"
  [[ -d $BCC_SRC ]] || die "$BCC_SRC missing (python3-bpfcc not installed?)"
  local site dir="$VENV/dsec-bcc"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [[ "$(readlink "$dir/bcc" 2>/dev/null || true)" != "$BCC_SRC" ]]; then
    mkdir -p "$dir"
    ln -sfn "$BCC_SRC" "$dir/bcc"
  fi
  if [[ "$(cat "$site/dsec_bcc.pth" 2>/dev/null || true)" != "$dir" ]]; then
    printf '%s\n' "$dir" >"$site/dsec_bcc.pth"
    log "wrote $site/dsec_bcc.pth"
  fi
  "$VENV/bin/python" -c 'import bcc' || die "the venv still cannot import bcc"
}

install_packages
header_shim
mount_bpffs
venv_pth
