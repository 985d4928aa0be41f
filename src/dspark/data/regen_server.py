"""Regeneration through an OpenAI-compatible server (`data.regen_backend=openai`): vLLM, SGLang, llama.cpp's server,
`transformers serve`, anything that answers `/v1/models` and `/v1/chat/completions` or `/v1/completions`.

The server only decides which text is written. The sequences are built exactly as in-process
(`dspark.data.regenerate`): our target's chat template and tokenizer make the prompt ids of every turn, the server's
text is re-tokenised by our tokenizer (special-token text split into ordinary tokens, so a literal "<|im_end|>" or
the MASK token's text never becomes a control id) and closed with our end-of-turn id, and the loss mask covers every
assistant turn. Features and p_t are computed by our target over these ids afterwards, as for any regenerated data.
A response that ends on `finish_reason=length` is marked `truncated`, as one that hits max_new_tokens in-process.
A server whose chat endpoint moves a reasoning block out of `content` (Qwen3's <think> with a reasoning parser)
returns the answer without it, so the sequence would lack text the model wrote: use data.regen_api=completions there.

Requests: one per user turn. data.regen_api=chat sends the conversation so far as messages (the server's chat
template renders them); completions sends it as text, our own prompt ids decoded (our template renders it). Sampling
goes as OpenAI's fields (temperature, top_p, max_tokens = data.sampling.max_new_tokens, seed) plus top_k, min_p = 0
and repetition_penalty = 1 in one of two dialects, the first the server accepts at the probe: `extended` (top-level
fields, as vLLM, SGLang and llama.cpp take them; top_k -1 = off) or `generation_config` (transformers serve, which
refuses unknown fields and samples only when its generation config says do_sample; there the MASK id is suppressed
and the stop ids are the target's, as in-process). seed = derive_seed(data seed, prompt id, turn) mod 2^31 for every
request, so a resumed run asks for the same draws as an uninterrupted one, whatever the sharding.

Concurrency: a thread pool of data.regen_concurrency workers does the HTTP and nothing else; every tokenisation runs
in the calling thread, which advances each conversation when its answer arrives (a fast tokenizer's settings, such
as the special-token split, are per object, so sharing one across threads could split the chat template's own
tokens). Threads and `requests` rather than asyncio (aiohttp): the work is I/O-bound, so the GIL costs nothing, the
stage stays synchronous (no event loop to own inside Lightning or a notebook), and a retry is a plain loop.

Retries: a connection error, a timeout, HTTP 429 or 5xx is retried data.regen_retries times with exponential backoff
(0.5 s, 1 s, 2 s, ... capped at 16 s; a 429's Retry-After wins); any other answer fails at once. When a request gives
up, the others stop, and `RegenServerError` names data.regen_url and the shards finished and kept (a rerun resumes).

The cache key (`ServerRegenerator.record`): the backend, the API, the dialect and the served model's /v1/models
entry without its volatile fields (created, permission, status): its id and whatever else the server reports (owned_by,
root, max_model_len, llama.cpp's meta), besides the sampling settings, prompts, seed and target fingerprint that every
key holds. The URL, concurrency, timeout and retries are not in it (they do not change the distribution written).

Tokenizer agreement (`check_tokenizer_agreement`, before any work). Checked: (1) for each of PROBES (prose, code,
digits, whitespace runs, accents, CJK and emoji, where tokenizers of different families disagree in count), the
server's `usage.prompt_tokens` for a one-token request of it through the configured API equals the length of our
chat-templated ids of it (chat: the server's template and tokenizer against ours; completions: the server's tokenizer
on our templated text, which also catches a server that prepends a BOS of its own); (2) where the model entry reports
a vocabulary size (llama.cpp's meta.n_vocab), that it is our tokenizer's. Not checked: the token ids themselves (the
OpenAI API returns text; echo and logprobs are not served everywhere: transformers serve ignores them), so a tokenizer
that splits every probe into as many pieces but different ones passes; the weights (another fine-tune behind the same
id and tokenizer passes: the model id in the cache key is what names them); that the server honours top_k, min_p or
seed (one that ignores a field writes text from another distribution). Re-tokenisation can differ from the ids the
server sampled (a non-canonical split, bytes that are not UTF-8): shards count the responses whose re-tokenised length
differs from the server's completion_tokens (`retokenised_mismatch`).

Secrets: the API key is read from the environment variable data.regen_api_key_env names and goes into the
Authorization header only; credentials in data.regen_url go as HTTP basic auth. Errors, logs and the manifest quote
the URL through `dspark.config.secrets.mask_url` and free text through `mask_text` with the key replaced.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from dspark.config.secrets import MASK, mask_text, mask_url, split_credentials
from dspark.data.regenerate import (
    RegeneratedSequence,
    derive_seed,
    end_of_turn_id,
    finish_sequences,
    next_prompt_ids,
    user_turns,
)

if TYPE_CHECKING:
    from dspark.config.schema import DataConfig, RunConfig, SamplingConfig
    from dspark.data.prompts import PromptRecord
    from dspark.targets import Target

log = logging.getLogger("dspark")

PREFLIGHT_TIMEOUT_S = 5.0  # preflight's one GET /models: a wrong or unreachable URL is refused in seconds
BACKOFF_S, MAX_BACKOFF_S = 0.5, 16.0
VOLATILE_MODEL_FIELDS = frozenset({"created", "permission", "status"})  # change between two calls to one server
DIALECTS = ("extended", "generation_config")
SEED_RANGE = 2**31  # llama.cpp takes a uint32 seed, vLLM and transformers serve any int
REGEN_STAGES = ("prepare", "train", "eval", "serve", "all")  # the stages that run `run_prepare`
PROBES = (
    "Résumé of naïve café owners: 3,141.59 € in 2024 — ok?  \n\tdef f(x):\n        return x ** 2  # 東京 🙂",
    'Solve 12345 * 678 = ? Then write <div class="a">{{x}}</div> and SELECT * FROM t WHERE id <= 42;',
)


class RegenServerError(RuntimeError):
    """The server did not answer (after the retries) or answered with an error; the message names data.regen_url."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerSettings:
    """The data.regen_* keys (schema.DataConfig)."""

    url: str
    api: str = "chat"
    model: str | None = None
    api_key_env: str = ""
    concurrency: int = 4
    timeout_s: float = 300.0
    retries: int = 4

    @classmethod
    def from_data(cls, data: DataConfig) -> ServerSettings:
        return cls(
            url=data.regen_url,
            api=data.regen_api,
            model=data.regen_model,
            api_key_env=data.regen_api_key_env,
            concurrency=data.regen_concurrency,
            timeout_s=data.regen_timeout_s,
            retries=data.regen_retries,
        )


class ServerClient:
    """JSON over HTTP to one OpenAI-compatible base URL, with the retries of the module docstring. Thread-safe: a
    `requests.Session` per thread. `stop` (set by the driver when one request gave up) ends the others' retries.
    `requests_sent` counts every HTTP attempt."""

    def __init__(self, settings: ServerSettings, *, timeout_s: float | None = None, retries: int | None = None):
        base, user, password = split_credentials(settings.url.rstrip("/"))
        self.base, self.shown = base, mask_url(settings.url)
        self.auth = None if user is None else (user, password or "")
        self._key = ""
        if settings.api_key_env:
            self._key = os.environ.get(settings.api_key_env, "")
            if not self._key:
                raise ValueError(
                    f"data.regen_api_key_env={settings.api_key_env}: the environment variable "
                    f"{settings.api_key_env} is not set (or empty); export it with the server's API key, or set "
                    "data.regen_api_key_env='' for a server without one"
                )
            if self.auth is not None:
                raise ValueError(
                    f"data.regen_url={self.shown} carries credentials and data.regen_api_key_env names a key: both "
                    "would be the Authorization header; keep one"
                )
        self.timeout_s = settings.timeout_s if timeout_s is None else timeout_s
        self.retries = settings.retries if retries is None else retries
        self.stop = threading.Event()
        self.requests_sent = 0
        self._lock, self._local, self._sessions = threading.Lock(), threading.local(), []

    def clean(self, text: str) -> str:
        """`text` (an exception, a server's answer) with credentials masked and cut short, for an error message."""
        text = mask_text(str(text))
        return (text.replace(self._key, MASK) if self._key else text)[:300]

    def get(self, path: str) -> Any:
        return self._request("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, body)

    def close(self) -> None:
        for session in self._sessions:
            session.close()

    def _session(self) -> requests.Session:
        if getattr(self._local, "session", None) is None:
            self._local.session = requests.Session()
            with self._lock:
                self._sessions.append(self._local.session)
        return self._local.session

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        where = f"data.regen_url={self.shown}: {method} {path}"
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        problem = ""
        for attempt in range(self.retries + 1):
            if self.stop.is_set():
                raise RegenServerError(f"{where} not sent: another request gave up ({problem or 'stopped'})")
            with self._lock:
                self.requests_sent += 1
            wait_s = BACKOFF_S * 2**attempt
            try:
                answer = self._session().request(
                    method, self.base + path, json=body, headers=headers, auth=self.auth, timeout=self.timeout_s
                )
            except requests.RequestException as err:  # refused, reset, timed out: worth another try
                problem = f"{type(err).__name__}: {self.clean(err)}"
            else:
                if answer.status_code < 400:
                    try:
                        return answer.json()
                    except ValueError:
                        raise RegenServerError(
                            f"{where} answered HTTP {answer.status_code} without JSON ({self.clean(answer.text)}); "
                            "is data.regen_url the API base of an OpenAI-compatible server (ending in /v1)?"
                        ) from None
                problem = f"HTTP {answer.status_code}: {self.clean(answer.text)}"
                if answer.status_code != 429 and answer.status_code < 500:
                    raise RegenServerError(
                        f"{where} was refused ({problem}){_hint(answer.status_code)}", status=answer.status_code
                    )
                wait_s = _retry_after(answer) or wait_s
            if attempt < self.retries:
                self.stop.wait(min(MAX_BACKOFF_S, wait_s))
        raise RegenServerError(
            f"{where} failed after {self.retries + 1} tries ({problem}); is the server at data.regen_url running "
            "and reachable?"
        )


def _hint(status: int) -> str:
    if status in (401, 403):
        return "; check the key data.regen_api_key_env names, or the credentials in data.regen_url"
    if status == 404:
        return "; is data.regen_url the API base (ending in /v1) and data.regen_api an endpoint the server has?"
    return ""


def _retry_after(answer: requests.Response) -> float | None:
    try:
        return max(0.0, float(answer.headers.get("Retry-After", "")))
    except ValueError:
        return None


def list_models(client: ServerClient) -> list[dict[str, Any]]:
    """The entries of GET /models (each a dict with a string `id`); a RegenServerError when it is not such a list."""
    answer = client.get("/models")
    entries = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(entries, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in entries):
        raise RegenServerError(
            f'data.regen_url={client.shown}: GET /models is not an OpenAI model list ({{"data": [{{"id": ...}}]}}): '
            f"{client.clean(json.dumps(answer))}; is data.regen_url the API base (ending in /v1)?"
        )
    return entries


def choose_model(models: list[dict[str, Any]], wanted: str | None, *, shown: str) -> dict[str, Any]:
    """The entry of data.regen_model, or the first one listed when it is None."""
    if not models:
        raise ValueError(
            f"data.regen_url={shown}: the server serves no model (GET /models lists none); start it with the "
            "target's model (e.g. `transformers serve <model dir>`, `vllm serve <model>`)"
        )
    if wanted is None:
        return models[0]
    for entry in models:
        if entry["id"] == wanted:
            return entry
    served = ", ".join(m["id"] for m in models[:8])
    raise ValueError(
        f"data.regen_model={wanted} is not among the models the server at data.regen_url={shown} serves ({served}); "
        "set data.regen_model to one of them, or null for the first"
    )


def preflight_errors(cfg: RunConfig) -> list[str]:
    """data.regen_backend=openai, when the run regenerates: the API key variable is set, and GET /models answers
    within PREFLIGHT_TIMEOUT_S, without retries, with a list holding data.regen_model (or any model). Seconds, before
    any work; the tokenizer agreement needs the target and is checked when regeneration starts."""
    data = cfg.data
    regenerates = data.responses != "reference" and cfg.stage in REGEN_STAGES
    if data.regen_backend != "openai" or not data.regen_url or not regenerates:
        return []
    if cfg.model.import_from and cfg.stage in ("eval", "all", "serve"):
        return []  # an imported drafter: nothing is prepared
    try:
        settings = ServerSettings.from_data(data)
        client = ServerClient(settings, timeout_s=min(PREFLIGHT_TIMEOUT_S, data.regen_timeout_s), retries=0)
        try:
            choose_model(list_models(client), settings.model, shown=client.shown)
        finally:
            client.close()
    except (RegenServerError, ValueError) as err:
        return [str(err)]
    return []


def request_body(
    *,
    api: str,
    model_id: str,
    dialect: str,
    sampling: SamplingConfig,
    target: Target,
    seed: int,
    history: list,
    prompt_text: str = "",
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """One request: chat = `history` as messages (a system turn first when data.sampling.system_prompt is set);
    completions = `prompt_text`. Sampling as the module docstring says for `dialect`."""
    body: dict[str, Any] = {
        "model": model_id,
        "max_tokens": sampling.max_new_tokens if max_tokens is None else max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": seed,
        "stream": False,
    }
    if api == "chat":
        system = [] if sampling.system_prompt is None else [{"role": "system", "content": sampling.system_prompt}]
        body["messages"] = system + history
    else:
        body["prompt"] = prompt_text
    if dialect == "extended":
        body |= {"top_k": sampling.top_k if sampling.top_k > 0 else -1, "min_p": 0.0, "repetition_penalty": 1.0}
    else:
        config = {
            "do_sample": sampling.temperature > 0,
            "top_k": sampling.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "suppress_tokens": [int(target.mask_token_id)],
            "eos_token_id": [int(t) for t in target.stop_token_ids],
        }
        body["generation_config"] = json.dumps(config)
    return body


def check_tokenizer_agreement(
    client: ServerClient, target: Target, *, model: dict[str, Any], api: str, sampling: SamplingConfig
) -> str:
    """Refuse a server whose tokenizer or chat template disagrees with the target's (module docstring: what is
    checked and what is not); returns the sampling dialect the server accepted."""
    meta = model.get("meta") if isinstance(model.get("meta"), dict) else {}
    if meta.get("n_vocab") is not None and int(meta["n_vocab"]) != len(target.tokenizer):
        raise ValueError(
            f"data.regen_url={client.shown}: the server's model {model['id']} has a {meta['n_vocab']}-token "
            f"vocabulary, target={target.name}'s tokenizer {len(target.tokenizer)}; serve the target's own model, or "
            "use data.regen_backend=hf"
        )
    dialect = None
    for number, probe in enumerate(PROBES, 1):
        ids = target.chat_prompt_ids(probe, system_prompt=sampling.system_prompt)
        common = {"api": api, "model_id": model["id"], "sampling": sampling, "target": target, "seed": 0}
        common |= {"max_tokens": 1, "history": [{"role": "user", "content": probe}]}
        common["prompt_text"] = _decode(target, ids)
        if dialect is None:
            answer, dialect = _probe_dialects(client, common, api=api)
        else:
            answer = client.post(_path(api), request_body(dialect=dialect, **common))
        served = _usage(answer, "prompt_tokens")
        if served is None:
            raise ValueError(
                f"data.regen_url={client.shown}: the server reports no usage.prompt_tokens, so its tokenizer cannot "
                f"be compared with target={target.name}'s; use a server that reports usage, or data.regen_backend=hf"
            )
        if served != len(ids):
            other = " or data.regen_api=completions (our template renders the prompts)" if api == "chat" else ""
            raise ValueError(
                f"data.regen_url={client.shown}: the server's tokenizer or chat template disagrees with "
                f"target={target.name}'s: probe {number} of {len(PROBES)} is {served} prompt tokens there and "
                f"{len(ids)} here (data.regen_api={api}); serve the target's own model and tokenizer{other}, or use "
                "data.regen_backend=hf"
            )
    return str(dialect)


def _probe_dialects(client: ServerClient, common: dict[str, Any], *, api: str) -> tuple[Any, str]:
    refusals = []
    for dialect in DIALECTS:
        try:
            return client.post(_path(api), request_body(dialect=dialect, **common)), dialect
        except RegenServerError as err:
            if err.status not in (400, 422):
                raise
            refusals.append(f"{dialect}: {err}")
    raise ValueError(
        f"data.regen_url={client.shown}: the server refused both ways of asking for data.sampling's top_k, min_p "
        f"and repetition_penalty ({'; '.join(refusals)}); regenerate with data.regen_backend=hf"
    )


def _usage(answer: Any, name: str) -> int | None:
    """`usage.<name>` of an answer when the server reports it as a count."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    value = usage.get(name) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _path(api: str) -> str:
    return "/chat/completions" if api == "chat" else "/completions"


def _decode(target: Target, ids: Sequence[int]) -> str:
    return target.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def retokenise(target: Target, text: str) -> list[int]:
    """The target's ids of a response's text; special-token text is split into ordinary tokens."""
    return list(target.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def open_server(data: DataConfig, *, target: Target, sampling: SamplingConfig) -> ServerRegenerator:
    """The server of data.regen_*: its model chosen, its tokenizer checked against the target's, its dialect found."""
    settings = ServerSettings.from_data(data)
    client = ServerClient(settings)
    model = choose_model(list_models(client), settings.model, shown=client.shown)
    dialect = check_tokenizer_agreement(client, target, model=model, api=settings.api, sampling=sampling)
    log.info(
        "regenerating through %s: model %s, %s API, %s sampling fields",
        client.shown,
        model["id"],
        settings.api,
        dialect,
    )
    return ServerRegenerator(client=client, settings=settings, model=model, dialect=dialect)


@dataclass
class _Conversation:
    """One prompt's conversation while it is regenerated: its sequence so far and the turn to ask next."""

    shard: int
    slot: int  # position in its shard's batch
    turns: list[str]
    seq: RegeneratedSequence
    history: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    generated: int = 0
    mismatched: int = 0


@dataclass
class ServerRegenerator:
    """The `backend` of `regenerate_responses` for data.regen_backend=openai."""

    client: ServerClient
    settings: ServerSettings
    model: dict[str, Any]
    dialect: str

    @property
    def record(self) -> dict[str, Any]:
        """What enters the cache key (module docstring)."""
        entry = {k: v for k, v in self.model.items() if k not in VOLATILE_MODEL_FIELDS}
        return {"backend": "openai", "api": self.settings.api, "dialect": self.dialect, "model": entry}

    @property
    def manifest_record(self) -> dict[str, Any]:
        s = self.settings
        return self.record | {"url": self.client.shown, "concurrency": s.concurrency, "retries": s.retries}

    def regenerate_shards(
        self,
        target: Target,
        batches: dict[int, Sequence[PromptRecord]],
        *,
        sampling: SamplingConfig,
        seed: int,
        max_length: int,
        min_loss_tokens: int,
        multi_turn: bool | str,
        on_shard: Callable[[int, list[RegeneratedSequence], dict[str, Any]], None],
        out_dir: Path,
        num_shards: int,
    ) -> None:
        """Regenerate the shards `batches` (shard index → its prompts) through the server, calling `on_shard(index,
        rows, stats)` as each one's last conversation ends (shards finish out of order). At most
        2 × data.regen_concurrency requests are queued, data.regen_concurrency of them sent at once."""
        eot, api = end_of_turn_id(target), self.settings.api
        queue = [(index, slot, p) for index, batch in batches.items() for slot, p in enumerate(batch)]
        finished: dict[int, list[_Conversation]] = {index: [] for index in batches}
        started: dict[int, float] = {}
        in_flight: dict[Future, _Conversation] = {}
        pool = ThreadPoolExecutor(self.settings.concurrency, thread_name_prefix="dspark-regen")
        self.client.stop.clear()
        try:
            position = 0
            while position < len(queue) or in_flight:
                while position < len(queue) and len(in_flight) < 2 * self.settings.concurrency:
                    index, slot, prompt = queue[position]
                    position += 1
                    seq = RegeneratedSequence([], [], prompt.id, getattr(prompt, "domain", ""))
                    conv = _Conversation(index, slot, user_turns(prompt, multi_turn=multi_turn), seq)
                    started.setdefault(index, time.perf_counter())
                    in_flight[self._ask(pool, target, conv, sampling=sampling, seed=seed, eot=eot)] = conv
                for future in wait(in_flight, return_when=FIRST_COMPLETED).done:
                    conv = in_flight.pop(future)
                    self._take(target, conv, future.result(), api=api, eot=eot)
                    if conv.turn < len(conv.turns) and len(conv.seq.input_ids) < max_length:
                        in_flight[self._ask(pool, target, conv, sampling=sampling, seed=seed, eot=eot)] = conv
                        continue
                    finished[conv.shard].append(conv)
                    if len(finished[conv.shard]) == len(batches[conv.shard]):
                        convs = sorted(finished.pop(conv.shard), key=lambda c: c.slot)  # in-process order
                        self._emit(
                            conv.shard,
                            convs,
                            started[conv.shard],
                            on_shard=on_shard,
                            max_length=max_length,
                            min_loss_tokens=min_loss_tokens,
                        )
        except RegenServerError as err:
            kept = len(list(Path(out_dir).glob("shard-*.parquet")))
            raise RegenServerError(
                f"{err}. {kept} of {num_shards} shards are finished and kept under {out_dir}; start the server "
                "again and rerun: the run resumes from them",
                status=err.status,
            ) from err
        finally:
            # the others' retries end and queued requests are never sent; after a failure (or Ctrl-C) requests still
            # in the air are not waited for (each ends within data.regen_timeout_s)
            self.client.stop.set()
            pool.shutdown(wait=not in_flight, cancel_futures=True)
            if not in_flight:
                self.client.stop.clear()

    def _ask(
        self,
        pool: ThreadPoolExecutor,
        target: Target,
        conv: _Conversation,
        *,
        sampling: SamplingConfig,
        seed: int,
        eot: int,
    ) -> Future:
        """Append the next user turn's ids to the conversation and send its request (in the pool)."""
        user_text = conv.turns[conv.turn]
        ids = next_prompt_ids(target, conv.history, user_text, sampling=sampling, eot=eot)
        conv.seq.input_ids += ids
        conv.seq.loss_mask += [0] * len(ids)
        body = request_body(
            api=self.settings.api,
            model_id=self.model["id"],
            dialect=self.dialect,
            sampling=sampling,
            target=target,
            seed=derive_seed(seed, conv.seq.prompt_id, conv.turn) % SEED_RANGE,
            history=[*conv.history, {"role": "user", "content": user_text}],
            prompt_text=_decode(target, conv.seq.input_ids) if self.settings.api == "completions" else "",
        )
        return pool.submit(self.client.post, _path(self.settings.api), body)

    def _take(self, target: Target, conv: _Conversation, answer: Any, *, api: str, eot: int) -> None:
        """Append the answer's re-tokenised text and end-of-turn to the conversation (loss mask 1)."""
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        text = (choice.get("message") or {}).get("content") if choice and api == "chat" else (choice or {}).get("text")
        if choice is None or not isinstance(text, (str, type(None))):
            raise RegenServerError(
                f"data.regen_url={self.client.shown}: {_path(api)} answered without a choice's text "
                f"({self.client.clean(json.dumps(answer))})"
            )
        text, hit_stop = text or "", choice.get("finish_reason") != "length"
        ids = retokenise(target, text)
        response = ids + [eot]
        conv.seq.input_ids += response
        conv.seq.loss_mask += [1] * len(response)
        conv.seq.truncated |= not hit_stop
        ours = len(ids) + (1 if hit_stop else 0)  # what the server sampled: text and the stop token it ended on
        served = _usage(answer, "completion_tokens")
        conv.generated += ours if served is None else served
        conv.mismatched += int(served is not None and served != ours)
        conv.history += [{"role": "user", "content": conv.turns[conv.turn]}, {"role": "assistant", "content": text}]
        conv.turn += 1

    @staticmethod
    def _emit(
        index: int,
        convs: list[_Conversation],
        started: float,
        *,
        on_shard: Callable,
        max_length: int,
        min_loss_tokens: int,
    ) -> None:
        """One finished shard's rows and counters to `on_shard`."""
        rows, stats = finish_sequences(
            [c.seq for c in convs],
            max_length=max_length,
            min_loss_tokens=min_loss_tokens,
            generated=sum(c.generated for c in convs),
        )
        stats["retokenised_mismatch"] = sum(c.mismatched for c in convs)
        stats["seconds"] = time.perf_counter() - started
        on_shard(index, rows, stats)
