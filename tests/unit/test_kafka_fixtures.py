"""The broker tests' own client helpers: a broker that does not answer for a moment (resumed
after SIGSTOP, restarted) is asked again, not taken as a failed test (seen in CI)."""

import time

from aiokafka.errors import NodeNotReadyError

from tests import kafka_fixtures


class _WakingAdmin:
    """Fails its first metadata request as a broker just resumed does, then answers."""

    def __init__(self, **_) -> None:
        self.calls = 0

    async def start(self) -> None:
        pass

    async def describe_topics(self) -> list[dict]:
        self.calls += 1
        if self.calls == 1:
            raise NodeNotReadyError("Attempt to send a request to node which is not ready")
        partitions = [{"partition": 1}, {"partition": 0}]
        return [{"topic": "replies", "error_code": 0, "partitions": partitions}]

    async def close(self) -> None:
        pass


async def test_waiting_for_a_topic_outlasts_a_broker_that_does_not_answer_yet(monkeypatch):
    monkeypatch.setattr(kafka_fixtures, "AIOKafkaAdminClient", _WakingAdmin)
    deadline = time.monotonic() + 30
    assert await kafka_fixtures._wait_partitions("localhost:1", "replies", deadline) == [0, 1]
