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


class BehindNode:
    """A node that owns every partition but never sees a call applied in time (it lost the
    lease right after publishing, or its applier is behind)."""

    results: dict = {}

    def owns(self, p: int) -> bool:
        return True

    async def wait_applied(self, p: int, min_seq: int, timeout: float) -> bool:
        return False


async def test_a_call_in_the_log_but_not_seen_applied_is_not_an_invitation_to_retry(
        store_path) -> None:
    """A logged call (a note, a fact) whose application the node did not see in time was a
    503 LogUnavailable, which a client retries; but the call was in the log, and the
    partition's owner applies it: the retry stored the note twice. It is CallLogged now,
    with the call's log_seq, a 202 over HTTP, saying not to retry and how to read it."""
    import httpx

    from engine._server import create_app
    from engine.cluster import CallLogged, ClusterEngine, LogUnavailable

    from ..conftest import open_engine

    log = KeptLog()
    async with open_engine(store_path) as engine:
        cluster = ClusterEngine(engine, log, BehindNode())  # type: ignore[arg-type]
        with pytest.raises(CallLogged, match=r"in the log at 1.*do not retry.*min_seq=1"
                           ) as caught:
            await cluster.store_note("ana", "Allergic to peanuts")
        assert caught.value.log_seq == 1 and not isinstance(caught.value, LogUnavailable)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cluster)),
                                     base_url="http://127.0.0.1") as http:
            answer = await http.post("/v1/users/ana/notes", json={"text": "Likes jazz"})
        assert answer.status_code == 202, answer.text
        assert answer.json()["error"] == "CallLogged" and answer.json()["log_seq"] == 2
    assert len(log.published) == 2


def test_a_publish_whose_id_is_in_process_waits_for_it_instead_of_refusing() -> None:
    """JetStream answers 409 (err_code 10158, "duplicate message id is in process") to a
    retry of an entry whose first attempt has not settled, as while the log regains its
    quorum: the entry then lands. The client took that for a refusal and answered 503,
    which invites the caller to retry with a new id, so the turn was stored twice. It waits
    for the first attempt's PubAck, as for a 503."""
    import asyncio
    from types import SimpleNamespace

    import nats.js.errors

    from engine.cluster._log import _Client

    class InProcess:  # the JetStream context at the client's edge
        def __init__(self) -> None:
            self.calls = 0

        async def publish(self, subject, payload, timeout, headers):
            self.calls += 1
            if self.calls < 3:
                raise nats.js.errors.APIError(
                    code=409, err_code=10158, description="duplicate message id is in process")
            return SimpleNamespace(seq=41, duplicate=True)

    client = _Client(ClusterConfig.checked({"publish_retry_seconds": 30.0}))
    client.js = InProcess()
    assert asyncio.run(client.publish("turns.p4", b"{}", "t_1")) == (41, True)
    assert client.js.calls == 3


@pytest.mark.parametrize("step", ["purge", "delete_where"])
def test_a_forget_that_meets_a_log_without_quorum_is_log_unavailable(step) -> None:
    """forget_user purges the user's subject and forget_session deletes its entries through
    a consumer: a log without quorum for a moment raised nats' TimeoutError or
    ServiceUnavailableError out of both, and the node answered 500 with a traceback. Both
    are LogUnavailable (503, retry), as a failed delete already was."""
    import asyncio

    import nats.errors

    from engine.cluster._log import LogUnavailable, _Client

    class NoQuorum:  # the JetStream context at the client's edge
        async def purge_stream(self, *args, **kwargs):
            raise nats.errors.TimeoutError

        async def add_consumer(self, *args, **kwargs):
            raise nats.errors.TimeoutError

    client = _Client(ClusterConfig.checked({}))
    client.js = NoQuorum()
    call = (client.purge("turns.p4.ana", None) if step == "purge"
            else client.delete_where("turns.p4.ana", 10, lambda data: True, "forget-1"))
    with pytest.raises(LogUnavailable, match="TimeoutError"):
        asyncio.run(call)
