#!/usr/bin/env bash
# Jaeger v2 (the `jaeger` binary: an OpenTelemetry Collector build with Jaeger's storage and query
# extensions) for the trace test (tests/kafka/test_jaeger.py, `make trace-check`), built from the
# Go module proxy and cached under ${INFERLINE_CACHE_DIR:-~/.cache/inferline}/jaeger (never
# committed). Jaeger's v2 releases are published on the module proxy under the module's v1 tags:
# JAEGER_VERSION v1.76.0 is Jaeger v2.13.0. Its go.mod has a replace directive, which
# `go install pkg@version` refuses, so the module is downloaded and built in a copy of its source.
#
# deploy/jaeger/tools.sh          build what is missing (idempotent; minutes the first time)
# deploy/jaeger/tools.sh --path   print the binary's path only (it may not exist yet)
# Exit 0 when the binary runs, 1 when it could not be had (the reason on stderr).
set -euo pipefail

JAEGER_VERSION=${JAEGER_VERSION:-v1.76.0}
MODULE=github.com/jaegertracing/jaeger
DIR=${INFERLINE_CACHE_DIR:-$HOME/.cache/inferline}/jaeger/$JAEGER_VERSION
JAEGER=$DIR/jaeger

[ "${1:-}" = --path ] && { echo "$JAEGER"; exit 0; }
say() { echo "jaeger tools: $*" >&2; }

build() {
    command -v go >/dev/null || { say "no Go toolchain (go): cannot build $MODULE"; return 1; }
    local src work
    src=$(GOFLAGS=-mod=mod go mod download -json "$MODULE@$JAEGER_VERSION" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') || true
    [ -n "$src" ] && [ -d "$src" ] || { say "go mod download $MODULE@$JAEGER_VERSION failed"; return 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    cp -r "$src"/. "$work" && chmod -R u+w "$work"  # the module cache is read-only
    say "building $MODULE/cmd/jaeger@$JAEGER_VERSION (go build; several minutes the first time)"
    mkdir -p "$DIR"
    (cd "$work" && GOFLAGS=-mod=mod go build -trimpath -o "$JAEGER.part" ./cmd/jaeger) || {
        rm -f "$JAEGER.part"
        say "go build failed"
        return 1
    }
    mv "$JAEGER.part" "$JAEGER"  # whole or absent: a test never finds half a binary
}

if [ ! -x "$JAEGER" ]; then
    build || { say "not built: tests/kafka/test_jaeger.py skips"; exit 1; }
fi
"$JAEGER" version >/dev/null 2>&1 || { say "$JAEGER does not run"; exit 1; }
say "ready: $JAEGER"
echo "$JAEGER"
