"""The gateway's reply topics (producer/gateway/clients.py): one per replica, or one named for
every replica and made ahead (#51: no topic rights at run time)."""

from __future__ import annotations

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
