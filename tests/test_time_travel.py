"""Time travel over facts: profile(as_of=) answers as the store knew it then."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from engine import InvalidInput

from .conftest import T0, open_engine


class ManualClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self):
        return self.now


async def test_profile_as_of_answers_as_the_store_knew_it_then(store_path) -> None:
    """Lisbon from March, corrected to Porto in May (valid from April, learned late), then
    retracted in June: each moment gets what the store held as true then."""
    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("maya", "identity", "location", "Lisbon",
                                valid_at=T0)                                     # 1 March
        clock.now = T0 + timedelta(days=61)                                      # 1 May
        await mem.remember_fact("maya", "identity", "location", "Porto", confidence=0.95,
                                valid_at=T0 + timedelta(days=31))                # since April
        await mem.remember_fact("maya", "preference", "coffee", "espresso")
        clock.now = T0 + timedelta(days=92)                                      # 1 June
        await mem.forget_fact("maya", "preference", "coffee")

        async def at(days: float) -> set[tuple[str, str]]:
            facts = await mem.profile("maya", as_of=T0 + timedelta(days=days))
            return {(f.key, f.value) for f in facts}

        assert await at(-1) == set()
        assert await at(10) == {("location", "Lisbon")}
        # Mid-April: Porto was true then, but the store only learned it in May.
        assert await at(45) == {("location", "Lisbon")}
        assert await at(70) == {("location", "Porto"), ("coffee", "espresso")}
        assert await at(100) == {("location", "Porto")}
        assert {(f.key, f.value) for f in await mem.profile("maya")} == {("location", "Porto")}
        history = await mem.fact_history("maya", "identity", "location")
        assert [(f.value, f.valid_at, f.invalid_at, f.created_at, f.expired_at)
                for f in history] == [
            ("Lisbon", T0, T0 + timedelta(days=31), T0, T0 + timedelta(days=61)),
            ("Porto", T0 + timedelta(days=31), None, T0 + timedelta(days=61), None)]
        with pytest.raises(InvalidInput, match="as_of"):
            await mem.profile("maya", as_of=datetime(2026, 3, 1))
