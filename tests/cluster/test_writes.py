"""The writes a node or a thin client publishes (``LogWriter``): the checks that run before
anything reaches the log, against a log that keeps what it is sent."""

from __future__ import annotations

import pytest

from actors.base.config import Config
from engine import InvalidInput
from engine.cluster._log import ClusterConfig, Pending
from engine.cluster._writes import LogWriter


class KeptLog:
    """A log that keeps the message ids published to it and acknowledges each at once."""

    def __init__(self) -> None:
        self.config = ClusterConfig()
        self.max_payload = 1 << 20
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes, msg_id: str) -> tuple[int, bool]:
        self.published.append(msg_id)
        return len(self.published), False

    def publish_soon(self, subject: str, payload: bytes, msg_id: str) -> Pending:
        self.published.append(msg_id)
        pending = Pending()
        pending.result, pending.done = (len(self.published), False), True
        return pending


@pytest.mark.parametrize("durable", ["no", 0, 1, None], ids=repr)
async def test_durable_is_true_or_false_and_anything_else_publishes_nothing(durable) -> None:
    """durable="no" was truthy: the turn was published and waited for as if durable=True;
    any value but True or False is refused naming durable, before anything is published."""
    log = KeptLog()
    writer = LogWriter(log, Config())  # type: ignore[arg-type]
    turn = {"user_id": "ana", "session_id": "s1", "role": "user", "text": "hi"}
    with pytest.raises(InvalidInput, match="durable: expected True or False, found ") as info:
        await writer.add_turn("ana", "s1", "user", "hi", durable=durable)
    assert info.value.field == "durable"
    with pytest.raises(InvalidInput, match="durable: expected True or False, found ") as info:
        await writer.add_turns([turn, turn], durable=durable)
    assert info.value.field == "durable"
    assert log.published == []
    assert (await writer.add_turn("ana", "s1", "user", "hi", durable=True)).log_seq == 1
    assert len(await writer.add_turns([turn], durable=False)) == 1
    assert len(log.published) == 2
