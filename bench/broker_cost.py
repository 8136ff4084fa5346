"""What a served request costs the broker, before and after, in one command: transactions per
served request and broker CPU-ms per request at a fixed offered rate (issue 48, item 7).

    python -m bench.broker_cost                          # baseline: the merge-base with main
    python -m bench.broker_cost --baseline main --requests 1000 --rate 50
    python -m bench.broker_cost --no-baseline            # this tree only (the smoke test)

Sides: `baseline`, a `git worktree add` of --baseline in a temporary directory, and `current`,
this checkout as it is (uncommitted edits included). Each side's worker is `python -P -m
inferline.worker` of its own tree: a launcher maps `inferline.*` onto that tree's folders before
anything imports it (the installed editable package points at one checkout only). The client,
the broker and the measurement are this tree's for both sides.

One broker for the whole command (default: a private one, started here on a free port, so no
other test's traffic is counted; `--broker local`: the broker of INFERLINE_KAFKA__BOOTSTRAP_SERVERS,
its JVM found through $INFERLINE_KAFKA_DIR/kafka.pid), primed first (its internal topics made by
one transaction, then --settle-s of quiet) and warmed (an unmeasured run of this tree, since a
broker's first minutes under load cost more), with fresh topics and a fresh group per run. Per run:
the idle broker's CPU for --idle-s; the worker started, a warm-up; the broker's CPU beside the
idle worker for --idle-s; then --requests requests offered at --rate per second (open loop, an
InferenceClient reading replies read_committed), measured from the first send to the last final.
The engine is a one-layer SmolLM2 with random weights (`load_format=dummy`), --max-tokens 1 by
default, so that the worker's compute stays small beside what Kafka costs.

Figures per run: served requests; transactions committed per served request (the worker's
`inferline_transactions_total{outcome="committed"}` over the window, from its /metrics); broker
CPU-ms per request (utime + stime of the broker JVM over the window, less the idle broker's CPU
for as long, over the served requests; also less the idle worker's instead). Target: at most
10 CPU-ms per request. Writes bench/results/broker_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench import stats
from bench.kafka_e2e import admin, free_port, http_get, stop, wait_ready

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGET_CPU_MS = 10.0
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # any ids: the dummy model's logits are random anyway

# Run as `python -P -c LAUNCH ROOT`: `inferline.X` is ROOT/X (as pyproject's package-dir maps it),
# found ahead of the installed editable finder, then `python -m inferline.worker` of that tree.
LAUNCH = """\
import importlib.abc, importlib.machinery, runpy, sys, types
root = sys.argv.pop(1)
class Checkout(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        head, _, rest = name.partition(".")
        if head == "inferline" and rest and "." not in rest:
            return importlib.machinery.PathFinder.find_spec(name, [root])
        return None
sys.meta_path.insert(0, Checkout())
pkg = types.ModuleType("inferline")
pkg.__path__ = [root]
sys.modules["inferline"] = pkg
import inferline.worker as w
assert w.__file__.startswith(root + "/"), (w.__file__, root)
print("broker_cost: inferline.worker from", w.__file__, file=sys.stderr, flush=True)
runpy.run_module("inferline.worker", run_name="__main__", alter_sys=True)
"""


def parse_args(argv=None):
    p = stats.parser("broker_cost", __doc__, out="broker_cost.json")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline", help="git ref of the baseline (default: merge-base with main)")
    base.add_argument("--no-baseline", action="store_true", help="measure this tree only")
    p.add_argument("--requests", type=int, default=200, help="measured requests per run")
    p.add_argument("--rate", type=float, default=20.0, help="offered requests per second")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per request")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured requests first")
    p.add_argument("--partitions", type=int, default=4, help="request topic partitions")
    p.add_argument("--idle-s", type=float, help="each idle window (default: requests / rate)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side, in ABBA order")
    p.add_argument("--broker", choices=("private", "local"), default="private")
    p.add_argument("--settle-s", type=float, default=10.0, help="quiet after priming the broker")
    p.add_argument(
        "--broker-warmup",
        type=int,
        default=300,
        help="requests of an unmeasured run of this tree before the measured ones (0: none)",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to /readyz")
    args = p.parse_args(argv)
    if min(args.requests, args.partitions, args.repeats) < 1 or args.rate <= 0:
        p.error("--requests, --partitions, --repeats and --rate must be positive")
    if args.idle_s is None:
        args.idle_s = args.requests / args.rate
    return args


# ---- the broker and the processes' CPU --------------------------------------------------------


def cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process, every thread's (dead ones included), in seconds."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pid_in(kdir: Path) -> int | None:
    try:
        pid = int((kdir / "kafka.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


@dataclass
class Broker:
    bootstrap: str
    kdir: Path

    @property
    def pid(self) -> int | None:
        return pid_in(self.kdir)


@contextlib.contextmanager
def broker(kind: str):
    """A private broker on a free port (stopped after), or the local one as it is."""
    if kind == "local":
        from inferline.config.settings import load_settings

        kdir = Path(os.environ.get("INFERLINE_KAFKA_DIR", REPO / ".kafka"))
        yield Broker(load_settings().kafka.bootstrap_servers, kdir)
        return
    from tests.chaos_fixtures import PrivateBroker

    kdir = Path(tempfile.mkdtemp(prefix="inferline-bench-broker-cost-"))
    private = PrivateBroker(kdir, heap="-Xmx512m -Xms256m")
    try:
        private.start()
        yield Broker(private.bootstrap, kdir)
    finally:
        try:
            private.stop()
        finally:
            shutil.rmtree(kdir, ignore_errors=True)


async def prime(bootstrap: str, settle_s: float) -> None:
    """One transaction that commits a group offset, then `settle_s` of quiet: a fresh broker
    creates and loads __transaction_state and __consumer_offsets (50 partitions each) on first
    use, which would otherwise land in the first run's windows."""
    from aiokafka import AIOKafkaProducer, TopicPartition
    from aiokafka.admin import NewTopic

    topic = f"bench-broker-cost-prime-{uuid.uuid4().hex[:8]}"
    await admin(lambda a: a.create_topics([NewTopic(topic, 1, 1)]), bootstrap_servers=bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=topic)
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"prime")
            await producer.send_offsets_to_transaction({TopicPartition(topic, 0): 1}, topic)
    finally:
        await producer.stop()
    await admin(lambda a: a.delete_topics([topic]), bootstrap_servers=bootstrap)
    await asyncio.sleep(settle_s)


async def cpu_over(pid: int | None, seconds: float) -> float | None:
    """A process's CPU-seconds per second over `seconds` of sleep here (None: not measured)."""
    if seconds <= 0:
        return None
    c0, t0 = cpu_s(pid), time.monotonic()
    await asyncio.sleep(seconds)
    c1, t1 = cpu_s(pid), time.monotonic()
    return None if c0 is None or c1 is None else (c1 - c0) / (t1 - t0)


# ---- the two trees ------------------------------------------------------------------------------


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def default_baseline() -> str:
    for ref in ("main", "origin/main"):
        with contextlib.suppress(subprocess.CalledProcessError):
            return git("merge-base", "HEAD", ref)
    raise SystemExit("broker_cost: no main or origin/main to take a merge-base with: --baseline")


@contextlib.contextmanager
def sides(args):
    """name -> (tree root, description); the baseline's worktree removed after."""
    head = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    current = {"root": str(REPO), "commit": head, "uncommitted_changes": dirty}
    if args.no_baseline:
        yield {"current": current}
        return
    ref = args.baseline or default_baseline()
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tmp = Path(tempfile.mkdtemp(prefix="inferline-baseline-"))
    tree = tmp / "tree"
    git("worktree", "add", "--detach", str(tree), commit)
    try:
        yield {"baseline": {"root": str(tree), "ref": ref, "commit": commit}, "current": current}
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)
        git("worktree", "prune")


def tiny_model(folder: Path) -> Path:
    """A config.json of SmolLM2-135M cut to one layer: with `load_format=dummy` the worker builds
    it with random weights (and a synthesized tokenizer), so a request costs it a few ms."""
    from inferline.worker.engine.models.loader import DUMMY_PRESETS

    shape = {**DUMMY_PRESETS["smollm2-135m"], "num_hidden_layers": 1}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **shape}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---- one run ------------------------------------------------------------------------------------


@dataclass
class Topics:
    requests: str
    cancel: str
    dlq: str
    group: str


def worker_env(bootstrap: str, topics: Topics, model: Path, port: int) -> dict:
    """The parent's environment without its INFERLINE_* settings, plus this run's: the tiny model
    on one thread and PyTorch kernels (nothing compiled or timed at load), default delivery."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERLINE_")}
    settings = {
        "KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "KAFKA__REQUEST_TOPIC": topics.requests,
        "KAFKA__CANCEL_TOPIC": topics.cancel,
        "KAFKA__DLQ_TOPIC": topics.dlq,
        "KAFKA__GROUP_ID": topics.group,
        "MODEL__PATH": str(model),
        "MODEL__LOAD_FORMAT": "dummy",
        "MODEL__DEVICE": "cpu",
        "MODEL__DTYPE": "float32",
        "MODEL__MAX_MODEL_LEN": "256",
        "MODEL__CPU_THREADS": "1",
        "MODEL__ATTENTION_BACKEND": "torch",
        "MODEL__CPU_LINEAR": "torch",
        "MODEL__CPU_FUSED_OPS": "torch",
        "MODEL__CPU_WEIGHT_CODES": "off",
        "CACHE__KV_MEMORY_GB": "0.05",
        "HTTP__HOST": "127.0.0.1",
        "HTTP__PORT": str(port),
        "LOG__FORMAT": "json",
        "WORKER__DRAIN_TIMEOUT_S": "10",
    }
    return {**env, **{f"INFERLINE_{k}": v for k, v in settings.items()}, "OMP_NUM_THREADS": "1"}


def scrape(port: int) -> dict[str, float]:
    """Every sample of the worker's /metrics: 'name{labels}' -> value."""
    status, text = http_get(port, "/metrics")
    if status != 200:
        return {}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[key] = float(value)
    return samples


def transactions(samples: dict[str, float]) -> dict[str, float]:
    """outcome -> count of the worker's `inferline_transactions_total`."""
    out = {}
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        if name == "inferline_transactions_total":
            outcome = labels.split('outcome="', 1)[-1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + value
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def offered(client, n: int, rate: float, max_tokens: int, timeout: float) -> list[bool]:
    """n requests, the i-th sent at i / rate s (open loop); each True once its final is read
    (read_committed) ending as asked."""
    t0, tasks = time.monotonic(), []

    async def one() -> bool:
        try:
            handle = await client.submit(
                prompt_token_ids=PROMPT_IDS, max_tokens=max_tokens, ignore_eos=True
            )
            result = await asyncio.wait_for(handle.result(check=False), timeout)
        except Exception:  # noqa: BLE001 - counted as not served
            return False
        return result.finish_reason == "length" and len(result.token_ids) == max_tokens

    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    return await asyncio.gather(*tasks)


async def measure(args, brk: Broker, worker, port: int, topics: Topics) -> dict:
    """The idle windows and the measured one, with the worker up (after the idle broker's)."""
    from inferline.producer.client import InferenceClient
    from inferline.config.settings import Settings

    settings = Settings(kafka={"bootstrap_servers": brk.bootstrap})
    client = InferenceClient(
        settings=settings, request_topic=topics.requests, cancel_topic=topics.cancel
    )
    await client.start()
    try:
        warm = await offered(client, args.warmup, args.rate, args.max_tokens, 60.0)
        idle_worker = await cpu_over(brk.pid, args.idle_s)
        m0, b0, w0, t0 = scrape(port), cpu_s(brk.pid), cpu_s(worker.pid), time.monotonic()
        served = await offered(client, args.requests, args.rate, args.max_tokens, 120.0)
        m1, b1, w1, t1 = scrape(port), cpu_s(brk.pid), cpu_s(worker.pid), time.monotonic()
    finally:
        await client.close()
    return {
        "warmup_served": sum(warm),
        "offered": len(served),
        "served": sum(served),
        "window_s": t1 - t0,
        "broker_cpu_s": None if b0 is None or b1 is None else b1 - b0,
        "worker_cpu_s": None if w0 is None or w1 is None else w1 - w0,
        "idle_worker_cpu_per_s": idle_worker,
        "transactions": delta(transactions(m1), transactions(m0)),
        # The machine's load over the window: on a shared machine CPU per request grows with it.
        "loadavg_1m_at_end": os.getloadavg()[0],
    }


def spawn(root: str, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-P", "-c", LAUNCH, root],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def run_side(args, brk: Broker, name: str, tree: dict, model: Path, label: str) -> dict:
    """One run: fresh topics and group, the idle broker, the worker of `tree`, the measurement."""
    from inferline.producer.client import create_topics

    stem = f"bench-broker-cost-{name}-{uuid.uuid4().hex[:8]}"
    topics = Topics(f"{stem}.requests", f"{stem}.cancel", f"{stem}.dlq", f"{stem}-workers")
    todo = [(topics.requests, args.partitions), (topics.cancel, 1), (topics.dlq, 1)]
    asyncio.run(admin(lambda a: create_topics(a, todo), bootstrap_servers=brk.bootstrap))
    idle_broker = asyncio.run(cpu_over(brk.pid, args.idle_s))
    port, log = free_port(), args.out.parent / f"broker_cost-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = spawn(tree["root"], worker_env(brk.bootstrap, topics, model, port), log)
    try:
        wait_ready(proc, port, log, time.monotonic() + args.ready_timeout)
        run = asyncio.run(measure(args, brk, proc, port, topics))
    finally:
        stop(proc)
        with contextlib.suppress(Exception):
            names = [topics.requests, topics.cancel, topics.dlq]
            asyncio.run(admin(lambda a: a.delete_topics(names), bootstrap_servers=brk.bootstrap))
    resolved = tree["root"] + "/worker/" in log.read_text(errors="replace")
    return figures(
        {
            "side": name,
            "label": label,
            "idle_broker_cpu_per_s": idle_broker,
            "worker_from_tree": resolved,
            **run,
        }
    )


def figures(run: dict) -> dict:
    """Per served request: transactions committed, broker CPU-ms (raw, less the idle broker, less
    the idle worker), the worker's CPU-ms."""
    n, window = run["served"], run["window_s"]

    def per_request_ms(cpu: float | None, idle_per_s: float | None = 0.0) -> float | None:
        if cpu is None or idle_per_s is None or not n:
            return None
        return 1e3 * (cpu - idle_per_s * window) / n

    committed = run["transactions"].get("committed")
    run.update(
        transactions_per_request=None if committed is None or not n else committed / n,
        broker_cpu_ms_raw=per_request_ms(run["broker_cpu_s"]),
        broker_cpu_ms=per_request_ms(run["broker_cpu_s"], run["idle_broker_cpu_per_s"]),
        broker_cpu_ms_less_idle_worker=per_request_ms(
            run["broker_cpu_s"], run["idle_worker_cpu_per_s"]
        ),
        worker_cpu_ms=per_request_ms(run["worker_cpu_s"]),
    )
    for key in ("idle_broker", "idle_worker"):  # CPU-s per s, shown as ms per s
        per_s = run[f"{key}_cpu_per_s"]
        run[f"{key}_ms_per_s"] = None if per_s is None else 1e3 * per_s
    ms = run["broker_cpu_ms"]
    run["target_met"] = None if ms is None else ms <= TARGET_CPU_MS
    return run


# ---- the report ---------------------------------------------------------------------------------

COLUMNS = (  # key, heading, width, format
    ("label", "run", 12, "s"),
    ("served", "served", 7, "d"),
    ("transactions_per_request", "txn/req", 9, ".3f"),
    ("broker_cpu_ms", "broker ms/req", 15, ".2f"),
    ("broker_cpu_ms_raw", "raw", 8, ".2f"),
    ("broker_cpu_ms_less_idle_worker", "-idle wkr", 11, ".2f"),
    ("idle_broker_ms_per_s", "idle ms/s", 11, ".1f"),
    ("idle_worker_ms_per_s", "wkr idle", 10, ".1f"),
    ("worker_cpu_ms", "worker ms/req", 15, ".2f"),
    ("loadavg_1m_at_end", "load", 6, ".1f"),
)


def table_row(texts: list[str]) -> str:
    """The run's name left-aligned, the figures right-aligned, in COLUMNS' widths."""
    widths = [w for _, _, w, _ in COLUMNS]
    return texts[0].ljust(widths[0]) + "".join(t.rjust(w) for t, w in zip(texts[1:], widths[1:]))


def summary(runs: list[dict]) -> dict:
    """Per side, the median over its runs of the per-request figures."""
    keys = ("transactions_per_request", "broker_cpu_ms", "broker_cpu_ms_raw", "worker_cpu_ms")
    out = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        rs = [r for r in runs if r["side"] == side]
        row = {}
        for k in keys:
            values = [r[k] for r in rs if r[k] is not None]
            row[k] = statistics.median(values) if values else None
        row["served"] = sum(r["served"] for r in rs)
        row["target_met"] = (
            row["broker_cpu_ms"] is not None and row["broker_cpu_ms"] <= TARGET_CPU_MS
        )
        out[side] = row
    base, cur = out.get("baseline"), out.get("current")
    if base and cur:
        cur["vs_baseline"] = {k: ratio(cur[k], base[k]) for k in keys[:2]}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_report(res: dict) -> None:
    s = res["settings"]
    print(
        f"\n{s['requests']} requests at {s['rate']:g}/s, {s['max_tokens']} token(s) each, "
        f"{s['partitions']} request partitions, broker: {s['broker']}; "
        f"CPU: {res['machine']['cpu']} ({res['machine']['cpu_count']} cores)"
    )
    for name, side in res["sides"].items():
        print(f"  {name}: {side.get('ref', 'this checkout')} {side['commit'][:12]}")
    head = table_row([h for _, h, _, _ in COLUMNS])
    print("\n" + head + "\n" + "-" * len(head))
    for r in res["runs"]:
        print(table_row([stats.fmt(r[k], spec) for k, _, _, spec in COLUMNS]))
    vs = res["summary"].get("current", {}).get("vs_baseline")
    if vs:
        print(
            f"\ncurrent / baseline (medians): transactions per request "
            f"x{stats.fmt(vs['transactions_per_request'], '.2f')}, broker CPU-ms per request "
            f"x{stats.fmt(vs['broker_cpu_ms'], '.2f')}"
        )
    print(
        f"\nbroker ms/req: broker CPU over the window less the idle broker's for as long, per "
        f"served request (target <= {TARGET_CPU_MS:g}); raw: nothing subtracted; -idle wkr: less "
        f"the broker's CPU beside the idle worker; idle columns in broker CPU-ms per second; load: "
        f"the machine's 1-minute load average at the window's end"
    )


def warm_broker(args, brk: Broker, tree: dict, model: Path) -> dict:
    """An unmeasured run first: the broker's first minutes under load cost more CPU per request
    (its JIT), which would otherwise fall on whichever side runs first."""
    print(f"broker warm-up: {args.broker_warmup} requests...", file=sys.stderr)
    warm = argparse.Namespace(**{**vars(args), "requests": args.broker_warmup, "idle_s": 0.0})
    run = run_side(warm, brk, "current", tree, model, "broker-warmup")
    return {k: run[k] for k in ("served", "broker_cpu_ms_raw", "transactions_per_request")}


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    keys = ("requests", "rate", "max_tokens", "warmup", "partitions", "idle_s", "repeats")
    keys += ("settle_s", "broker_warmup")
    res = stats.header(
        "broker_cost", argv, settings={k: getattr(args, k) for k in keys} | {"broker": args.broker}
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="inferline-tiny-model-") as tmp, sides(args) as trees:
        model = tiny_model(Path(tmp))
        res["sides"] = trees
        with broker(args.broker) as brk:
            asyncio.run(prime(brk.bootstrap, args.settle_s))
            if args.broker_warmup:
                res["broker_warmup"] = warm_broker(args, brk, trees["current"], model)
            order = stats.abba(list(trees), args.repeats)
            for i, name in enumerate(order):
                label = f"{name}#{i // len(trees) + 1}" if args.repeats > 1 else name
                print(f"run {i + 1}/{len(order)}: {label}...", file=sys.stderr)
                runs.append(run_side(args, brk, name, trees[name], model, label))
    res["runs"], res["summary"] = runs, summary(runs)
    res["target_cpu_ms_per_request"] = TARGET_CPU_MS
    return stats.save(res, args.out, started, print_report)


if __name__ == "__main__":
    main()
