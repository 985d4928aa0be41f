"""Bad inputs through the real command line: exit code, seconds before the error, first line, what was created.

Every case runs `python experiments/run.py ARGS paths.root=<fresh dir>` as a fresh process (imports included, as a
user would see it), with the damaged files it needs made first in a temporary directory (a directory that is not a
model, a truncated GGUF / safetensors, malformed JSONL, a read-only output directory, a damaged tracking store, an
exported drafter with absurd sizes, a server that answers /health and fails every API call, ...). A case passes when
it exits 2 (refused before any work), nothing ran (no file under its paths.root was created or changed) and its
guard holds: no secret of its arguments reached the console or any file, and no file we did not write changed.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO, RESULTS, command_line, repo_path, without_repo_root, write_result

#: the password the secret cases put into URLs; a guard greps the console and every file written for it
SECRET = "s3cret-Pw-9f4d"


@dataclass
class Case:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    root: str | None = None  # paths.root placeholder key (default: a fresh directory per case)
    setup: Callable[[Path, dict[str, str]], None] | None = None  # prepares the fresh paths.root before the run
    guard: Callable[[Path, str, dict[str, str]], str] | None = None  # (root, console, files) → "" or the defect
    kind: str = "input"  # the class of bad input (the section of cases() it comes from)


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
    files |= _foreign_outputs(work, tiny)
    files |= _bad_prompt_files(work / "prompts2")
    files |= _bad_sps_tables(work)
    files |= _exported_drafters(work)
    files["RO_STORE"] = _read_only_store(work / "ro-store")
    return files


def _foreign_outputs(work: Path, tiny: Path) -> dict[str, str]:
    """Directories and files we did not write, which no output may replace: someone's model, someone's notes."""
    model = work / "someones-model"
    shutil.copytree(tiny, model)
    reports = work / "someones-reports"
    reports.mkdir()
    (reports / "depth.md").write_text("# my own notes on depth\n")
    (reports / "main.md").write_text("# my own notes on the main table\n")
    plain = work / "a-file.txt"
    plain.write_text("a user's file\n")
    for path in (model, reports, plain):
        FOREIGN[str(path)] = snapshot(path)
    return {"FOREIGN_MODEL": str(model), "FOREIGN_REPORTS": str(reports), "A_FILE": str(plain)}


def _bad_prompt_files(prompts: Path) -> dict[str, str]:
    """One defect per file, each under a built-in set's file name so `decode.eval_sets=[NAME]` reads it."""
    prompts.mkdir()
    (prompts / "gsm8k_test.jsonl").write_text('{"id": "g0", "prompt": 123}\n')
    (prompts / "humaneval.jsonl").write_text('{"id": "h0", "turns": "not a list"}\n')
    (prompts / "mtbench.jsonl").write_bytes(b'{"id": "m0", "prompt": "caf\xe9 \xff\xfe"}\n')
    (prompts / "math500.jsonl").write_text('["a", "list", "not", "an", "object"]\n')
    (prompts / "mbpp.jsonl").write_text('{"id": ["a"], "prompt": "ok"}\n')
    (prompts / "alpaca.jsonl").write_text('{"id": "a0", "prompt": "' + "x" * (64 << 20) + '"}\n')
    return {"PROMPTS2": str(prompts)}


def _bad_sps_tables(work: Path) -> dict[str, str]:
    (work / "sps-broken.json").write_text('{"batch_tokens": [1, 2], "steps_per')
    (work / "sps-fields.json").write_text('{"rows": [1, 2, 3]}')
    (work / "sps-negative.json").write_text('{"batch_tokens": [1, 2], "steps_per_second": [10.0, -3.0]}')
    return {
        name: str(work / f"{name.lower().replace('_', '-')}.json")
        for name in ("SPS_BROKEN", "SPS_FIELDS", "SPS_NEGATIVE")
    }


def _exported_drafters(work: Path) -> dict[str, str]:
    """A smoke drafter trained and exported once (~1-2 minutes), then damaged copies of its run and export."""
    root = work / "train-root"
    run = [sys.executable, str(REPO / "experiments" / "run.py"), "budget=smoke", f"paths.root={root}"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    subprocess.run([*run, "stage=train"], env=env, cwd=REPO, check=True, capture_output=True)
    (run_dir,) = {p.parent for p in root.glob("runs/*/drafter.pt")}
    export = work / "export"
    subprocess.run(
        [*run, "stage=export", f"export.run_dir={run_dir}", f"export.out_dir={export}"],
        env=env,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    files = {"RUN_DIR": str(run_dir), "EXPORT": str(export)}
    config = json.loads((export / "config.json").read_text())
    for label, change in (
        ("IMPORT_HUGE_DEPTH", {"num_hidden_layers": 100_000}),
        ("IMPORT_HUGE_RANK", {"markov_rank": 1 << 30}),
        ("IMPORT_HUGE_WIDTH", {"hidden_size": 1 << 24, "intermediate_size": 1 << 26}),
        ("IMPORT_HUGE_BLOCK", {"block_size": 10**9}),
        ("IMPORT_NEGATIVE", {"num_hidden_layers": -3}),
        ("IMPORT_WRONG_TYPE", {"block_size": "seven"}),
    ):
        files[label] = _damaged_copy(export, work / label.lower(), config=config | change)
    files["IMPORT_BAD_JSON"] = _damaged_copy(export, work / "import-bad-json", text='{"architectures": ["DSpark')
    files["IMPORT_LIST_JSON"] = _damaged_copy(export, work / "import-list-json", text="[1, 2, 3]")
    files["IMPORT_NO_CONFIG"] = _damaged_copy(export, work / "import-no-config", text=None)
    weights = (export / "model.safetensors").read_bytes()
    files["IMPORT_CUT_WEIGHTS"] = _damaged_copy(export, work / "import-cut", weights=weights[: len(weights) // 2])
    files["IMPORT_TEXT_WEIGHTS"] = _damaged_copy(export, work / "import-text", weights=b"not safetensors at all\n")
    files["IMPORT_HUGE_HEADER"] = _damaged_copy(
        export, work / "import-huge-header", weights=(1 << 62).to_bytes(8, "little") + b"{}"
    )
    files["IMPORT_PADDED_WEIGHTS"] = _damaged_copy(export, work / "import-padded", weights=weights + b"\0" * 4096)
    pickled = work / "pickled-run"
    shutil.copytree(run_dir, pickled)
    import argparse as _argparse

    import torch

    torch.save({"state": _argparse.Namespace(note="not a tensor")}, pickled / "drafter.pt")
    files["PICKLED_RUN"] = str(pickled)
    FOREIGN[str(export)] = snapshot(export)
    return files


def _damaged_copy(export: Path, dest: Path, *, config: dict | None = None, text: str | None = "", weights=None) -> str:
    shutil.copytree(export, dest)
    if config is not None:
        (dest / "config.json").write_text(json.dumps(config))
    elif text is None:
        (dest / "config.json").unlink()
    elif text:
        (dest / "config.json").write_text(text)
    if weights is not None:
        (dest / "model.safetensors").write_bytes(weights)
    return str(dest)


def _read_only_store(path: Path) -> str:
    """A tracking.uri pointing at a valid sqlite file on a read-only filesystem (root only: a remounted tmpfs)."""
    import sqlite3

    path.mkdir()
    if os.geteuid() != 0:
        return ""
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "dspark-ro-store", str(path)], capture_output=True
    ).returncode:
        return ""
    sqlite3.connect(path / "mlflow.db").close()
    subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True)
    return f"sqlite:///{path}/mlflow.db"


# ---- what a case may not do: change a file we did not write, leak a secret ----

#: path → snapshot of every file we did not write that a case points at (checked after every case)
FOREIGN: dict[str, dict[str, tuple[int, int]]] = {}


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """relative path → (size, mtime_ns) of every file under `path` (or of `path` itself)."""
    if path.is_file():
        st = path.stat()
        return {".": (st.st_size, st.st_mtime_ns)}
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


def foreign_unchanged(root: Path, console: str, files: dict[str, str]) -> str:
    changed = [Path(path).name for path, before in FOREIGN.items() if snapshot(Path(path)) != before]
    return f"changed a file we did not write: {', '.join(changed)}" if changed else ""


def no_secret(root: Path, console: str, files: dict[str, str]) -> str:
    """The secret is nowhere: not on the console, not in any file under paths.root (the MLflow store included)."""
    where = ["console"] if SECRET in console else []
    for path in root.rglob("*") if root.is_dir() else []:
        if path.is_file() and SECRET.encode() in path.read_bytes():
            where.append(str(path.relative_to(root)))
    return f"secret recorded in {', '.join(where[:4])}" if where else ""


def _damaged_store(root: Path, files: dict[str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "mlflow.db").write_bytes(b"this is not an sqlite database\n" * 64)


def _truncated_store(root: Path, files: dict[str, str]) -> None:
    """A real store from the smoke training, cut in half (a copy interrupted midway)."""
    root.mkdir(parents=True, exist_ok=True)
    data = (Path(files["RUN_DIR"]).parents[1] / "mlflow.db").read_bytes()
    (root / "mlflow.db").write_bytes(data[: len(data) // 2])


def _store_is_a_directory(root: Path, files: dict[str, str]) -> None:
    (root / "mlflow.db").mkdir(parents=True)


# ---- a tracking server that answers /health and fails every API call ----


def half_server() -> tuple[str, Callable[[], None]]:
    """http://127.0.0.1:PORT of a server whose /health says OK and whose every other path answers 500."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            ok = self.path.startswith("/health")
            body = b"OK" if ok else b'{"error_code": "INTERNAL_ERROR", "message": "broken"}'
            self.send_response(200 if ok else 500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PATCH = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server.shutdown


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
        Case("unknown confidence source", [*smoke, "decode.confidence=maxprob"]),
        Case(
            "calibrated threshold, calibration off",
            [*smoke, "decode.policy=calibrated_threshold", "decode.calibrate=false"],
        ),
        Case("unknown calibration prompt set", [*smoke, "decode.calibration_set=alpacaa"]),
        Case("regen server unreachable", [*smoke, "data.regen_backend=openai", "data.regen_url=http://127.0.0.1:9/v1"]),
        Case("regen server without a URL", [*smoke, "data.regen_backend=openai"]),
        Case(
            "regen API key variable unset",
            [
                *smoke,
                "data.regen_backend=openai",
                "data.regen_url=http://127.0.0.1:9/v1",
                "data.regen_api_key_env=DSPARK_NO_SUCH_KEY",
            ],
        ),
        Case(
            "regen API key given instead of a name",
            [
                *smoke,
                "data.regen_backend=openai",
                "data.regen_url=http://127.0.0.1:9/v1",
                "data.regen_api_key_env=sk-abc123secret",
            ],
        ),
        Case("features_from: no such directory", [*smoke, "data.features_from=/no/such/features"]),
        Case("features_from: a directory of notes", [*smoke, "data.features_from=NOT_A_MODEL"]),
        *classed("range", range_cases(smoke)),
        *classed("memory", memory_cases(smoke)),
        *classed("ownership", ownership_cases(smoke)),
        *classed("secret", secret_cases(smoke)),
        *classed("store", store_cases(smoke)),
        *classed("parser", parser_cases(smoke)),
    ]


def classed(kind: str, cases: list[Case]) -> list[Case]:
    for case in cases:
        case.kind = kind
    return cases


def range_cases(smoke: list[str]) -> list[Case]:
    """A value outside what its key means: refused by the key's declared range before any work."""
    bad = [
        ("no epochs", "optim.epochs=0"),
        ("negative epochs", "optim.epochs=-1"),
        ("infinite learning rate", "optim.lr=inf"),
        ("negative learning rate", "optim.lr=-0.001"),
        ("zero learning rate", "optim.lr=0"),
        ("Adam beta1 above 1", "optim.beta1=1.5"),
        ("warm-up fraction above 1", "optim.warmup_fraction=2"),
        ("negative gradient clip", "optim.grad_clip=-1"),
        ("zero gradient accumulation", "optim.accumulate_grad_batches=0"),
        ("max_steps below -1", "optim.max_steps=-5"),
        ("infinite decoding temperature", "decode.temperature=inf"),
        ("negative regeneration temperature", "data.sampling.temperature=-0.5"),
        ("top_p above 1", "data.sampling.top_p=1.5"),
        ("top_p of 0", "data.sampling.top_p=0"),
        ("negative top_k", "data.sampling.top_k=-1"),
        ("zero new tokens (regeneration)", "data.sampling.max_new_tokens=0"),
        ("zero new tokens (decoding)", "decode.max_new_tokens=0"),
        ("zero batch size", "data.batch_size=0"),
        ("negative regeneration batch", "data.sampling.batch_size=-2"),
        ("validation fraction above 1", "data.val_fraction=1.5"),
        ("negative calibration fraction", "data.calib_fraction=-0.1"),
        ("zero prompts per set", "decode.prompts_per_set=0"),
        ("zero training prompts", "data.num_train_prompts=0"),
        ("zero max length", "data.max_length=0"),
        ("zero anchors", "data.max_anchors=0"),
        ("no draft layers", "model.depth=0"),
        ("negative Markov rank", "model.markov_rank=-3"),
        ("negative draft vocabulary", "model.draft_vocab_size=-1"),
        ("negative loss weight", "loss.alpha_tv=-1"),
        ("infinite position decay", "loss.decay=inf"),
        ("negative seed", "seed=-1"),
        ("static_k of 0", "decode.static_k=0"),
        ("threshold of inf", "decode.threshold=inf"),
        ("zero serving concurrency", "serve.concurrency=0"),
        ("zero in a simulated load", "serve.simulate_concurrency=[8,0]"),
        ("zero requests", "serve.num_requests=0"),
        ("zero tree nodes", "decode.tree.nodes=0"),
        ("negative tree width", "decode.tree.widths=[4,-2]"),
        ("zero validation interval", "trainer.val_check_interval=0"),
        ("negative checkpoint interval", "trainer.checkpoint_every_min=-5"),
        ("zero devices", "trainer.devices=0"),
        ("negative MASK id", "target_options.mask_token_id=-5"),
        ("negative training-set weight", "data.train_weights=[-1]"),
        ("zero Optuna trials", "optuna.n_trials=0"),
        ("boolean as a number", "decode.calibrate=2"),
        ("number as a boolean", "model.depth=true"),
        ("fractional layer count", "model.depth=2.5"),
    ]
    return [Case(name, [*smoke, arg]) for name, arg in bad]


def memory_cases(smoke: list[str]) -> list[Case]:
    """Sizes that would allocate far more than any machine has: refused before anything is built."""
    bomb = "[&a [1,1,1,1,1,1,1,1,1],&b [*a,*a,*a,*a,*a,*a,*a,*a,*a],&c [*b,*b,*b,*b,*b,*b,*b,*b,*b]," + (
        "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c],&e [*d,*d,*d,*d,*d,*d,*d,*d,*d],&f [*e,*e,*e,*e,*e,*e,*e,*e,*e]]"
    )
    return [
        Case("YAML alias bomb as a value", [*smoke, f"model.feature_layers={bomb}"]),
        Case("30,000-element list value", [*smoke, "decode.tree.widths=[" + ",".join(["1"] * 30_000) + "]"]),
        Case("100,000 draft layers", [*smoke, "model.depth=100000"]),
        Case("block of a million drafts", [*smoke, "model.block_size=1000000"]),
        Case("draft vocabulary above the target's", [*smoke, "model.draft_vocab_size=100000000"]),
        Case("Markov rank of a billion", [*smoke, "model.markov_rank=1000000000"]),
        Case("imported config: 100,000 layers", [*smoke, "stage=eval", "model.import_from=IMPORT_HUGE_DEPTH"]),
        Case("imported config: rank 2^30", [*smoke, "stage=eval", "model.import_from=IMPORT_HUGE_RANK"]),
        Case("imported config: hidden 2^24", [*smoke, "stage=eval", "model.import_from=IMPORT_HUGE_WIDTH"]),
        Case("imported config: block 10^9", [*smoke, "stage=eval", "model.import_from=IMPORT_HUGE_BLOCK"]),
        Case(
            "imported safetensors header of 2^62 bytes", [*smoke, "stage=eval", "model.import_from=IMPORT_HUGE_HEADER"]
        ),
    ]


def ownership_cases(smoke: list[str]) -> list[Case]:
    """Outputs pointed at files we did not write: refused, and those files stay byte for byte."""
    guard = foreign_unchanged
    return [
        Case(
            "export into someone's model directory",
            [*smoke, "stage=export", "export.run_dir=RUN_DIR", "export.out_dir=FOREIGN_MODEL"],
            guard=guard,
        ),
        Case(
            "export into a directory of notes",
            [*smoke, "stage=export", "export.run_dir=RUN_DIR", "export.out_dir=FOREIGN_REPORTS"],
            guard=guard,
        ),
        Case(
            "export onto a file",
            [*smoke, "stage=export", "export.run_dir=RUN_DIR", "export.out_dir=A_FILE"],
            guard=guard,
        ),
        Case(
            "report over someone's depth.md, no runs",
            [*smoke, "sweep=depth", "stage=report", "paths.reports=FOREIGN_REPORTS"],
            guard=guard,
        ),
        Case("reports directory is a file", [*smoke, "paths.reports=A_FILE"], guard=guard),
        Case("paths.root is a file", [*smoke], root="A_FILE", guard=guard),
        Case(
            "export of a run dir without drafter.pt",
            [*smoke, "stage=export", "export.run_dir=FOREIGN_REPORTS"],
            guard=guard,
        ),
    ]


def secret_cases(smoke: list[str]) -> list[Case]:
    """Credentials in URL-valued keys: never on the console, in a file, a param, a tag or a report."""
    return [
        Case(
            "password in Optuna storage",
            [*smoke, "sweep=rank", f"optuna.storage=postgresql://u:{SECRET}@127.0.0.1:9/x"],
            guard=no_secret,
        ),
        Case(
            "password in a MySQL storage",
            [*smoke, "sweep=rank", f"optuna.storage=mysql://root:{SECRET}@127.0.0.1:9/db"],
            guard=no_secret,
        ),
        Case("password in tracking.uri", [*smoke, f"tracking.uri=http://user:{SECRET}@127.0.0.1:9"], guard=no_secret),
        Case(
            "token in tracking.uri's query",
            [*smoke, f"tracking.uri=http://127.0.0.1:9/?token={SECRET}"],
            guard=no_secret,
        ),
        Case(
            "password in a sqlite-looking URI",
            [*smoke, f"tracking.uri=postgresql://u:{SECRET}@127.0.0.1:9/mlflow"],
            guard=no_secret,
        ),
    ]


def store_cases(smoke: list[str]) -> list[Case]:
    """A tracking store that cannot be used: refused in seconds, naming tracking.uri / paths.root and the fix."""
    return [
        Case("damaged sqlite store", [*smoke], setup=_damaged_store),
        Case("half-copied sqlite store", [*smoke], setup=_truncated_store),
        Case("store path is a directory", [*smoke], setup=_store_is_a_directory),
        Case("read-only sqlite store", [*smoke, "tracking.uri=RO_STORE"]),
        Case("empty experiment name", [*smoke, "tracking.experiment="]),
        Case("over-long experiment name", [*smoke, "tracking.experiment=" + "x" * 600]),
        Case("server: /health OK, API fails", [*smoke, "tracking.uri=HALF_SERVER"]),
        Case("unsupported tracking scheme", [*smoke, "tracking.uri=ftp://127.0.0.1/mlruns"]),
        Case("sqlite store in a missing directory", [*smoke, "tracking.uri=sqlite:////no/such/dir/mlflow.db"]),
    ]


def parser_cases(smoke: list[str]) -> list[Case]:
    """Files a parser reads: the message names the file (and line or field) and the fix."""
    prompts = [*smoke, "data.local_dir=PROMPTS2"]
    imported = [*smoke, "stage=eval"]
    return [
        Case("prompt is a number", [*prompts, "decode.eval_sets=[gsm8k]"]),
        Case("turns is a string", [*prompts, "decode.eval_sets=[humaneval]"]),
        Case("prompt file not UTF-8", [*prompts, "decode.eval_sets=[mt-bench]"]),
        Case("JSONL row is a list", [*prompts, "decode.eval_sets=[math500]"]),
        Case("id is a list", [*prompts, "decode.eval_sets=[mbpp]"]),
        Case("64 MiB prompt line", [*prompts, "decode.eval_sets=[alpaca]"]),
        Case("import: config.json cut off", [*imported, "model.import_from=IMPORT_BAD_JSON"]),
        Case("import: config.json is a list", [*imported, "model.import_from=IMPORT_LIST_JSON"]),
        Case("import: no config.json", [*imported, "model.import_from=IMPORT_NO_CONFIG"]),
        Case("import: negative layer count", [*imported, "model.import_from=IMPORT_NEGATIVE"]),
        Case("import: block size as text", [*imported, "model.import_from=IMPORT_WRONG_TYPE"]),
        Case("import: truncated safetensors", [*imported, "model.import_from=IMPORT_CUT_WEIGHTS"]),
        Case("import: text as safetensors", [*imported, "model.import_from=IMPORT_TEXT_WEIGHTS"]),
        Case("import: safetensors with trailing bytes", [*imported, "model.import_from=IMPORT_PADDED_WEIGHTS"]),
        Case("export of a pickled drafter.pt", [*smoke, "stage=export", "export.run_dir=PICKLED_RUN"]),
        Case("SPS table cut off", [*smoke, "stage=serve", "serve.sps_table=SPS_BROKEN"]),
        Case("SPS table without its fields", [*smoke, "stage=serve", "serve.sps_table=SPS_FIELDS"]),
        Case("SPS table with a negative rate", [*smoke, "stage=serve", "serve.sps_table=SPS_NEGATIVE"]),
        Case("data.local_dir is a file", [*smoke, "data.local_dir=A_FILE"]),
        Case("export.run_dir missing", [*smoke, "stage=export", "export.run_dir=/no/such/run"]),
    ]


def run_case(case: Case, *, tree: Path, files: dict[str, str], root: Path, timeout: float) -> dict:
    args = [_fill(a, files) for a in case.args]
    target_root = Path(files.get(case.root, "")) if case.root else root
    if case.root and not files.get(case.root):
        return {
            "exit": "skipped",
            "seconds": 0.0,
            "message": "(no such input can be made here)",
            "clean": True,
            "created": "",
            "guard": "",
        }
    if any(files.get(a.partition("=")[2]) == "" for a in case.args):
        return {
            "exit": "skipped",
            "seconds": 0.0,
            "message": "(its input cannot be made here)",
            "clean": True,
            "created": "",
            "guard": "",
        }
    if case.setup is not None:
        case.setup(target_root, files)
    before = snapshot(target_root)
    argv = [sys.executable, str(tree / "experiments" / "run.py"), *args, f"paths.root={target_root}"]
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS="1", **case.env)
    env.pop("DSPARK_MLFLOW_RUN_ID", None)
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        code, err, out = proc.returncode, proc.stderr, proc.stdout
    except OSError as exc:  # the command line itself cannot be started (e.g. an argument over the kernel's limit)
        code, err, out = f"not started ({exc.strerror})", "", ""
    except subprocess.TimeoutExpired as exc:
        code = f"timeout ({timeout:.0f} s)"
        err, out = ((exc.stderr or b"").decode(errors="replace"), (exc.stdout or b"").decode(errors="replace"))
    seconds = time.perf_counter() - started
    after = snapshot(target_root) if target_root.is_dir() else {}
    created = sorted({name.split("/")[0] for name, stat in after.items() if before.get(name) != stat})
    defect = case.guard(target_root, err + out, files) if case.guard is not None else ""
    return {
        "exit": code,
        "seconds": seconds,
        "message": first_message_line(err),
        "clean": not created,
        "created": ", ".join(created[:4]) + (" …" if len(created) > 4 else ""),
        "guard": defect,
    }


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


def handled(result: dict) -> bool:
    """Refused before any work (exit 2, nothing created under paths.root) and its guard held."""
    return result["exit"] == 2 and result["clean"] and not result["guard"]


def table(rows: list[dict], *, compare: bool) -> str:
    head = "| # | class | bad input | arguments | exit | seconds | created under paths.root | guard | first line of the message |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if compare:
        head += " before: exit | before: seconds | before: first line |"
        rule += "---|---|---|"
    out = [head, rule]
    for i, row in enumerate(rows, 1):
        now = row["now"]
        cells = [
            str(i),
            row["kind"],
            row["name"],
            f"`{_md(row['args'].replace(SECRET, '<password>'), 90)}`",
            str(now["exit"]),
            f"{now['seconds']:.1f}",
            now["created"] or "nothing",
            f"**{_md(now['guard'])}**" if now["guard"] else "held",
            _md(now["message"]),
        ]
        if compare:
            before = row["before"]
            cells += [str(before["exit"]), f"{before['seconds']:.1f}", _md(before["message"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    """Per class: handled / cases, and the slowest refusal."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    out = ["| class | handled (exit 2, nothing created, guard held) | slowest s |", "|---|---|---|"]
    for kind in kinds:
        mine = [r["now"] for r in rows if r["kind"] == kind]
        ok = sum(handled(r) for r in mine)
        out.append(f"| {kind} | {ok} of {len(mine)} | {max(r['seconds'] for r in mine):.1f} |")
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
        files["HALF_SERVER"], stop_server = half_server()
        try:
            rows = []
            for i, case in enumerate(selected):
                row = {"name": case.name, "args": " ".join(case.args), "kind": case.kind}
                row["now"] = run_case(case, tree=REPO, files=files, root=work / f"root-{i}", timeout=args.timeout)
                if args.compare:
                    row["before"] = run_case(
                        case, tree=args.compare.resolve(), files=files, root=work / f"before-{i}", timeout=args.timeout
                    )
                for result in (row["now"], row.get("before")):
                    if result is not None:
                        for key in ("message", "guard"):
                            result[key] = placeholders(result[key], files=files, work=work, compare=args.compare)
                print(
                    f"{case.name}: exit {row['now']['exit']} in {row['now']['seconds']:.1f} s"
                    f"{' [' + row['now']['guard'] + ']' if row['now']['guard'] else ''}: "
                    f"{row['now']['message'][:120]}",
                    flush=True,
                )
                rows.append(row)
        finally:
            stop_server()
            if os.geteuid() == 0:
                for key in ("READ_ONLY", "RO_STORE"):
                    if files.get(key):
                        subprocess.run(
                            [
                                "umount",
                                str(
                                    Path(files[key].removeprefix("sqlite:///")).parent
                                    if key == "RO_STORE"
                                    else files[key]
                                ),
                            ],
                            capture_output=True,
                        )
    refused = sum(handled(r["now"]) for r in rows)
    slowest = max(r["now"]["seconds"] for r in rows)
    command = command_line("bad_inputs.py", argv, prefix="PYTHONPATH=src python")
    text = "\n".join(
        [
            "# Bad inputs through the command line",
            "",
            f"`{command.strip()}` on {os.cpu_count()} CPUs; each case is a fresh `python experiments/run.py ARGS "
            "paths.root=<fresh dir>` process, so seconds include Python's imports (~3-6 s here). A case is handled "
            "when it exits 2 (refused before any work), nothing under its paths.root was created or changed, and its "
            "guard held (no file we did not write changed; the password of the secret cases is on neither the console "
            "nor any file under paths.root, the MLflow store included).",
            "",
            f"**{refused} of {len(rows)} handled; slowest {slowest:.1f} s.**"
            + (
                f" Before: the same cases against {args.compare_label or repo_path(args.compare)}."
                if args.compare
                else ""
            ),
            "",
            summary(rows),
            "",
            table(rows, compare=bool(args.compare)),
            "",
            "Placeholders: NOT_A_MODEL a directory holding a README; NO_WEIGHTS / CUT_SAFETENSORS / NO_MODEL_TYPE copies "
            "of the tiny target's directory without model.safetensors, with it cut in half, without config.json's "
            "model_type; CUT_GGUF the first MiB of SmolLM2-135M's GGUF; HEADER_GGUF its first 24 bytes; TEXT_GGUF a text "
            "file; PROMPTS a directory with a gsm8k_test.jsonl whose 2nd line is cut off, an mtbench.jsonl of blank "
            "lines and a humaneval.jsonl row without `prompt`; PROMPTS2 one defect per file (a number as prompt, "
            "turns as a string, non-UTF-8 bytes, a list as row, a list as id, a 64 MiB line); READ_ONLY a read-only "
            "directory (a read-only tmpfs when run as root, which ignores directory modes); RO_STORE an sqlite file "
            "on a read-only tmpfs; RUN_DIR a smoke drafter trained for these cases and EXPORT its deepspec export; "
            "IMPORT_* copies of EXPORT with one field of config.json or model.safetensors damaged as the case says; "
            "PICKLED_RUN a copy of RUN_DIR whose drafter.pt holds a pickled Python object; FOREIGN_MODEL a copy of the "
            "tiny target's directory, FOREIGN_REPORTS a directory of someone's notes (depth.md, main.md), A_FILE a "
            "plain file; SPS_* damaged SPS tables; HALF_SERVER a local HTTP server whose /health answers 200 and every "
            "other path 500; <password> the secret of the secret cases; <tmp> the temporary directory of the run.",
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
