#!/usr/bin/env bash
# kcat for the test that drives the JSON encoding with it (tests/kafka/test_json_encoding.py), from
# Debian's `kcat` package and the shared libraries it needs that a slim image lacks (librdkafka1,
# libyajl2), cached under ${INFERLINE_CACHE_DIR:-~/.cache/inferline}/kcat (never committed). No root
# needed: `apt-get download` fetches the .debs (or, without apt-get, curl from deb.debian.org's
# pool), `dpkg-deb -x` unpacks them, and a wrapper runs kcat with LD_LIBRARY_PATH on their libs.
#
# deploy/kcat/tools.sh          install what is missing (idempotent), print the wrapper's path
# deploy/kcat/tools.sh --paths  print the wrapper's path only (it may not exist yet)
# Exit 0 when it runs, 1 when it could not be had (the reason on stderr).
set -euo pipefail

# Debian bookworm's: package=version pool-folder (the versions curl fetches without apt-get).
PACKAGES=(
    "kcat=${KCAT_DEB_VERSION:-1.7.1-2} k/kafkacat"
    "librdkafka1=${LIBRDKAFKA_DEB_VERSION:-2.0.2-1} libr/librdkafka"
    "libyajl2=${LIBYAJL_DEB_VERSION:-2.1.0-3+deb12u2} y/yajl"
)
ARCH=$(dpkg --print-architecture 2>/dev/null || echo amd64)
POOL=${DEBIAN_POOL:-https://deb.debian.org/debian/pool/main}
DIR=${INFERLINE_CACHE_DIR:-$HOME/.cache/inferline}/kcat
KCAT=$DIR/kcat

say() { echo "kcat tools: $*" >&2; }
[ "${1:-}" = --paths ] && { echo "$KCAT"; exit 0; }

fetch_deb() {  # fetch_deb FOLDER NAME=VERSION POOL_FOLDER: the package's .deb into FOLDER
    local name=${2%%=*} version=${2#*=}
    # The version apt knows (a security update may have replaced the pinned one), else the pin.
    if command -v apt-get >/dev/null && (cd "$1" && apt-get download -q "$name" >/dev/null 2>&1)
    then
        return 0
    fi
    command -v curl >/dev/null || { say "neither apt-get download nor curl worked"; return 1; }
    local deb=${name}_${version}_$ARCH.deb
    say "apt-get download $name failed; curl $POOL/$3/$deb"
    curl -fsSL -o "$1/$deb" "$POOL/$3/${deb//+/%2B}"
}

install() {
    command -v dpkg-deb >/dev/null || { say "no dpkg-deb to unpack the packages"; return 1; }
    local dl entry; dl=$(mktemp -d)
    trap 'rm -rf "$dl"' RETURN
    say "fetching Debian's kcat, librdkafka1 and libyajl2 (about 0.7 MB, once)"
    for entry in "${PACKAGES[@]}"; do
        fetch_deb "$dl" ${entry} || return 1
    done
    rm -rf "$DIR" && mkdir -p "$DIR"
    for deb in "$dl"/*.deb; do dpkg-deb -x "$deb" "$DIR/root" || return 1; done
    local libs; libs=$(dirname "$(find "$DIR/root/usr/lib" -name 'librdkafka.so.1' | head -n1)")
    cat >"$KCAT" <<WRAPPER
#!/bin/sh
# Debian's kcat with the libraries unpacked beside it (written by deploy/kcat/tools.sh).
LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DIR/root/usr/bin/kcat" "\$@"
WRAPPER
    chmod +x "$KCAT"
}

if [ ! -x "$KCAT" ] || ! "$KCAT" -V >/dev/null 2>&1; then
    install || { say "not installed: the test that needs it skips"; exit 1; }
fi
"$KCAT" -V >/dev/null 2>&1 || { say "$KCAT does not run"; exit 1; }
echo "$KCAT"
