"""The gateway's reply topics (producer/gateway/clients.py): one per replica, or one named for
every replica and made ahead (#51: no topic rights at run time)."""

from __future__ import annotations

import pytest

import inferline.producer.gateway.clients as clients
from inferline.config.settings import Settings
from inferline.producer.gateway.clients import ClientPool


def test_each_replica_has_its_own_reply_topic_unless_one_is_named():
    own = ClientPool(Settings(), set())
    assert own.clients[None].reply_topic == f"inferline.reply.{own.instance}"
    named = ClientPool(Settings(gateway={"reply_topic": "gw"}), set())
    assert named.clients[None].reply_topic == "inferline.reply.gw"
    tenants = ClientPool(
        Settings(gateway={"reply_topic": "gw"}, kafka={"tenancy": "topic"}), {"acme", "globex"}
    )
    assert {t: c.reply_topic for t, c in tenants.clients.items()} == {
        "acme": "inferline.reply.acme.gw",
        "globex": "inferline.reply.globex.gw",
    }


async def test_a_named_reply_topic_is_never_deleted(monkeypatch):
    def no_admin(**options):
        raise AssertionError("a named reply topic is every replica's: no admin client")

    monkeypatch.setattr(clients, "AIOKafkaAdminClient", no_admin)
    await ClientPool(Settings(gateway={"reply_topic": "gw"}), set())._delete_reply_topics()
    kafka = {"create_reply_topics": False}
    await ClientPool(Settings(kafka=kafka), set())._delete_reply_topics()


async def test_a_gateway_without_topic_rights_refuses_batches_by_name():
    """Each batch needs a reply topic of its own: with CREATE_REPLY_TOPICS off, POST /v1/batches
    is refused at once, naming the setting (it failed each batch at its start, as `internal`)."""
    from inferline.producer.gateway.batches import BatchService
    from inferline.producer.gateway.errors import OpenAIError

    service = BatchService(Settings(kafka={"create_reply_topics": False}), "g1")
    with pytest.raises(OpenAIError) as err:
        await service.create(None, {"input_file_id": "file-1", "endpoint": "/v1/chat/completions"})
    assert (err.value.status, err.value.code) == (501, "batches_unavailable")
    assert "INFERLINE_KAFKA__CREATE_REPLY_TOPICS" in err.value.message
