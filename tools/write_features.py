"""Reference writer of the captured-feature format (docs/FEATURES.md): features from a plain transformers forward.

What an external capture job (a serving engine's hidden-state hook, a cluster job) must write for
`data.features_from=DIR` to train on it, shown with nothing of ours but the format module: AutoModelForCausalLM with
`output_hidden_states=True` (not dspark's Target), one sequence at a time, no padding.

    python tools/write_features.py --model PATH_OR_HUB_ID --pairs pairs.jsonl --out DIR [--layers 1,2,3,4,5]

pairs.jsonl: one object per line, `{"prompt": ..., "response": ..., "id": ..., "domain": ...}` (id and domain
optional). Each becomes `chat template(user prompt) + response tokens + end-of-turn`, loss on the response and the
end-of-turn token: the construction of `data.responses=reference` (dspark.data.reference), so the same pairs give the
same token ids as our own prepare stage. Then, e.g.:

    python experiments/run.py budget=smoke target=PATH data.features_from=DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark.data.feature_format import (
    FEATURE_DTYPES,
    TargetIdentity,
    new_manifest,
    seal_feature_dir,
    shard_name,
    tokenizer_digest,
    weights_digest,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="save_pretrained directory or hub id of the target")
    parser.add_argument("--pairs", required=True, type=Path, help="JSONL of prompt/response pairs")
    parser.add_argument("--out", required=True, type=Path, help="a new or empty directory")
    parser.add_argument("--layers", default="", help="feature layer ids, e.g. 1,9,17,25,33 (default: METHOD §2.1)")
    parser.add_argument("--num-layers", type=int, default=5, help="m, when --layers is not given")
    parser.add_argument("--shard-size", type=int, default=64, help="sequences per shard")
    parser.add_argument("--dtype", default="float16", choices=sorted(FEATURE_DTYPES), help="stored feature dtype")
    parser.add_argument("--max-length", type=int, default=4096, help="sequences are cut at this many tokens")
    parser.add_argument("--system-prompt", default=None, help="a system turn before each prompt (default: none)")
    return parser.parse_args(argv)


def default_layers(num_layers: int, m: int) -> list[int]:
    """METHOD §2.1: round(1 + i·(L−4)/(m−1)), i = 0..m−1 (Python's round: half to even)."""
    return [round(1 + i * (num_layers - 4) / (m - 1)) for i in range(m)] if m > 1 else [1]


def end_of_turn_id(model, tokenizer) -> int:
    """The token closing an assistant turn: the tokenizer's eos, else the generation config's, else <|im_end|>."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = model.generation_config.eos_token_id
    if eos is not None:
        return int(eos[0] if isinstance(eos, (list, tuple)) else eos)
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))


def encode_pair(pair: dict, *, tokenizer, eot: int, max_length: int, system_prompt: str | None):
    """(input_ids [T] int32, loss_mask [T] bool) of one prompt/response pair."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + [
        {"role": "user", "content": pair["prompt"]}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    response = tokenizer(pair["response"].strip(), add_special_tokens=False)["input_ids"] + [eot]
    ids = torch.tensor(prompt + response, dtype=torch.int32)[:max_length]
    mask = torch.tensor([False] * len(prompt) + [True] * len(response))[:max_length]
    return ids, mask


@torch.no_grad()
def capture(model, ids: torch.Tensor, mask: torch.Tensor, *, layers: list[int], dtype: torch.dtype):
    """The per-sequence tensors of the format and this sequence's share of `target_mass`.

    hidden_states[l + 1] is decoder layer l's raw output for l < L − 1; the last entry is the final-norm state."""
    out = model(input_ids=ids.long()[None], output_hidden_states=True)
    states = out.hidden_states
    features = torch.cat([states[layer + 1][0] for layer in layers], dim=-1).to(dtype)
    final_hidden = states[-1][0].to(dtype)
    head = model.get_output_embeddings()
    # log Z from the *stored* final hidden state, in fp32: what training recomputes p_t from
    logits = torch.nn.functional.linear(
        final_hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float()
    )
    log_z = torch.logsumexp(logits, dim=-1)
    predicts = torch.zeros(len(ids), dtype=torch.bool)
    predicts[:-1] = mask[1:]  # position t predicts token t + 1: summed where that token is supervised
    mass = torch.softmax(logits[predicts], dim=-1).sum(dim=0)
    tensors = {
        "features": features.contiguous(),
        "final_hidden": final_hidden.contiguous(),
        "log_normalizer": log_z.contiguous(),
        "input_ids": ids.contiguous(),
        "loss_mask": mask.contiguous(),
    }
    return tensors, mass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: --out {args.out} is not empty; give a new directory", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    num_layers = len(model.get_decoder().layers)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else default_layers(num_layers, args.num_layers)
    if any(not 0 <= layer < num_layers - 1 for layer in layers):
        # the last entry of hidden_states is the final-norm state, not layer L − 1's raw output
        print(f"error: --layers {layers}: ids must lie in 0..{num_layers - 2} with hidden_states", file=sys.stderr)
        return 2
    pairs = [json.loads(line) for line in args.pairs.read_text(encoding="utf-8").splitlines() if line.strip()]
    local = Path(args.model).expanduser()
    identity = TargetIdentity(
        name=str(local.resolve()) if local.is_dir() else args.model,  # what `target=` names in a run
        model_type=model.config.model_type,
        num_layers=num_layers,
        hidden_size=int(model.config.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        feature_layer_ids=tuple(layers),
        weights_digest=weights_digest(model),
        tokenizer_digest=tokenizer_digest(tokenizer),
        revision=getattr(model.config, "_commit_hash", None),
    )
    eot = end_of_turn_id(model, tokenizer)
    manifest = new_manifest(
        identity,
        tokenizer=tokenizer,
        dtype=args.dtype,
        precision="fp32",
        shard_size=args.shard_size,
        num_sequences=len(pairs),
        writer="tools/write_features.py",
        end_of_turn_id=eot,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    for shard in range(manifest["num_shards"]):
        first = shard * args.shard_size
        chunk = pairs[first : first + args.shard_size]
        tensors, mass = {}, torch.zeros(identity.vocab_size)
        for i, pair in enumerate(chunk, start=first):
            ids, mask = encode_pair(
                pair, tokenizer=tokenizer, eot=eot, max_length=args.max_length, system_prompt=args.system_prompt
            )
            parts, part_mass = capture(model, ids, mask, layers=layers, dtype=dtype)
            tensors |= {f"{name}.{i}": value for name, value in parts.items()}
            mass += part_mass
        tensors["target_mass"] = mass
        metadata = {
            "prompt_ids": json.dumps([str(p.get("id", f"pair-{first + j}")) for j, p in enumerate(chunk)]),
            "domains": json.dumps([str(p.get("domain", "")) for p in chunk]),
        }
        save_file(tensors, str(args.out / shard_name(shard)), metadata=metadata)
    seal_feature_dir(args.out, manifest)  # shard table, checksums, then the COMPLETE marker
    print(f"wrote {len(pairs)} sequences in {manifest['num_shards']} shards to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
