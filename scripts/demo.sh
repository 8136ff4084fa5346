#!/usr/bin/env bash
# `make demo`: the local broker, a worker with the default model, one prompt streamed back.
# Everything it starts, it stops again (the broker only if it started it).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
BIN=$REPO/.venv/bin
PROMPT=${DEMO_PROMPT:-"Explain Kafka in one sentence."}
export INFERLINE_HTTP__PORT=${INFERLINE_HTTP__PORT:-8089}
LOG_DIR=$REPO/.cache/demo
mkdir -p "$LOG_DIR"
WORKER_PID= LEASED=

cleanup() {
    if [ -n "$WORKER_PID" ] && kill -0 "$WORKER_PID" 2>/dev/null; then
        echo "demo: stopping the worker (SIGTERM, graceful drain)" >&2
        kill -TERM "$WORKER_PID"; wait "$WORKER_PID" 2>/dev/null
    fi
    [ -n "$LEASED" ] && scripts/kafka.sh release $$ >/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT

how=$(scripts/kafka.sh acquire $$) || { echo "demo: the Kafka broker could not be started" >&2; exit 1; }
[ "$how" = external ] || LEASED=1
echo "demo: Kafka broker $how" >&2
"$BIN/inferline" topics create >/dev/null || exit 1

echo "demo: starting the worker (log: $LOG_DIR/worker.log)" >&2
INFERLINE_LOG__FORMAT=json "$BIN/inferline-worker" >"$LOG_DIR/worker.log" 2>&1 &
WORKER_PID=$!
for _ in $(seq 1 600); do
    curl -fs "http://127.0.0.1:$INFERLINE_HTTP__PORT/readyz" >/dev/null 2>&1 && break
    kill -0 "$WORKER_PID" 2>/dev/null || { echo "demo: the worker exited:" >&2; tail -20 "$LOG_DIR/worker.log" >&2; exit 1; }
    sleep 0.5
done
echo "demo: worker ready; submitting: $PROMPT" >&2
echo
"$BIN/inferline" submit --chat --max-tokens "${DEMO_MAX_TOKENS:-96}" --temperature 0 "$PROMPT"
rc=$?
echo
exit $rc
