"""Tenant isolation: no read path returns another user's turns, whatever the interleaving."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import open_engine

USERS = st.sampled_from(["ana", "bo", "ana:", "an", "b\u00f6"])
SESSIONS = st.sampled_from(["s", "s1", "s\u00e9", "1"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), USERS, SESSIONS),
        st.tuples(st.just("forget_session"), USERS, SESSIONS),
        st.tuples(st.just("forget_user"), USERS, st.none()),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 2**16))
async def test_reads_see_exactly_the_users_own_turns(tmp_path_factory, ops, seed) -> None:
    """Random adds and forgets across users whose ids prefix each other never leak across them."""
    path = tmp_path_factory.mktemp("tenancy")
    model: dict[tuple[str, str], list[str]] = {}
    async with open_engine(path) as mem:
        for i, (op, user, session) in enumerate(ops):
            if op == "add":
                text = f"{user}|{session}|{seed}|{i}"
                await mem.add_turn(user, session, "user", text)
                model.setdefault((user, session), []).append(text)
            elif op == "forget_session":
                await mem.forget_session(user, session)
                model.pop((user, session), None)
            else:
                await mem.forget_user(user)
                model = {k: v for k, v in model.items() if k[0] != user}
        for user in ["ana", "bo", "ana:", "an", "b\u00f6"]:
            listed = {s.session_id for s in await mem.list_sessions(user)}
            assert listed == {s for (u, s) in model if u == user}
            for session in listed:
                history = await mem.session_history(user, session, limit=1000)
                assert [t.text for t in history] == model[(user, session)]
    async with open_engine(path) as mem:
        for (user, session), texts in model.items():
            history = await mem.session_history(user, session, limit=1000)
            assert [t.text for t in history] == texts
