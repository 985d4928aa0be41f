"""Regeneration through a real OpenAI-compatible server (`data.regen_backend=openai`, dspark.data.regen_server).

The server is `transformers serve`, started on a free loopback port with the `tiny` target's own save_pretrained
directory (offline: HF_HUB_OFFLINE=1; the directory holds config, safetensors, the offline BPE tokenizer and its chat
template, so the served model and our target are one model). Nothing is mocked on the server's side: the tests
count our client's HTTP attempts and kill the real processes. The server tests share one server (~30 s to start on
the loaded 2-core machine), and the one that kills it mid-run comes last.

The tests skip, with the reason, only when the `transformers` CLI or its serving dependencies (`openai`, which
`transformers[serving]` adds to fastapi and uvicorn) are not installed; `.ci/run` installs them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from process_group import free_port

from dspark.config import ConfigError, resolve_config
from dspark.config.schema import DataConfig
from dspark.data.prompts import PromptRecord
from dspark.data.regen_server import (
    PROBES,
    RegenServerError,
    ServerClient,
    ServerSettings,
    choose_model,
    open_server,
)
from dspark.data.regenerate import (
    COMPLETE,
    FEATURES,
    MANIFEST,
    SamplingConfig,
    load_regenerated,
    read_manifest,
    regen_cache_key,
    regenerate_responses,
    with_followups,
)
from dspark.stages.experiment import preflight

TRANSFORMERS_CLI = Path(sys.executable).with_name("transformers")
SAMPLING = SamplingConfig(max_new_tokens=6, batch_size=2)
TINY_TARGET = {"threads": 1}
PROMPTS = [
    PromptRecord("a", "math", "What is 3 + 4?"),
    PromptRecord("b", "chat", "Say hello.", turns=["Now say it in French."]),
    PromptRecord("c", "code", "def add(a, b):"),
    PromptRecord("d", "chat", "Give three tips."),
    PromptRecord("e", "math", "Solve 3x + 5 = 20."),
]
SECRET = "sk-test-0123456789abcdef"  # an API key that must never be written anywhere


def _serve_unavailable() -> str | None:
    if not TRANSFORMERS_CLI.exists():
        return f"no `transformers` CLI beside {sys.executable}"
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return "transformers serve's dependencies are missing: pip install openai (transformers[serving])"
    return None


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """`transformers serve <tiny dir>` on a free loopback port: (process, API base URL). Killed at the end."""
    reason = _serve_unavailable()
    if reason:
        pytest.skip(reason)
    model_dir, port = Path(tiny.model.name_or_path), free_port()
    home = tmp_path_factory.mktemp("hf-home")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "OMP_NUM_THREADS": "1"}
    log = open(home / "serve.log", "w")
    command = [str(TRANSFORMERS_CLI), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--device", "cpu", "--log-level", "warning"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the model runs in a child process of its own
    )
    url, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + 180
    while not _health(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            pytest.fail(f"transformers serve did not come up:\n{(home / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield proc, url
    _kill(proc)
    log.close()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _data(url: str, **overrides) -> DataConfig:
    settings = {"regen_backend": "openai", "regen_url": url, "regen_concurrency": 2, "regen_retries": 1}
    return DataConfig(**(settings | overrides))


def _regenerate(target, backend, cache_dir: Path, prompts=PROMPTS, **overrides) -> Path:
    kwargs = dict(sampling=SAMPLING, cache_dir=cache_dir, seed=0, min_loss_tokens=1, show_progress=False)
    return regenerate_responses(target, prompts, backend=backend, **{**kwargs, **overrides})


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.slow
def test_regenerates_through_the_server_then_reuses_the_cache(server, tiny, tmp_path) -> None:
    """followup mode through /chat/completions: every conversation has two assistant spans built from our template
    and tokenizer; the rerun sends no request; the key names the server's model and changes with it."""
    _, url = server
    backend = open_server(_data(url), target=tiny, sampling=SAMPLING)
    assert backend.dialect == "generation_config"  # transformers serve refuses top-level top_k
    assert backend.record["model"]["id"] == tiny.model.name_or_path and "created" not in backend.record["model"]
    out = _regenerate(tiny, backend, tmp_path, multi_turn="followup")
    assert (out / COMPLETE).exists()
    eot = tiny.tokenizer.eos_token_id
    rows = load_regenerated(out)
    assert [r["prompt_id"] for r in rows] == [p.id for p in PROMPTS]
    for row, prompt in zip(rows, PROMPTS):
        ids, spans = row["input_ids"], _spans(row["loss_mask"])
        assert len(spans) == 2 and ids[: spans[0][0]] == tiny.chat_prompt_ids(prompt.prompt)
        for start, end in spans:
            assert ids[end - 1] == eot and eot not in ids[start : end - 1]  # one end-of-turn, ours, closing each
        assert tiny.mask_token_id not in ids
    manifest = read_manifest(out)
    assert manifest["backend"]["url"] == url and manifest["sampling"]["multi_turn"] == "followup"
    assert manifest["stats"]["generated_tokens"] > 0 and "retokenised_mismatch" in manifest["stats"]
    sent = backend.client.requests_sent
    assert _regenerate(tiny, backend, tmp_path, multi_turn="followup") == out
    assert backend.client.requests_sent == sent  # finished: no request at all
    renamed = replace(backend, model={**backend.model, "id": "another-model"})
    key = dict(sampling=SAMPLING, seed=0, max_length=4096, min_loss_tokens=1, multi_turn="followup")
    asked = with_followups(PROMPTS, seed=0)  # the prompts as regenerated: follow-ups drawn
    assert regen_cache_key(tiny, asked, **key, server=backend.record) == out.name
    assert regen_cache_key(tiny, asked, **key, server=renamed.record) != out.name
    assert regen_cache_key(tiny, asked, **key) != out.name  # the in-process key differs


@pytest.mark.slow
def test_completions_api_templates_here_and_keys_stay_out_of_records(server, tiny, tmp_path, monkeypatch) -> None:
    """data.regen_api=completions: the server continues our own templated text; the API key read from the variable
    data.regen_api_key_env names reaches no manifest, and a refusal quoting the request does not show it."""
    _, url = server
    monkeypatch.setenv("DSPARK_TEST_REGEN_KEY", SECRET)
    data = _data(url, regen_api="completions", regen_api_key_env="DSPARK_TEST_REGEN_KEY")
    backend = open_server(data, target=tiny, sampling=SAMPLING)
    out = _regenerate(tiny, backend, tmp_path, prompts=PROMPTS[:3], multi_turn="off")
    rows = load_regenerated(out)
    for row, prompt in zip(rows, PROMPTS):
        spans = _spans(row["loss_mask"])
        assert len(spans) == 1 and row["input_ids"][: spans[0][0]] == tiny.chat_prompt_ids(prompt.prompt)
    assert SECRET not in (out / MANIFEST).read_text()
    assert read_manifest(out)["backend"]["api"] == "completions"
    with pytest.raises(ValueError, match="data.regen_model=nope") as err:
        open_server(replace(data, regen_model="nope"), target=tiny, sampling=SAMPLING)
    assert SECRET not in str(err.value)


@pytest.mark.slow
def test_a_chat_template_the_server_does_not_share_is_refused(server, tiny, monkeypatch) -> None:
    """The probe compares the server's prompt token counts with ours: a target whose chat template differs from the
    served model's is refused before any work (chat API); the completions API renders with ours and passes."""
    _, url = server
    open_server(_data(url), target=tiny, sampling=SAMPLING)  # the control: the same template passes
    other = tiny.tokenizer.chat_template.replace("'<|im_start|>' + message['role']", "'<|im_start|>' + 'x'")
    monkeypatch.setattr(tiny.tokenizer, "chat_template", other)
    with pytest.raises(ValueError, match=r"data.regen_url=.*chat template disagrees.*probe 1 of 2") as err:
        open_server(_data(url), target=tiny, sampling=SAMPLING)
    assert "data.regen_api=completions" in str(err.value)
    open_server(_data(url, regen_api="completions"), target=tiny, sampling=SAMPLING)
    assert len(PROBES) == 2


CHILD = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from dspark.config.schema import DataConfig, SamplingConfig
from dspark.data.prompts import PromptRecord
from dspark.data.regen_server import open_server
from dspark.data.regenerate import regenerate_responses
from dspark.targets import load_target
url, target_cache, cache_dir, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
target = load_target("tiny", cache_dir=Path(target_cache))
sampling = SamplingConfig(max_new_tokens=6, batch_size=2)
data = DataConfig(regen_backend="openai", regen_url=url, regen_concurrency=1)
backend = open_server(data, target=target, sampling=sampling)
print("regenerating", flush=True)
regenerate_responses(target, [PromptRecord(**p) for p in prompts], sampling=sampling, cache_dir=Path(cache_dir),
                     seed=0, min_loss_tokens=1, show_progress=False, multi_turn="off", backend=backend)
"""


def _many(count: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i:02d}", "math", f"What is {i} + {2 * i}? Explain.") for i in range(count)]


def _wait_for_shard(cache_dir: Path, *, alive, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not list(cache_dir.glob("regen/*/shard-*.parquet")):
        assert alive() and time.monotonic() < deadline, "no shard was written"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_finished_shards(server, tiny, tmp_path) -> None:
    """A regenerating process killed (SIGKILL) after its first shard: the rerun asks only for the unfinished shards'
    prompts and its data equal an uninterrupted run's (per-request seeds; one request at a time)."""
    _, url = server
    prompts = _many(12)  # 6 shards of 2
    killed_dir = tmp_path / "killed"
    target_cache = Path(tiny.model.name_or_path).parents[1]
    payload = json.dumps([{"id": p.id, "domain": p.domain, "prompt": p.prompt} for p in prompts])
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(target_cache), str(killed_dir), payload],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        text=True,
    )
    try:
        _wait_for_shard(killed_dir, alive=lambda: child.poll() is None)
        child.kill()
    finally:
        output = child.communicate(timeout=60)[0]
    (partial,) = list((killed_dir / "regen").iterdir())
    finished = sorted(p.name for p in partial.glob("shard-*.parquet"))
    assert not (partial / COMPLETE).exists() and 1 <= len(finished) < 6, output[-2000:]
    for name in finished:  # every finished shard is whole (written all-or-nothing)
        assert pq.read_table(partial / name).schema.names == list(FEATURES)
    backend = open_server(_data(url, regen_concurrency=1), target=tiny, sampling=SAMPLING)
    sent = backend.client.requests_sent
    assert _regenerate(tiny, backend, killed_dir, prompts=prompts, multi_turn="off") == partial
    assert backend.client.requests_sent - sent == 2 * (6 - len(finished))  # one request per unfinished prompt
    whole = _regenerate(tiny, backend, tmp_path / "whole", prompts=prompts, multi_turn="off")
    assert load_regenerated(partial).to_dict() == load_regenerated(whole).to_dict()


def test_a_wrong_url_or_a_missing_key_is_refused_in_preflight_in_seconds(tmp_path, monkeypatch) -> None:
    """No server behind the port: preflight refuses in seconds (connect refused; one try, 5 s at most) naming
    data.regen_url; an unset key variable names data.regen_api_key_env; a key given in place of a name is refused
    without being echoed."""
    monkeypatch.delenv("DSPARK_TEST_UNSET_KEY", raising=False)
    base = ["budget=smoke", "stage=prepare", f"paths.root={tmp_path}", "data.regen_backend=openai"]
    url = f"http://user:pw-{SECRET}@127.0.0.1:{free_port()}/v1"
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"data.regen_url=http://user:\*\*\*@127.0.0.1") as err:
        preflight(resolve_config([*base, f"data.regen_url={url}"]), claim=False)
    assert time.monotonic() - started < 15 and SECRET not in str(err.value)
    with pytest.raises(ConfigError, match="data.regen_api_key_env=DSPARK_TEST_UNSET_KEY") as err:
        preflight(
            resolve_config([*base, f"data.regen_url={url}", "data.regen_api_key_env=DSPARK_TEST_UNSET_KEY"]),
            claim=False,
        )
    with pytest.raises(ConfigError, match="data.regen_api_key_env must be the NAME") as err:
        resolve_config([*base, f"data.regen_url={url}", f"data.regen_api_key_env={SECRET}"])
    assert SECRET not in str(err.value)
    with pytest.raises(ConfigError, match="data.regen_backend=openai needs data.regen_url"):
        resolve_config(base)
    assert not list(tmp_path.iterdir())  # refused before anything was created


def test_model_choice_and_credentials_given_twice(monkeypatch) -> None:
    """The model list's first entry or the named one; none listed is refused; a URL with credentials and a key
    variable would both be the Authorization header, so the pair is refused."""
    assert choose_model([{"id": "m1"}, {"id": "m2"}], None, shown="u")["id"] == "m1"
    assert choose_model([{"id": "m1"}, {"id": "m2"}], "m2", shown="u")["id"] == "m2"
    with pytest.raises(ValueError, match="serves no model"):
        choose_model([], None, shown="u")
    monkeypatch.setenv("DSPARK_TEST_BOTH_KEY", SECRET)
    with pytest.raises(ValueError, match="both would be the Authorization header") as err:
        ServerClient(ServerSettings(url="http://u:pass-word@127.0.0.1:1/v1", api_key_env="DSPARK_TEST_BOTH_KEY"))
    assert "pass-word" not in str(err.value) and SECRET not in str(err.value)


@pytest.mark.slow
def test_a_server_that_dies_mid_run_stops_it_with_its_shards_kept(server, tiny, tmp_path) -> None:
    """Runs last: kills the shared server (SIGKILL to its process group) once the first shard is written. The run
    stops with an error naming data.regen_url and the shards kept; those shards are whole and a rerun keeps them."""
    proc, url = server
    backend = open_server(_data(url, regen_concurrency=1), target=tiny, sampling=SAMPLING)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _regenerate(tiny, backend, tmp_path, prompts=_many(16), multi_turn="off")
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            failure.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    _wait_for_shard(tmp_path, alive=worker.is_alive)
    _kill(proc)
    worker.join(timeout=120)
    assert not worker.is_alive() and failure and isinstance(failure[0], RegenServerError), failure
    message = str(failure[0])
    assert f"data.regen_url={url}" in message and "shards are finished and kept" in message
    (partial,) = list((tmp_path / "regen").iterdir())
    finished = sorted(partial.glob("shard-*.parquet"))
    assert 1 <= len(finished) < 8 and not (partial / COMPLETE).exists()
    assert f"{len(finished)} of 8 shards" in message
    for path in finished:
        assert pq.read_table(path).num_rows == 2
    assert not _health(url)
