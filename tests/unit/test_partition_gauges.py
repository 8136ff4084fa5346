"""Per-partition gauges under topic tenancy: every tenant's request topic has a partition 0, so a
partition's lag and backlog are labelled by topic too (before, the lag was labelled by partition
alone: two tenants' partitions wrote one series, and revoking one removed the other's)."""

from __future__ import annotations

from aiokafka import TopicPartition

from inferline.worker.delivery.offsets import OffsetTracker
from inferline.worker.intake.group import Intake
from inferline.worker.service.metrics import Metrics

ACME, INITECH = (
    TopicPartition("inferline.requests.acme", 0),
    TopicPartition("inferline.requests.initech", 0),
)


def lag_by_topic(metrics: Metrics) -> dict[str, float]:
    samples = (s for m in metrics.consumer_lag.collect() for s in m.samples)
    return {s.labels["topic"]: s.value for s in samples if s.labels["partition"] == "0"}


def test_each_tenant_topic_s_partition_keeps_its_own_lag():
    intake = object.__new__(Intake)  # only what _set_lag reads
    intake._tracker, intake._m = OffsetTracker(), Metrics()
    for tp in (ACME, INITECH):
        intake._tracker.resume(tp, 0, None)
    intake._set_lag({ACME: (0, 5), INITECH: (0, 7)})
    assert lag_by_topic(intake._m) == {ACME.topic: 5, INITECH.topic: 7}
    intake._m.forget_partition(ACME.topic, 0)  # as a revoke of acme's partition does
    assert lag_by_topic(intake._m) == {INITECH.topic: 7}
