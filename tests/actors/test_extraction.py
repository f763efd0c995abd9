"""The offline extraction rules: each phrasing becomes its (category, key, value), and
questions and hypotheticals state nothing; an extracted fact's id is what it states (the Facts
actor that takes the candidates: tests/actors/test_facts.py; plugged-in extractors through the
engine: tests/test_extraction.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import actors.extraction as extraction
from actors.extraction import extract_facts

DEMO = Path(__file__).resolve().parents[2] / "engine" / "demo_data" / "conversation.json"


CASES = [
    ("My name is Maya Lindqvist and I live in Lisbon now.",
     {("identity", "name", "Maya Lindqvist"), ("identity", "location", "Lisbon")}),
    ("Big change: I moved to Porto, the flat is much brighter.",
     {("identity", "location", "Porto")}),
    ("I work as a data engineer, it's tiring but I like it.", {("identity", "job", "data engineer")}),
    ("Honestly ramen has become my favourite food lately, more than paella.",
     {("preference", "favourite food", "ramen")}),
    ("My sister is called Ines, she is two years older than me.",
     {("relationship", "sister:ines", "Ines")}),
    ("I'm allergic to peanuts.", {("constraint", "allergy:peanuts", "allergic")}),
    ("I'm vegetarian.", {("constraint", "diet", "vegetarian")}),
    ("From now on, answer in Spanish please.",
     {("instruction", "answer in", "always answer in Spanish")}),
    ("Never call me Tom.", {("instruction", "call me", "never call me Tom")}),
    ("I love jazz but I hate cilantro.",
     {("preference", "likes:jazz", "likes"), ("preference", "likes:cilantro", "dislikes")}),
    ("I speak Portuguese and English.", {("identity", "languages", "Portuguese and English")}),
    ("My timezone is Europe/Lisbon.", {("identity", "timezone", "Europe/Lisbon")}),
    ("Every Tuesday I go climbing with Ana.", {("schedule", "tuesday", "go climbing with Ana")}),
    ("I usually wake up at 6:30 am.", {("schedule", "wake up", "6:30 am")}),
    ("Hi! I'm Maya. I'm moving from Berlin to Lisbon at the end of the month.",
     {("identity", "name", "Maya"), ("identity", "location", "Lisbon")}),
    ("I work remotely as a data engineer for a logistics startup in Hamburg.",
     {("identity", "job", "data engineer")}),
    ("One more thing: I'm severely allergic to peanuts, so I'm nervous.",
     {("constraint", "allergy:peanuts", "allergic")}),
    ("Also, my dog Pixel is coming with me.", {("pet", "dog:pixel", "Pixel")}),
    ("Please keep answers short, by the way.",
     {("instruction", "keep answers", "always keep answers short")}),
    ("Also I went vegetarian last year.", {("constraint", "diet", "vegetarian")}),
    ("Hi! I'm Portuguese too.", set()),
    ("Do you like jazz?", set()),
    ("What if I moved to Porto?", set()),
    ("I tried a new coffee place near the station.", set()),
    ("I moved to Lisbon.", {("identity", "location", "Lisbon")}),
    # preferences
    ("I prefer tea over coffee.", {("preference", "likes:tea", "likes")}),
    ("I'd rather have tea than coffee.", {("preference", "likes:tea", "likes")}),
    ("I'd rather not talk about my ex.", {("preference", "likes:talk about ex", "dislikes")}),
    ("I can't stand cilantro.", {("preference", "likes:cilantro", "dislikes")}),
    ("I'm a big fan of jazz.", {("preference", "likes:jazz", "likes")}),
    ("I love café au lait.", {("preference", "likes:café au lait", "likes")}),
    # constraints and instructions
    ("I'm intolerant to gluten.", {("constraint", "intolerance:gluten", "intolerant")}),
    ("I can't drink milk.", {("constraint", "avoids:milk", "avoids")}),
    ("Don't use emojis.", {("instruction", "use emojis", "never use emojis")}),
    ("Please don't call me Tom.", {("instruction", "call me", "never call me Tom")}),
    ("I want you to answer in Portuguese.",
     {("instruction", "answer in", "always answer in Portuguese")}),
    ("Don't book it yet.", set()),
    ("Don't worry about it.", set()),
    ("I need you to write an email to my boss.", set()),
    # relations: people one has one of, people one has several of, and pets
    ("My wife is called Ines.", {("relationship", "wife", "Ines")}),
    ("My sister Ana lives in Porto.", {("relationship", "sister:ana", "Ana")}),
    ("Ana is my sister.", {("relationship", "sister:ana", "Ana")}),
    ("My friend Tom and my friend Sara came over.",
     {("relationship", "friend:tom", "Tom"), ("relationship", "friend:sara", "Sara")}),
    ("I have a cat named Mochi.", {("pet", "cat:mochi", "Mochi")}),
    ("My puppy Biscuit chewed my shoe.", {("pet", "dog:biscuit", "Biscuit")}),
    ("My dog is tired.", set()),
    ("This is my sister.", set()),
    # a few other languages' names and homes
    ("Me llamo Sofía y vivo en Madrid.",
     {("identity", "name", "Sofía"), ("identity", "location", "Madrid")}),
    ("Je m'appelle Élodie.", {("identity", "name", "Élodie")}),
    ("Ich heiße Jürgen und ich wohne in München.",
     {("identity", "name", "Jürgen"), ("identity", "location", "München")}),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_the_rules_extract_the_common_facts_and_skip_questions(text, expected) -> None:
    """Each rule turns its phrasing into (category, key, value); questions and hypotheticals
    state nothing."""
    assert {(c.category, c.key, c.value) for c in extract_facts(text)} == expected


GATED = [(rule.pattern, rule.needs) for rule in extraction._RULES]
GATED.append((extraction._GREETING_NAME, extraction._GREETING_NEEDS))


@pytest.mark.parametrize("index", range(len(GATED)))
def test_every_match_of_a_rule_holds_one_of_its_needs(index) -> None:
    """A rule (or the greeting) is skipped for ASCII text that holds none of its needs, so
    each needs list must be something every match holds: here for random ASCII text the
    rule's own pattern matches (hypothesis writes it from the pattern, case mixed at random)."""
    pattern, needs = GATED[index]

    @settings(max_examples=25, derandomize=True, deadline=None)
    @given(st.from_regex(pattern, alphabet=st.characters(max_codepoint=127)))
    def check(text: str) -> None:
        # Every match the gated code could find holds a need: each one finditer gives, not
        # only the text around it (which from_regex pads at random).
        matches = [m.group(0).lower() for m in pattern.finditer(text)]
        assert matches
        for match in matches:
            assert any(need in match for need in needs), (match, needs)

    check()


def test_the_needs_change_no_fact_extracted(monkeypatch) -> None:
    """The demo's conversation and the phrasings above give the same facts with every rule
    run on every sentence."""
    texts = [text for user in json.loads(DEMO.read_text())["users"]
             for session in user["sessions"] for role, text in session["turns"]]
    texts += [text for text, _ in CASES]
    gated = [extract_facts(text) for text in texts]
    monkeypatch.setattr(extraction, "_RULES", tuple(
        dataclasses.replace(rule, needs=("",)) for rule in extraction._RULES))
    monkeypatch.setattr(extraction, "_NEEDS", ("",))
    monkeypatch.setattr(extraction, "_GREETING_NEEDS", ("",))
    assert [extract_facts(text) for text in texts] == gated
    assert sum(map(len, gated)) > 40
