#!/usr/bin/env bash
# prometheus and promtool for the tests that run them (tests/kafka/test_dashboard_queries.py,
# tests/unit/test_recording_rules.py), from Debian's `prometheus` package, cached under
# ${INFERLINE_CACHE_DIR:-~/.cache/inferline}/prometheus (never committed). No root needed:
# `apt-get download` fetches the .deb (or, without apt-get, curl from deb.debian.org's pool)
# and `dpkg-deb -x` unpacks it.
#
# deploy/prometheus/tools.sh          install what is missing (idempotent), print the two paths
# deploy/prometheus/tools.sh --paths  print the two paths only (they may not exist yet)
# Exit 0 when both run, 1 when they could not be had (the reason on stderr).
set -euo pipefail

VERSION=${PROMETHEUS_DEB_VERSION:-2.42.0+ds-5+deb12u1}   # Debian bookworm's
ARCH=$(dpkg --print-architecture 2>/dev/null || echo amd64)
POOL=${DEBIAN_POOL:-https://deb.debian.org/debian/pool/main/p/prometheus}
DIR=${INFERLINE_CACHE_DIR:-$HOME/.cache/inferline}/prometheus/$VERSION
PROMETHEUS=$DIR/usr/bin/prometheus
PROMTOOL=$DIR/usr/bin/promtool

paths() { printf '%s\n%s\n' "$PROMETHEUS" "$PROMTOOL"; }
say() { echo "prometheus tools: $*" >&2; }
[ "${1:-}" = --paths ] && { paths; exit 0; }

fetch_deb() {  # fetch_deb FOLDER: the package's .deb into FOLDER
    if command -v apt-get >/dev/null &&
        (cd "$1" && apt-get download -q "prometheus=$VERSION" >/dev/null 2>&1); then
        return 0
    fi
    command -v curl >/dev/null || { say "neither apt-get download nor curl worked"; return 1; }
    local deb=prometheus_${VERSION}_$ARCH.deb
    say "apt-get download failed; curl $POOL/$deb"
    curl -fsSL -o "$1/$deb" "$POOL/${deb//+/%2B}"
}

install() {
    command -v dpkg-deb >/dev/null || { say "no dpkg-deb to unpack the package"; return 1; }
    local dl; dl=$(mktemp -d)
    trap 'rm -rf "$dl"' RETURN
    say "fetching Debian's prometheus $VERSION (about 19 MB, once)"
    fetch_deb "$dl" || return 1
    mkdir -p "$DIR"
    dpkg-deb -x "$dl"/prometheus_*.deb "$DIR"
}

if [ ! -x "$PROMETHEUS" ] || [ ! -x "$PROMTOOL" ]; then
    install || { say "not installed: the tests that need them skip"; exit 1; }
fi
"$PROMTOOL" --version >/dev/null 2>&1 || { say "$PROMTOOL does not run"; exit 1; }
paths
