"""producer/topics.py's create_topics against a stand-in admin client: topics that exist are not
asked for (no CreateTopics, so no CREATE right on them and no wait on a lost broker taken for the
controller), and a broker that does not answer gives way to another. On the real cluster:
tests/kafka/test_replication.py."""

from __future__ import annotations

from types import SimpleNamespace

from aiokafka.errors import NodeNotReadyError

from inferline.producer.topics import create_topics, topic_partitions


class Admin:
    """The calls create_topics makes; the first `unreachable` metadata reads find a lost broker."""

    def __init__(self, existing: set[str], unreachable: int = 0) -> None:
        self.existing, self.unreachable = set(existing), unreachable
        self.asked: list[str] = []

    def _reach(self) -> None:
        if self.unreachable:
            self.unreachable -= 1
            raise NodeNotReadyError("node 3 is not ready")

    async def list_topics(self) -> list[str]:
        self._reach()
        return sorted(self.existing)

    async def describe_topics(self, topics: list[str]) -> list[dict]:
        self._reach()
        return [
            {"topic": t, "error_code": 0, "partitions": [{"partition": 0, "leader": 1}]}
            for t in topics
        ]

    async def create_topics(self, new: list) -> SimpleNamespace:
        self.asked += [t.name for t in new]
        self.existing.update(t.name for t in new)
        return SimpleNamespace(topic_errors=[(t.name, 0, None) for t in new])


async def test_topics_that_exist_are_not_asked_for():
    admin = Admin({"llm.requests.batch.files", "llm.requests.batch.state"})
    wanted = [("llm.requests.batch.files", 1), ("llm.requests.batch.state", 1)]
    assert await create_topics(admin, wanted) == []
    assert admin.asked == []


async def test_only_the_missing_are_created_and_a_lost_broker_gives_way_to_another():
    admin = Admin({"inferline.reply.shared"}, unreachable=2)
    wanted = [("inferline.reply.shared", 4), ("inferline.reply.new", 4)]
    assert await create_topics(admin, wanted, replication_factor=3) == ["inferline.reply.new"]
    assert admin.asked == ["inferline.reply.new"]


async def test_a_reply_topics_partitions_are_read_past_a_lost_broker():
    """A gateway starting while a lost broker is still in the metadata (watch_shared)."""
    assert await topic_partitions(Admin({"inferline.reply.shared"}, unreachable=3), "t") == [0]
