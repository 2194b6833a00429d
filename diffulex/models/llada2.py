"""LLaDA2 (LLaDA2.0/2.1 mini and flash, and the DMax checkpoints): a block-diffusion LM on the Ling/Bailing-MoE
decoder.

Per layer: pre-norm attention with one fused ``query_key_value`` projection (q heads, then k, then v), per-head
q/k RMSNorm and rotary on the first part of each head only (``partial_rotary_factor``, half on the published
checkpoints); then a pre-norm MLP, dense in the first ``first_k_dense_replace`` layers and elsewhere a mixture of
experts routed by `diffulex.layers.moe.GroupLimitedRouter`, plus a shared expert. Module and parameter names are
the checkpoint's (``model.word_embeddings``, ``model.layers.N.attention.query_key_value``,
``model.layers.N.mlp.gate.expert_bias`` ...). No logit shift: a position's hidden state predicts its own token.

On the GPU the q/k norm, the partial rotary and the KV store are one Triton launch, as for the other families
(`diffulex.kernels.fused_norm.qk_norm_rope_store`: the rest of each head is normed and stored unrotated).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from diffulex.attention import Attention, AttentionMetadata
from diffulex.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    UnsummedProduct,
    VocabEmbedding,
)
from diffulex.layers.moe import GatedMLP, GroupLimitedRouter, SparseMoE
from diffulex.layers.parallel_state import tensor_parallel_group
from diffulex.layers.rotary import Rope
from diffulex.layers.token_merge import SoftInputs
from diffulex.models.dense import DenseArch, DenseForDiffusionLM, DenseMLP, pre_norm_layer, run_decoder
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import LLaDA2Config


class LLaDA2Attention(nn.Module):
    """``query_key_value`` -> q/k norm + partial rotary -> attention -> ``dense``."""

    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        tp = tensor_parallel_group()
        # the fused matrix splits each of q, k and v across the ranks on its own (no replicated K/V heads)
        self.num_heads = tp.shard(heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.shard(kv_heads, "num_key_value_heads")[1]
        parts = [heads * hd, kv_heads * hd, kv_heads * hd]
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, sum(parts), bias=config.use_qkv_bias, output_parts=parts
        )
        self.sizes = [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd]  # this rank's parts
        self.dense = RowParallelLinear(heads * hd, config.hidden_size, bias=config.use_bias)
        self.query_layernorm: RMSNorm | None = None
        self.key_layernorm: RMSNorm | None = None
        if config.use_qk_norm:
            self.query_layernorm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.key_layernorm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, scale=hd**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        attn_meta: AttentionMetadata,
        unsummed: bool = False,
        readers: torch.Tensor | None = None,
    ) -> torch.Tensor | UnsummedProduct:
        T = x.shape[0]
        q, k, v = self.query_key_value(x).split(self.sizes, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, attn_meta, rope, self.query_layernorm, self.key_layernorm)
        return self.dense.forward_unsummed(out, readers) if unsummed else self.dense(out, readers=readers)


def _mlp(config: LLaDA2Config, index: int) -> nn.Module:
    """Layer `index`'s MLP: dense in the first layers, else routed experts plus the shared ones."""
    if not config.is_sparse_layer(index):
        return DenseMLP(config, DenseArch(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False))
    gate = GroupLimitedRouter(
        config.hidden_size, config.num_experts, config.num_experts_per_tok, config.n_group, config.topk_group,
        config.routed_scaling_factor, expert_bias=config.expert_bias,
    )  # fmt: skip
    shared = None
    if config.num_shared_experts:
        shared = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts,
                          merge_gate_up=True)  # fmt: skip
    return SparseMoE(config.hidden_size, config.moe_intermediate_size, gate, shared)


class LLaDA2DecoderLayer(nn.Module):
    """Pre-norm attention and MLP over ``(hidden, residual)``, as `diffulex.models.dense.DenseDecoderLayer`."""

    def __init__(self, config: LLaDA2Config, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = LLaDA2Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = _mlp(config, index)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | UnsummedProduct, torch.Tensor]:
        parts = (self.input_layernorm, self.attention, self.post_attention_layernorm, self.mlp)
        return pre_norm_layer(*parts, hidden, residual, rope, attn_meta, readers)


class LLaDA2Model(nn.Module):
    """The ``model.`` prefix of the checkpoint."""

    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
        merge: SoftInputs | None = None,
    ) -> torch.Tensor:
        return run_decoder(
            input_ids, positions, self.word_embeddings, self.rotary_emb, self.layers, self.norm, attn_meta, readers,
            merge,
        )


class LLaDA2ForDiffusionLM(DenseForDiffusionLM):
    """``forward(input_ids [T], positions [T], attn_meta) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab_size]``. The dense families' model class with the Ling
    decoder in place of the dense one."""

    def build_decoder(self, config: LLaDA2Config) -> nn.Module:  # type: ignore[override]
        return LLaDA2Model(config)

    def token_embedding(self) -> VocabEmbedding:
        return self.model.word_embeddings


LLADA2 = register_family(
    Family(
        name="llada2",
        model=LLaDA2ForDiffusionLM,
        read_config=LLaDA2Config.from_pretrained,
        mask_token_id=156895,
        default_strategy="multi_bd",
        model_types=("llada2_moe",),
        architectures=("LLaDA2Moe",),
        aliases=("llada2_moe", "llada2_mini", "llada2_mini_dmax"),
        sampling_modes=("naive", "edit"),
    )
)
# LLaDA2.1 is trained for edit decoding only (its checkpoints say llada2_moe too: it is chosen by name).
register_family(
    dataclasses.replace(LLADA2.renamed("llada2dot1_mini"), sampling_modes=("edit",))
)
