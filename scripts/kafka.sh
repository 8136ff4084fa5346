#!/usr/bin/env bash
# The local Apache Kafka broker for development and tests: one KRaft node (broker + controller)
# on localhost:9092 (controller on localhost:9093), run from the Maven Central jars.
#
#   scripts/kafka.sh start       fetch the jars once, format storage once, start, wait until it answers
#   scripts/kafka.sh stop        SIGTERM (controlled shutdown), wait, SIGKILL if it hangs
#   scripts/kafka.sh restart     stop + start, keeping the data (for chaos tests)
#   scripts/kafka.sh status      exit 0 when the broker answers, 3 when it does not
#   scripts/kafka.sh logs-path   the broker's log file
#   scripts/kafka.sh acquire PID start if needed and hold a lease for process PID (test runners)
#   scripts/kafka.sh release PID drop the lease; the last holder stops the broker if a lease started it
#
# Environment:
#   INFERLINE_KAFKA__BOOTSTRAP_SERVERS  when set to anything but localhost:9092, nothing is started
#   INFERLINE_CACHE_DIR     jar cache (default ~/.cache/inferline): kafka-<version>/libs
#   INFERLINE_KAFKA_DIR     data, logs, pid file (default <repo>/.kafka, gitignored)
#   INFERLINE_KAFKA_VERSION Apache Kafka version from Maven Central (default 4.1.1)
#   INFERLINE_KAFKA_PORT    client port (default 9092; the controller takes the next one). With
#                           INFERLINE_KAFKA_DIR, a second private broker, e.g. for tests that kill it
#   INFERLINE_KAFKA_HEAP    JVM heap flags (default -Xmx512m -Xms256m)
#   INFERLINE_KAFKA_START_TIMEOUT  seconds to wait for the broker to answer (default 90)
#   INFERLINE_KAFKA_FEATURES  space-separated features set when storage is formatted, e.g.
#                           "share.version=1" (share groups, KIP-932; off by default on 4.1)
#   INFERLINE_KAFKA_VOTERS  a node of a cluster (replication tests): the static quorum of every
#                           node's controller, "1@localhost:9193,2@localhost:9195,...", with
#                           INFERLINE_KAFKA_NODE_ID this node's id and INFERLINE_KAFKA_CLUSTER_ID
#                           the cluster's; every topic then defaults to one replica per node and
#                           min.insync.replicas 2. Start the nodes together: none answers before
#                           a majority of them runs.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE=$REPO/scripts/kafka

KAFKA_VERSION=${INFERLINE_KAFKA_VERSION:-4.1.1}
SLF4J_VERSION=2.0.16
LOG4J_VERSION=2.24.3
PORT=${INFERLINE_KAFKA_PORT:-9092}
CONTROLLER_PORT=$((PORT + 1))
HEAP_OPTS=${INFERLINE_KAFKA_HEAP:--Xmx512m -Xms256m}
START_TIMEOUT=${INFERLINE_KAFKA_START_TIMEOUT:-90}
STOP_TIMEOUT=30
FEATURES=${INFERLINE_KAFKA_FEATURES:-}
VOTERS=${INFERLINE_KAFKA_VOTERS:-}
NODE_ID=${INFERLINE_KAFKA_NODE_ID:-1}

CACHE=${INFERLINE_CACHE_DIR:-$HOME/.cache/inferline}/kafka-$KAFKA_VERSION
LIBS=$CACHE/libs
KDIR=${INFERLINE_KAFKA_DIR:-$REPO/.kafka}
DATA=$KDIR/data
LOGS=$KDIR/logs
LOG=$LOGS/server.log   # written by log4j2 (rolls at 20 MB)
OUT=$LOGS/kafka.out    # the JVM's own stdout/stderr: crashes before logging starts
CONFIG=$KDIR/server.properties
PIDFILE=$KDIR/kafka.pid
LEASES=$KDIR/leases
AUTOSTOP=$KDIR/auto-stop   # present when a lease (a test run), not a person, started the broker

PYTHON=python3
[ -x "$REPO/.venv/bin/python" ] && PYTHON=$REPO/.venv/bin/python

say() { echo "kafka.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

external_bootstrap() {
    # Prints the configured bootstrap servers when they name a broker other than the local one.
    local servers=${INFERLINE_KAFKA__BOOTSTRAP_SERVERS:-localhost:$PORT}
    case "$servers" in
        "localhost:$PORT" | "127.0.0.1:$PORT") return 1 ;;
        *) echo "$servers" ;;
    esac
}

probe() {  # 0 ready, 1 nothing listens, 2 something listens that is not (yet) a ready broker
    "$PYTHON" "$HERE/probe.py" localhost "$PORT" "${1:-2}" 2>/dev/null
}

alive() {  # a process that exists and is not a zombie
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null && ! grep -qs '^[0-9]* (.*) Z' "/proc/$1/stat"
}

is_our_broker() {  # is PID a live JVM running kafka.Kafka with our config?
    local pid=$1
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    local cmdline
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $cmdline == *"kafka.Kafka $CONFIG"* ]]
}

find_our_broker() {  # the pid of our broker, from the pid file or, if that is stale, from /proc
    local pid cmd
    pid=$(cat "$PIDFILE" 2>/dev/null || true)
    if is_our_broker "$pid"; then echo "$pid"; return 0; fi
    # A leftover from an earlier session whose pid file was lost or overwritten.
    for cmd in /proc/[0-9]*/cmdline; do
        pid=${cmd#/proc/}; pid=${pid%/cmdline}
        if is_our_broker "$pid"; then echo "$pid" >"$PIDFILE"; echo "$pid"; return 0; fi
    done
    rm -f "$PIDFILE"
    return 1
}

fetch_jars() {
    [ -f "$LIBS/.complete" ] && return 0
    command -v mvn >/dev/null || die "mvn (Apache Maven) is needed once to fetch the Kafka jars"
    command -v java >/dev/null || die "java (17+) is needed to run the Kafka broker"
    mkdir -p "$CACHE"
    sed -e "s/@KAFKA_VERSION@/$KAFKA_VERSION/" -e "s/@SLF4J_VERSION@/$SLF4J_VERSION/" \
        -e "s/@LOG4J_VERSION@/$LOG4J_VERSION/" "$HERE/pom.xml.in" >"$CACHE/pom.xml"
    local tmp=$CACHE/libs.tmp.$$ goal=dependency:copy-dependencies
    local args=(-q -B -f "$CACHE/pom.xml" "$goal" -DincludeScope=runtime -DoutputDirectory="$tmp")
    say "fetching Apache Kafka $KAFKA_VERSION jars into $LIBS (once)"
    # Offline first (the local Maven repository may have them all), then Maven Central.
    if ! mvn -o "${args[@]}" >"$CACHE/mvn.log" 2>&1; then
        rm -rf "$tmp"
        mvn "${args[@]}" >"$CACHE/mvn.log" 2>&1 || { tail -n 30 "$CACHE/mvn.log" >&2; rm -rf "$tmp"; die "mvn could not resolve org.apache.kafka:kafka_2.13:$KAFKA_VERSION (log: $CACHE/mvn.log)"; }
    fi
    ls "$tmp"/kafka_2.13-*.jar >/dev/null 2>&1 || die "no kafka_2.13 jar in $tmp"
    touch "$tmp/.complete"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
}

write_config() {
    mkdir -p "$DATA" "$LOGS" "$LEASES"
    sed -e "s#@DATA_DIR@#$DATA#" -e "s/@PORT@/$PORT/g" -e "s/@CONTROLLER_PORT@/$CONTROLLER_PORT/g" \
        "$HERE/server.properties.in" >"$CONFIG"
    [ -n "$VOTERS" ] && cluster_config
    return 0
}

cluster_config() {  # this node of a static quorum; a replica of everything per node
    local nodes isr
    nodes=$(($(tr -cd , <<<"$VOTERS" | wc -c) + 1))
    isr=$((nodes > 1 ? 2 : 1))
    sed -i -e "s/^node.id=.*/node.id=$NODE_ID/" \
        -e "s/^controller.quorum.bootstrap.servers=.*/controller.quorum.voters=$VOTERS/" \
        -e "s/^\(.*replication.factor\)=.*/\1=$nodes/" \
        -e "s/^\(min.insync.replicas\|.*min.isr\)=.*/\1=$isr/" "$CONFIG"
}

JVM_FLAGS=()
jvm_flags() {  # the broker's JVM flags (as the Kafka start script, with a smaller heap)
    local heap
    read -r -a heap <<<"$HEAP_OPTS"
    JVM_FLAGS=("${heap[@]}" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
        -Djava.awt.headless=true -Dkafka.logs.dir="$LOGS"
        -Dlog4j2.configurationFile="$HERE/log4j2.properties" -cp "$LIBS/*")
}

format_storage() {
    [ -f "$DATA/meta.properties" ] && return 0
    local cluster_id
    cluster_id=${INFERLINE_KAFKA_CLUSTER_ID:-$(cat "$KDIR/cluster.id" 2>/dev/null || true)}
    if [ -z "$cluster_id" ]; then
        cluster_id=$(java -cp "$LIBS/*" -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
            -Dkafka.logs.dir="$LOGS" kafka.tools.StorageTool random-uuid)
        echo "$cluster_id" >"$KDIR/cluster.id"
    fi
    say "formatting KRaft storage in $DATA (cluster id $cluster_id)"
    local feature features=() quorum=(--standalone)
    for feature in $FEATURES; do features+=(--feature "$feature"); done
    [ -n "$VOTERS" ] && quorum=()  # a static quorum (controller.quorum.voters)
    java -Xmx256m -cp "$LIBS/*" -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
        -Dkafka.logs.dir="$LOGS" kafka.tools.StorageTool format -t "$cluster_id" -c "$CONFIG" \
        "${quorum[@]}" "${features[@]}" >>"$OUT" 2>&1 || { tail -n 20 "$OUT" >&2; die "formatting $DATA failed"; }
}

show_failure() {
    say "the broker did not come up; last lines of $LOG:"
    tail -n 40 "$LOG" 2>/dev/null | sed 's/^/    /' >&2 || true
    if [ -s "$OUT" ]; then
        say "last lines of $OUT:"
        tail -n 20 "$OUT" | sed 's/^/    /' >&2
    fi
}

wait_answer() {  # PID SECONDS: 0 once the broker answers, 1 if PID exits, 2 on timeout
    local pid=$1 deadline=$((SECONDS + $2))
    while ! probe 1; do
        alive "$pid" || return 1
        [ "$SECONDS" -ge "$deadline" ] && return 2
        sleep 0.3
    done
}

wait_ready() {
    local pid=$1 status=0
    wait_answer "$pid" "$START_TIMEOUT" || status=$?
    case $status in
        1) show_failure; rm -f "$PIDFILE"; die "the broker (pid $pid) exited during start-up" ;;
        2) show_failure; stop_broker
           die "the broker did not answer on localhost:$PORT within ${START_TIMEOUT}s" ;;
    esac
}

start_broker() {  # prints "started" or "running"
    local pid
    if pid=$(find_our_broker); then
        if probe 5; then echo running; return 0; fi
        # Alive but not answering: a hung leftover. Give it a moment (it may be starting), then replace it.
        say "broker pid $pid does not answer; waiting for it"
        if wait_answer "$pid" 20; then echo running; return 0; fi
        say "replacing the unresponsive broker (pid $pid)"
        stop_broker
    fi
    case $(probe 2; echo $?) in
        0) say "a broker that this script did not start already answers on localhost:$PORT: reusing it"
           echo running; return 0 ;;
        2) die "localhost:$PORT is taken by something that is not a ready Kafka broker" ;;
    esac
    fetch_jars
    write_config
    format_storage
    : >"$OUT"
    jvm_flags
    # fd 9 is the start/stop lock: the broker must not inherit it.
    nohup java "${JVM_FLAGS[@]}" kafka.Kafka "$CONFIG" >>"$OUT" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$PIDFILE"
    local t0=$SECONDS
    wait_ready "$pid"
    say "started Apache Kafka $KAFKA_VERSION (pid $pid) on localhost:$PORT in $((SECONDS - t0))s"
    echo started
}

stop_broker() {
    local pid
    if ! pid=$(find_our_broker); then
        say "no local broker running"; return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_TIMEOUT))
    while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if alive "$pid"; then
        say "broker pid $pid ignored SIGTERM for ${STOP_TIMEOUT}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        while alive "$pid"; do sleep 0.1; done
    fi
    rm -f "$PIDFILE"
    say "stopped the broker (pid $pid)"
}

live_leases() {  # prints the pids that hold a lease and are still alive; forgets the dead ones
    local f pid
    for f in "$LEASES"/*; do
        [ -e "$f" ] || continue
        pid=${f##*/}
        if alive "$pid"; then echo "$pid"; else rm -f "$f"; fi
    done
}

with_lock() {  # serialises start/stop between concurrent test runs sharing one broker
    mkdir -p "$KDIR"
    exec 9>"$KDIR/.lock"
    flock -w $((START_TIMEOUT + STOP_TIMEOUT + 60)) 9 || die "timed out waiting for $KDIR/.lock"
    "$@"
}

cmd_start() {
    local how
    how=$(start_broker) || exit 1
    # Started by a person: no test run may stop it at its end. (One that a test run started is
    # still stopped by that run, even if `start` was asked for meanwhile.)
    [ "$how" = started ] && rm -f "$AUTOSTOP"
    [ "$how" = running ] && say "broker already running on localhost:$PORT: reusing it"
    echo "$LOG"
}

cmd_acquire() {
    local holder=$1 how
    how=$(start_broker) || exit 1
    [ "$how" = started ] && touch "$AUTOSTOP"
    mkdir -p "$LEASES" && touch "$LEASES/$holder"
    echo "$how"
}

cmd_stop() {
    stop_broker
    rm -f "$AUTOSTOP"
}

cmd_restart() {  # keeps the data, and whether a test run is to stop the broker at its end
    stop_broker
    start_broker >/dev/null || exit 1
    echo "$LOG"
}

cmd_release() {
    rm -f "$LEASES/$1"
    local others
    others=$(live_leases | tr '\n' ' ')
    if [ ! -f "$AUTOSTOP" ]; then return 0; fi
    if [ -n "$others" ]; then
        say "leaving the broker running for the other runs using it (pids $others)"
    else
        stop_broker
    fi
}

cmd_status() {
    local pid
    if pid=$(find_our_broker); then
        if probe 2; then say "running (pid $pid) on localhost:$PORT; log $LOG"; return 0; fi
        say "pid $pid is alive but does not answer on localhost:$PORT; log $LOG"; return 3
    fi
    if probe 2; then say "a broker this script did not start answers on localhost:$PORT"; return 0; fi
    say "not running"; return 3
}

main() {
    local cmd=${1:-}
    case "$cmd" in
        start | acquire | restart)
            if servers=$(external_bootstrap); then
                say "INFERLINE_KAFKA__BOOTSTRAP_SERVERS=$servers names another broker: not starting a local one"
                [ "$cmd" = acquire ] && echo external
                return 0
            fi ;;
    esac
    case "$cmd" in
        start) with_lock cmd_start ;;
        stop) with_lock cmd_stop ;;
        restart) with_lock cmd_restart ;;
        status) cmd_status ;;
        logs-path) echo "$LOG" ;;
        acquire) [ -n "${2:-}" ] || die "usage: $0 acquire PID"; with_lock cmd_acquire "$2" ;;
        release) [ -n "${2:-}" ] || die "usage: $0 release PID"; with_lock cmd_release "$2" ;;
        *) echo "usage: $0 start|stop|restart|status|logs-path" >&2; exit 2 ;;
    esac
}

main "$@"
