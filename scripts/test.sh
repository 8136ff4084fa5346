#!/usr/bin/env bash
# Runs the test suite against a real Kafka broker: `scripts/test.sh [pytest arguments]`.
#
# Starts the local broker (scripts/kafka.sh) unless INFERLINE_KAFKA__BOOTSTRAP_SERVERS names another
# one, runs `.venv/bin/python -m pytest "$@"`, and stops the broker at the end only if this run
# started it (and no other run is still using it: runs hold a lease, see scripts/kafka.sh).
# `scripts/test.sh --parts [pytest arguments]` (make test) runs the broker's tests and the others
# side by side, in two pytest processes (see parts() below).
# Exits with pytest's code, except that "no tests collected" (5) counts as success.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
T0=$(date +%s.%N)
PYTHON=$REPO/.venv/bin/python
[ -x "$PYTHON" ] || { echo "test.sh: $PYTHON missing: run 'make install' first" >&2; exit 1; }

LEASED=
release() {
    if [ -n "$LEASED" ]; then
        scripts/kafka.sh release $$ || echo "test.sh: warning: releasing the broker failed" >&2
        LEASED=
    fi
}
trap release EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Prints "started", "running" or "external"; the lease stops a broker it started when the last
# run using it releases it.
if ! how=$(scripts/kafka.sh acquire $$); then
    echo "test.sh: the Kafka broker could not be started (see above)" >&2
    exit 1
fi
[ "$how" = external ] || LEASED=1
# Subprocesses (CLIs, benches, workers) read the settings, whose default is localhost:9092: point
# them at the broker of INFERLINE_KAFKA_PORT too.
export INFERLINE_KAFKA__BOOTSTRAP_SERVERS=${INFERLINE_KAFKA__BOOTSTRAP_SERVERS:-localhost:${INFERLINE_KAFKA_PORT:-9092}}
echo "test.sh: Kafka broker: $how (${INFERLINE_KAFKA__BOOTSTRAP_SERVERS:-localhost:${INFERLINE_KAFKA_PORT:-9092}})" >&2

# The slowest tests in every run's log: where the suite's time goes, on whatever machine ran it.
pytest() { "$PYTHON" -m pytest --durations=25 "$@"; }

# --parts: the broker's tests (tests/kafka) and the others run side by side, in two pytest
# processes. The broker's mostly wait (sessions, transactions, worker processes: about one core of
# two), the others mostly compute, so together they take about as long as the broker's alone. The
# broker's stream live; the others' log follows, then every failure of both again.
# Two broker tests that start brokers of their own (the shared one unused) run with the others, to
# even out the two parts (the 3-node replication test stays with the broker's).
OWN_BROKERS="tests/kafka/test_acl_tenancy.py tests/kafka/test_oauth.py"
parts() {
    local log rest kafka_rc rest_rc
    # Each part (and every worker process it starts) gets half the cores for torch's intra-op
    # threads: two processes of one thread per core each spin-waited for a core the other held
    # (on 2 cores an engine test took 198 s with 2 threads beside a busy core, 88 s with 1).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) > 3 ? $(nproc) / 2 : 1 ))}
    log=$(mktemp)
    rest=$(find tests -mindepth 1 -maxdepth 1 -type d ! -name kafka ! -name data ! -name '__*' \
        -exec sh -c 'ls "$1"/test_*.py >/dev/null 2>&1' _ {} \; -print | sort)
    # shellcheck disable=SC2086 - one word per path
    pytest -p no:cacheprovider "$@" $rest $OWN_BROKERS >"$log" 2>&1 &
    local pid=$! ignore=() path
    for path in $OWN_BROKERS; do ignore+=("--ignore=$path"); done
    pytest "$@" "${ignore[@]}" tests/kafka
    kafka_rc=$?
    wait "$pid"
    rest_rc=$?
    echo "==================== test.sh: the other tests ($rest) ===================="
    cat "$log"
    echo "test.sh: tests/kafka exit code $kafka_rc; the others $rest_rc"
    grep -h -E '^(FAILED|ERROR) ' "$log" || true
    rm -f "$log"
    for code in "$kafka_rc" "$rest_rc"; do
        [ "$code" -ne 0 ] && [ "$code" -ne 5 ] && return "$code"
    done
    [ "$kafka_rc" -eq 5 ] && [ "$rest_rc" -eq 5 ] && return 5
    return 0
}

if [ "${1:-}" = "--parts" ]; then
    shift
    parts "$@"
else
    pytest "$@"
fi
rc=$?
[ "$rc" -eq 5 ] && { echo "test.sh: no tests collected: counted as success" >&2; rc=0; }

release
awk -v t0="$T0" -v t1="$(date +%s.%N)" -v rc="$rc" \
    'BEGIN { printf "test.sh: pytest exit code %d, wall time %.1fs\n", rc, t1 - t0 }' >&2
exit "$rc"
