"""Prompt sets: the paper's nine evaluation sets, training sets, and one loader for local JSONL or the hub.

Where a set is read from, first match wins: `data.local_dir`, then `$DSPARK_DATA_DIR`, then the prompt sets
vendored with the package (`dspark/data/prompt_sets/`, sources and licences in its SOURCES.md and LICENSES.md), then
the hub. Every set with a local file is vendored, so a fresh clone or an installed wheel needs no network.

Local files use the schema of `prompt_sets/SOURCES.md`: one JSON object per line with `prompt` (the first user
turn, already in the paper's format for eval sets), optional `id`, `domain`, `turns` (later user turns),
`reference` and `paper_eval_rank`. A DeepSpec-style row `{"turns": [t1, t2, ...]}` without `prompt` is read as
prompt = t1, turns = [t2, ...].

The paper's selection (DeepSpec `eval.py`): only the first turn is fed; a set with more rows than the task's cap
is shuffled with `random.Random(980406)` and the first `cap` rows kept. `Random.shuffle` depends only on the list
length, so a staged file's `paper_eval_rank` column and a fresh shuffle of the hub rows agree.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from dspark.data.records import PromptRecord, quote, row_defect
from dspark.data.synthetic import generate_synthetic_prompts
from dspark.registry import Registry, unknown_name_message

PAPER_SEED = 980406  # DeepSpec eval.py --seed default; fixes which rows the paper evaluates
SYNTHETIC_DEFAULT_COUNT = 1000  # prompts generated for the `synthetic` set when no limit is given
REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
LCB_HEADER = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
    "a correct Python program that matches the specification and passes all tests. You will NOT return anything "
    "except for the program\n\n"
)
SELECTIONS = ("paper", "all")
VENDORED_DIR = Path(__file__).resolve().parent / "prompt_sets"  # package data (pyproject: tool.setuptools.package-data)
# No prompt is 4 MiB (~1M tokens); a longer line is a file that is not JSONL, refused before it is held in memory.
MAX_LINE_BYTES = 4 << 20
SCHEMA_HINT = (
    "one JSON object per line with a `prompt` string and optional `id`, `domain`, `turns`, `reference`, "
    "`paper_eval_rank` (see dspark/data/prompt_sets/SOURCES.md)"
)


@dataclass(frozen=True)
class PromptSetSpec:
    """Where a prompt set lives and how its rows become PromptRecords.

    `local_files` are candidate file names (first present wins) in the shared JSONL schema. `format_hub_row` is
    a pure function of one hub row that applies the paper's prompt format. `paper_max` is the paper's cap on
    evaluated rows (None: no cap). `generate(n, seed)` replaces file and hub for generated sets. `reference_of`
    reads a local row's reference response (None: the row's `reference` field as it is).
    """

    name: str
    domain: str  # math | code | chat | instruction, or mixed (records then carry their own domain)
    role: str  # eval | train
    local_files: tuple[str, ...] = ()
    hub_id: str | None = None
    hub_config: str | None = None
    hub_split: str | None = None
    hub_data_files: tuple[str, ...] = ()  # files in the hub repo, read with the json builder (script-based repos)
    paper_max: int | None = None
    format_hub_row: Callable[[Mapping[str, Any]], PromptRecord] | None = None
    keep_local_row: Callable[[Mapping[str, Any]], bool] | None = None
    generate: Callable[[int, int], list[PromptRecord]] | None = None
    reference_of: Callable[[Mapping[str, Any]], str | None] | None = None
    note: str = ""


PROMPT_SETS: Registry[PromptSetSpec] = Registry("prompt set")


# ---- the paper's prompt formats for hub rows (DeepSpec eval_datasets/convert_eval_datasets_to_jsonl.py) ----


def format_gsm8k(row: Mapping[str, Any]) -> PromptRecord:
    return PromptRecord("", "math", row["question"] + REASONING_SUFFIX, reference=row.get("answer"))


def format_math_problem(row: Mapping[str, Any]) -> PromptRecord:
    """MATH-500 and AIME rows: `problem` + the boxed-answer suffix; reference = worked solution or final answer."""
    reference = row.get("solution", row.get("answer"))
    return PromptRecord(
        str(row.get("unique_id") or ""),
        "math",
        row["problem"] + REASONING_SUFFIX,
        reference=None if reference is None else str(reference),
    )


def format_humaneval(row: Mapping[str, Any]) -> PromptRecord:
    prompt = HUMANEVAL_PREFIX + row["prompt"] + "\n```"
    return PromptRecord(row["task_id"], "code", prompt, reference=row.get("canonical_solution"))


def format_mbpp(row: Mapping[str, Any]) -> PromptRecord:
    """Sanitized MBPP: the `prompt` text alone, no tests shown."""
    return PromptRecord(f"mbpp-{row['task_id']}", "code", row["prompt"], reference=row.get("code"))


def format_livecodebench(row: Mapping[str, Any]) -> PromptRecord:
    """The official LiveCodeBench code-generation template: starter code, or `# YOUR CODE HERE` without one."""
    starter = row.get("starter_code") or ""
    label = "Use the following code structure:" if starter else "Write your code in the following format:"
    prompt = (
        f"{LCB_HEADER}### Question:\n{row['question_content']}\n\n### Format: {label}\n"
        f"```python\n{starter or '# YOUR CODE HERE'}\n```\n\n### Answer: (use the provided format with backticks)"
    )
    return PromptRecord("", "code", prompt)


def format_mt_bench(row: Mapping[str, Any]) -> PromptRecord:
    turns = list(row["prompt"])
    references = row.get("reference") or []
    pid = row.get("prompt_id")
    return PromptRecord(
        "" if pid is None else f"mtbench-{pid}",
        "chat",
        turns[0],
        turns=turns[1:],
        reference=references[0] if references else None,
    )


def format_alpaca(row: Mapping[str, Any]) -> PromptRecord:
    """`instruction`, or `instruction + "\\n\\nInput:\\n" + input` when the input is non-empty."""
    text = row["instruction"]
    if row.get("input"):
        text = f"{text}\n\nInput:\n{row['input']}"
    return PromptRecord("", "chat", text, reference=row.get("output"))


def format_arena_hard(row: Mapping[str, Any]) -> PromptRecord:
    uid = row.get("uid")
    return PromptRecord("" if uid is None else f"arena_hard_v2-{uid}", "chat", row["prompt"])


def format_conversation(row: Mapping[str, Any]) -> PromptRecord:
    """ShareGPT-style `conversations` of {from, value}: first human turn = prompt, later human turns = turns."""
    human = [t["value"] for t in row["conversations"] if t.get("from") in ("human", "user")]
    if not human:
        raise ValueError(f"prompt set 'open-perfectblend': a row has no human turn: {row['conversations']!r:.200}")
    return PromptRecord("", guess_domain(str(row.get("source") or "")), human[0], turns=human[1:])


def guess_domain(source: str) -> str:
    """Domain of a mixed-set row from its source dataset name (math/code by keyword, else chat)."""
    lowered = source.lower()
    if any(key in lowered for key in ("math", "gsm", "aime", "numina")):
        return "math"
    if any(key in lowered for key in ("code", "coder", "program", "python")):
        return "code"
    return "chat"


# ---- registry ----


def _eval_set(name: str, *, domain: str, local: str | tuple[str, ...], cap: int, fmt, **hub) -> None:
    files = (local,) if isinstance(local, str) else local
    PROMPT_SETS.add(
        name, PromptSetSpec(name, domain, "eval", local_files=files, paper_max=cap, format_hub_row=fmt, **hub)
    )


def _generate_synthetic(n: int, seed: int) -> list[PromptRecord]:
    return generate_synthetic_prompts(n, seed=seed)


def strip_calculator_notes(text: str) -> str:
    """GSM8K solutions annotate arithmetic as `48/2 = <<48/2=24>>24`; the reference response keeps `48/2 = 24`."""
    return re.sub(r"<<[^<>]*>>", "", text)


def _gsm8k_reference(row: Mapping[str, Any]) -> str | None:
    reference = row.get("reference")
    return None if reference is None else strip_calculator_notes(str(reference))


def _not_mbpp_test_task(row: Mapping[str, Any]) -> bool:
    """MBPP's test split is task ids 11-510 (the eval set `mbpp` is its sanitized subset); keep every other task."""
    task = row.get("task_id")
    if isinstance(task, bool) or not isinstance(task, int):
        raise ValueError(f"`task_id` must be MBPP's integer task number (the set keeps rows by it), not {quote(task)}")
    return not 11 <= task <= 510


_eval_set(
    "gsm8k",
    domain="math",
    local="gsm8k_test.jsonl",
    cap=500,
    fmt=format_gsm8k,
    hub_id="openai/gsm8k",
    hub_config="main",
    hub_split="test",
)
_eval_set(
    "math500",
    domain="math",
    local="math500.jsonl",
    cap=500,
    fmt=format_math_problem,
    hub_id="HuggingFaceH4/MATH-500",
    hub_split="test",
)
# DeepSpec's converter reads AIME 2025 from MathArena/aime_2025 (split train, 30 problems, `problem` column).
_eval_set(
    "aime25",
    domain="math",
    local="aime25.jsonl",
    cap=30,
    fmt=format_math_problem,
    hub_id="MathArena/aime_2025",
    hub_split="train",
)
_eval_set(
    "humaneval",
    domain="code",
    local="humaneval.jsonl",
    cap=164,
    fmt=format_humaneval,
    hub_id="openai/openai_humaneval",
    hub_split="test",
)
_eval_set(
    "mbpp",
    domain="code",
    local="mbpp.jsonl",
    cap=256,
    fmt=format_mbpp,
    hub_id="google-research-datasets/mbpp",
    hub_config="sanitized",
    hub_split="test",
)
# The hub repo ships a loading script that datasets>=4 refuses, so its JSONL files are read directly (as DeepSpec).
_eval_set(
    "livecodebench",
    domain="code",
    local="livecodebench.jsonl",
    cap=500,
    fmt=format_livecodebench,
    hub_id="livecodebench/code_generation_lite",
    hub_split="test",
    hub_data_files=("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"),
)
_eval_set(
    "mt-bench",
    domain="chat",
    local="mtbench.jsonl",
    cap=80,
    fmt=format_mt_bench,
    hub_id="HuggingFaceH4/mt_bench_prompts",
    hub_split="train",
)
# `alpaca.jsonl` (the paper's set, e.g. DeepSpec's eval_datasets/alpaca.jsonl) wins over the staged stand-in.
_eval_set(
    "alpaca",
    domain="chat",
    local=("alpaca.jsonl", "alpaca_eval.jsonl"),
    cap=500,
    fmt=format_alpaca,
    hub_id="tatsu-lab/alpaca",
    hub_split="train",
    note="The staged alpaca_eval.jsonl (805 AlpacaEval instructions) is a stand-in: the paper draws 500 rows "
    "of tatsu-lab/alpaca (52k), which is not staged. Hub or a local alpaca.jsonl gives the paper's set.",
)
# Arena-Hard v2.0 questions (750; the paper evaluates 500): the lmarena-ai/arena-hard-auto hub dataset holds the
# same question.jsonl as github lmarena/arena-hard-auto, which the staged file and DeepSpec's copy come from.
_eval_set(
    "arena-hard",
    domain="chat",
    local="arena_hard_v2.jsonl",
    cap=500,
    fmt=format_arena_hard,
    hub_id="lmarena-ai/arena-hard-auto",
    hub_split="train",
    hub_data_files=("data/arena-hard-v2.0/question.jsonl",),
)

PROMPT_SETS.add(
    "open-perfectblend",
    PromptSetSpec(
        "open-perfectblend",
        "mixed",
        "train",
        hub_id="mlabonne/open-perfectblend",
        hub_split="train",
        format_hub_row=format_conversation,
        note="Domain per row is guessed from its `source` column.",
    ),
)
PROMPT_SETS.add(
    "gsm8k-train",
    PromptSetSpec(
        "gsm8k-train",
        "math",
        "train",
        local_files=("gsm8k_train.jsonl",),
        reference_of=_gsm8k_reference,
        note="Reference = the GSM8K worked solution without its <<calculator>> notes, ending in '#### answer'.",
    ),
)
PROMPT_SETS.add(
    "math-train",
    PromptSetSpec(
        "math-train",
        "math",
        "train",
        local_files=("math_train.jsonl",),
        reference_of=lambda row: None,
        note="The staged MATH train rows hold final answers only, so records carry no reference response.",
    ),
)
PROMPT_SETS.add(
    "mbpp-train",
    PromptSetSpec(
        "mbpp-train",
        "code",
        "train",
        local_files=("mbpp_full.jsonl",),
        keep_local_row=_not_mbpp_test_task,
        note="MBPP task ids 1-10 and 511-974 (reference = the task's code); the test ids 11-510 hold the eval set's tasks.",
    ),
)
PROMPT_SETS.add(
    "alpaca-seed",
    PromptSetSpec(
        "alpaca-seed",
        "instruction",
        "train",
        local_files=("alpaca_seed_tasks.jsonl",),
        note="175 human-written self-instruct seed tasks; reference = the first instance's output.",
    ),
)
PROMPT_SETS.add(
    "alpaca-5k",
    PromptSetSpec(
        "alpaca-5k",
        "instruction",
        "train",
        local_files=("alpaca_5k_train.jsonl",),
        note="5,000 Alpaca-52k rows (tatsu-lab/stanford_alpaca data/alpaca_5000.json), the paper's alpaca prompt format; "
        "reference = the Alpaca (text-davinci-003) output. Training only; no prompt overlaps alpaca_eval.jsonl.",
    ),
)
PROMPT_SETS.add(
    "synthetic",
    PromptSetSpec(
        "synthetic",
        "mixed",
        "train",
        generate=_generate_synthetic,
        note=f"Offline generator (dspark.data.synthetic); limit=None gives {SYNTHETIC_DEFAULT_COUNT} prompts.",
    ),
)


def prompt_set_domain(name: str) -> str:
    """The set's domain (math | code | chat | instruction | mixed); raises the registry's error for unknown names."""
    return PROMPT_SETS.resolve(name).domain


def default_data_dir() -> Path | None:
    """$DSPARK_DATA_DIR when it names an existing directory, else None (the vendored sets come after it)."""
    env = os.environ.get("DSPARK_DATA_DIR")
    return Path(env) if env and Path(env).is_dir() else None


@dataclass(frozen=True)
class PromptSource:
    """Where `load_prompts` will read a set from: kind file (path), hub (hub_id) or generated (neither)."""

    name: str
    kind: str  # file | hub | generated
    path: Path | None = None
    hub_id: str | None = None


def search_dirs(local_dir: str | Path | None) -> list[tuple[str, Path]]:
    """(label, directory) in lookup order: data.local_dir, $DSPARK_DATA_DIR, the vendored prompt sets.

    Raises ValueError when `local_dir` is given but is not a directory (a typo should not silently fall through).
    """
    dirs = []
    if local_dir is not None:
        local_dir = Path(local_dir).expanduser()
        if not local_dir.is_dir():
            raise ValueError(
                f"data.local_dir={local_dir} does not exist; point it at a directory of JSONL prompt files "
                f"({SCHEMA_HINT}) or leave it unset."
            )
        dirs.append(("data.local_dir", local_dir))
    env = default_data_dir()
    if env is not None:
        dirs.append(("$DSPARK_DATA_DIR", env))
    dirs.append(("vendored prompt sets", VENDORED_DIR))
    return dirs


def resolve_prompt_source(name: str, *, local_dir: str | Path | None = None) -> PromptSource:
    """The first source of `name` in lookup order, without reading it (cheap: used by preflight).

    Raises ValueError (naming the file, the places searched and the fix) when no local file exists and the set
    has no hub copy. A hub source is not contacted here; see `hub_unreachable_reason`.
    """
    spec = PROMPT_SETS.resolve(name)
    if spec.generate is not None:
        return PromptSource(name, "generated")
    dirs = search_dirs(local_dir)
    for _, directory in dirs:
        path = _find_local_file(spec, directory)
        if path is not None:
            return PromptSource(name, "file", path=path)
    if spec.hub_id is None:
        raise ValueError(_not_found_message(spec, _searched(dirs), hub_error=None))
    return PromptSource(name, "hub", hub_id=spec.hub_id)


def hub_unreachable_reason(hub_id: str, *, cache_dir: str | Path | None, timeout_s: float = 5.0) -> str | None:
    """None when the hub dataset `hub_id` can be loaded (it is in the `datasets` / hub cache, or the hub answers
    within `timeout_s`), else a one-line reason. Preflight calls it so an offline run stops before any work."""
    cached_names = (hub_id.replace("/", "___"), "datasets--" + hub_id.replace("/", "--"))
    roots = [Path(cache_dir)] if cache_dir is not None else []
    roots += [
        Path(os.environ.get("HF_DATASETS_CACHE") or Path.home() / ".cache" / "huggingface" / "datasets"),
        Path(os.environ.get("HF_HUB_CACHE") or Path.home() / ".cache" / "huggingface" / "hub"),
    ]
    if any((root / name).exists() for root in roots for name in cached_names):
        return None
    offline = any(
        os.environ.get(key, "").lower() in ("1", "true", "yes", "on")
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    if offline:
        return "it is not in the datasets cache and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"
    try:
        from huggingface_hub import HfApi

        HfApi().dataset_info(hub_id, timeout=timeout_s)
    except Exception as exc:  # offline, DNS, timeout, 404, gated: all mean the load would fail
        return f"the hub did not answer ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def check_prompt_file(
    path: Path, *, keep_row: Callable[[Mapping[str, Any]], bool] | None = None, domain_required: bool = False
) -> int:
    """Validate a JSONL prompt file line by line and return its row count (`read_prompt_rows`)."""
    return len(read_prompt_rows(path, keep_row=keep_row, domain_required=domain_required))


def read_prompt_rows(
    path: Path, *, keep_row: Callable[[Mapping[str, Any]], bool] | None = None, domain_required: bool = False
) -> list[dict[str, Any]]:
    """Every row of a JSONL prompt file, in file order. Each non-blank line must be one UTF-8 JSON object of at most
    MAX_LINE_BYTES with a `prompt` string (or a `turns` list) and typed optional fields (`records.row_defect`);
    blank lines are skipped, as `datasets` does. Rows that `keep_row` drops are not checked for a prompt. An error
    names the file, the line, the field and what to fix."""
    path, rows = Path(path), []
    try:
        with open(path, "rb") as handle:
            for number, line in _numbered_lines(handle, path):
                if not line.strip():
                    continue
                row = _parse_row(line, where=f"{path} line {number}")
                rows.append(row)
                if keep_row is not None and not _kept(keep_row, row, where=f"{path} line {number}"):
                    continue
                defect = row_defect(row, domain_required=domain_required)
                if defect is not None:
                    raise ValueError(f"{path} line {number}: {defect}; prompt files need {SCHEMA_HINT}.")
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or err}); point data.local_dir elsewhere.") from None
    if not rows:
        raise ValueError(f"{path} is empty (no non-blank lines); a prompt file needs {SCHEMA_HINT}.")
    return rows


def _numbered_lines(handle: Any, path: Path) -> Iterator[tuple[int, str]]:
    """(1-based number, text) of each line, split on "\n" only (U+2028 may sit inside a JSON string), each read
    with a bound so a file of one huge line is refused instead of loaded."""
    number = 0
    while raw := handle.readline(MAX_LINE_BYTES + 1):
        number += 1
        raw = raw.rstrip(b"\n")
        if len(raw) > MAX_LINE_BYTES:
            raise ValueError(
                f"{path} line {number}: longer than {MAX_LINE_BYTES:,} bytes, which no prompt is (a file "
                f"that is not JSONL, or rows not split by newlines?); each non-blank line must be {SCHEMA_HINT}."
            )
        try:
            yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path} line {number}: not UTF-8 text (byte {err.start + 1} of the line is "
                f"0x{raw[err.start]:02x}); save the file as UTF-8 ({SCHEMA_HINT})."
            ) from None


def _parse_row(line: str, *, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where}: not valid JSON ({err.msg}, column {err.colno}); each non-blank line must be {SCHEMA_HINT}."
        ) from None
    except (ValueError, RecursionError) as err:  # an integer of > 4300 digits, nesting deeper than the stack
        reason = "nested too deeply" if isinstance(err, RecursionError) else quote(str(err))
        raise ValueError(f"{where}: not valid JSON ({reason}); each non-blank line must be {SCHEMA_HINT}.") from None
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: a JSON {type(row).__name__}, not an object; each non-blank line must be {SCHEMA_HINT}."
        )
    return row


def _kept(keep_row: Callable[[Mapping[str, Any]], bool], row: dict[str, Any], *, where: str) -> bool:
    """`keep_row(row)`; its ValueError (a field it reads is missing or ill-typed) named with the line."""
    try:
        return keep_row(row)
    except ValueError as err:
        raise ValueError(f"{where}: {err}; prompt files need {SCHEMA_HINT}.") from None


# ---- loading ----


def load_prompts(
    name: str,
    *,
    local_dir: str | Path | None = None,
    limit: int | None = None,
    seed: int = PAPER_SEED,
    selection: str = "paper",
    cache_dir: str | Path | None = None,
) -> list[PromptRecord]:
    """Load a prompt set: `local_dir` (if it holds the set's file) > $DSPARK_DATA_DIR > vendored > the hub.

    selection="paper": eval sets give the paper's rows in the paper's order (`paper_eval_rank` when the file has
    it and seed is the paper's, else the seeded shuffle capped at `paper_max`); training sets give all rows.
    selection="all": every row in file order. `limit` then keeps the first `limit` records. `cache_dir` is where
    `datasets` keeps its Arrow cache (None: its default, HF_DATASETS_CACHE).
    """
    spec = PROMPT_SETS.resolve(name)
    if selection not in SELECTIONS:
        raise ValueError(f"selection='{selection}' is not one of {', '.join(SELECTIONS)}; use 'paper' or 'all'.")
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0 (or None for the whole set).")
    if spec.generate is not None:
        return spec.generate(SYNTHETIC_DEFAULT_COUNT if limit is None else limit, seed)
    records, ranks = _load_records(spec, local_dir=local_dir, cache_dir=cache_dir)
    if selection == "paper":
        records = _paper_selection(spec, records=records, ranks=ranks, seed=seed)
    return records if limit is None else records[:limit]


def paper_subset(items: list, *, cap: int, seed: int = PAPER_SEED) -> list:
    """DeepSpec's selection: if len(items) > cap, shuffle (random.Random(seed)) and keep the first cap."""
    if len(items) <= cap:
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[:cap]]


def _paper_selection(
    spec: PromptSetSpec, *, records: list[PromptRecord], ranks: list | None, seed: int
) -> list[PromptRecord]:
    if spec.paper_max is None:
        return records
    if ranks is not None and seed == PAPER_SEED and any(rank is not None for rank in ranks):
        # the staged rank reproduces the paper's order exactly, even where file order and hub order might differ
        ranked = sorted((rank, i) for i, rank in enumerate(ranks) if rank is not None)
        return [records[i] for _, i in ranked]
    return paper_subset(records, cap=spec.paper_max, seed=seed)


def _load_records(spec: PromptSetSpec, *, local_dir, cache_dir) -> tuple[list[PromptRecord], list | None]:
    """Records of the whole set in source order, plus the `paper_eval_rank` column for local files."""
    source = resolve_prompt_source(spec.name, local_dir=local_dir)
    if source.kind == "file":
        return _read_local(spec, source.path)
    try:
        return _read_hub(spec, cache_dir=cache_dir), None
    except Exception as exc:  # datasets raises many types when offline (ConnectionError, httpx, not-found, ...)
        raise ValueError(_not_found_message(spec, _searched(search_dirs(local_dir)), hub_error=exc)) from exc


def _find_local_file(spec: PromptSetSpec, directory: Path) -> Path | None:
    return next((directory / f for f in spec.local_files if (directory / f).is_file()), None)


def _searched(dirs: list[tuple[str, Path]]) -> list[str]:
    return [f"{label}={path}" for label, path in dirs]


def _not_found_message(spec: PromptSetSpec, searched: list[str], *, hub_error: Exception | None) -> str:
    files = " or ".join(spec.local_files) or "(no local file)"
    where = "; ".join(searched)
    if hub_error is None:
        hub = "it has no hub copy"
        fix = f"set data.local_dir=DIR to a directory holding {files}"
    else:
        hub = f"loading hub dataset {spec.hub_id} failed ({type(hub_error).__name__}: {str(hub_error)[:300]})"
        fix = f"set data.local_dir=DIR to a directory holding {files}, or allow network access to the hub"
    return f"Prompt set '{spec.name}': no {files} found in {where}, and {hub}. Fix: {fix} ({SCHEMA_HINT})."


def _read_local(spec: PromptSetSpec, path: Path) -> tuple[list[PromptRecord], list]:
    rows = read_prompt_rows(path, keep_row=spec.keep_local_row, domain_required=spec.domain == "mixed")
    if spec.keep_local_row is not None:
        rows = [row for row in rows if spec.keep_local_row(row)]
    records = [_record_from_row(row, spec=spec, path=path, index=i) for i, row in enumerate(rows)]
    return records, [row.get("paper_eval_rank") for row in rows]


def _record_from_row(row: Mapping[str, Any], *, spec: PromptSetSpec, path: Path, index: int) -> PromptRecord:
    """A checked row (`read_prompt_rows`) as a record; `index` counts the kept rows (the default id's suffix)."""
    prompt, turns = row.get("prompt"), list(row.get("turns") or [])
    if prompt is None:  # DeepSpec eval file: {"turns": [first, later...]}
        prompt, turns = turns[0], turns[1:]
    reference = spec.reference_of(row) if spec.reference_of is not None else row.get("reference")
    # a set's own domain wins over the file's tag (the staged alpaca-5k rows say `chat`, the set is `instruction`)
    domain = str(row.get("domain") or "chat") if spec.domain == "mixed" else spec.domain
    return PromptRecord(
        id=str(row["id"]) if row.get("id") is not None else f"{path.stem}-{index}",
        domain=domain,
        prompt=prompt,
        turns=turns,
        reference=None if reference is None or reference == "" else str(reference),  # two alpaca-5k rows have ""
    )


def _read_hub(spec: PromptSetSpec, *, cache_dir) -> list[PromptRecord]:
    """All hub rows in source order, formatted; rows without their own id get `<local stem>-<index>`."""
    import datasets

    cache = None if cache_dir is None else str(cache_dir)
    if spec.hub_data_files:
        files = [f"hf://datasets/{spec.hub_id}/{name}" for name in spec.hub_data_files]
        ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=cache)
    else:
        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.hub_split, cache_dir=cache)
    stem = Path(spec.local_files[0]).stem if spec.local_files else spec.name  # ids match the staged file's
    records = []
    for index, row in enumerate(ds):
        record = spec.format_hub_row(row)
        records.append(record if record.id else replace(record, id=f"{stem}-{index}"))
    return records


def prompt_set_errors(
    keyed_sets: Mapping[str, list[str]], *, local_dir: str | Path | None, cache_dir: str | Path | None
) -> list[str]:
    """One message per set that cannot be loaded, for every (config key, set names) pair, reading local files only.

    Unknown names, a missing data.local_dir, a local file that is not valid JSONL of prompts (`check_prompt_file`),
    a set with no local file and no hub copy, and a hub-only set while the hub is unreachable (and the set is not
    cached) each give `<key>: <why>. Fix: <how>`. Used by preflight so that a run stops in seconds instead of after
    regeneration and training.
    """
    errors, probed = [], {}
    for key, names in keyed_sets.items():
        for name in names:
            if name not in PROMPT_SETS:
                errors.append(f"{key}: " + unknown_name_message("prompt set", name, PROMPT_SETS.names()))
                continue
            try:
                source = resolve_prompt_source(name, local_dir=local_dir)
            except ValueError as err:
                errors.append(f"{key}: {err}")
                continue
            if source.kind == "file":  # read now (~0.1 s for the default sets): a malformed line fails here
                try:
                    spec = PROMPT_SETS.resolve(name)
                    check_prompt_file(source.path, keep_row=spec.keep_local_row, domain_required=spec.domain == "mixed")
                except ValueError as err:
                    errors.append(f"{key}: {err}")
            if source.kind != "hub":
                continue
            if source.hub_id not in probed:
                probed[source.hub_id] = hub_unreachable_reason(source.hub_id, cache_dir=cache_dir)
            if probed[source.hub_id] is not None:
                files = " or ".join(PROMPT_SETS.resolve(name).local_files) or f"a {name}.jsonl file"
                errors.append(
                    f"{key}: prompt set '{name}' has no local file and loads from the hub ({source.hub_id}), but "
                    f"{probed[source.hub_id]}. Fix: allow network access, or set data.local_dir=DIR to a directory "
                    f"holding {files} ({SCHEMA_HINT}), or drop '{name}' from {key}."
                )
    return errors
