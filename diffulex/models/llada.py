"""LLaDA: a masked diffusion LM with an OLMo-derived ("llama" block type) decoder.

``model_type: "llada"``, ``architectures: ["LLaDAModelLM"]``; the config uses OLMo field names (``d_model``,
``n_layers``, ``n_heads``, ``n_kv_heads``, ``mlp_hidden_size``, ``weight_tying``, ...), read by
`diffulex.models.hf_config.LLaDAConfig`.

Module and parameter names are the checkpoint's, so weights and PEFT adapters load without renaming::

    model.transformer.wte.weight                          token embedding [embedding_size, d_model]
    model.transformer.blocks.N.attn_norm.weight           RMSNorm before attention
    model.transformer.blocks.N.{q,k,v}_proj.weight        (+ .bias with include_qkv_bias)
    model.transformer.blocks.N.attn_out.weight            attention output projection
    model.transformer.blocks.N.ff_norm.weight             RMSNorm before the MLP
    model.transformer.blocks.N.ff_proj.weight             MLP gate: SiLU is applied to its output
    model.transformer.blocks.N.up_proj.weight             MLP up: multiplies the activated gate
    model.transformer.blocks.N.ff_out.weight              MLP down projection
    model.transformer.ln_f.weight                         final RMSNorm
    model.transformer.ff_out.weight                       LM head (absent with weight_tying)

The MLP reading: the OLMo "llama" block computes ``ff_out(act(ff_proj(x)) * up_proj(x))``, so ``ff_proj`` is
the gate and ``up_proj`` the linear branch (the reverse of what the names suggest). The network itself is
bidirectional; which positions a token sees is decided by the strategy's mask, as for every family. No logit
shift: the hidden state at ``p`` predicts the token at ``p``.
"""

from __future__ import annotations

import math

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
)
from diffulex.models.dense import Rope, add_and_norm, head_projections, run_decoder
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import LLaDAConfig


class LLaDABlock(nn.Module):
    """One OLMo "llama" block: attention and SwiGLU MLP, each pre-normed, with residual adds.

    Takes and returns ``(hidden, residual)`` with the residual add folded into the next norm, like the other
    families (the true stream is ``hidden + residual``; ``residual`` is None before block 0).
    """

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.head_dim = hd
        self.attn_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.q_proj, self.k_proj, self.v_proj = head_projections(
            d, config.n_heads, config.n_kv_heads, hd, config.include_qkv_bias, ("n_heads", "n_kv_heads")
        )
        self.num_heads, self.num_kv_heads = self.q_proj.local_heads, self.k_proj.local_heads  # this rank's
        self.attn_out = RowParallelLinear(config.n_heads * hd, d)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, scale=hd**-0.5)
        self.ff_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.ff_proj = ColumnParallelLinear(d, config.mlp_hidden_size)  # gate
        self.up_proj = ColumnParallelLinear(d, config.mlp_hidden_size)
        self.ff_out = RowParallelLinear(config.mlp_hidden_size, d)
        self.act = SiluAndMul()

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``readers``: `diffulex.models.dense.run_decoder` (the rows of this block's output anyone reads)."""
        hidden, residual = add_and_norm(self.attn_norm, hidden, residual)
        T = hidden.shape[0]
        q = self.q_proj(hidden).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(T, self.num_kv_heads, self.head_dim)
        # the attention layer rotates q/k (writing k/v to the cache in the same launch on CUDA)
        hidden = self.attn_out(self.attn(q, k, v, attn_meta, rope), readers=readers)
        hidden, residual = self.ff_norm(hidden, residual)
        gate, up = self.ff_proj(hidden, readers=readers), self.up_proj(hidden, readers=readers)
        return self.ff_out(self.act(gate, up), readers=readers), residual


class LLaDATransformer(nn.Module):
    """``model.transformer``: embedding, blocks, final norm and (untied) LM head ``ff_out``."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.embedding_size, config.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers))
        self.ln_f = RMSNorm(config.d_model, eps=config.rms_norm_eps)
        self.ff_out = LMHead(config.embedding_size, config.d_model)
        if config.weight_tying:
            self.ff_out.tie_to(self.wte)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_sequence_length, config.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return run_decoder(input_ids, positions, self.wte, self.rotary_emb, self.blocks, self.ln_f, attn_meta, readers)


class LLaDAModel(nn.Module):
    """The ``model.`` level of the checkpoint (it only holds ``transformer``)."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.transformer = LLaDATransformer(config)


class LLaDAForDiffusionLM(nn.Module):
    """LLaDA-8B Base/Instruct (and D2F-LLaDA, which is LLaDA-8B-Instruct plus a PEFT adapter).

    ``forward(input_ids [T], positions [T], attn_meta) -> hidden [T, d_model]``;
    ``compute_logits(hidden [N, d_model]) -> [N, embedding_size]``.
    """

    ignored_checkpoint_keys = (r"rotary_emb\.inv_freq$",)

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LLaDAModel(config)
        self.logit_scale = 1.0 / math.sqrt(config.d_model) if config.scale_logits else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model.transformer(input_ids, positions, attn_meta, readers)

    def compute_logits(self, hidden: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model.transformer.ff_out(hidden, readers)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        return logits


register_family(
    Family(
        name="llada",
        model=LLaDAForDiffusionLM,
        read_config=LLaDAConfig.from_pretrained,
        mask_token_id=126336,
        default_strategy="d2f",
        model_types=("llada",),
        architectures=("LLaDAModelLM",),
    )
)
