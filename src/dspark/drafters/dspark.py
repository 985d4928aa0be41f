"""The DSpark drafter: parallel backbone + sequential head + confidence head (METHOD §2.1–§2.3).

    U_k = lm_head(h_k)                          parallel logits from the KV-injected backbone
    logits_k = U_k + B_k(x_0, x_<k)             teacher-forced sequential correction (B_k = 0 for head `none`)
    c_k = σ(confidence_logits_k)                never a function of x_k

DFlash is this drafter with `head="none"` (or `markov_rank=0`) and `confidence=False` — a component choice, not a
subclass. With a draft vocabulary (`draft_vocab_ids`, `dspark.drafters.vocab`) every logits tensor is over the Vd
draft ids instead of V (U_k from the frozen LM-head rows of those ids, W₂ of the head r → Vd); inputs stay target ids. The target's embedding table and LM head are shared and frozen: they are held outside the module tree,
so `parameters()` and `state_dict()` contain only trained drafter weights.

Shape symbols: B sequences, T context length, N blocks per sequence, γ block size, d hidden size,
m feature layers, V vocabulary, r Markov rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dspark.drafters.backbone import DSparkBackbone
from dspark.drafters.heads import SEQUENTIAL_HEADS, ConfidenceHead, build_sequential_head
from dspark.drafters.layers import DraftLayerSpec
from dspark.drafters.vocab import DraftVocabHead


@dataclass
class DSparkOutput:
    """Teacher-forced drafter outputs for N blocks of γ slots per sequence."""

    hidden: Tensor  # [B, N, γ, d] final-norm backbone output h_k
    parallel_logits: Tensor  # [B, N, γ, Vd] U_k (Vd = V without a draft vocabulary)
    logits: Tensor  # [B, N, γ, Vd] U_k + B_k (the same tensor as parallel_logits when B_k ≡ 0)
    confidence_logits: Tensor | None  # [B, N, γ] pre-sigmoid c_k; None without a confidence head


def validate_drafter_args(*, depth: int, block_size: int, head: str, markov_rank: int, num_feature_layers: int) -> None:
    """Raise ValueError naming the config key of the first bad value."""
    checks = [
        (block_size >= 1, f"model.block_size must be >= 1 (got {block_size}); set e.g. model.block_size=7"),
        (depth >= 1, f"model.depth must be >= 1 (got {depth}); set e.g. model.depth=5"),
        (markov_rank >= 0, f"model.markov_rank must be >= 0 (got {markov_rank}); 0 disables the head, paper 256"),
        (
            num_feature_layers >= 1,
            f"num_feature_layers must be >= 1 (got {num_feature_layers}): give the target at least one feature layer",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    SEQUENTIAL_HEADS.resolve(head)  # raises with the valid names


class DSparkDrafter(nn.Module):
    """Backbone + sequential head (`model.head`, `heads.SEQUENTIAL_HEADS`) + optional confidence head; DFlash = head
    none, no confidence. A head with `block_conv` (selector_conv) also puts its block convolution in the draft layers."""

    def __init__(
        self,
        *,
        spec: DraftLayerSpec,
        num_feature_layers: int,
        depth: int,
        block_size: int,
        head: str,
        markov_rank: int,
        confidence: bool,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        mask_token_id: int,
        draft_vocab_ids: Tensor | None = None,
        confidence_with_markov: bool = True,
    ) -> None:
        super().__init__()
        validate_drafter_args(
            depth=depth,
            block_size=block_size,
            head=head,
            markov_rank=markov_rank,
            num_feature_layers=num_feature_layers,
        )
        if not 0 <= mask_token_id < spec.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary [0, {spec.vocab_size})")
        self.spec, self.num_feature_layers, self.depth, self.block_size = spec, num_feature_layers, depth, block_size
        self.head_name, self.markov_rank, self.mask_token_id = head, markov_rank, mask_token_id
        # Frozen by contract (METHOD §3): make sure no gradient reaches the target's tables.
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        self._frozen = (lm_head,)  # a tuple: not a submodule, so not in parameters() or state_dict()
        self.backbone = DSparkBackbone(
            spec=spec,
            num_feature_layers=num_feature_layers,
            depth=depth,
            embed_tokens=embed_tokens,
            mask_token_id=mask_token_id,
            # the head's parallel half (selector_conv) lives in the draft layers; rank 0 is DFlash, without it
            block_conv=markov_rank > 0 and SEQUENTIAL_HEADS.resolve(head).block_conv,
        )
        self.draft_head = DraftVocabHead(lm_head, vocab_size=spec.vocab_size, draft_vocab_ids=draft_vocab_ids)
        self.confidence_with_markov = bool(confidence_with_markov)
        self.head = build_sequential_head(
            head,
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            rank=markov_rank,
            output_size=self.draft_head.size,
        )
        self.confidence_head = (
            # confidence_with_markov=False: c_k from h_k alone (DeepSpec `confidence_head_with_markov`)
            ConfidenceHead(hidden_size=spec.hidden_size, rank=self.head.rank if confidence_with_markov else 0)
            if confidence
            else None
        )

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[0]

    @property
    def embed_tokens(self) -> nn.Module:
        return self.backbone.embed_tokens

    @property
    def draft_vocab_size(self) -> int:
        """Vd, the width of every logits tensor (V without a draft vocabulary)."""
        return self.draft_head.size

    @property
    def draft_to_target(self) -> Tensor:
        """[Vd] long: the target id of each draft id."""
        return self.draft_head.draft_to_target

    def forward(
        self,
        *,
        context_features: Tensor,
        context_valid: Tensor,
        block_input_ids: Tensor,
        anchor_positions: Tensor,
        prev_tokens: Tensor,
    ) -> DSparkOutput:
        """Teacher-forced forward of all blocks.

        context_features [B, T, m·d] raw target features; context_valid [B, T] bool (False = padding, never
        attended); block_input_ids [B, N, γ] (`[x_0, MASK, …]`); anchor_positions [B, N] (position of x_0);
        prev_tokens [B, N, γ] (x_{k-1}: the anchor then the ground-truth labels of slots 1..γ-1).
        """
        if block_input_ids.shape[-1] != self.block_size:
            raise ValueError(
                f"model.block_size is {self.block_size} but the blocks have "
                f"{block_input_ids.shape[-1]} slots; build blocks with the same block_size"
            )
        hidden = self.backbone(
            context_features,
            block_input_ids=block_input_ids,
            anchor_positions=anchor_positions,
            context_valid=context_valid,
        )
        parallel_logits = self.project(hidden)
        bias = self.head.teacher_forced_bias(hidden, prev_tokens, parallel_logits=parallel_logits)
        logits = parallel_logits if bias is None else parallel_logits + bias.to(parallel_logits.dtype)
        return DSparkOutput(
            hidden=hidden,
            parallel_logits=parallel_logits,
            logits=logits,
            confidence_logits=self.confidence(hidden, prev_tokens),
        )

    def project(self, hidden: Tensor) -> Tensor:
        """Parallel logits U_k = frozen LM-head rows of the draft vocabulary applied to h_k: [..., d] → [..., Vd]."""
        return self.draft_head(hidden)

    def confidence(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """Confidence logits from h_k [..., d] and x_{k-1} [...] → [...], or None without a confidence head."""
        if self.confidence_head is None:
            return None
        if self.confidence_head.rank == 0:  # no W_1 (head none) or model.confidence_with_markov=false
            return self.confidence_head(hidden, None)
        return self.confidence_head(hidden, self.head.prev_token_embedding(prev_tokens))

    def sequential_step(
        self, *, hidden_k: Tensor, parallel_logits_k: Tensor, prev_token: Tensor, state: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """One inference slot k, left to right: (U_k + B_k [..., Vd], c_k logit [...] or None, new state).

        hidden_k [..., d], parallel_logits_k [..., Vd], prev_token [...] = x_{k-1} (a target id) (the drafted token, or x_0 for
        k = 1), state from `self.head.init_state(...)` or the previous step. Teacher-forcing the tokens through
        this loop reproduces `forward`'s logits and confidence_logits.
        """
        bias, state = self.head.step(hidden_k, prev_token, state, parallel_logits=parallel_logits_k)
        logits = parallel_logits_k if bias is None else parallel_logits_k + bias.to(parallel_logits_k.dtype)
        return logits, self.confidence(hidden_k, prev_token), state

    def extra_config(self) -> dict[str, Any]:
        """Plain (YAML/JSON-safe) hyper-parameters that rebuild this drafter with `from_extra_config`."""
        return {
            "spec": asdict(self.spec),
            "num_feature_layers": self.num_feature_layers,
            "depth": self.depth,
            "block_size": self.block_size,
            "head": self.head_name,
            "markov_rank": self.markov_rank,
            "confidence": self.confidence_head is not None,
            "mask_token_id": self.mask_token_id,
            "draft_vocab_size": self.draft_vocab_size,
            "confidence_with_markov": self.confidence_with_markov,
        }

    @classmethod
    def from_extra_config(
        cls, config: dict[str, Any], *, embed_tokens: nn.Module, lm_head: nn.Module
    ) -> "DSparkDrafter":
        """Rebuild (untrained weights) from `extra_config()` and the target's frozen modules."""
        kwargs = dict(config)
        spec = DraftLayerSpec(**kwargs.pop("spec"))
        draft_vocab_size = int(kwargs.pop("draft_vocab_size", spec.vocab_size))
        # placeholder ids of the right size: load_state_dict fills the stored mapping
        ids = None if draft_vocab_size >= spec.vocab_size else torch.arange(draft_vocab_size)
        return cls(spec=spec, embed_tokens=embed_tokens, lm_head=lm_head, draft_vocab_ids=ids, **kwargs)
