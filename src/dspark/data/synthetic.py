"""Offline prompt generator: varied math word problems (with computed answers), Python coding tasks and chat requests.

Used as the `synthetic` prompt set when no real training data is reachable. Prompts are written here from templates
filled with random names, objects, topics and numbers; one `random.Random(seed)` drives everything, so the output
is a pure function of (n, seed, domains) and a shorter run is a prefix of a longer one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from dspark.data.records import PromptRecord

DOMAINS = ("math", "code", "chat")  # the generator writes no `instruction` prompts
MAX_DRAWS = 500  # fresh draws tried per record before giving up on finding an unseen prompt

NAMES = (
    "Amara",
    "Ben",
    "Chen",
    "Dalia",
    "Emeka",
    "Farah",
    "Gustavo",
    "Hana",
    "Ines",
    "Jonas",
    "Keiko",
    "Liam",
    "Maya",
    "Nikhil",
    "Olga",
    "Pedro",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Ximena",
    "Yusuf",
    "Zoe",
    "Aiden",
    "Bianca",
    "Carlos",
    "Dina",
    "Elif",
    "Felix",
    "Greta",
    "Hugo",
    "Isla",
    "Jamal",
    "Kofi",
    "Lena",
)
ITEMS = (
    "marbles",
    "stickers",
    "apples",
    "pencils",
    "seashells",
    "stamps",
    "books",
    "cupcakes",
    "beads",
    "oranges",
    "postcards",
    "buttons",
    "candles",
    "eggs",
    "trading cards",
    "shells",
    "balloons",
    "cookies",
    "toy cars",
    "plums",
    "notebooks",
    "erasers",
    "lemons",
    "crayons",
    "tomatoes",
    "keychains",
)
PRODUCTS = ("backpack", "lamp", "jacket", "bicycle helmet", "blender", "chess set", "kettle", "desk chair", "tent")


@dataclass(frozen=True)
class MathTemplate:
    """A word problem: `text` with {placeholders}, `draw(rng)` fills them, `solve(values)` gives the integer answer.

    Single-letter placeholders (a, b, c, d, p) are integers; the others are words.
    """

    name: str
    text: str
    draw: Callable[[random.Random], dict]
    solve: Callable[[dict], int]


def _two_names(rng: random.Random) -> dict:
    first, second = rng.sample(NAMES, 2)
    return {"name": first, "name2": second}


def _with(rng: random.Random, **values) -> dict:
    return {"name": rng.choice(NAMES), "obj": rng.choice(ITEMS), **values}


def _shared(rng: random.Random) -> dict:
    b, c = rng.randint(1, 5), rng.randint(1, 5)
    return {**_two_names(rng), "obj": rng.choice(ITEMS), "a": (b + c) * rng.randint(2, 12), "b": b, "c": c}


def _average(rng: random.Random) -> dict:
    a, b, c = (rng.randint(10, 40) for _ in range(3))
    return _with(rng, a=a, b=b, c=c, d=-(-(a + b + c) // 4) + rng.randint(0, 10))


def _change(rng: random.Random) -> dict:
    a, b = rng.randint(2, 19), rng.randint(2, 9)
    return _with(rng, a=a, b=b, c=next(bill for bill in (20, 50, 100, 200) if bill >= a * b))


def _tank(rng: random.Random) -> dict:
    b, c = rng.randint(2, 9), rng.randint(2, 8)
    return _with(rng, a=b * c + rng.randint(5, 200), b=b, c=c, d=rng.randint(5, 60))


MATH_TEMPLATES = (
    MathTemplate(
        "restock",
        "{name} has {a} {obj}. {name} buys {b} more packs with {c} {obj} in each pack. "
        "How many {obj} does {name} have now?",
        lambda r: _with(r, a=r.randint(3, 90), b=r.randint(2, 9), c=r.randint(2, 15)),
        lambda v: v["a"] + v["b"] * v["c"],
    ),
    MathTemplate(
        "share",
        "{name} has {a} {obj} and shares them equally among {b} friends, keeping none. "
        "How many {obj} does each friend get?",
        lambda r: (lambda b: _with(r, a=b * r.randint(2, 25), b=b))(r.randint(2, 12)),
        lambda v: v["a"] // v["b"],
    ),
    MathTemplate(
        "change",
        "A shop sells {obj} for ${a} each. {name} buys {b} of them and pays with a ${c} bill. "
        "How much change, in dollars, does {name} get?",
        _change,
        lambda v: v["c"] - v["a"] * v["b"],
    ),
    MathTemplate(
        "reading",
        "{name} reads {a} pages a day for {b} days, then {c} pages a day for {d} days. "
        "How many pages does {name} read in total?",
        lambda r: _with(r, a=r.randint(5, 60), b=r.randint(2, 14), c=r.randint(5, 60), d=r.randint(2, 14)),
        lambda v: v["a"] * v["b"] + v["c"] * v["d"],
    ),
    MathTemplate(
        "train",
        "A train travels at {a} km per hour for {b} hours and then at {c} km per hour for {d} "
        "hours. {name} is on board the whole time. How many kilometres does {name} travel?",
        lambda r: _with(r, a=r.randint(40, 160), b=r.randint(2, 6), c=r.randint(40, 160), d=r.randint(2, 6)),
        lambda v: v["a"] * v["b"] + v["c"] * v["d"],
    ),
    MathTemplate(
        "savings",
        "{name} saves ${a} every week. How many weeks will it take {name} to save ${b}?",
        lambda r: (lambda a: _with(r, a=a, b=a * r.randint(3, 52)))(r.randint(5, 75)),
        lambda v: v["b"] // v["a"],
    ),
    MathTemplate(
        "fence",
        "A rectangular garden is {a} metres long and {b} metres wide. {name} wants to put a fence "
        "all the way around it. How many metres of fence does {name} need?",
        lambda r: _with(r, a=r.randint(4, 80), b=r.randint(3, 60)),
        lambda v: 2 * (v["a"] + v["b"]),
    ),
    MathTemplate(
        "bus",
        "There are {a} students in {name}'s school year. {p}% of them walk to school and the rest "
        "take the bus. How many students take the bus?",
        lambda r: _with(r, a=20 * r.randint(2, 30), p=5 * r.randint(1, 19)),
        lambda v: v["a"] - v["a"] * v["p"] // 100,
    ),
    MathTemplate(
        "ages",
        "{name} is {a} years old. {name2} is {b} times as old as {name}. How old will {name2} be in {c} years?",
        lambda r: {**_two_names(r), "a": r.randint(3, 20), "b": r.randint(2, 4), "c": r.randint(1, 15)},
        lambda v: v["a"] * v["b"] + v["c"],
    ),
    MathTemplate(
        "boxes",
        "A box holds {a} {obj}. {name} fills {b} boxes and has {c} {obj} left over. "
        "How many {obj} did {name} start with?",
        lambda r: (lambda a: _with(r, a=a, b=r.randint(2, 20), c=r.randint(1, a - 1)))(r.randint(4, 30)),
        lambda v: v["a"] * v["b"] + v["c"],
    ),
    MathTemplate(
        "shopping",
        "{name} buys {a} notebooks at ${b} each and {c} pens at ${d} each. "
        "How many dollars does {name} spend in total?",
        lambda r: _with(r, a=r.randint(2, 12), b=r.randint(2, 9), c=r.randint(2, 15), d=r.randint(1, 5)),
        lambda v: v["a"] * v["b"] + v["c"] * v["d"],
    ),
    MathTemplate(
        "recipe",
        "A recipe uses {a} grams of flour for {b} cookies. {name} wants to bake {c} cookies. "
        "How many grams of flour does {name} need?",
        lambda r: (lambda b: _with(r, a=25 * r.randint(4, 20), b=b, c=b * r.randint(2, 8)))(r.randint(6, 24)),
        lambda v: v["a"] * (v["c"] // v["b"]),
    ),
    MathTemplate(
        "laps",
        "{name} runs {a} laps of a {b}-metre track every day. How many metres does {name} run in {c} days?",
        lambda r: _with(r, a=r.randint(2, 12), b=100 * r.randint(2, 8), c=r.randint(2, 14)),
        lambda v: v["a"] * v["b"] * v["c"],
    ),
    MathTemplate(
        "tank",
        "A tank holds {a} litres of water. It leaks {b} litres per hour. After {c} hours, {name} "
        "pours in {d} more litres. How many litres are in the tank now?",
        _tank,
        lambda v: v["a"] - v["b"] * v["c"] + v["d"],
    ),
    MathTemplate(
        "ratio",
        "{name} and {name2} share {a} {obj} in the ratio {b}:{c}. How many {obj} does {name2} get?",
        _shared,
        lambda v: v["a"] // (v["b"] + v["c"]) * v["c"],
    ),
    MathTemplate(
        "sale",
        "{name} wants a {product} that costs ${a}. During a sale it is {p}% off. What is the sale price in dollars?",
        lambda r: _with(r, product=r.choice(PRODUCTS), a=20 * r.randint(2, 25), p=5 * r.randint(1, 15)),
        lambda v: v["a"] - v["a"] * v["p"] // 100,
    ),
    MathTemplate(
        "average",
        "{name} scored {a}, {b} and {c} points in three games. How many points must {name} "
        "score in the fourth game to average exactly {d} points per game?",
        _average,
        lambda v: 4 * v["d"] - v["a"] - v["b"] - v["c"],
    ),
    MathTemplate(
        "farm",
        "{name}'s farm has {a} chickens and {b} cows. How many legs do these animals have altogether?",
        lambda r: _with(r, a=r.randint(2, 60), b=r.randint(1, 30)),
        lambda v: 2 * v["a"] + 4 * v["b"],
    ),
)

# (function names, arguments, what it does); {k}, {w1}, {w2}, {ch}, {sep}, {target} are drawn per prompt
CODE_TASKS = (
    (
        ("sum_multiples", "total_divisible"),
        "numbers",
        "returns the sum of the elements of `numbers` that are divisible by {k}",
    ),
    (("count_vowels", "vowel_count"), "text", "counts the vowels in `text`, ignoring case"),
    (
        ("is_palindrome", "reads_same_backwards"),
        "text",
        "returns True if `text` reads the same forwards and backwards once spaces, punctuation and case are ignored",
    ),
    (
        ("chunk_list", "split_into_chunks"),
        "items",
        "splits `items` into consecutive chunks of length {k}; the last chunk may be shorter",
    ),
    (("rotate_right", "rotate_list"), "items", "rotates `items` to the right by {k} positions and returns a new list"),
    (
        ("top_words", "most_common_words"),
        "text",
        "returns the {k} most frequent words in `text` as (word, count) pairs, breaking ties alphabetically",
    ),
    (
        ("fizzbuzz_words", "number_words"),
        "n",
        "returns a list of strings for 1..n where multiples of {k} become "
        '"{w1}", multiples of {k2} become "{w2}", and multiples of both become "{w1}{w2}"',
    ),
    (
        ("caesar_shift", "encode_caesar"),
        "text",
        "shifts every letter of `text` by {k} places in the alphabet, keeping "
        "case and leaving other characters unchanged",
    ),
    (("flatten", "flatten_nested"), "nested", "flattens an arbitrarily nested list of integers into one flat list"),
    (("running_max", "prefix_maximum"), "values", "returns a list whose i-th element is the maximum of values[:i+1]"),
    (
        ("moving_average", "window_means"),
        "values",
        "returns the averages of every window of {k} consecutive elements of `values`",
    ),
    (("nth_prime", "prime_at"), "n", "returns the n-th prime number, counting from nth_prime(1) == 2"),
    (
        ("digit_sum", "sum_of_digits"),
        "n",
        "returns the sum of the decimal digits of the integer `n`, using its absolute value for negative numbers",
    ),
    (
        ("merge_sorted", "merge_two_lists"),
        "a, b",
        "merges two sorted lists into one sorted list without calling sort() or sorted()",
    ),
    (
        ("group_by_length", "bucket_words"),
        "words",
        "maps each word length to the list of words of that length, keeping input order",
    ),
    (("count_char", "char_frequency"), "text", "returns how many times the character '{ch}' occurs in `text`"),
    (
        ("pairs_with_sum", "find_pairs"),
        "numbers",
        "returns every index pair (i, j) with i < j and numbers[i] + numbers[j] == {target}",
    ),
    (("longest_run", "max_streak"), "values", "returns the length of the longest run of equal consecutive elements"),
    (("to_snake_case", "snake_case"), "name", "converts a camelCase or PascalCase identifier to snake_case"),
    (
        ("parse_pairs", "parse_settings"),
        "text",
        "parses a string like 'a{sep}1;b{sep}2' into the dict {{'a': '1', 'b': '2'}}, skipping empty entries",
    ),
    (("transpose", "matrix_transpose"), "matrix", "returns the transpose of a matrix given as a list of rows"),
    (
        ("second_largest", "runner_up"),
        "numbers",
        "returns the second largest distinct value in `numbers`, or None if there is none",
    ),
    (
        ("binary_search", "find_index"),
        "items, target",
        "returns the index of `target` in the sorted list `items` using binary search, or -1 if it is absent",
    ),
    (("run_length_encode", "compress"), "text", "run-length encodes `text`, so 'aaab' becomes 'a3b1'"),
    (
        ("temperature_table", "celsius_to_fahrenheit_table"),
        "start, stop",
        "returns (celsius, fahrenheit) pairs from `start` to `stop` inclusive in steps of {k} degrees",
    ),
    (
        ("anagram_groups", "group_anagrams"),
        "words",
        "groups words that are anagrams of each other and returns the groups, largest first",
    ),
    (
        ("clamp_all", "clip_values"),
        "values, low, high",
        "returns a copy of `values` with each element clamped to [low, high]",
    ),
    (("count_primes_below", "prime_count"), "n", "counts the primes smaller than `n` with the sieve of Eratosthenes"),
    (
        ("brackets_balanced", "is_balanced"),
        "text",
        "returns True if the brackets (), [] and {{}} in `text` are balanced",
    ),
    (("unique_in_order", "dedupe"), "items", "removes duplicates from `items`, keeping the first occurrence of each"),
    (("every_nth", "take_every"), "items", "returns every {k}-th element of `items`, starting with the first"),
    (
        ("gcd_of_list", "list_gcd"),
        "numbers",
        "returns the greatest common divisor of all integers in `numbers` without using math.gcd",
    ),
    (("format_duration", "seconds_to_clock"), "seconds", "formats a number of seconds as 'H:MM:SS'"),
    (
        ("zero_pad", "pad_numbers"),
        "values",
        "returns the integers in `values` as strings left-padded with zeros to width {k}",
    ),
    (
        ("word_lengths", "lengths_of_words"),
        "sentence",
        "returns the length of each word in `sentence`, ignoring punctuation",
    ),
    (
        ("split_on", "tokenize"),
        "text",
        "splits `text` on the separator '{sep}', strips each piece and drops empty pieces",
    ),
)
CODE_OPENERS = (
    "Write a Python function",
    "Implement a Python function",
    "Create a Python function",
    "In Python, write a function",
)
CODE_EXTRAS = (
    "",
    "Include a docstring with one example.",
    "Add type hints.",
    "Do not import any modules.",
    "Handle an empty input gracefully.",
    "Then write three assert statements that test it.",
    "Explain its time complexity after the code.",
    "Avoid recursion.",
    "Keep it under 15 lines.",
    "Raise a ValueError for invalid input.",
    "Add a short comment on each non-obvious line.",
)
WORDS = ("Fizz", "Buzz", "Ping", "Pong", "Tick", "Tock", "Foo", "Bar", "Zip", "Zap")

TOPICS = (
    "how vaccines train the immune system",
    "why the sky is blue",
    "how compound interest works",
    "what a blockchain is",
    "how photosynthesis works",
    "the causes of inflation",
    "how a neural network learns",
    "plate tectonics",
    "the water cycle",
    "how GPS finds your location",
    "the difference between weather and climate",
    "black holes",
    "how the internet routes data",
    "the greenhouse effect",
    "supply and demand",
    "how muscles grow",
    "the placebo effect",
    "why we dream",
    "how batteries store energy",
    "the French Revolution",
    "evolution by natural selection",
    "how noise-cancelling headphones work",
    "opportunity cost",
    "how credit scores work",
    "DNA replication",
    "how tides work",
    "the printing press",
    "public-key cryptography",
)
AUDIENCES = (
    "a ten-year-old",
    "a high-school student",
    "a busy manager",
    "a retired engineer",
    "someone who has never studied science",
    "a new employee",
    "a curious grandparent",
    "a first-year student",
)
PAIRS = (
    ("tea", "coffee"),
    ("renting", "buying a home"),
    ("Python", "JavaScript"),
    ("trains", "planes for short trips"),
    ("e-books", "printed books"),
    ("cats", "dogs as pets"),
    ("solar power", "wind power"),
    ("Rome", "Athens"),
    ("working from home", "working in an office"),
    ("running", "swimming"),
    ("SQL", "NoSQL databases"),
    ("classical music", "jazz"),
    ("the violin", "the cello"),
    ("stocks", "bonds"),
    ("Mars", "Venus"),
)
DEBATES = (
    "a four-day working week",
    "school uniforms",
    "banning cars from city centres",
    "universal basic income",
    "nuclear power",
    "homework for primary-school children",
    "daylight saving time",
    "space tourism",
    "social media age limits",
    "tipping in restaurants",
    "open-plan offices",
    "remote learning",
)
RECIPIENTS = (
    "my landlord",
    "a hiring manager",
    "my team",
    "a customer",
    "my professor",
    "a neighbour",
    "the city council",
    "a supplier",
)
PURPOSES = (
    "to ask for a deadline extension",
    "to report a broken heater",
    "to follow up after an interview",
    "to apologise for a delayed order",
    "to propose a new meeting time",
    "to request a reference letter",
    "to thank them for their help",
    "to suggest a community clean-up day",
    "to dispute an invoice",
)
CHARACTERS = (
    "a lighthouse keeper",
    "a retired astronaut",
    "a shy dragon",
    "a street musician",
    "a robot gardener",
    "a detective cat",
    "a young chess prodigy",
    "a time-travelling baker",
    "an old sailor",
)
EVENTS = (
    "finds a mysterious map",
    "loses their voice before a big day",
    "receives a letter from the future",
    "has to win back a friend's trust",
    "discovers a hidden door",
    "gets stuck in a lift with a stranger",
)
PLACES = (
    "a snowy mountain village",
    "a busy night market",
    "a floating city",
    "a quiet seaside town",
    "a space station",
    "a rainforest research camp",
)
ACTIVITIES = (
    "learning a new language",
    "sleeping better",
    "saving money on groceries",
    "starting to run",
    "giving a good presentation",
    "keeping houseplants alive",
    "studying for exams",
    "cooking for a crowd",
)
CITIES = ("Lisbon", "Kyoto", "Mexico City", "Edinburgh", "Cape Town", "Istanbul", "Vancouver", "Hanoi", "Prague")
TRAVELLERS = (
    "a family with two children",
    "a solo traveller on a budget",
    "two friends who love food",
    "a retired couple",
    "a history enthusiast",
)
FORMS = ("haiku", "limerick", "sonnet", "short free-verse poem")
SUBJECTS = (
    "the first snow of winter",
    "a city at dawn",
    "an old bicycle",
    "the smell of rain",
    "a lost glove",
    "the sea at night",
    "a crowded train",
    "autumn leaves",
)
CHAT_TEMPLATES = (
    "Explain {topic} to {audience} in {k} short paragraphs.",
    "Compare {a} and {b} for {audience}: list three similarities and three differences, then give a verdict.",
    "Summarise the main arguments for and against {debate} in {k} bullet points each, for {audience}.",
    "Write a polite email to {recipient} {purpose}. Keep it under {k}00 words.",
    "Write a short story of about {k}00 words about {character} who {event}, set in {place}.",
    "Give {audience} {k} practical tips for {activity}, each with a one-line reason.",
    "Write a {form} about {subject}.",
    "Plan a {k}-day itinerary in {city} for {traveller}.",
    "What are the pros and cons of {debate}? Answer as a two-column table, then add {audience}'s likely view.",
    "I am {audience}. In {k} sentences, why should I care about {topic}?",
)


def render_math(rng: random.Random) -> tuple[str, str]:
    """One word problem and its integer answer (as text)."""
    template = rng.choice(MATH_TEMPLATES)
    values = template.draw(rng)
    return template.text.format(**values), str(template.solve(values))


def render_code(rng: random.Random) -> str:
    """One 'write a Python function' task with drawn parameters and an optional extra requirement."""
    names, args, task = rng.choice(CODE_TASKS)
    k = rng.randint(2, 9)
    w1, w2 = rng.sample(WORDS, 2)
    values = {
        "k": k,
        "k2": k + rng.randint(1, 4),
        "w1": w1,
        "w2": w2,
        "ch": rng.choice("aeiouxyz,.;!"),
        "sep": rng.choice((":", "=", "->")),
        "target": rng.randint(5, 40),
    }
    text = f"{rng.choice(CODE_OPENERS)} `{rng.choice(names)}({args})` that {task.format(**values)}."
    extra = rng.choice(CODE_EXTRAS)
    return f"{text} {extra}" if extra else text


def render_chat(rng: random.Random) -> str:
    """One open-ended chat request (explain, compare, summarise, email, story, tips, poem, itinerary)."""
    a, b = rng.choice(PAIRS)
    values = {
        "topic": rng.choice(TOPICS),
        "audience": rng.choice(AUDIENCES),
        "k": rng.randint(2, 6),
        "a": a,
        "b": b,
        "debate": rng.choice(DEBATES),
        "recipient": rng.choice(RECIPIENTS),
        "purpose": rng.choice(PURPOSES),
        "character": rng.choice(CHARACTERS),
        "event": rng.choice(EVENTS),
        "place": rng.choice(PLACES),
        "activity": rng.choice(ACTIVITIES),
        "form": rng.choice(FORMS),
        "subject": rng.choice(SUBJECTS),
        "city": rng.choice(CITIES),
        "traveller": rng.choice(TRAVELLERS),
    }
    return rng.choice(CHAT_TEMPLATES).format(**values)


def _draw(domain: str, rng: random.Random) -> tuple[str, str | None]:
    if domain == "math":
        return render_math(rng)
    return (render_code(rng) if domain == "code" else render_chat(rng)), None


def generate_synthetic_prompts(n: int, *, seed: int, domains: tuple[str, ...] = DOMAINS) -> list[PromptRecord]:
    """`n` distinct prompts, domains round-robin (record i has domains[i % len(domains)]).

    Math records carry the computed answer in `reference`; code and chat records have none. Ids are
    `synthetic-s<seed>-<i>`. Raises ValueError when the templates cannot give `n` distinct prompts.
    """
    _validate(n, domains)
    rng = random.Random(seed)
    seen: set[str] = set()
    records = []
    for index in range(n):
        domain = domains[index % len(domains)]
        for _ in range(MAX_DRAWS):
            prompt, reference = _draw(domain, rng)
            if prompt not in seen:
                break
        else:
            raise ValueError(
                f"synthetic: no new {domain} prompt after {MAX_DRAWS} draws at record {index}; the templates are "
                f"nearly exhausted, so ask for fewer prompts (data.num_train_prompts) or add real prompt sets."
            )
        seen.add(prompt)
        records.append(PromptRecord(f"synthetic-s{seed}-{index:05d}", domain, prompt, reference=reference))
    return records


def _validate(n: int, domains: tuple[str, ...]) -> None:
    if n < 0:
        raise ValueError(f"synthetic: n={n} must be >= 0.")
    unknown = [d for d in domains if d not in DOMAINS]
    if not domains or unknown or len(set(domains)) != len(domains):
        raise ValueError(f"synthetic: domains={tuple(domains)} must be distinct names from {DOMAINS}.")
