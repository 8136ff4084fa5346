"""The local broker as benchmarks use it: a lease on it (scripts/kafka.sh) and its CPU from /proc.

Shared by bench/kafka_e2e.py, bench/read_committed.py and bench/transactions.py, so that every
figure of "broker CPU per request" is counted the same way: utime + stime of every thread of the
broker's JVM, before and after, and an idle window of the same broker to subtract.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KAFKA_SH = REPO / "scripts" / "kafka.sh"
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def acquire_broker(settings) -> bool:
    """Start the local broker if needed and hold a lease on it; False when it is someone else's."""
    from inferline.config.settings import is_local_broker

    if not is_local_broker(settings) or lease_path().exists():
        return False  # another broker, or this process holds a lease already (a pytest session)
    res = subprocess.run([str(KAFKA_SH), "acquire", str(os.getpid())], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"scripts/kafka.sh acquire failed:\n{res.stderr[-2000:]}")
    return res.stdout.strip() != "external"


def release_broker() -> None:
    subprocess.run([str(KAFKA_SH), "release", str(os.getpid())], capture_output=True, text=True, timeout=120)


def kafka_dir() -> Path:
    return Path(os.environ.get("INFERLINE_KAFKA_DIR", REPO / ".kafka"))


def lease_path() -> Path:
    return kafka_dir() / "leases" / str(os.getpid())


def broker_pid() -> int | None:
    path = kafka_dir() / "kafka.pid"
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process: its main thread (the worker's asyncio loop) and all the others
    (the engine thread and torch's pool). Empty where /proc is missing."""
    main = other = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that just ended
        secs = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
        if int(tid) == pid:
            main += secs
        else:
            other += secs
    return {"main_thread": main, "other_threads": other, "total": main + other}


def cpu_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def broker_cpu() -> float | None:
    pid = broker_pid()
    return thread_cpu(pid).get("total") if pid else None


async def idle_cpu(seconds: float) -> float | None:
    """The broker's CPU-seconds over `seconds` of nothing sent: its background, to subtract."""
    b0 = broker_cpu()
    await asyncio.sleep(seconds)
    b1 = broker_cpu()
    return None if b0 is None or b1 is None else b1 - b0


def per_request_ms(cpu_s: float | None, n: int) -> float | None:
    return None if cpu_s is None or not n else 1e3 * cpu_s / n
