"""SDAR: a block-diffusion LM with the Qwen3 architecture (per-head q/k RMSNorm, GQA, SwiGLU, NeoX RoPE).

The network is an ordinary Qwen3 decoder; what makes it a block-diffusion model is only the attention mask
(block-causal, carried by the attention metadata) and the sampler. Module and parameter names mirror the HF
checkpoint exactly (``model.layers.N.self_attn.q_proj.weight`` ...), so weights load without any renaming.
"""

from __future__ import annotations

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
from diffulex.models.hf_config import SDARConfig
from diffulex.registry import AutoModelForDiffusionLM


class SDARAttention(nn.Module):
    """q/k/v projections, per-head RMSNorm of q and k, RoPE, attention through the shared module, o_proj."""

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = ColumnParallelLinear(hidden, self.num_heads * hd, bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, self.num_kv_heads * hd, bias=bias)
        self.v_proj = ColumnParallelLinear(hidden, self.num_kv_heads * hd, bias=bias)
        self.o_proj = RowParallelLinear(self.num_heads * hd, hidden, bias=bias)
        self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, scale=hd**-0.5)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, attn_meta))


class SDARMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size)
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class SDARDecoderLayer(nn.Module):
    """Pre-norm block. The residual add is folded into the next norm: a layer takes and returns
    ``(hidden, residual)`` where the true stream is ``hidden + residual`` (``residual`` is None before
    layer 0).
    """

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SDARAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SDARMLP(config)

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


class SDARModel(nn.Module):
    """Embedding, decoder layers and the final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SDARDecoderLayer(config) for _ in range(config.num_hidden_layers))
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


@AutoModelForDiffusionLM.register("sdar")
class SDARForDiffusionLM(nn.Module):
    """The SDAR family (``model_type: "sdar"``; SDAR-1.7B/4B/8B-Chat and their ``-bN`` block-size variants).

    ``forward(input_ids [T], positions [T], attn_meta) -> hidden [T, hidden_size]`` over a flat batch;
    ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]``. No logit shift: the hidden state at a
    position predicts the token at that same position.
    """

    # What the engine assumes for this family when neither the user nor the checkpoint says otherwise.
    family_defaults = {"mask_token_id": 151669, "decoding_strategy": "multi_bd"}
    # Checkpoint tensors that are derived state, not weights (old HF exports saved the RoPE frequencies).
    ignored_checkpoint_keys = (r"rotary_emb\.inv_freq$",)

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.config = config
        self.model = SDARModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
