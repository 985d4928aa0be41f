"""What the single-request and the batched DSpark proposers share: the drafter's precision, the parallel stage's
LM head over the draft vocabulary, the draft-vocabulary → target-id map and the fault guard (METHOD §2, §5).

Draft vocabulary (`model.draft_vocab_size`, contract in the drafters): the drafter's logits have Vd columns, column
j meaning target token `draft_to_target[j]`. A proposer samples j over Vd — softmax, CDF and search over Vd only —
and hands the verifier the target id and p_d over the full V, zero outside the draft vocabulary (`to_target_probs`),
so rejection sampling stays exact: the verifier never sees a distribution other than the one x_k was drawn from.

Precision (`decode.drafter_precision`): `fp32`, `bf16`, or `auto` = bf16 when this CPU has bf16 matrix instructions
(`dspark.hardware.cpu_has_fast_bf16`: `amx_bf16` or `avx512_bf16` in /proc/cpuinfo, read at run time), else fp32; on a GPU `auto`
is fp32. bf16 applies to the parallel stage only
(context fusion, the draft layers and their cached keys/values, the LM head): that stage reads large weights for
γ rows at once and runs ~3.5× faster in bf16 on AMX (measured: SmolLM2's 49,152-row LM head over 7 rows, 24.7 vs
6.7 ms on one thread). The sequential loop (Markov/RNN W_2, confidences, softmax) stays fp32: a one-row product
over W_2 is slower in bf16 there (2.0 vs 3.0 ms for 256 × 49,152). The proposer works on a bf16 *copy* of the
backbone made at construction; later changes to the drafter's weights are not seen. Precision changes the drafts,
never losslessness: p_d is always the fp32 distribution the token was sampled from.

`int8` (opt-in): the parallel stage's linear layers — context fusion, the draft layers' projections and MLPs, the
LM head over the draft vocabulary — become dynamically quantised int8 copies (`torch.ao.quantization.quantize_dynamic`:
int8 weights with one scale per output row, activations quantised per call, fp32 out; CPU only). On a CPU without bf16
instructions these products are bandwidth-bound, and the target's forward between two rounds evicts the drafter's
weights from cache: an 8,192 × 576 LM head over 7 rows from DRAM took 4.0 ms in fp32 and 0.7 ms in int8, a draft
layer's MLP projections ~0.7 vs ~0.3 ms (EPYC Zen 3, 2 threads). Norms, RoPE, attention and the sequential loop stay
fp32. Like bf16 it changes the drafts (acceptance may move), never losslessness.

Faults: a slot whose logits are unusable (NaN, +inf, or all −inf; `usable_logits`) ends the proposal before that
slot is sampled. The decision depends on x_<k only (like a policy stop), so the output stays the target's; such a
slot is never verified, hence never accepted. Non-finite confidences read as 0.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from dspark.hardware import cpu_has_fast_bf16

PRECISIONS = ("auto", "fp32", "bf16", "int8")
PRECISION_KEY = "decode.drafter_precision"


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> torch.dtype:
    """`decode.drafter_precision` → the dtype of the drafter's parallel stage (module docstring); `torch.qint8`
    stands for the dynamically quantised int8 stage (CPU only)."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"{PRECISION_KEY}={precision!r} is not one of {', '.join(PRECISIONS)}; use auto (bf16 on "
            "CPUs with AMX-BF16 / AVX512-BF16, else fp32), fp32, bf16 or int8 (CPU only)"
        )
    if precision == "auto":
        return torch.bfloat16 if torch.device(device).type == "cpu" and cpu_has_fast_bf16() else torch.float32
    if precision == "int8":
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"{PRECISION_KEY}=int8 runs on the CPU only (dynamic int8 quantisation); the drafter is "
                f"on {torch.device(device)}: use auto, fp32 or bf16 there"
            )
        return torch.qint8
    return torch.bfloat16 if precision == "bf16" else torch.float32


def precision_name(precision: str, device: torch.device | str = "cpu") -> str:
    """What `decode.drafter_precision` resolves to on this machine, as a word: fp32 | bf16 | int8 (report headers)."""
    return {torch.qint8: "int8", torch.bfloat16: "bf16"}.get(resolve_precision(precision, device), "fp32")


def draft_to_target(drafter: nn.Module) -> Tensor | None:
    """The drafter's [Vd] long draft → target id map (`drafter.draft_head`), or None for the full vocabulary."""
    head = getattr(drafter, "draft_head", None)
    if head is None or head.is_full:
        return None
    return head.draft_to_target


def prepare_sequential_head(drafter: nn.Module, ids: Tensor | None) -> bool:
    """Give a Markov head its decode-time bias table over the draft vocabulary (`heads.BiasTable`): each slot's
    bias becomes a row look-up instead of a product over all of W_2. No-op for other heads and for the full
    vocabulary (a V × V table would not fit). Returns whether the table is on."""
    enable = getattr(getattr(drafter, "head", None), "enable_bias_table", None)
    return bool(enable(ids)) if enable is not None and ids is not None else False


def to_target_probs(probs: Tensor, ids: Tensor | None, vocab_size: int) -> Tensor:
    """p_d over the draft vocabulary [..., Vd] → over the target's [..., V], zero outside it (ids None: as is)."""
    if ids is None:
        return probs
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    # scatter along the last dimension: the same values as index_copy_, ~2× faster over V = 49,152 columns
    return full.scatter_(-1, ids.expand(*probs.shape[:-1], -1), probs)


def usable_logits(logits: Tensor) -> Tensor:
    """[..., Vd] → [...] bool: the row defines a distribution (no NaN, no +inf, not all −inf; module docstring)."""
    return torch.isfinite(logits.amax(dim=-1))


def clean_confidences(confidences: Tensor) -> Tensor:
    """σ outputs with NaN read as 0 (a confidence the drafter could not compute admits nothing)."""
    return torch.nan_to_num(confidences, nan=0.0)


class ParallelStage:
    """The drafter's parallel stage in the proposer's precision: backbone (a bf16 copy when bf16) and the LM head
    over the draft vocabulary (`logits(h)`, fp32 out). fp32 uses the drafter's own modules and `project`."""

    def __init__(self, drafter: nn.Module, dtype: torch.dtype) -> None:
        self.drafter, self.dtype = drafter, dtype
        self.ids = draft_to_target(drafter)
        #: the dtype of the stage's activations and of the context keys/values a proposer caches
        self.activation_dtype = torch.float32 if dtype in (torch.float32, torch.qint8) else dtype
        self._quantized_head: nn.Module | None = None
        if dtype == torch.float32:
            self.backbone = drafter.backbone
            self._weight = self._bias = None
            return
        embed = drafter.backbone.embed_tokens  # the target's frozen table: shared, never copied
        self.backbone = copy.deepcopy(drafter.backbone, memo={id(embed): embed})
        for layer in self.backbone.layers:  # q/k/v, k/v and gate/up as one product each (a copy: ours to change)
            layer.fuse_projections()
        head = drafter.draft_head  # the frozen LM-head rows of the draft vocabulary (dspark.drafters.vocab)
        bias = getattr(head.lm_head, "bias", None)
        if bias is not None and self.ids is not None:
            bias = bias[self.ids.to(bias.device)]
        self._bias = None if bias is None else bias.detach().float()
        if dtype == torch.qint8:
            self.backbone = quantize_linears(self.backbone)
            rows = head.weight().float()
            linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
            linear.weight.data.copy_(rows)
            self._quantized_head = quantize_linears(nn.Sequential(linear))
            self._weight = None
            return
        self.backbone = self.backbone.to(dtype)
        self.backbone.rotary.float()  # positions × inv_freq stays fp32 (bf16 would blur long positions)
        self._weight = head.weight().to(dtype).contiguous()

    def logits(self, hidden: Tensor) -> Tensor:
        """U_k [..., Vd] float32 from h_k [..., d]."""
        if self._quantized_head is not None:
            logits = self._quantized_head(hidden.float())
        elif self._weight is None:
            return self.drafter.project(hidden).float()
        else:
            logits = (hidden.to(self.dtype) @ self._weight.t()).float()
        return logits if self._bias is None else logits + self._bias


def quantize_linears(module: nn.Module) -> nn.Module:
    """`module` (a copy the caller owns) with every `nn.Linear` replaced by a dynamically quantised int8 one (int8
    weights, one scale per output row; float in, float out), for inference on the CPU."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao; the kernels are the same
        warnings.simplefilter("ignore")
        return quantize_dynamic(module.eval(), {nn.Linear: per_channel_dynamic_qconfig}, inplace=True)
