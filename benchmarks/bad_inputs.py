"""Bad inputs through the real command line (issue 14, defect 4): exit code, seconds before the error, first line.

Every case runs `python experiments/run.py ARGS paths.root=<fresh dir>` as a fresh process (imports included, as a
user would see it), with the damaged files it needs made first in a temporary directory (a directory that is not a
model, a truncated GGUF / safetensors, malformed JSONL, a read-only output directory, ...). A case passes when it
exits 2 (refused before any work) and nothing ran: no MLflow store was created under its paths.root.

Writes outputs/benchmarks/bad_inputs.md with the command that produced it.

    PYTHONPATH=src .venv/bin/python benchmarks/bad_inputs.py                       # ~3-5 minutes on 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/bad_inputs.py --compare ../other-checkout  # adds its columns
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO, RESULTS, command_line, repo_path, without_repo_root, write_result


@dataclass
class Case:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    root: str | None = None  # paths.root placeholder key (default: a fresh directory per case)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="another checkout whose run.py/src to time on the same cases")
    parser.add_argument("--compare-label", default="", help="what the --compare checkout is, for the results file")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per case before it is stopped")
    parser.add_argument("--only", nargs="*", help="run only the cases whose name contains one of these words")
    return parser.parse_args(argv)


def make_files(work: Path) -> dict[str, str]:
    """The damaged inputs the cases point at; returns placeholder → path."""
    from dspark.targets.builtin import SMOLLM2_GGUF, SMOLLM2_PACKAGE
    from dspark.targets.storage import find_package_file

    files: dict[str, str] = {}
    (work / "notes").mkdir()
    (work / "notes" / "README.txt").write_text("a directory of notes, not a model\n")
    files["NOT_A_MODEL"] = str(work / "notes")
    tiny = _tiny_model_dir(work / "tiny-cache")
    for label, damage in (
        ("NO_WEIGHTS", _drop_weights),
        ("CUT_SAFETENSORS", _cut_safetensors),
        ("NO_MODEL_TYPE", _drop_model_type),
    ):
        copy = work / label.lower()
        shutil.copytree(tiny, copy)
        damage(copy)
        files[label] = str(copy)
    gguf = find_package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    data = gguf.read_bytes() if gguf is not None else b"GGUF" + b"\0" * 4096
    (work / "cut.gguf").write_bytes(data[: 1 << 20])  # the first MiB of SmolLM2-135M's 94 MiB GGUF
    (work / "header.gguf").write_bytes(data[:24])
    (work / "text.gguf").write_text("not a gguf file\n")
    files |= {
        "CUT_GGUF": str(work / "cut.gguf"),
        "HEADER_GGUF": str(work / "header.gguf"),
        "TEXT_GGUF": str(work / "text.gguf"),
    }
    prompts = work / "prompts"
    prompts.mkdir()
    (prompts / "gsm8k_test.jsonl").write_text('{"prompt": "What is 2+2?"}\n{"prompt": "cut off\n')
    (prompts / "mtbench.jsonl").write_text("\n\n")
    (prompts / "humaneval.jsonl").write_text('{"id": "h0", "text": "no prompt field"}\n')
    files["PROMPTS"] = str(prompts)
    files["READ_ONLY"] = _read_only_dir(work / "read-only")
    return files


def _tiny_model_dir(cache: Path) -> Path:
    from dspark.targets import load_target

    load_target("tiny", cache_dir=cache)
    return cache / "targets" / "tiny-seed0"


def _drop_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _cut_safetensors(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_model_type(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config.pop("model_type")
    (model / "config.json").write_text(json.dumps(config))


def _read_only_dir(path: Path) -> str:
    """A directory nobody here can write to: chmod for ordinary users; root ignores modes, so a read-only tmpfs."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return str(path)
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "dspark-bad-inputs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        return ""
    return str(path)


def cases() -> list[Case]:
    smoke = ["budget=smoke"]
    return [
        Case("unknown key", ["no_such_key=1"]),
        Case("misspelt key", ["model.depht=3"]),
        Case("not key=value", ["model"]),
        Case("integer key given text", ["model.depth=abc"]),
        Case("float key given text", ["optim.lr=fast"]),
        Case("NaN learning rate", ["optim.lr=nan"]),
        Case("list for a number", ["loss.alpha_ce=[1]"]),
        Case("unknown drafter", ["drafter=medusa"]),
        Case("unknown budget", ["budget=huge"]),
        Case("block size 0", ["model.block_size=0"]),
        Case("threshold outside [0, 1]", ["decode.threshold=1.5"]),
        Case("negative temperature", ["decode.temperature=-1"]),
        Case("dflash with a head", ["drafter=dflash", "model.head=markov"]),
        Case("scheduler policy, no confidence head", [*smoke, "decode.policy=scheduler", "drafter=dflash"]),
        Case("async serving, no confidence head", [*smoke, "stage=serve", "serve.policy=async", "drafter=dflash"]),
        Case("unknown sweep", ["sweep=no_such_sweep"]),
        Case("axis value selecting no cell", [*smoke, "sweep=depth", "model.depth=9"]),
        Case("multi-device sweep", [*smoke, "sweep=depth", "trainer.devices=2"]),
        Case("unknown train prompt set", [*smoke, "data.train_sets=[gsm8kk]"]),
        Case("unknown eval prompt set", [*smoke, "decode.eval_sets=[nope]"]),
        Case("missing data.local_dir", [*smoke, "data.local_dir=/no/such/dir"]),
        Case("malformed JSONL line", [*smoke, "data.local_dir=PROMPTS", "decode.eval_sets=[gsm8k]"]),
        Case("JSONL of blank lines only", [*smoke, "data.local_dir=PROMPTS", "decode.eval_sets=[mt-bench]"]),
        Case("JSONL row without a prompt", [*smoke, "data.local_dir=PROMPTS", "decode.eval_sets=[humaneval]"]),
        Case(
            "hub-only set, hub off",
            [*smoke, "decode.eval_sets=[gsm8k]", "data.train_sets=[open-perfectblend]"],
            env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        ),
        Case("missing target path", [*smoke, "target=/no/such/model"]),
        Case("directory that is not a model", [*smoke, "target=NOT_A_MODEL"]),
        Case("model directory without weights", [*smoke, "target=NO_WEIGHTS"]),
        Case("truncated model.safetensors", [*smoke, "target=CUT_SAFETENSORS"]),
        Case("config.json without model_type", [*smoke, "target=NO_MODEL_TYPE"]),
        Case("truncated .gguf (first MiB)", [*smoke, "target=CUT_GGUF"]),
        Case(".gguf cut inside its header", [*smoke, "target=HEADER_GGUF"]),
        Case("text file named .gguf", [*smoke, "target=TEXT_GGUF"]),
        Case("uncached hub id, hub off", [*smoke, "target=someone/some-model"], env={"HF_HUB_OFFLINE": "1"}),
        Case("missing SPS table", [*smoke, "stage=serve", "serve.sps_table=/no/such/sps.json"]),
        Case("unreachable tracking server", [*smoke, "tracking.uri=http://127.0.0.1:9"]),
        Case("unreachable Optuna storage", [*smoke, "sweep=rank", "optuna.storage=postgresql://u@127.0.0.1:9/x"]),
        Case("read-only paths.root", [*smoke], root="READ_ONLY"),
    ]


def run_case(case: Case, *, tree: Path, files: dict[str, str], root: Path, timeout: float) -> dict:
    args = [_fill(a, files) for a in case.args]
    target_root = files.get(case.root, "") if case.root else str(root)
    if case.root and not target_root:
        return {
            "exit": "skipped",
            "seconds": 0.0,
            "message": "(no read-only directory can be made here)",
            "clean": True,
        }
    argv = [sys.executable, str(tree / "experiments" / "run.py"), *args, f"paths.root={target_root}"]
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS="1", **case.env)
    env.pop("DSPARK_MLFLOW_RUN_ID", None)
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = f"timeout ({timeout:.0f} s)", (exc.stderr or b"").decode(errors="replace")
    seconds = time.perf_counter() - started
    clean = case.root is not None or not (root / "mlflow.db").exists()
    return {"exit": code, "seconds": seconds, "message": first_message_line(err), "clean": clean}


def _fill(arg: str, files: dict[str, str]) -> str:
    key, _, value = arg.partition("=")
    return f"{key}={files.get(value, value)}" if value in files else arg


def first_message_line(stderr: str) -> str:
    """The first line of the error the user sees: `error: ...`, with a bullet header joined to its first bullet."""
    lines = [line.rstrip() for line in stderr.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            text = line[len("error:") :].strip()
            if text.endswith(":") and i + 1 < len(lines):
                text = f"{text} {lines[i + 1].strip()}"
            return text
    tail = [line for line in lines if line.strip()]
    return f"(no error line; last: {tail[-1]})" if tail else "(nothing on stderr)"


def table(rows: list[dict], *, compare: bool) -> str:
    head = "| # | bad input | arguments | exit | seconds | nothing ran | first line of the message |"
    rule = "|---|---|---|---|---|---|---|"
    if compare:
        head += " before: exit | before: seconds | before: first line |"
        rule += "---|---|---|"
    out = [head, rule]
    for i, row in enumerate(rows, 1):
        now = row["now"]
        cells = [
            str(i),
            row["name"],
            f"`{row['args']}`",
            str(now["exit"]),
            f"{now['seconds']:.1f}",
            "yes" if now["clean"] else "**no**",
            _md(now["message"]),
        ]
        if compare:
            before = row["before"]
            cells += [str(before["exit"]), f"{before['seconds']:.1f}", _md(before["message"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _md(text: str, limit: int = 230) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    selected = [c for c in cases() if not args.only or any(w in c.name for w in args.only)]
    with tempfile.TemporaryDirectory(prefix="dspark-bad-inputs-") as tmp:
        work = Path(tmp)
        files = make_files(work)
        try:
            rows = []
            for i, case in enumerate(selected):
                row = {"name": case.name, "args": " ".join(case.args)}
                row["now"] = run_case(case, tree=REPO, files=files, root=work / f"root-{i}", timeout=args.timeout)
                if args.compare:
                    row["before"] = run_case(
                        case, tree=args.compare.resolve(), files=files, root=work / f"before-{i}", timeout=args.timeout
                    )
                for result in (row["now"], row.get("before")):
                    if result is not None:
                        result["message"] = placeholders(
                            result["message"], files=files, work=work, compare=args.compare
                        )
                print(
                    f"{case.name}: exit {row['now']['exit']} in {row['now']['seconds']:.1f} s: "
                    f"{row['now']['message'][:120]}",
                    flush=True,
                )
                rows.append(row)
        finally:
            if os.geteuid() == 0 and files.get("READ_ONLY"):
                subprocess.run(["umount", files["READ_ONLY"]], capture_output=True)
    refused = sum(r["now"]["exit"] == 2 and r["now"]["clean"] for r in rows)
    slowest = max(r["now"]["seconds"] for r in rows)
    command = command_line("bad_inputs.py", argv, prefix="PYTHONPATH=src python")
    text = "\n".join(
        [
            "# Bad inputs through the command line (issue 14, defect 4)",
            "",
            f"`{command.strip()}` on {os.cpu_count()} CPUs; each case is a fresh `python experiments/run.py ARGS "
            "paths.root=<fresh dir>` process, so seconds include Python's imports (~3-6 s here). A case is refused "
            'before any work when it exits 2 and no MLflow store was created ("nothing ran").',
            "",
            f"**{refused} of {len(rows)} refused before any work; slowest {slowest:.1f} s.**"
            + (
                f" Before: the same cases against {args.compare_label or repo_path(args.compare)}."
                if args.compare
                else ""
            ),
            "",
            table(rows, compare=bool(args.compare)),
            "",
            "Placeholders: NOT_A_MODEL a directory holding a README; NO_WEIGHTS / CUT_SAFETENSORS / NO_MODEL_TYPE copies "
            "of the tiny target's directory without model.safetensors, with it cut in half, without config.json's "
            "model_type; CUT_GGUF the first MiB of SmolLM2-135M's GGUF; HEADER_GGUF its first 24 bytes; TEXT_GGUF a text "
            "file; PROMPTS a directory with a gsm8k_test.jsonl whose 2nd line is cut off, an mtbench.jsonl of blank "
            "lines and a humaneval.jsonl row without `prompt`; READ_ONLY a read-only directory (a read-only tmpfs when "
            "run as root, which ignores directory modes); <tmp> the temporary directory of the run.",
            "",
        ]
    )
    if args.only:
        print(text)
    else:
        write_result(text, RESULTS / "bad_inputs.md")
    return 0


def placeholders(message: str, *, files: dict[str, str], work: Path, compare: Path | None) -> str:
    """An error message with this run's temporary paths as their placeholder names (NOT_A_MODEL, <tmp>, ...) and
    the checkouts' paths relative: the results file names no path of this machine."""
    for name, path in sorted(files.items(), key=lambda item: -len(item[1])):
        if path:
            message = message.replace(path, name)
    message = message.replace(str(work), "<tmp>")
    if compare is not None:
        message = message.replace(str(compare.resolve()), "<compare>")
    return without_repo_root(message)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
