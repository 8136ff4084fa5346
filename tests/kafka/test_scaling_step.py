"""A scaling step under load: two workers serve long streaming requests on 8 partitions (long by
tokens and a paced engine step, whatever the machine) and a third joins, or one of three leaves
with a SIGTERM drain. Only the requests of partitions that moved to another worker are requeued;
the others stream on through the step; every request ends with exactly one final `done`, read
with read_committed. The scenario is bench/scaling_step.py's (`python -m bench.scaling_step`
measures it); each worker is a process."""

from __future__ import annotations

import pytest

from bench.scaling_step import PARTITIONS, QUICK, SHARE, Load, figures, run_step
from tests.chaos_fixtures import running_private_broker
from tests.worker_fixtures import attempts_of, check_attempts

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


# Three worker processes, a minute or more each: `make chaos` (and make test-full) runs both;
# `make test` keeps test_worker_process.py's join and SIGTERM drain under load.
@pytest.mark.full
@pytest.mark.chaos
@pytest.mark.parametrize("step", ["join", "leave"])
async def test_a_scaling_step_requeues_only_the_requests_of_moved_partitions(
    kafka_bootstrap, tmp_path, step
):
    run = await run_step(kafka_bootstrap, step, "incremental", tmp_path, QUICK)
    assert 0 < len(run.moved) < PARTITIONS, (run.before, run.after)
    requeued = run.requeued()
    running = len(run.running_at(run.begin))
    print(
        f"{step}: moved {sorted(run.moved)}; requeued {len(requeued)} of {running} running, "
        f"on partitions {sorted(set(requeued.values()))}"
    )
    assert {p for p in requeued.values()} <= run.moved
    through = {i for i in run.ran_through() if run.partition_of[i] not in run.moved}
    assert through, "no request of a kept partition was running through the step"
    for i in through:  # kept streaming: one attempt, never paused into a new one
        assert len(attempts_of([e for _, e in run.events[i]])) == 1
    for i in run.sent_at:
        check_attempts([e for _, e in run.events[i]])
        assert len(run.finals(i)) == 1, run.events[i]


@pytest.fixture(scope="module")
def share_broker(tmp_path_factory):
    pytest.importorskip("confluent_kafka", minversion="2.16")
    yield from running_private_broker(
        tmp_path_factory.mktemp("kafka-share"), INFERLINE_KAFKA_VERSION="4.2.0"
    )


@pytest.mark.full  # the bench's share mode, smoke-run (test_share_intake.py covers joins and kills)
@pytest.mark.parametrize("step", ["join", "leave"])
async def test_a_share_mode_step_finishes_every_request_once(share_broker, tmp_path, step):
    """`python -m bench.scaling_step --mode share` on a quick load: the joiner takes work, or the
    leaver drains; every request ends with exactly one final `done`."""
    load = Load(**{**QUICK.__dict__, "initial": SHARE.initial, "max_tokens": 16, "step_delay_s": 0})
    run = await run_step(share_broker.bootstrap, step, "share", tmp_path, load, "share")
    result = figures(run, "share")
    print(result)
    assert result["finished_more_than_once"] == 0 and result["running_at_step"] > 0
    for i in run.sent_at:
        check_attempts([e for _, e in run.events[i]])
        assert len(run.finals(i)) == 1, run.events[i]
