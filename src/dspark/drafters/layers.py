"""Building blocks shared by every drafter: RMSNorm, SwiGLU MLP, rotary embeddings, the target-shape spec.

Draft layers are "ordinary decoder layers of the target's family" (METHOD §2.1): pre-norm attention with
the target's q/k norm if it has one and a SwiGLU MLP. The dimensions come from the target's HF config
through `DraftLayerSpec.from_hf_config`, so nothing here is written per target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class DraftLayerSpec:
    """Shapes a draft layer copies from the target (d, heads, kv heads, head_dim, MLP width, eps, RoPE θ)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool  # Qwen3-style per-head RMSNorm on q and k
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config) -> "DraftLayerSpec":
        """Read the spec from a transformers `PretrainedConfig` of a Llama/Qwen/Mistral-like model."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            qk_norm="qwen3" in str(getattr(config, "model_type", "")),
            vocab_size=config.vocab_size,
        )


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in fp32 (as HF Llama/Qwen)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # decode-only copies: [W_gate; W_up] (`fuse_projections`)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse_projections(self) -> None:
        """One [W_gate; W_up] product instead of two (decode-time copies only; each output row depends on its own
        weight row, so the values are the separate products'); the separate projections are dropped."""
        self.gate_up_proj = linear_from(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        self.gate_proj = self.up_proj = None


def linear_from(weight: Tensor) -> nn.Linear:
    """A bias-free `nn.Linear` holding a copy of `weight` [out, in] (same dtype and device): fused products of
    decode-time copies."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight.data.copy_(weight.detach())
    return linear


class RotaryEmbedding(nn.Module):
    """Standard RoPE (rotate-half convention, as HF Llama): cos/sin for arbitrary integer positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: [...] int → (cos, sin) each [..., head_dim] fp32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, L, hd]; cos/sin: [B, L, hd] → rotated x (same dtype as x)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def init_new_weights(module: nn.Module, std: float = 0.02) -> None:
    """N(0, std) for new Linear/Embedding weights, zero biases (METHOD §3: new layers ~ N(0, 0.02))."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
