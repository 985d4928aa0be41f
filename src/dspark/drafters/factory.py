"""Build drafters from config names (`drafter=dspark|dflash|eagle3`) and rebuild them from checkpoints.

DFlash is DSpark with `head=none` and no confidence head — a component choice, not a subclass (METHOD §3).
The rebuild record (`DrafterSpec`) names the target it was trained for, so a checkpoint cannot silently be used
with another target or block size.
"""

from __future__ import annotations

import reprlib
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Callable

import torch
from torch import Tensor, nn

from dspark.config.schema import CONFIDENCE_HEAD, drafter_head
from dspark.drafters.heads import SEQUENTIAL_HEADS, matched_rank
from dspark.registry import Registry


@dataclass(frozen=True)
class DrafterSpec:
    """Everything needed to rebuild a drafter around a loaded target (stored in checkpoints and MLflow)."""

    kind: str  # dspark | dflash | eagle3
    head: str
    depth: int
    block_size: int
    markov_rank: int
    feature_layers: tuple[int, ...]
    mask_token_id: int
    target_fingerprint: str
    draft_vocab_size: int = 0  # Vd of the draft vocabulary; 0 = the full target vocabulary (older checkpoints)
    confidence_with_markov: bool = True  # c_k also reads W_1[x_{k-1}] (DeepSpec confidence_head_with_markov)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"feature_layers": list(self.feature_layers)}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "drafter spec", fix: str = "") -> "DrafterSpec":
        """The spec of a stored dict; a ValueError naming `source`, the field, its value (bounded) and `fix` for
        an unknown, missing or ill-typed field (`SPEC_FIELD_CHECKS`) or an unregistered kind or head."""
        end = f". {fix}" if fix else ""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: the drafter spec is a {type(data).__name__}, not a dict{end}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in set(data) - set(names))
        if unknown:
            raise ValueError(f"{source}: unknown drafter spec field(s) {_quote(unknown)}{end}")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"{source}: the drafter spec lacks {', '.join(missing)}{end}")
        for name, (ok, expected) in SPEC_FIELD_CHECKS.items():
            if name in data and not ok(data[name]):
                raise ValueError(
                    f"{source}: drafter spec field {name} must be {expected}, not {_quote(data[name])}{end}"
                )
        for name, registry in (("kind", DRAFTER_BUILDERS), ("head", SEQUENTIAL_HEADS)):
            if data[name] not in registry:
                valid = ", ".join(registry.names())
                raise ValueError(f"{source}: drafter spec {name} {_quote(data[name])} is not one of {valid}{end}")
        return cls(**{**data, "feature_layers": tuple(data["feature_layers"])})

    def vocab_ids_placeholder(self, vocab_size: int) -> Tensor | None:
        """Ids of the right size for rebuilding before `load_state_dict` fills the stored mapping (None = full)."""
        if self.draft_vocab_size <= 0 or self.draft_vocab_size >= vocab_size:
            return None
        return torch.arange(self.draft_vocab_size)


def _count(minimum: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# field -> (check, what it must be) of a stored spec; a field missing here is not type-checked on load
SPEC_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "kind": (lambda v: isinstance(v, str), "a string"),
    "head": (lambda v: isinstance(v, str), "a string"),
    "depth": (_count(1), "an integer >= 1"),
    "block_size": (_count(1), "an integer >= 1"),
    "markov_rank": (_count(0), "an integer >= 0"),
    "feature_layers": (
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in v),
        "a list of integers",
    ),
    "mask_token_id": (_count(0), "an integer >= 0"),
    "target_fingerprint": (lambda v: isinstance(v, str), "a string"),
    "draft_vocab_size": (_count(0), "an integer >= 0"),
    "confidence_with_markov": (lambda v: isinstance(v, bool), "true or false"),
}
_REPR = reprlib.Repr()
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8
_REPR.maxstring = _REPR.maxother = 60


def _quote(value: Any) -> str:
    """A bounded repr (a stored value may be any size)."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int past str()'s 4300 digits
        return "<a value too large to show>"


DRAFTER_BUILDERS: Registry[Callable[..., nn.Module]] = Registry("drafter")


@DRAFTER_BUILDERS.register("dspark", label="DSpark")
@DRAFTER_BUILDERS.register("dflash", label="DFlash")
def build_dspark(spec: DrafterSpec, target: Any, draft_vocab_ids: Tensor | None = None) -> nn.Module:
    """DSpark, or DFlash: the same drafter without the heads its kind lacks (`drafter_head`, `CONFIDENCE_HEAD`)."""
    from dspark.drafters.dspark import DSparkDrafter

    head = drafter_head(spec.kind, spec.head)
    return DSparkDrafter(
        spec=target.layer_spec,
        num_feature_layers=len(spec.feature_layers),
        depth=spec.depth,
        block_size=spec.block_size,
        head=head,
        markov_rank=spec.markov_rank if head != "none" else 0,
        confidence=CONFIDENCE_HEAD[spec.kind],
        embed_tokens=target.embed_tokens,
        lm_head=target.lm_head,
        mask_token_id=spec.mask_token_id,
        draft_vocab_ids=draft_vocab_ids,
        confidence_with_markov=spec.confidence_with_markov,
    )


@DRAFTER_BUILDERS.register("eagle3", label="EAGLE-3")
def build_eagle3(spec: DrafterSpec, target: Any, draft_vocab_ids: Tensor | None = None) -> nn.Module:
    from dspark.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter(
        spec=target.layer_spec,
        num_feature_layers=len(spec.feature_layers),
        block_size=spec.block_size,
        embed_tokens=target.embed_tokens,
        lm_head=target.lm_head,
        draft_vocab_ids=draft_vocab_ids,
    )


def drafter_spec_for(*, kind: str, model_cfg: Any, target: Any) -> DrafterSpec:
    """The spec of a new drafter for `target` from the `model.*` config."""
    head = drafter_head(kind, model_cfg.head)
    vocab = int(getattr(model_cfg, "draft_vocab_size", 0) or 0)
    draft_vocab = 0 if vocab >= target.vocab_size else vocab
    rank = model_cfg.markov_rank if head != "none" else 0
    if getattr(model_cfg, "match_params", False):  # the parameter-matched variant of the head (heads.matched_rank)
        dims = dict(hidden_size=target.layer_spec.hidden_size, vocab_size=target.vocab_size, depth=model_cfg.depth)
        rank = matched_rank(head, rank=rank, output_size=draft_vocab or None, **dims)
    return DrafterSpec(
        kind=kind,
        head=head,
        depth=model_cfg.depth,
        block_size=model_cfg.block_size,
        markov_rank=rank,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=checkpoint_fingerprint(target),
        draft_vocab_size=draft_vocab,
        confidence_with_markov=bool(getattr(model_cfg, "confidence_with_markov", True)),
    )


def build_drafter(spec: DrafterSpec, target: Any, *, draft_vocab_ids: Tensor | None = None) -> nn.Module:
    """Instantiate the drafter of `spec` around `target`; refuses a target other than the one it was made for.

    draft_vocab_ids [Vd] (sorted target ids, `dspark.drafters.vocab.build_draft_vocab`) when
    spec.draft_vocab_size > 0; omitted, a placeholder of the right size is used (for `load_state_dict`)."""
    check_spec_matches(spec, target)
    if draft_vocab_ids is None:
        draft_vocab_ids = spec.vocab_ids_placeholder(target.vocab_size)
    elif spec.draft_vocab_size and draft_vocab_ids.numel() != spec.draft_vocab_size:
        raise ValueError(f"model.draft_vocab_size={spec.draft_vocab_size} but {draft_vocab_ids.numel()} ids given")
    return DRAFTER_BUILDERS.resolve(spec.kind)(spec, target, draft_vocab_ids)


def state_shapes(spec: DrafterSpec, target: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every `state_dict` entry of the drafter `spec` describes around `target`, from a build on the
    meta device: no weight is allocated, so a checkpoint's tensors can be compared with it before the real build.
    Each of `spec.depth` layers is still a module object: bound the depth (by the checkpoint's layers) first."""
    vd = spec.draft_vocab_size
    ids = torch.arange(vd if 0 < vd < target.vocab_size else target.vocab_size)  # on the CPU: its checks read it
    with torch.device("meta"):
        drafter = build_drafter(spec, target, draft_vocab_ids=ids)
    return {name: tuple(tensor.shape) for name, tensor in drafter.state_dict().items()}


def checkpoint_fingerprint(target: Any) -> str:
    """The target checkpoint's dtype-independent identity (`Target.checkpoint_fingerprint`; test doubles may only
    carry `fingerprint`)."""
    return getattr(target, "checkpoint_fingerprint", None) or target.fingerprint


def check_spec_matches(spec: DrafterSpec, target: Any, *, block_size: int | None = None) -> None:
    """Clear errors for a drafter trained for another target, feature layers or block size."""
    if spec.target_fingerprint not in (target.fingerprint, checkpoint_fingerprint(target)):
        raise ValueError(
            f"This drafter was trained for another target (fingerprint {spec.target_fingerprint[:12]}, "
            f"loaded target '{target.name}' is {checkpoint_fingerprint(target)[:12]}). Use the same "
            "`target=` as in training (any target.dtype), or train a drafter for this target."
        )
    if list(spec.feature_layers) != list(target.feature_layer_ids):
        raise ValueError(
            f"The drafter reads target layers {list(spec.feature_layers)} but the target was loaded "
            f"with {target.feature_layer_ids}; set model.feature_layers={list(spec.feature_layers)}."
        )
    if block_size is not None and block_size != spec.block_size:
        raise ValueError(
            f"The drafter was trained with model.block_size={spec.block_size}, not {block_size}; "
            f"set model.block_size={spec.block_size} or train a new drafter."
        )
