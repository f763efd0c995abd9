"""A deterministic generator of multi-session conversations with questions and their evidence.

Every user gets sessions spread over months: small talk and work chatter (with distractors that
share words with the facts), and planted facts of four kinds, each with a question whose
evidence is the turn (or turns) that answer it:

- plain:     a fact said once ("My sister is called Clara").
- updated:   a fact said, then changed sessions later; the evidence is the *latest* statement.
- temporal:  an event told with a date reference ("last Tuesday I went to the dentist").
- combined:  an answer that needs two turns ("My dog is Pixel" + "Pixel turned 5 today").

Same seed, same conversations, same questions.

``hard=True`` makes the set ``bench/recall.py quality`` measures: 24 sessions of 30 turns per
user (720 turns), both speakers named in every turn (``"Sam: ..."``, as in LoCoMo, so a name
carries no signal), the sister's and the pet's names also in small talk, a third of the
questions paraphrased so they share no content word with their evidence ("Who is my older
sibling?" for "My sister is called Clara"), and a second two-turn question ("Which city does my
sister live in?": her name in one turn, her move in another).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

NAMES = ["Clara", "Jonas", "Mei", "Tariq", "Ines", "Bruno", "Aiko", "Farah", "Pavel", "Lucia",
         "Omar", "Greta", "Ravi", "Noor", "Elena", "Kofi"]
PETS = ["Pixel", "Mochi", "Biscuit", "Luna", "Toast", "Pepper", "Nimbus", "Olive"]
CITIES = ["Lisbon", "Porto", "Braga", "Madrid", "Valencia", "Lyon", "Ghent", "Turin", "Bergen",
          "Krakow", "Tallinn", "Seville"]
JOBS = ["nurse", "data engineer", "carpenter", "teacher", "pharmacist", "pilot", "architect",
        "baker", "translator", "electrician"]
FOODS = ["sushi", "lentil soup", "pad thai", "ramen", "falafel", "paella", "goulash", "pierogi"]
HOBBIES = ["bouldering", "watercolour painting", "chess", "sailing", "pottery", "birdwatching",
           "salsa dancing", "woodworking"]
EVENTS = [("went to the dentist", "When did I go to the dentist?"),
          ("ran a 10k race", "When did I run the 10k race?"),
          ("visited my grandmother", "When did I visit my grandmother?"),
          ("had a job interview", "When was my job interview?"),
          ("fixed the kitchen sink", "When did I fix the kitchen sink?"),
          ("saw a jazz concert", "When did I see the jazz concert?")]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

SMALL_TALK = [
    "The weather was grey again today, I stayed in with a book.",
    "Work was busy, three meetings back to back about the quarterly plan.",
    "I tried a new coffee place near the station, the flat white was good.",
    "My neighbour's dog barked all night, I barely slept.",
    "A friend's sister is visiting town this week, we might get dinner.",
    "I need to renew my passport before summer.",
    "The train was late by twenty minutes this morning.",
    "I'm thinking about repainting the living room a lighter colour.",
    "We had a long debate at work about moving the office.",
    "I watched a documentary about deep sea creatures, fascinating.",
    "My phone battery keeps dying, probably time for a new one.",
    "I cooked dinner for friends, everyone liked the dessert.",
    "The gym was packed so I went for a walk by the river instead.",
    "I'm reading a novel about a family of clockmakers.",
    "Someone at work adopted a cat and shows us photos every day.",
    "My cousin moved to a new city and keeps sending postcards.",
]
ASSISTANT = [
    "That sounds like a full day. Anything you want to plan for tomorrow?",
    "Noted. Do you want me to remind you about it later?",
    "Nice! Tell me more if you like.",
    "Sorry to hear that. I hope the rest of the week is calmer.",
    "Good idea. Want some suggestions?",
    "Understood, I'll keep that in mind.",
]


# Questions asked without the evidence's words (hard mode), by the plain question.
PARAPHRASES = {
    "What is my sister called?": "Who is my older sibling?",
    "What do I do for a living?": "What is my profession?",
    "Which hobby did I take up?": "What pastime keeps me busy on Saturdays and Sundays?",
    "Which city do I live in now?": "Where is home these days?",
    "What is my favourite food these days?": "Which dish do I crave most at the moment?",
    "How old is my dog?": "What age did my terrier reach?",
    "When did I go to the dentist?": "When was my dental appointment?",
    "When did I run the 10k race?": "When did I do the running competition?",
    "When did I visit my grandmother?": "When did I see my gran?",
    "When was my job interview?": "When did I meet the recruiters?",
    "When did I fix the kitchen sink?": "When did I repair the plumbing?",
    "When did I see the jazz concert?": "When did I hear live music?",
    "Which city does my sister live in?": "Where did my sibling relocate?",
}
NAME_TALK = ["{sister} called me about the weather, nothing new.",
             "{pet} chewed a shoe again this morning.",
             "{sister} says work is busy for her too.",
             "I took {pet} to the park, it was muddy."]


@dataclass
class Planted:
    """A turn to plant: where, what, and which question it serves as evidence for."""

    session: int
    text: str
    evidence_for: list[int] = field(default_factory=list)


@dataclass
class Question:
    user_id: str
    kind: str
    text: str
    evidence: list[tuple[str, int, int]]  # (session id, turn index) per evidence turn, + seq
    evidence_turn_ids: list[str] = field(default_factory=list)
    evidence_text: str = ""  # the last evidence turn's text (for an updated answer: the new one)


@dataclass
class Conversation:
    user_id: str
    sessions: list[tuple[str, datetime, list[tuple[str, str]]]]  # id, start, [(role, text)]


def generate(users: int = 12, sessions: int = 12, turns: int = 20, seed: int = 7,
             hard: bool = False) -> tuple[list[Conversation], list[Question]]:
    """Conversations and questions; question evidence is located by (session, turn index).
    ``hard``: the harder set (see the module docstring); ``sessions`` and ``turns`` become 24
    and 30."""
    if hard:
        sessions, turns = 24, 30
    rng = random.Random(seed)
    start = datetime(2026, 1, 5, 9, 0, tzinfo=timezone.utc)
    conversations: list[Conversation] = []
    questions: list[Question] = []
    for u in range(users):
        user_id = f"user{u:03d}"
        plan: list[tuple[int, str, int | None]] = []  # (session, text, question index or None)
        local_q: list[tuple[str, str, list[int]]] = []  # kind, question, plan indices

        def plant(session: int, text: str, plan: list = plan) -> int:
            plan.append((session, text, None))
            return len(plan) - 1

        sister, pet, job = rng.choice(NAMES), rng.choice(PETS), rng.choice(JOBS)
        city1, city2 = rng.sample(CITIES, 2)
        food, hobby = rng.choice(FOODS), rng.choice(HOBBIES)
        event, event_question = rng.choice(EVENTS)
        day = rng.choice(WEEKDAYS)
        age = rng.randint(2, 12)
        s = list(range(sessions))
        rng.shuffle(s)
        local_q.append(("plain", "What is my sister called?",
                        [plant(s[0], f"My sister is called {sister}, she is two years older than me.")]))
        local_q.append(("plain", "What do I do for a living?",
                        [plant(s[1], f"I work as {'an' if job[0] in 'aeiou' else 'a'} {job}, it's tiring but I like it.")]))
        local_q.append(("plain", "Which hobby did I take up?",
                        [plant(s[2], f"I've taken up {hobby} on weekends, it clears my head.")]))
        early, late = sorted((s[3], s[4]))
        plant(early, f"I live in {city1} now, near the old market.")
        local_q.append(("updated", "Which city do I live in now?",
                        [plant(late, f"Big change: I moved to {city2}, the flat is much brighter.")]))
        early, late = sorted((s[5], s[6]))
        plant(early, f"My favourite food is {food}, I could eat it every day.")
        new_food = rng.choice([f for f in FOODS if f != food])
        local_q.append(("updated", "What is my favourite food these days?",
                        [plant(late, f"Honestly {new_food} has become my favourite food lately, more than {food}.")]))
        local_q.append(("temporal", event_question,
                        [plant(s[7], f"Last {day} I {event}, it went better than expected.")]))
        first, second = sorted((s[8], s[9]))
        a = plant(first, f"My dog is called {pet}, a scruffy little terrier.")
        b = plant(second, f"{pet} turned {age} today, we celebrated with a walk on the beach.")
        local_q.append(("combined", "How old is my dog?", [a, b]))
        if hard:
            city3 = rng.choice([c for c in CITIES if c not in (city1, city2)])
            first, second = sorted((s[10], s[11]))
            a = plant(first, f"My sister is {sister}, the one who paints.")
            b = plant(second, f"{sister} moved to {city3} last month for a new job.")
            local_q.append(("combined", "Which city does my sister live in?", [a, b]))
            me, other = rng.sample([n for n in NAMES if n != sister], 2)

        convo_sessions = []
        placed: dict[int, tuple[int, int]] = {}
        for si in range(sessions):
            begin = start + timedelta(days=7 * si + rng.randint(0, 3), hours=rng.randint(0, 10))
            mine = [(i, text) for i, (sess, text, _) in enumerate(plan) if sess == si]
            body: list[tuple[str, str]] = []
            slots = sorted(rng.sample(range(turns // 2), len(mine)))
            k = 0
            for t in range(turns // 2):
                if k < len(mine) and slots[k] == t:
                    placed[mine[k][0]] = (si, len(body))
                    said = mine[k][1]
                    k += 1
                elif hard and rng.random() < 0.2:
                    said = rng.choice(NAME_TALK).format(sister=sister, pet=pet)
                else:
                    said = rng.choice(SMALL_TALK)
                reply = rng.choice(ASSISTANT)
                if hard:  # both speakers named in every turn, as in LoCoMo's transcripts
                    said, reply = f"{me}: {said}", f"{other}: {reply}"
                body.append(("user", said))
                body.append(("assistant", reply))
            convo_sessions.append((f"s{si:02d}", begin, body))
        conversations.append(Conversation(user_id, convo_sessions))
        for n, (kind, text, indices) in enumerate(local_q):
            if hard and n % 3 == u % 3:  # a third of the questions, a different third per user
                text = PARAPHRASES[text]
            questions.append(Question(user_id, kind, text,
                                      [(f"s{placed[i][0]:02d}", placed[i][1], 0) for i in indices]))
    return conversations, questions
