"""Write the seeded sample chat dataset eaglegen/assets/sample/chat.jsonl."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "eaglegen" / "assets" / "sample" / "chat.jsonl"
SEED = 20240611
# Rows per kind: 70% single user turn, 10% system, 10% multi-turn, 10% tools.
COUNTS = {"single": 210, "system": 30, "multi": 30, "tools": 30}
PARTS_ROWS = 12  # single-turn rows whose content is a list of text parts

Message = dict[str, Any]
Row = dict[str, Any]
Call = tuple[str, dict[str, Any], Any]  # tool name, arguments, result


def items(block: str) -> list[str]:
    """Split a ';'-separated word list; a string block stays compact under `ruff format`."""
    return [" ".join(item.split()) for item in block.split(";") if item.strip()]


def pairs(block: str) -> list[tuple[str, str]]:
    """Split 'a | b; c | d' into [(a, b), (c, d)]."""
    return [(a.strip(), b.strip()) for a, b in (item.split("|") for item in items(block))]


SUFFIXES = ["", " Keep it short.", " Explain your reasoning.", " Use simple words.", " Be precise."]

# --- math ------------------------------------------------------------------


def poly(terms: list[tuple[int, int]]) -> str:
    """Format [(coef, exp)] as '3x^4 - x^2 + 5'."""
    parts = []
    for i, (coef, exp) in enumerate(terms):
        c = "" if abs(coef) == 1 and exp > 0 else str(abs(coef))
        mono = {0: c, 1: f"{c}x"}.get(exp, f"{c}x^{exp}")
        sign = "-" if coef < 0 else "+"
        parts.append((f"-{mono}" if coef < 0 else mono) if i == 0 else f"{sign} {mono}")
    return " ".join(parts)


def math_qa(rng: random.Random) -> tuple[str, str]:
    """A math question with its worked answer."""
    kind = rng.randrange(8)
    if kind == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 1:
        x, a, b = rng.randint(-9, 15), rng.randint(2, 9), rng.randint(1, 40)
        q = f"Solve for x: {a}x + {b} = {a * x + b}."
        return q, f"Subtract {b} from both sides: {a}x = {a * x}. Divide by {a}: x = {x}."
    if kind == 2:
        p, n = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75]), rng.randrange(40, 2000, 20)
        return f"What is {p}% of {n}?", f"{p}% of {n} is {p * n / 100:g}."
    if kind == 3:
        g = rng.randint(2, 30)
        a, b = g * rng.randint(2, 20), g * rng.randint(2, 20)
        q = f"What is the greatest common divisor of {a} and {b}?"
        return q, f"gcd({a}, {b}) = {math.gcd(a, b)}."
    if kind == 4:
        n = rng.randint(20, 500)
        return f"What is the sum of the integers from 1 to {n}?", f"n(n+1)/2 = {n * (n + 1) // 2}."
    if kind == 5:
        n = rng.randint(101, 999)
        prime = all(n % d for d in range(2, math.isqrt(n) + 1))
        return f"Is {n} a prime number?", f"{n} is {'' if prime else 'not '}prime."
    if kind == 6:
        exps = sorted(rng.sample(range(6), 3), reverse=True)
        terms = [(rng.choice([-1, 1]) * rng.randint(1, 9), e) for e in exps]
        deriv = [(c * e, e - 1) for c, e in terms if e > 0]
        return f"Find the derivative of f(x) = {poly(terms)}.", f"f'(x) = {poly(deriv)}."
    d, h = rng.randrange(60, 900, 10), rng.choice([1.5, 2, 2.5, 3, 4, 5])
    q = f"A train travels {d} km in {h} hours. What is its average speed?"
    return q, f"{d} / {h} = {d / h:g} km/h."


# --- code ------------------------------------------------------------------

CODE_TASKS = {
    "reverses a string": "def reverse(s: str) -> str:\n    return s[::-1]",
    "checks whether a word is a palindrome": (
        "def is_palindrome(word: str) -> bool:\n    w = word.lower()\n    return w == w[::-1]"
    ),
    "returns the n-th Fibonacci number": (
        "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a"
    ),
    "counts the vowels in a string": (
        "def count_vowels(s: str) -> int:\n    return sum(c in 'aeiou' for c in s.lower())"
    ),
    "removes duplicates from a list while keeping order": (
        "def dedupe(items: list) -> list:\n    return list(dict.fromkeys(items))"
    ),
    "flattens a list of lists": (
        "def flatten(rows: list[list]) -> list:\n    return [x for row in rows for x in row]"
    ),
    "finds the largest number in a list without using max()": (
        "def largest(nums: list[int]) -> int:\n    best = nums[0]\n    for n in nums[1:]:\n"
        "        if n > best:\n            best = n\n    return best"
    ),
    "splits a list into chunks of a given size": (
        "def chunks(items: list, size: int) -> list[list]:\n"
        "    return [items[i : i + size] for i in range(0, len(items), size)]"
    ),
    "converts a temperature from Celsius to Fahrenheit": (
        "def c_to_f(celsius: float) -> float:\n    return celsius * 9 / 5 + 32"
    ),
    "counts how often each word appears in a text": (
        "from collections import Counter\n\n\ndef word_counts(text: str) -> Counter[str]:\n"
        "    return Counter(text.lower().split())"
    ),
    "checks whether two strings are anagrams": (
        "def anagrams(a: str, b: str) -> bool:\n    return sorted(a) == sorted(b)"
    ),
    "merges two sorted lists into one sorted list": (
        "import heapq\n\n\ndef merge(a: list[int], b: list[int]) -> list[int]:\n"
        "    return list(heapq.merge(a, b))"
    ),
}
CONCEPTS = items("""
    generator; decorator; context manager; closure; list comprehension; dataclass;
    virtual environment; type hint; coroutine; lambda function; iterator; metaclass;
""")
PY_PAIRS = pairs("""
    a list | a tuple; == | is; copy.copy | copy.deepcopy; a thread | a process; str | bytes;
    a module | a package; yield | return; a set | a frozenset; @staticmethod | @classmethod;
    append | extend;
""")
HOWTO = items("""
    read a CSV file; parse JSON from a string; sort a list of dictionaries by a key;
    measure how long a function takes; run a shell command and capture its output;
    merge two dictionaries; write a unit test with pytest; retry a network request with backoff;
    format a float with two decimal places; read a large file line by line;
    limit how many tasks run at once with asyncio; validate an email address;
""")
SQL_TASKS = items("""
    finds the ten customers with the highest total order value;
    counts jobs per state in a jobs table; returns users who signed up in the last 7 days;
    deletes duplicate rows but keeps the one with the lowest id;
    computes a running total of sales per day; finds orders that have no matching customer;
""")
BUGGY = [
    "def average(xs):\n    return sum(xs) / len(xs) + 1",
    "def last(items):\n    return items[len(items)]",
    "def add_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is odd')",
    "def is_even(n):\n    return n % 2 == 1",
    "total = 0\nfor price in prices:\n    total =+ price",
]


def code_q(rng: random.Random) -> str:
    """A programming question."""
    kind = rng.randrange(6)
    if kind == 0:
        return f"Write a Python function that {rng.choice(list(CODE_TASKS))}."
    if kind == 1:
        return f"Explain what a {rng.choice(CONCEPTS)} is in Python and give a short example."
    if kind == 2:
        a, b = rng.choice(PY_PAIRS)
        return f"What is the difference between {a} and {b} in Python?"
    if kind == 3:
        return f"How do I {rng.choice(HOWTO)} in Python?"
    if kind == 4:
        return f"Write a SQL query that {rng.choice(SQL_TASKS)}."
    return f"Find the bug in this code and fix it:\n```python\n{rng.choice(BUGGY)}\n```"


# --- writing ---------------------------------------------------------------

TOPICS = items("""
    autumn rain; a lighthouse; the first snow; a busy train station; an old bicycle; morning coffee;
    a thunderstorm at sea; a city at night; a forgotten garden; the moon; a cat asleep in the sun;
    a mountain lake; the last day of summer; a library; fireflies; a kitchen on a holiday;
    a quiet beach in winter; a desert road; migrating birds; a server room at 3 a.m.;
""")
CHARACTERS = items("""
    a retired astronaut; a shy baker; a lighthouse keeper; a curious robot; two rival chess players;
    a lost dog; a young violinist; a night-shift nurse; a grandmother learning to code;
""")
EVENTS = items("""
    finds a mysterious letter; misses the last train home; wins an unexpected prize;
    meets an old friend after twenty years; has to fix a broken machine before dawn;
    discovers a hidden door; gets snowed in for a week;
""")
RECIPIENTS = items("""
    my landlord; a professor; my team; a client; the city council; a former colleague;
""")
REQUESTS = items("""
    to reschedule our meeting to next week; for an extension on a deadline; for feedback on a draft;
    to fix a leaking tap; for a letter of recommendation; to approve a small budget increase;
""")
SENTENCES = items("""
    hey, the report is gonna be late cause we had problems;
    we can't do the thing you asked for by friday; thanks a lot for the help, it was super useful;
    the app keeps crashing and nobody knows why; can u send me the files asap;
""")
HAIKU = {
    "autumn rain": "Rain on the gutter\ncounting down the afternoon\nleaves let go at last",
    "the moon": "Half a silver coin\ndropped into the pond at dusk\nthe frogs keep it safe",
    "morning coffee": "Steam over the cup\nthe kitchen still half asleep\nfirst sip, day begins",
    "a library": "Dust in the sunbeam\na thousand voices waiting\nbehind closed covers",
    "fireflies": "Small lamps in the grass\nblinking out a slow message\nsummer writes in light",
    "the first snow": "Nobody walked here\nthe street a blank white page\nthen one dog, then all",
}
FORMS = ["a haiku", "a limerick", "a four-line poem", "a short free-verse poem"]


def writing_q(rng: random.Random) -> str:
    """A writing request."""
    kind = rng.randrange(6)
    if kind == 0:
        return f"Write {rng.choice(FORMS)} about {rng.choice(TOPICS)}."
    if kind == 1:
        words = rng.choice([100, 150, 200, 300])
        who, what = rng.choice(CHARACTERS), rng.choice(EVENTS)
        return f"Write a story of about {words} words about {who} who {what}."
    if kind == 2:
        return f"Draft a polite email to {rng.choice(RECIPIENTS)} asking {rng.choice(REQUESTS)}."
    if kind == 3:
        return f'Rewrite this sentence to sound more professional: "{rng.choice(SENTENCES)}"'
    if kind == 4:
        return f"Suggest five titles for a blog post about {rng.choice(TOPICS)}."
    return f"Describe {rng.choice(TOPICS)} in three sentences, using all five senses."


# --- facts -----------------------------------------------------------------

CAPITALS = dict(
    pairs("""
    Portugal | Lisbon; Kenya | Nairobi; Canada | Ottawa; Australia | Canberra; Japan | Tokyo;
    Peru | Lima; Norway | Oslo; Egypt | Cairo; Vietnam | Hanoi; Austria | Vienna; Chile | Santiago;
    Morocco | Rabat; Finland | Helsinki; Argentina | Buenos Aires; Thailand | Bangkok;
    Poland | Warsaw; Ghana | Accra; New Zealand | Wellington; Turkey | Ankara; Mexico | Mexico City;
""")
)
WHY = items("""
    is the sky blue; does ice float on water; do we have seasons; do cats purr;
    do leaves change color in autumn; does bread rise; do onions make people cry;
    is the ocean salty; do airplanes leave white trails; does the Moon look bigger near the horizon;
    do we get hiccups; does metal feel colder than wood at the same temperature;
""")
HOW = items("""
    a refrigerator; a vaccine; GPS; a bicycle gear; a solar panel; noise-cancelling headphones;
    a database index; public-key encryption; a compiler; photosynthesis; a microwave oven;
    a suspension bridge; the immune system; a job queue; a hash table;
""")
DIFFS = pairs("""
    weather | climate; a virus | a bacterium; latency | throughput; speed | velocity;
    an alligator | a crocodile; RAM | disk storage; a comet | an asteroid; mass | weight; TCP | UDP;
    a simile | a metaphor;
""")
SUBJECTS = items("""
    octopuses; the planet Saturn; honeybees; the printing press; volcanoes; the human heart;
    coral reefs; the Roman aqueducts; tardigrades; the deep ocean; the history of chess; glaciers;
    the invention of paper; owls; black holes;
""")
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year student", "my grandmother"]


def facts_q(rng: random.Random) -> str:
    """A factual question."""
    kind = rng.randrange(5)
    if kind == 0:
        return f"Why {rng.choice(WHY)}?"
    if kind == 1:
        return f"Explain how {rng.choice(HOW)} works to {rng.choice(AUDIENCES)}."
    if kind == 2:
        a, b = rng.choice(DIFFS)
        return f"What is the difference between {a} and {b}?"
    if kind == 3:
        return f"Give me three interesting facts about {rng.choice(SUBJECTS)}."
    return f"What is the capital of {rng.choice(list(CAPITALS))}?"


def any_q(rng: random.Random) -> str:
    """A question from any domain, with an optional style suffix."""
    make = rng.choice([lambda r: math_qa(r)[0], code_q, writing_q, facts_q])
    return make(rng) + rng.choice(SUFFIXES)


# --- system prompts and multi-turn -----------------------------------------

SYSTEM_PROMPTS = [
    "You are a patient math tutor. Explain each step.",
    "You are a senior Python engineer. Answer with code first, then a short explanation.",
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a friendly writing coach who gives specific, kind feedback.",
    "Explain everything in plain English suitable for a twelve-year-old.",
    "You are a careful science teacher. Say when something is uncertain.",
]
FOLLOW_UPS = {
    "math": [
        "Can you check that answer another way?",
        "Explain the steps as if I were twelve.",
        "Now give me a similar problem to try.",
        "What changes if the numbers are doubled?",
    ],
    "code": [
        "Can you add a docstring and type hints?",
        "Now write a pytest test for it.",
        "What happens on an empty input?",
        "How would you make it faster for huge inputs?",
    ],
    "poem": [
        "Make it more cheerful.",
        "Now write a second one that continues it.",
        "Explain the imagery you chose.",
        "Turn it into a two-sentence story.",
    ],
    "capital": [
        "What is {city} best known for?",
        "Roughly how many people live in {city}?",
        "What is a good time of year to visit {city}?",
        "What language is mainly spoken there?",
    ],
}


def multi_turn(rng: random.Random) -> list[Message]:
    """user / assistant / user, with a real answer in the middle."""
    kind, city = rng.choice(list(FOLLOW_UPS)), ""
    if kind == "math":
        q, a = math_qa(rng)
    elif kind == "code":
        task = rng.choice(list(CODE_TASKS))
        q, a = f"Write a Python function that {task}.", f"```python\n{CODE_TASKS[task]}\n```"
    elif kind == "poem":
        topic = rng.choice(list(HAIKU))
        q, a = f"Write a haiku about {topic}.", HAIKU[topic]
    else:
        country = rng.choice(list(CAPITALS))
        city = CAPITALS[country]
        q, a = f"What is the capital of {country}?", f"The capital of {country} is {city}."
    return [
        {"role": "user", "content": q},
        {"role": "assistant", "content": a},
        {"role": "user", "content": rng.choice(FOLLOW_UPS[kind]).format(city=city)},
    ]


# --- tools -----------------------------------------------------------------


def fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An OpenAI function-tool schema."""
    params = {"type": "object", "properties": props, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


STRING, NUMBER = {"type": "string"}, {"type": "number"}
TOOLS = {
    "get_weather": fn(
        "get_weather",
        "Get the current weather for a city.",
        {"city": STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    "convert_currency": fn(
        "convert_currency",
        "Convert an amount between two currencies at today's rate.",
        {"amount": NUMBER, "from_currency": STRING, "to_currency": STRING},
        ["amount", "from_currency", "to_currency"],
    ),
    "search_web": fn(
        "search_web",
        "Search the web and return the top results.",
        {"query": STRING, "max_results": {"type": "integer", "default": 5}},
        ["query"],
    ),
    "run_python": fn(
        "run_python",
        "Run a Python snippet in a sandbox and return its output.",
        {"code": {"type": "string", "description": "Python source code"}},
        ["code"],
    ),
    "create_event": fn(
        "create_event",
        "Create a calendar event.",
        {
            "title": STRING,
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "time": {"type": "string", "description": "HH:MM, 24-hour clock"},
        },
        ["title", "date", "time"],
    ),
}
CITIES = items("Oslo; Lisbon; Nairobi; Lima; Hanoi; Vienna; Toronto; Seoul; Cairo; Quito")
CONDITIONS = ["sunny", "cloudy", "light rain", "heavy rain", "snow", "fog", "windy"]
CURRENCIES = items("EUR; USD; GBP; JPY; CHF; NOK; KES; BRL")
EVENTS_TITLES = ["Team retro", "Dentist", "Budget review", "Lunch with Sam", "Sprint planning"]


def weather(rng: random.Random, city: str) -> Call:
    result = {
        "city": city,
        "temperature": rng.randint(-10, 35),
        "condition": rng.choice(CONDITIONS),
    }
    return "get_weather", {"city": city, "unit": "celsius"}, result


def tool_scenario(rng: random.Random) -> tuple[str, list[Call]]:
    """A user request plus the calls that would answer it."""
    kind = rng.randrange(6)
    if kind == 0:
        city = rng.choice(CITIES)
        q = rng.choice(["What's the weather like in {} right now?", "Do I need an umbrella in {}?"])
        return q.format(city), [weather(rng, city)]
    if kind == 1:
        a, b = rng.sample(CITIES, 2)
        return f"Is it warmer in {a} or in {b} today?", [weather(rng, a), weather(rng, b)]
    if kind == 2:
        amount, (src, dst) = rng.randrange(10, 5000, 5), rng.sample(CURRENCIES, 2)
        rate = round(rng.uniform(0.01, 3.0), 4)
        args = {"amount": amount, "from_currency": src, "to_currency": dst}
        result: dict[str, Any] = {"converted": round(amount * rate, 2), "rate": rate}
        return f"How much is {amount} {src} in {dst}?", [("convert_currency", args, result)]
    if kind == 3:
        topic = rng.choice(SUBJECTS)
        results = [
            {"title": f"{topic.capitalize()}: {title}", "url": f"https://example.org/{i}"}
            for i, title in enumerate(["an overview", "new findings", "a short guide"])
        ]
        q = f"Search the web for recent articles about {topic} and summarize them."
        return q, [("search_web", {"query": topic, "max_results": 3}, results)]
    if kind == 4:
        n = rng.randint(20, 60)
        code = f"import math\nprint(math.factorial({n}) % 1_000_007)"
        result = {"stdout": f"{math.factorial(n) % 1_000_007}\n"}
        q = f"Use Python to compute {n}! modulo 1000007."
        return q, [("run_python", {"code": code}, result)]
    title = rng.choice(EVENTS_TITLES)
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    at = f"{rng.randint(8, 18):02d}:{rng.choice(['00', '30'])}"
    result = {"event_id": f"evt_{rng.randrange(16**6):06x}", "status": "confirmed"}
    args = {"title": title, "date": date, "time": at}
    return f'Put "{title}" in my calendar on {date} at {at}.', [("create_event", args, result)]


def tools_row(rng: random.Random, with_history: bool) -> Row:
    """Tools plus a request; with history, an assistant tool_calls turn and the tool answers."""
    q, calls = tool_scenario(rng)
    needed = {name for name, _, _ in calls}
    extra = rng.sample([n for n in TOOLS if n not in needed], rng.randint(0, 2))
    messages: list[Message] = [{"role": "user", "content": q}]
    if with_history:
        # Kimi-K2 style call ids, so the template's "## Return of <id>" matches the call.
        ids = [f"functions.{name}:{i}" for i, (name, _, _) in enumerate(calls)]
        tool_calls = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for cid, (name, args, _) in zip(ids, calls, strict=True)
        ]
        messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        messages += [
            {"role": "tool", "tool_call_id": cid, "content": json.dumps(result)}
            for cid, (_, _, result) in zip(ids, calls, strict=True)
        ]
    return {"messages": messages, "tools": [TOOLS[n] for n in sorted(needed | set(extra))]}


# --- assembly --------------------------------------------------------------


def first_user_text(row: Row) -> str:
    content = next(m["content"] for m in row["messages"] if m["role"] == "user")
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def build(seed: int = SEED) -> list[Row]:
    """Build the rows, every first user prompt distinct."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def unique(make: Callable[[], Row]) -> Row:
        for _ in range(1000):
            row = make()
            if (text := first_user_text(row)) not in seen:
                seen.add(text)
                return row
        raise RuntimeError("prompt pool exhausted: add templates or words")

    def single() -> Row:
        return {"messages": [{"role": "user", "content": any_q(rng)}]}

    def system() -> Row:
        sys_msg = {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}
        return {"messages": [sys_msg, {"role": "user", "content": any_q(rng)}]}

    def multi() -> Row:
        return {"messages": multi_turn(rng)}

    plan: list[Callable[[], Row]] = [
        *[single] * COUNTS["single"],
        *[system] * COUNTS["system"],
        *[multi] * COUNTS["multi"],
        *[partial(tools_row, rng, i % 2 == 0) for i in range(COUNTS["tools"])],
    ]
    rows = [unique(make) for make in plan]
    for row in rows[:PARTS_ROWS]:
        # Exercise the list-of-parts content form that OpenAI-style datasets also use.
        row["messages"][0]["content"] = [{"type": "text", "text": row["messages"][0]["content"]}]
    rng.shuffle(rows)
    return rows


def main() -> None:
    """Write the dataset as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    rows = build(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    args.out.write_bytes(text.encode("utf-8"))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
