"""The Kafka ACLs of topic tenancy (docs/security.md) as data (`recipe()`), printed or applied by
`inferline topics acls`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AclRule:
    principal: str  # e.g. User:acme
    operation: str  # READ, WRITE, CREATE, ...
    resource: str  # TOPIC, GROUP or TRANSACTIONAL_ID
    name: str
    prefixed: bool = False

    def command(self, bootstrap: str) -> str:
        kind = {"TOPIC": "--topic", "GROUP": "--group", "TRANSACTIONAL_ID": "--transactional-id"}[
            self.resource
        ]
        pattern = " --resource-pattern-type prefixed" if self.prefixed else ""
        return (
            f"kafka-acls.sh --bootstrap-server {bootstrap} --add "
            f"--allow-principal {self.principal} "
            f"--operation {''.join(w.capitalize() for w in self.operation.split('_'))} "
            f"{kind} {self.name}{pattern}"
        )


def recipe(kafka, worker: str, tenants: list[str]) -> list[AclRule]:
    """Workers read tenants' request and cancel topics and write replies and dead letters (in
    transactions named by the group id); each tenant writes its own request and cancel topics and
    reads topics under its own reply prefix, and creates them there unless they are made ahead
    (`kafka.create_reply_topics` false)."""
    req, cancel, reply = kafka.request_topic, kafka.cancel_topic, kafka.reply_topic_prefix
    rules = [
        AclRule(worker, "READ", "TOPIC", f"{req}.", prefixed=True),
        AclRule(worker, "READ", "TOPIC", f"{cancel}.", prefixed=True),
        AclRule(worker, "READ", "GROUP", kafka.group_id),
        AclRule(worker, "WRITE", "TOPIC", reply, prefixed=True),
        # A reply topic's limits are read before a transaction may touch it
        AclRule(worker, "DESCRIBE_CONFIGS", "TOPIC", reply, prefixed=True),
        AclRule(worker, "WRITE", "TRANSACTIONAL_ID", f"{kafka.group_id}.", prefixed=True),
        AclRule(worker, "DESCRIBE", "TRANSACTIONAL_ID", f"{kafka.group_id}.", prefixed=True),
        AclRule(worker, "WRITE", "TOPIC", kafka.dlq_topic),
    ]
    for tenant in tenants:
        principal = f"User:{tenant}"
        rules += [
            AclRule(principal, "WRITE", "TOPIC", f"{req}.{tenant}"),
            AclRule(principal, "WRITE", "TOPIC", f"{cancel}.{tenant}"),
            AclRule(principal, "READ", "TOPIC", f"{reply}{tenant}.", prefixed=True),
        ]
        if kafka.create_reply_topics:
            rules.append(AclRule(principal, "CREATE", "TOPIC", f"{reply}{tenant}.", prefixed=True))
    return rules


async def apply(kafka, rules: list[AclRule]) -> None:
    """Create the rules on the broker, as `kafka`'s principal (an admin)."""
    import asyncio

    from confluent_kafka.admin import AdminClient

    client = AdminClient(kafka.librdkafka_config())  # held until every result is in
    for future in client.create_acls(confluent_bindings(rules)).values():
        await asyncio.to_thread(future.result, 30)


def confluent_bindings(rules: list[AclRule]) -> list:
    """The rules as confluent-kafka AclBindings."""
    from confluent_kafka import admin

    return [
        admin.AclBinding(
            getattr(admin.ResourceType, r.resource),
            r.name,
            admin.ResourcePatternType.PREFIXED if r.prefixed else admin.ResourcePatternType.LITERAL,
            r.principal,
            "*",
            getattr(admin.AclOperation, r.operation),
            admin.AclPermissionType.ALLOW,
        )
        for r in rules
    ]
