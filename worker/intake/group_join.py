"""One JoinGroup request naming every assignor: aiokafka joins once per assignor
(aio-libs/aiokafka#1168), and members out of step then keep each other rebalancing.
"""

from __future__ import annotations

import asyncio

import aiokafka.errors as Errors
import structlog
from aiokafka.consumer import group_coordinator
from aiokafka.coordinator.protocol import ConsumerProtocol
from aiokafka.protocol.group import JoinGroupRequest

log = structlog.get_logger(__name__)


class SingleJoinRebalance(group_coordinator.CoordinatorGroupRebalance):
    async def perform_group_join(self):
        """Join with every assignor's protocol at once, then sync. Returns (protocol, assignment
        bytes), or None to try again."""
        response = await self._join(self._protocols())
        if response is None:
            return None
        error = Errors.for_code(response.error_code)
        if error is not Errors.NoError:
            await self._on_join_error(error)
            return None
        coordinator = self._coordinator
        coordinator.member_id, coordinator.generation = response.member_id, response.generation_id
        log.debug(
            "group.joined",
            group=self.group_id,
            generation=response.generation_id,
            leader=response.leader_id == response.member_id,
        )
        if response.leader_id == response.member_id:
            assignment = await self._on_join_leader(response)
        else:
            assignment = await self._on_join_follower()
        return None if assignment is None else (response.group_protocol, assignment)

    def _protocols(self) -> list[tuple[str, bytes]]:
        topics = self._subscription.topics
        out = []
        for assignor in self._assignors:
            metadata = assignor.metadata(topics)
            out.append(
                (assignor.name, metadata if isinstance(metadata, bytes) else metadata.encode())
            )
        return out

    async def _join(self, protocols: list[tuple[str, bytes]]):
        """The JoinGroup response once the broker gave this member an id (KIP-394); None without a
        coordinator or after a subscription change."""
        coordinator = self._coordinator
        while True:
            request = JoinGroupRequest(
                self.group_id,
                self._session_timeout_ms,
                self._rebalance_timeout_ms,
                coordinator.member_id,
                coordinator._group_instance_id,
                ConsumerProtocol.PROTOCOL_TYPE,
                protocols,
            )
            try:
                response = await coordinator._send_req(request)
            except Errors.KafkaError:  # the coordinator lookup that follows backs off
                return None
            if not self._subscription.active:
                return None
            if Errors.for_code(response.error_code) is not Errors.MemberIdRequired:
                return response
            coordinator.member_id = response.member_id

    async def _on_join_error(self, error: type[Errors.KafkaError]) -> None:
        """As aiokafka: retry, with a fresh member id, or at a new coordinator; raise the fatal."""
        if error is Errors.GroupLoadInProgressError:
            await asyncio.sleep(self._retry_backoff_ms / 1000)
        elif error is Errors.UnknownMemberIdError:
            self._coordinator.reset_generation()
        elif error in (
            Errors.GroupCoordinatorNotAvailableError,
            Errors.NotCoordinatorForGroupError,
        ):
            self._coordinator.coordinator_dead()
        elif error in (
            Errors.InconsistentGroupProtocolError,
            Errors.InvalidSessionTimeoutError,
            Errors.InvalidGroupIdError,
        ):
            log.error("group.join_failed", group=self.group_id, error=error.__name__)
            raise error()
        elif error is Errors.GroupAuthorizationFailedError:
            raise error(self.group_id)
        else:
            raise Errors.KafkaError(repr(error()))


def install() -> None:
    """Every aiokafka consumer group of this process joins with SingleJoinRebalance."""
    group_coordinator.CoordinatorGroupRebalance = SingleJoinRebalance
