"""Prompt sets: registry, the paper's formats and selection, local/env/vendored/hub resolution, preflight checks,
the offline generator.

Hub loads are faked by monkeypatching `datasets.load_dataset`; nothing here touches the network.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest

from dspark.data import prompts as P
from dspark.data import synthetic as S
from dspark.data.prompts import PROMPT_SETS, PromptRecord, load_prompts

VENDORED = P.VENDORED_DIR
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
PAPER_COUNTS = {
    "gsm8k": 500,
    "math500": 500,
    "aime25": 30,
    "humaneval": 164,
    "mbpp": 256,
    "livecodebench": 500,
    "mt-bench": 80,
    "alpaca": 500,
    "arena-hard": 500,
}
LOCAL_ONLY = {"gsm8k-train", "math-train", "mbpp-train", "alpaca-seed", "alpaca-5k"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_cache")


@pytest.fixture
def no_default_data(tmp_path, monkeypatch):
    """Point $DSPARK_DATA_DIR at an empty folder and hide the vendored sets, so only local_dir or the (faked) hub
    can answer."""
    empty = tmp_path / "empty_data"
    empty.mkdir()
    monkeypatch.setenv("DSPARK_DATA_DIR", str(empty))
    monkeypatch.setattr(P, "VENDORED_DIR", tmp_path / "no_vendored_sets")
    return empty


def fake_hub(monkeypatch, rows, *, error: Exception | None = None) -> list:
    """Replace datasets.load_dataset by a stub that records its arguments and returns `rows` (or raises)."""
    calls = []

    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        if error is not None:
            raise error
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# ---- registry ----


def test_registry_holds_every_set_with_domain_and_source():
    assert set(PROMPT_SETS) == set(PAPER_COUNTS) | LOCAL_ONLY | {"open-perfectblend", "synthetic"}
    for name in PROMPT_SETS:
        spec = PROMPT_SETS.resolve(name)
        assert (
            spec.name == name
            and spec.domain in ("math", "code", "chat", "instruction", "mixed")
            and spec.role in ("eval", "train")
        )
        if name in PAPER_COUNTS:
            assert spec.role == "eval" and spec.hub_id and spec.format_hub_row and spec.local_files
            assert spec.paper_max == PAPER_COUNTS[name]
        elif name in LOCAL_ONLY:
            assert spec.hub_id is None and spec.local_files and spec.role == "train"
    assert PROMPT_SETS.resolve("open-perfectblend").hub_id == "mlabonne/open-perfectblend"
    assert PROMPT_SETS.resolve("synthetic").generate is not None
    assert "stand-in" in PROMPT_SETS.resolve("alpaca").note
    assert P.prompt_set_domain("humaneval") == "code" and P.prompt_set_domain("synthetic") == "mixed"
    assert P.prompt_set_domain("alpaca-5k") == "instruction" and PROMPT_SETS.resolve("alpaca-5k").role == "train"


def test_every_local_file_is_vendored_with_its_sources_section():
    """A fresh clone (or an installed wheel) must find every local-file set without network or shared/data."""
    sources = (VENDORED / "SOURCES.md").read_text(encoding="utf-8")
    assert (VENDORED / "LICENSES.md").is_file()
    for name in PROMPT_SETS:
        spec = PROMPT_SETS.resolve(name)
        if not spec.local_files:
            continue
        present = [f for f in spec.local_files if (VENDORED / f).is_file()]
        assert present, f"{name}: none of {spec.local_files} is vendored in {VENDORED}"
        assert all(f in sources for f in present), f"{name}: SOURCES.md does not describe {present}"
        assert P.resolve_prompt_source(name).path == VENDORED / present[0]


def test_package_data_ships_the_vendored_sets():
    """pyproject's package-data must cover the vendored files, or a wheel install loses them."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["dspark.data"]
    shipped = {p.name for pattern in patterns for p in (Path(P.__file__).parent).glob(pattern)}
    assert {p.name for p in VENDORED.iterdir() if p.is_file()} <= shipped


def test_unknown_set_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown prompt set 'gsm9k'.*Valid: .*humaneval"):
        load_prompts("gsm9k")
    with pytest.raises(ValueError, match="Valid"):
        P.prompt_set_domain("nope")


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="data.local_dir=.*does not exist"):
        load_prompts("gsm8k", local_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="selection"):
        load_prompts("gsm8k", selection="random")
    with pytest.raises(ValueError, match="limit"):
        load_prompts("gsm8k", limit=-1)


# ---- the staged paper sets ----


def _ranked_ids(path: Path) -> list[str]:
    """Ids of a staged file ordered by paper_eval_rank, read with plain json (independent of the loader)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]
    ranked = [r for r in rows if r["paper_eval_rank"] is not None]
    return [r["id"] for r in sorted(ranked, key=lambda r: r["paper_eval_rank"])]


@pytest.mark.parametrize("name", sorted(PAPER_COUNTS))
def test_paper_sets_load_from_shared_dir(name, cache_dir, monkeypatch):
    monkeypatch.delenv("DSPARK_DATA_DIR", raising=False)
    records = load_prompts(name, cache_dir=cache_dir)
    assert len(records) == PAPER_COUNTS[name]
    assert len({r.id for r in records}) == len(records)
    assert all(isinstance(r, PromptRecord) and r.prompt and r.domain == P.prompt_set_domain(name) for r in records)
    spec = PROMPT_SETS.resolve(name)
    if name != "alpaca":  # the stand-in has no ranks; its selection is the seeded shuffle (tested below)
        assert [r.id for r in records] == _ranked_ids(VENDORED / spec.local_files[-1])
    if name in ("gsm8k", "math500", "aime25"):
        assert all(r.prompt.endswith(SUFFIX) for r in records)
    elif name == "humaneval":
        assert all(r.prompt.startswith(P.HUMANEVAL_PREFIX) and r.prompt.endswith("\n```") for r in records)
    elif name == "livecodebench":
        assert all(r.prompt.startswith(P.LCB_HEADER) and r.prompt.endswith("backticks)") for r in records)
    elif name == "mbpp":
        assert all("assert " not in r.prompt for r in records)
    elif name == "mt-bench":
        assert all(len(r.turns) == 1 for r in records)
    assert load_prompts(name, limit=7, cache_dir=cache_dir) == records[:7]


@pytest.mark.parametrize("name", ["gsm8k", "mbpp", "livecodebench", "arena-hard"])
def test_seeded_shuffle_reproduces_staged_ranks(name, cache_dir, monkeypatch):
    """The hub path's selection (shuffle of all rows) must pick the same rows, in the same order, as the ranks."""
    monkeypatch.delenv("DSPARK_DATA_DIR", raising=False)
    every = load_prompts(name, selection="all", cache_dir=cache_dir)
    shuffled = P.paper_subset(every, cap=PAPER_COUNTS[name], seed=P.PAPER_SEED)
    assert [r.id for r in shuffled] == [r.id for r in load_prompts(name, cache_dir=cache_dir)]
    other_seed = load_prompts(name, seed=1, cache_dir=cache_dir)
    assert len(other_seed) == PAPER_COUNTS[name] and other_seed != shuffled


def test_alpaca_stand_in_uses_the_paper_shuffle(cache_dir, monkeypatch):
    monkeypatch.delenv("DSPARK_DATA_DIR", raising=False)
    every = load_prompts("alpaca", selection="all", cache_dir=cache_dir)
    assert len(every) == 805
    assert load_prompts("alpaca", cache_dir=cache_dir) == P.paper_subset(every, cap=500)


@pytest.mark.parametrize(
    "name, formatter, fields",
    [
        ("gsm8k_test", P.format_gsm8k, {"raw_prompt": "question"}),
        ("math500", P.format_math_problem, {"raw_prompt": "problem", "id": "unique_id"}),
        ("humaneval", P.format_humaneval, {"raw_prompt": "prompt", "id": "task_id"}),
    ],
)
def test_hub_formats_match_staged_paper_prompts(name, formatter, fields):
    """Formatting each staged row's original question must give DeepSpec's exact prompt, row by row."""
    for line in (VENDORED / f"{name}.jsonl").read_text(encoding="utf-8").strip().split("\n"):
        row = json.loads(line)
        record = formatter({hub: row[staged] for staged, hub in fields.items()})
        assert record.prompt == row["prompt"]
        if "id" in fields:
            assert record.id == row["id"]


def test_training_sets_load_whole_files_with_reference_responses(cache_dir, monkeypatch):
    monkeypatch.delenv("DSPARK_DATA_DIR", raising=False)
    mbpp = load_prompts("mbpp-train", cache_dir=cache_dir)
    task_ids = {int(r.id.rsplit("-", 1)[1]) for r in mbpp}
    assert len(mbpp) == 474 and not task_ids & set(range(11, 511))
    assert all(r.domain == "code" and "def " in r.reference for r in mbpp)
    seed = load_prompts("alpaca-seed", cache_dir=cache_dir)
    assert len(seed) == 175 and all(r.domain == "instruction" and r.reference for r in seed)
    alpaca = load_prompts("alpaca-5k", cache_dir=cache_dir)
    assert len(alpaca) == 5000 and len({r.id for r in alpaca}) == 5000
    assert all(r.domain == "instruction" for r in alpaca)
    assert sum(r.reference is None for r in alpaca) == 2  # two source rows have an empty output
    assert alpaca[0].prompt.endswith(
        "\n\nInput:\nSentence 1: I am going to the store.\nSentence 2: I goes to the store."
    )
    gsm = load_prompts("gsm8k-train", cache_dir=cache_dir)
    assert len(gsm) == 7473 and all("<<" not in r.reference and "\n#### " in r.reference for r in gsm)
    assert gsm[0].reference == (
        "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
    )
    math = load_prompts("math-train", limit=50, cache_dir=cache_dir)  # final answers only: no reference response
    assert len(math) == 50 and all(r.reference is None for r in math)


def test_strip_calculator_notes():
    assert P.strip_calculator_notes("12/60 = $<<12/60=0.2>>0.2 per minute, <<2*3=6>>6") == "12/60 = $0.2 per minute, 6"
    assert P.strip_calculator_notes("no notes << here") == "no notes << here"


# ---- format_hub_row on hand-made hub rows ----

LCB_HEAD = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will "
    "generate a correct Python program that matches the specification and passes all tests. You will NOT "
    "return anything except for the program\n\n### Question:\n"
)


@pytest.mark.parametrize(
    "name, row, prompt, extra",
    [
        (
            "gsm8k",
            {"question": "Tom has 3 cats. How many?", "answer": "3 cats\n#### 3"},
            "Tom has 3 cats. How many?\nPlease reason step by step, and put your final answer within \\boxed{}.",
            {"reference": "3 cats\n#### 3"},
        ),
        (
            "math500",
            {"problem": "Find $x$.", "solution": "It is $2$.", "answer": "2", "unique_id": "test/a/1.json"},
            "Find $x$.\nPlease reason step by step, and put your final answer within \\boxed{}.",
            {"id": "test/a/1.json", "reference": "It is $2$."},
        ),
        (
            "aime25",
            {"problem": "Compute $n$.", "answer": 70, "problem_idx": 1},
            "Compute $n$.\nPlease reason step by step, and put your final answer within \\boxed{}.",
            {"reference": "70"},
        ),
        (
            "humaneval",
            {
                "task_id": "HumanEval/7",
                "prompt": 'def f(x):\n    """Double x."""\n',
                "canonical_solution": "    return 2 * x\n",
            },
            "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            'def f(x):\n    """Double x."""\n\n```',
            {"id": "HumanEval/7"},
        ),
        (
            "mbpp",
            {
                "task_id": 11,
                "prompt": "Write a python function to add.",
                "code": "def add(a, b): return a + b",
                "test_list": ["assert add(1, 2) == 3"],
            },
            "Write a python function to add.",
            {"id": "mbpp-11"},
        ),
        (
            "livecodebench",
            {"question_content": "Print 1.", "starter_code": ""},
            LCB_HEAD + "Print 1.\n\n### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n"
            "```\n\n### Answer: (use the provided format with backticks)",
            {},
        ),
        (
            "livecodebench",
            {"question_content": "Sum.", "starter_code": "class Solution:\n    def s(self):\n        "},
            LCB_HEAD + "Sum.\n\n### Format: Use the following code structure:\n```python\nclass Solution:\n    def "
            "s(self):\n        \n```\n\n### Answer: (use the provided format with backticks)",
            {},
        ),
        (
            "mt-bench",
            {
                "prompt": ["Write a haiku.", "Now make it rhyme."],
                "prompt_id": 81,
                "category": "writing",
                "reference": [],
            },
            "Write a haiku.",
            {"id": "mtbench-81", "turns": ["Now make it rhyme."], "reference": None},
        ),
        (
            "alpaca",
            {"instruction": "Give three tips.", "input": "", "output": "1. 2. 3."},
            "Give three tips.",
            {"reference": "1. 2. 3."},
        ),
        (
            "alpaca",
            {"instruction": "Classify the sentiment.", "input": "I love it!", "output": "positive"},
            "Classify the sentiment.\n\nInput:\nI love it!",
            {},
        ),
        (
            "arena-hard",
            {"uid": "ab12", "category": "hard_prompt", "subcategory": "coding", "prompt": "Write zig."},
            "Write zig.",
            {"id": "arena_hard_v2-ab12", "domain": "chat"},
        ),
        (
            "open-perfectblend",
            {
                "source": "meta-math/MetaMathQA",
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "What is 2+2?"},
                    {"from": "gpt", "value": "4"},
                    {"from": "human", "value": "And 3+3?"},
                    {"from": "gpt", "value": "6"},
                ],
            },
            "What is 2+2?",
            {"turns": ["And 3+3?"], "domain": "math"},
        ),
    ],
)
def test_format_hub_row_gives_the_paper_text(name, row, prompt, extra):
    record = PROMPT_SETS.resolve(name).format_hub_row(row)
    assert record.prompt == prompt
    for key, value in extra.items():
        assert getattr(record, key) == value


# ---- resolution: local_dir > $DSPARK_DATA_DIR > vendored > hub ----


def test_lookup_order_local_env_vendored(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPARK_DATA_DIR", raising=False)
    assert P.resolve_prompt_source("gsm8k") == P.PromptSource("gsm8k", "file", path=VENDORED / "gsm8k_test.jsonl")
    env, local = tmp_path / "env", tmp_path / "local"
    for folder in (env, local):
        folder.mkdir()
        write_jsonl(folder / "gsm8k_test.jsonl", [{"prompt": folder.name}])
    monkeypatch.setenv("DSPARK_DATA_DIR", str(env))
    assert P.resolve_prompt_source("gsm8k").path == env / "gsm8k_test.jsonl"
    assert P.resolve_prompt_source("gsm8k", local_dir=local).path == local / "gsm8k_test.jsonl"
    assert P.resolve_prompt_source("humaneval", local_dir=local).path == VENDORED / "humaneval.jsonl"
    assert P.resolve_prompt_source("synthetic").kind == "generated"
    assert P.resolve_prompt_source("open-perfectblend").kind == "hub"


def test_local_dir_wins_over_default_dir(tmp_path, monkeypatch, cache_dir):
    default = tmp_path / "default"
    default.mkdir()
    write_jsonl(default / "gsm8k_test.jsonl", [{"id": "d0", "prompt": "from default"}])
    monkeypatch.setenv("DSPARK_DATA_DIR", str(default))
    assert P.default_data_dir() == default
    local = tmp_path / "local"
    local.mkdir()
    write_jsonl(
        local / "gsm8k_test.jsonl",
        [
            {"id": f"l{i}", "domain": "math", "prompt": f"local {i}", "turns": ["more"], "reference": 7}
            for i in range(3)
        ],
    )
    records = load_prompts("gsm8k", local_dir=local, cache_dir=cache_dir)
    assert records == [PromptRecord(f"l{i}", "math", f"local {i}", ["more"], "7") for i in range(3)]
    # a local_dir without the set's file falls through to the default dir
    assert [r.prompt for r in load_prompts("gsm8k", local_dir=tmp_path, cache_dir=cache_dir)] == ["from default"]


def test_deepspec_turns_file_and_paper_alpaca_name(tmp_path, no_default_data, cache_dir):
    """A DeepSpec eval file ({"turns": [...]}) named alpaca.jsonl beats the stand-in and gets shuffled to 500."""
    write_jsonl(tmp_path / "alpaca_eval.jsonl", [{"prompt": "stand-in"}])
    write_jsonl(tmp_path / "alpaca.jsonl", [{"turns": [f"instr {i}", "later"]} for i in range(600)])
    records = load_prompts("alpaca", local_dir=tmp_path, cache_dir=cache_dir)
    order = P.paper_subset(list(range(600)), cap=500)
    assert [r.prompt for r in records] == [f"instr {i}" for i in order]
    assert records[0].id == f"alpaca-{order[0]}" and records[0].turns == ["later"] and records[0].domain == "chat"


def test_bad_local_files_raise_with_the_schema(tmp_path, no_default_data, cache_dir):
    (tmp_path / "mtbench.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_prompts("mt-bench", local_dir=tmp_path, cache_dir=cache_dir)
    write_jsonl(tmp_path / "mtbench.jsonl", [{"id": "a", "text": "no prompt field"}])
    with pytest.raises(ValueError, match="mtbench.jsonl line 1: no `prompt`"):
        load_prompts("mt-bench", local_dir=tmp_path, cache_dir=cache_dir)


def test_hub_rows_get_paper_format_selection_and_ids(monkeypatch, no_default_data):
    rows = [{"question": f"Q{i}?", "answer": f"#### {i}"} for i in range(600)]
    calls = fake_hub(monkeypatch, rows)
    records = load_prompts("gsm8k", limit=20)
    assert calls == [("openai/gsm8k", "main", {"split": "test", "cache_dir": None})]
    order = P.paper_subset(list(range(600)), cap=500)[:20]
    assert [r.id for r in records] == [f"gsm8k_test-{i}" for i in order]
    assert [r.prompt for r in records] == [f"Q{i}?" + SUFFIX for i in order]
    assert len(load_prompts("gsm8k", selection="all")) == 600


def test_hub_data_files_are_read_with_the_json_builder(monkeypatch, no_default_data, tmp_path):
    calls = fake_hub(monkeypatch, [{"question_content": f"P{i}", "starter_code": ""} for i in range(3)])
    records = load_prompts("livecodebench", cache_dir=tmp_path)
    path, name, kwargs = calls[0]
    assert path == "json" and name is None and kwargs["cache_dir"] == str(tmp_path)
    assert kwargs["data_files"][0] == "hf://datasets/livecodebench/code_generation_lite/test.jsonl"
    assert [r.id for r in records] == ["livecodebench-0", "livecodebench-1", "livecodebench-2"]


def test_offline_hub_failure_names_set_places_and_fix(monkeypatch, no_default_data, tmp_path):
    fake_hub(monkeypatch, [], error=ConnectionError("Couldn't reach 'openai/openai_humaneval' on the Hub"))
    with pytest.raises(ValueError) as info:
        load_prompts("humaneval", local_dir=tmp_path)
    message = str(info.value)
    for part in (
        "'humaneval'",
        "humaneval.jsonl",
        str(tmp_path),
        str(no_default_data),
        "data.local_dir=DIR",
        "network",
        "ConnectionError",
    ):
        assert part in message
    calls = fake_hub(monkeypatch, [])
    with pytest.raises(ValueError, match="'math-train'.*no hub copy.*data.local_dir=DIR"):
        load_prompts("math-train")
    assert calls == []  # local-only sets never try the hub


def test_default_data_dir_skips_missing_env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_DATA_DIR", str(tmp_path / "nope"))
    assert P.default_data_dir() is None
    assert [label for label, _ in P.search_dirs(None)] == ["vendored prompt sets"]


# ---- preflight: resolve every set without reading it ----


def test_prompt_set_errors_name_the_key_and_the_fix(tmp_path, monkeypatch, no_default_data):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(P, "hub_unreachable_reason", lambda hub_id, **_: f"{hub_id} unreachable")
    errors = P.prompt_set_errors(
        {"data.train_sets": ["math-train", "synthetic", "gsm8kk"], "decode.eval_sets": ["humaneval"]},
        local_dir=None,
        cache_dir=tmp_path,
    )
    assert len(errors) == 3
    assert errors[0].startswith("data.train_sets: Prompt set 'math-train': no math_train.jsonl") and "Fix" in errors[0]
    assert errors[1].startswith("data.train_sets: Unknown prompt set 'gsm8kk'") and "gsm8k" in errors[1]
    assert (
        errors[2].startswith("decode.eval_sets: prompt set 'humaneval'")
        and "openai/openai_humaneval unreachable" in errors[2]
        and "data.local_dir=DIR" in errors[2]
    )
    write_jsonl(tmp_path / "humaneval.jsonl", [{"prompt": "p"}])
    assert P.prompt_set_errors({"decode.eval_sets": ["humaneval"]}, local_dir=tmp_path, cache_dir=None) == []


def test_hub_reason_uses_the_cache_and_the_offline_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    assert "HF_HUB_OFFLINE" in P.hub_unreachable_reason("mlabonne/open-perfectblend", cache_dir=tmp_path / "c")
    (tmp_path / "c" / "mlabonne___open-perfectblend").mkdir(parents=True)
    assert P.hub_unreachable_reason("mlabonne/open-perfectblend", cache_dir=tmp_path / "c") is None


# ---- synthetic generator ----


def _template_regex(text: str) -> re.Pattern:
    """A regex that parses a rendered template back into its values (numbers for one-letter placeholders)."""
    pattern, seen = "", set()
    for i, part in enumerate(re.split(r"\{(\w+)\}", text)):
        if i % 2 == 0:
            pattern += re.escape(part)
        elif part in seen:
            pattern += f"(?P={part})"
        else:
            seen.add(part)
            pattern += f"(?P<{part}>\\d+)" if len(part) == 1 else f"(?P<{part}>.+?)"
    return re.compile(pattern)


# answers written independently of synthetic.py, keyed by template name
EXPECTED = {
    "restock": lambda a, b, c, **_: a + b * c,
    "share": lambda a, b, **_: a / b,
    "change": lambda a, b, c, **_: c - a * b,
    "reading": lambda a, b, c, d, **_: a * b + c * d,
    "train": lambda a, b, c, d, **_: a * b + c * d,
    "savings": lambda a, b, **_: b / a,
    "fence": lambda a, b, **_: 2 * a + 2 * b,
    "bus": lambda a, p, **_: a * (100 - p) / 100,
    "ages": lambda a, b, c, **_: a * b + c,
    "boxes": lambda a, b, c, **_: a * b + c,
    "shopping": lambda a, b, c, d, **_: a * b + c * d,
    "recipe": lambda a, b, c, **_: a * c / b,
    "laps": lambda a, b, c, **_: a * b * c,
    "tank": lambda a, b, c, d, **_: a - b * c + d,
    "ratio": lambda a, b, c, **_: a * c / (b + c),
    "sale": lambda a, p, **_: a * (100 - p) / 100,
    "average": lambda a, b, c, d, **_: 4 * d - (a + b + c),
    "farm": lambda a, b, **_: 2 * a + 4 * b,
}


def test_synthetic_math_references_are_correct():
    assert set(EXPECTED) == {t.name for t in S.MATH_TEMPLATES}
    regexes = [(t.name, _template_regex(t.text)) for t in S.MATH_TEMPLATES]
    records = S.generate_synthetic_prompts(900, seed=5, domains=("math",))
    used = set()
    for record in records:
        matches = [(name, m) for name, rx in regexes if (m := rx.fullmatch(record.prompt))]
        assert len(matches) == 1, record.prompt
        name, match = matches[0]
        values = {k: int(v) if len(k) == 1 else v for k, v in match.groupdict().items()}
        expected = EXPECTED[name](**values)
        assert expected == int(expected) >= 0 and record.reference == str(int(expected)), record.prompt
        used.add(name)
    assert used == set(EXPECTED)


def test_synthetic_is_deterministic_unique_and_round_robin():
    records = S.generate_synthetic_prompts(3000, seed=11)
    assert records == S.generate_synthetic_prompts(3000, seed=11)
    assert S.generate_synthetic_prompts(50, seed=11) == records[:50]
    assert [r.prompt for r in S.generate_synthetic_prompts(50, seed=12)] != [r.prompt for r in records[:50]]
    assert len({r.id for r in records}) == len({r.prompt for r in records}) == 3000
    assert [r.domain for r in records[:6]] == ["math", "code", "chat"] * 2
    assert {d: sum(r.domain == d for r in records) for d in S.DOMAINS} == {"math": 1000, "code": 1000, "chat": 1000}
    code = [r.prompt for r in records if r.domain == "code"]
    assert all(re.match(r"^.*`\w+\([\w, ]*\)` that ", p) for p in code)
    assert len({p.split("`")[1].split("(")[0] for p in code}) >= 60  # function names: many templates in use
    assert all(r.reference is None for r in records if r.domain != "math")


def test_synthetic_set_through_load_prompts_and_errors():
    assert load_prompts("synthetic", limit=12, seed=3) == S.generate_synthetic_prompts(12, seed=3)
    assert len(load_prompts("synthetic")) == P.SYNTHETIC_DEFAULT_COUNT
    assert {r.domain for r in S.generate_synthetic_prompts(10, seed=0, domains=("chat", "code"))} == {"chat", "code"}
    for bad in [("poetry",), (), ("math", "math")]:
        with pytest.raises(ValueError, match="domains"):
            S.generate_synthetic_prompts(3, seed=0, domains=bad)
    with pytest.raises(ValueError, match="n=-1"):
        S.generate_synthetic_prompts(-1, seed=0)
