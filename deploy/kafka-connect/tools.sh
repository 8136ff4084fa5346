#!/usr/bin/env bash
# Kafka Connect for the test that drives the JSON encoding with it (tests/kafka/test_json_encoding.py,
# marked `full`): connect-runtime, connect-json, connect-transforms and connect-file of the broker's
# Kafka version and their runtime dependencies, fetched once by Maven (offline first, then Maven
# Central, as scripts/kafka.sh fetches the broker) into
# ${INFERLINE_CACHE_DIR:-~/.cache/inferline}/kafka-connect-<version>/libs (never committed).
#
# deploy/kafka-connect/tools.sh          fetch what is missing (idempotent), print the libs folder
# deploy/kafka-connect/tools.sh --paths  print the libs folder only (it may not exist yet)
# Exit 0 when the folder is complete, 1 when it could not be had (the reason on stderr).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KAFKA_VERSION=${INFERLINE_KAFKA_VERSION:-4.1.1}   # as scripts/kafka.sh
SLF4J_VERSION=2.0.16
LOG4J_VERSION=2.24.3
CACHE=${INFERLINE_CACHE_DIR:-$HOME/.cache/inferline}/kafka-connect-$KAFKA_VERSION
LIBS=$CACHE/libs

say() { echo "kafka connect tools: $*" >&2; }
[ "${1:-}" = --paths ] && { echo "$LIBS"; exit 0; }

fetch() {
    command -v mvn >/dev/null || { say "mvn (Apache Maven) is needed once to fetch the jars"; return 1; }
    command -v java >/dev/null || { say "java (17+) is needed to run Kafka Connect"; return 1; }
    mkdir -p "$CACHE"
    sed -e "s/@KAFKA_VERSION@/$KAFKA_VERSION/" -e "s/@SLF4J_VERSION@/$SLF4J_VERSION/" \
        -e "s/@LOG4J_VERSION@/$LOG4J_VERSION/" "$HERE/pom.xml.in" >"$CACHE/pom.xml"
    local tmp=$CACHE/libs.tmp.$$
    local args=(-q -B -f "$CACHE/pom.xml" dependency:copy-dependencies -DincludeScope=runtime
        -DoutputDirectory="$tmp")
    say "fetching Kafka Connect $KAFKA_VERSION jars into $LIBS (about 35 MB, once)"
    if ! mvn -o "${args[@]}" >"$CACHE/mvn.log" 2>&1; then
        rm -rf "$tmp"
        mvn "${args[@]}" >"$CACHE/mvn.log" 2>&1 || {
            tail -n 20 "$CACHE/mvn.log" >&2; rm -rf "$tmp"; say "mvn failed (log: $CACHE/mvn.log)"
            return 1
        }
    fi
    ls "$tmp"/connect-runtime-*.jar >/dev/null 2>&1 || { say "no connect-runtime jar"; return 1; }
    touch "$tmp/.complete"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
}

[ -f "$LIBS/.complete" ] || fetch || { say "not installed: the test that needs it skips"; exit 1; }
echo "$LIBS"
