#!/usr/bin/env bash
# Container set-up for Belayer's sandbox backends on Debian 12 (see shared/notes/containers.md):
# Podman, Docker (docker.io, daemon NOT started here: tests start a private dockerd), runc,
# busybox-static, debootstrap, and CRIU >= 4.2 built from Debian sid's source package, because
# bookworm's CRIU 3.17 fails `criu check` on kernel 6.18 and trixie's 4.1 cannot dump AF_INET sockets.
# Idempotent: a re-run only checks. Exits non-zero on any failure.
#   BELAYER_CRIU_CACHE   where the built criu binary is cached (default /var/cache/belayer-criu)
#   BELAYER_CRIU_MIN     minimal acceptable CRIU version (default 4.2)
set -euo pipefail

CACHE=${BELAYER_CRIU_CACHE:-/var/cache/belayer-criu}
CRIU_MIN=${BELAYER_CRIU_MIN:-4.2}
CRIU_DST=/usr/local/sbin/criu
# The Debian mirror this machine's apt already uses (never a hard-coded host).
system_mirror() {
  local u
  u=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -1)
  [ -n "$u" ] || u=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                     | sed 's/\[[^]]*\] *//' | awk '{print $2}' | grep -v -- '-security' | head -1)
  printf '%s' "$u"
}
SID_MIRROR=${BELAYER_SID_MIRROR:-$(system_mirror)}
log() { printf '[setup_containers] %s\n' "$*"; }
die() { printf '[setup_containers] ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (installs packages and /usr/local/sbin/criu)"
command -v apt-get >/dev/null || die "needs apt-get (Debian)"
export DEBIAN_FRONTEND=noninteractive

# Another process may hold the dpkg lock; wait for it (bounded) instead of killing it.
apt_wait() {
  local i
  for i in $(seq 1 180); do
    if ! fuser /var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock >/dev/null 2>&1; then
      return 0
    fi
    [ "$i" = 1 ] && log "waiting for another apt/dpkg process to finish"
    sleep 2
  done
  die "apt/dpkg lock still held after 360 s"
}
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} = 0 ] && return 0
  log "installing: ${missing[*]}"
  apt_wait
  if ! apt-cache show "${missing[0]}" >/dev/null 2>&1; then apt-get update -q; fi
  apt_wait
  # policy-rc.d 101: do not start services (dockerd, containerd) on install; tests start their own.
  local prc=/usr/sbin/policy-rc.d had_prc=0
  [ -e "$prc" ] && had_prc=1
  if [ $had_prc = 0 ]; then printf '#!/bin/sh\nexit 101\n' > "$prc"; chmod +x "$prc"; fi
  local rc=0
  apt-get install -y -q --no-install-recommends "${missing[@]}" || rc=$?
  if [ $had_prc = 0 ]; then rm -f "$prc"; fi
  [ $rc = 0 ] || die "apt-get install failed (rc=$rc)"
}
ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
criu_version() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -1; }

# 1. runtime packages
apt_install ca-certificates psmisc podman runc docker.io containerd busybox-static debootstrap \
  zstd tar iptables uidmap fuse-overlayfs

# 2. CRIU >= CRIU_MIN
have=""
[ -x "$CRIU_DST" ] && have=$(criu_version "$CRIU_DST" || true)
if [ -n "$have" ] && ver_ge "$have" "$CRIU_MIN"; then
  log "criu $have already at $CRIU_DST"
else
  mkdir -p "$CACHE"
  cached=$(ls -1 "$CACHE"/criu-* 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$cached" ] && v=$(criu_version "$cached") && [ -n "$v" ] && ver_ge "$v" "$CRIU_MIN"; then
    log "installing cached $cached (criu $v)"
  else
    log "building CRIU >= $CRIU_MIN from Debian sid's source package"
    apt_install gcc make pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler \
      protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev \
      libgnutls28-dev libnftables-dev uuid-dev libaio-dev xz-utils
    work=$(mktemp -d /tmp/belayer-criu-build.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    # Private apt configuration: the system's sources.list stays untouched.
    mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
    [ -n "$SID_MIRROR" ] || die "no Debian mirror in this machine's apt sources: set BELAYER_SID_MIRROR"
    echo "deb-src [trusted=yes] $SID_MIRROR sid main" > "$work/apt/sources.list"
    aptopts=(-o "Dir::Etc::sourcelist=$work/apt/sources.list" -o "Dir::Etc::sourceparts=-"
             -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache"
             -o "APT::Get::List-Cleanup=0")
    apt-get "${aptopts[@]}" update -q >/dev/null || die "apt-get update of sid deb-src failed"
    # Only the orig tarball is needed; the debian tarball may 404, so tolerate a partial download.
    (cd "$work/src" && apt-get "${aptopts[@]}" source --download-only criu) || true
    orig=$(ls -1 "$work"/src/criu_*.orig.tar.* 2>/dev/null | head -1 || true)
    [ -n "$orig" ] || die "could not download criu orig tarball from sid"
    log "building from $(basename "$orig")"
    tar -C "$work/src" -xf "$orig"
    srcdir=$(find "$work/src" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' | head -1)
    [ -n "$srcdir" ] || die "unexpected layout of $orig"
    make -C "$srcdir" -j2 criu >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; die "criu build failed"; }
    v=$(criu_version "$srcdir/criu/criu")
    [ -n "$v" ] && ver_ge "$v" "$CRIU_MIN" || die "built criu reports version '$v' < $CRIU_MIN"
    cached="$CACHE/criu-$v"
    install -m 0755 "$srcdir/criu/criu" "$cached.tmp" && mv -f "$cached.tmp" "$cached"
    log "built criu $v, cached at $cached"
  fi
  install -m 0755 "$cached" "$CRIU_DST.tmp" && mv -f "$CRIU_DST.tmp" "$CRIU_DST"
fi
# runc and podman call `criu` from PATH; /usr/local/sbin precedes /usr/sbin in Debian's default PATH.
# bookworm's own criu package is not installed, so nothing shadows it.
"$CRIU_DST" check >/dev/null 2>&1 || { "$CRIU_DST" check >&2 || true; die "criu check failed"; }
log "criu $(criu_version "$CRIU_DST"): check ok"

# 3. rlimit workaround: the VM lacks CAP_SYS_RESOURCE, so podman's default rlimits make runc fail
# ("error setting rlimit type 7"). Belayer's Podman backend writes its own containers.conf too; this
# makes plain `podman` usable for people as well.
conf=/etc/containers/containers.conf
hn=$(ulimit -Hn)
if ! grep -q '^# belayer-ulimits' "$conf" 2>/dev/null; then
  if [ -s "$conf" ] && grep -q '^\[containers\]' "$conf"; then
    log "$conf already has a [containers] table; leaving it (Belayer sets CONTAINERS_CONF itself)"
  else
    mkdir -p /etc/containers
    { echo "# belayer-ulimits (written by .ci/setup_containers.sh)"
      echo "[containers]"
      echo "default_ulimits = [\"nofile=$hn:$hn\", \"nproc=32768:32768\"]"
      echo "[engine]"
      echo "runtime = \"runc\""
    } >> "$conf"
    log "wrote ulimit workaround to $conf"
  fi
fi

# 4. sanity: versions
for b in podman runc dockerd containerd busybox debootstrap; do
  command -v "$b" >/dev/null || die "$b missing after install"
done
log "podman $(podman --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'), dockerd $(dockerd --version | awk '{print $3}' | tr -d ,)"
log "ok"
