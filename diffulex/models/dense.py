"""The dense decoder shared by the Qwen2.5-, Qwen3- and Llama-style families (Dream, DiffuCoder, Dream reasoner,
Stable-DiffCoder, Fast-dLLM v2).

These checkpoints differ only in a few switches: biases on q/k/v, on o, on the MLP, and per-head q/k RMSNorm
(Qwen3). `DenseArch` holds the switches; each family's model class picks them from its config. Module and
parameter names are the HF ones (``model.layers.N.self_attn.q_proj.weight`` ...), so checkpoints and PEFT
adapters load without renaming. The block-diffusion part (mask, sampler, logit shift) lives outside the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffulex.attention import Attention, AttentionMetadata
from diffulex.layers import (
    ColumnParallelLinear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    apply_rotary,
)
from diffulex.models.hf_config import DenseDecoderConfig


@dataclass(frozen=True)
class DenseArch:
    """Which optional parts a family's decoder has."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool = False


class DenseAttention(nn.Module):
    """q/k/v projections, optional per-head RMSNorm of q and k, NeoX RoPE, attention, o_proj."""

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        hidden = config.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, self.num_heads * hd, bias=arch.qkv_bias)
        self.k_proj = ColumnParallelLinear(hidden, self.num_kv_heads * hd, bias=arch.qkv_bias)
        self.v_proj = ColumnParallelLinear(hidden, self.num_kv_heads * hd, bias=arch.qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * hd, hidden, bias=arch.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, scale=hd**-0.5)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, attn_meta))


class DenseMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, arch.mlp_bias
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class DenseDecoderLayer(nn.Module):
    """Pre-norm block; takes and returns ``(hidden, residual)`` with the residual add folded into the next norm
    (the true stream is ``hidden + residual``; ``residual`` is None before layer 0)."""

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DenseAttention(config, arch)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DenseMLP(config, arch)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, attn_meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DenseModel(nn.Module):
    """Embedding, decoder layers and the final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DenseDecoderLayer(config, arch) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attn_meta)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DenseForDiffusionLM(nn.Module):
    """Base of the dense families: ``forward(input_ids [T], positions [T], attn_meta) -> hidden [T, H]`` over a
    flat batch, ``compute_logits(hidden [N, H]) -> [N, vocab_size]``.

    Subclasses set `arch_for` (the switches for a config), ``family_defaults``, and ``logits_shift`` (True when
    the hidden state at ``p - 1`` predicts the token at ``p``). ``load_error_hint`` is appended to a strict
    loading error, to point at the family the checkpoint probably belongs to.
    """

    family_defaults: dict[str, object] = {}
    logits_shift = False
    ignored_checkpoint_keys = (r"rotary_emb\.inv_freq$",)
    load_error_hint = ""

    @classmethod
    def arch_for(cls, config: DenseDecoderConfig) -> DenseArch:
        raise NotImplementedError

    def __init__(self, config: DenseDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DenseModel(config, self.arch_for(config))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
