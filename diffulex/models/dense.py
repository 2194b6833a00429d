"""The dense decoder shared by the Qwen2.5-, Qwen3- and Llama-style families (SDAR, Dream, DiffuCoder, Dream
reasoner, Stable-DiffCoder, Fast-dLLM v2).

These checkpoints differ only in a few switches: biases on q/k/v, on o, on the MLP, and per-head q/k RMSNorm
(Qwen3). `DenseArch` holds the switches and names the three layouts the published checkpoints use; each family's
model class picks its layout. Module and parameter names are the HF ones (``model.layers.N.self_attn.q_proj.weight``
...), so checkpoints and PEFT adapters load without renaming. The block-diffusion part (mask, sampler, logit shift)
lives outside the network. `add_and_norm` and `run_decoder` are the residual-stream plumbing of every family's
forward, LLaDA's (other module names, same computation) included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from diffulex.attention import Attention, AttentionMetadata
from diffulex.layers import (
    ColumnParallelLinear,
    HeadParallelLinear,
    LMHead,
    MergedProjection,
    PartialOverRanks,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    UnsummedProduct,
    VocabEmbedding,
)
from diffulex.layers.rotary import Rope
from diffulex.layers.token_inputs import embed_with_angles
from diffulex.layers.token_merge import SoftInputs
from diffulex.models.hf_config import DenseDecoderConfig


@dataclass(frozen=True)
class DenseArch:
    """Which optional parts a family's decoder has."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool = False

    @classmethod
    def qwen2(cls, config: DenseDecoderConfig) -> DenseArch:
        """Qwen2 / Qwen2.5: biases on q/k/v whatever the config says (as in the published code), none on o."""
        return cls(qkv_bias=True, o_bias=False, qk_norm=False)

    @classmethod
    def qwen3(cls, config: DenseDecoderConfig) -> DenseArch:
        """Qwen3: per-head RMSNorm of q and k; ``attention_bias`` puts biases on q/k/v and o."""
        return cls(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)

    @classmethod
    def llama(cls, config: DenseDecoderConfig) -> DenseArch:
        """Llama: ``attention_bias`` puts biases on q/k/v and o, ``mlp_bias`` on the three MLP projections."""
        bias = config.attention_bias
        return cls(qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=config.mlp_bias)


def add_and_norm(
    norm: RMSNorm, hidden: torch.Tensor | UnsummedProduct, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(hidden + residual), hidden + residual)`` with the add fused into the norm.

    Layers pass the residual stream as two tensors so that each add happens inside the next norm; before the first
    layer there is nothing to add yet (``residual`` is None) and the stream is `hidden` itself.
    """
    if residual is None:
        if isinstance(hidden, (UnsummedProduct, PartialOverRanks)):  # it becomes the residual stream, a tensor
            hidden = hidden.materialize()
        return norm(hidden), hidden
    return norm(hidden, residual)


def run_decoder(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embedding: VocabEmbedding,
    rotary: RotaryEmbedding,
    layers: Sequence[nn.Module],
    final_norm: RMSNorm,
    attn_meta: AttentionMetadata,
    readers: torch.Tensor | None = None,
    merge: SoftInputs | None = None,
) -> torch.Tensor:
    """The tokens embedded (with their rotary angles, `embed_with_angles`), through `layers` (each maps ``(hidden,
    residual, rope, attn_meta)`` to the next ``(hidden, residual)``) and the final norm: the body of every family's
    forward, whatever its module names. ``merge``: soft inputs replacing some rows' embeddings (DMax's token
    merge, `diffulex.layers.token_merge`).

    ``readers`` (device row indices, -1 for none; None: every row) names the rows of the result anyone reads. The
    last layer is handed it: its K/V are always stored, but when no row is read, the projections after its
    attention may skip their weight streams (`diffulex.layers.linear.linear`), and the result is undefined. A
    decode step that only stores a finished block (one in five at block 4, buffer 1) reads no row.
    """
    hidden, rope = embed_with_angles(embedding, rotary, input_ids, positions)
    if merge is not None:
        hidden = merge.apply(hidden, embedding)
    residual: torch.Tensor | None = None
    last = len(layers) - 1
    for index, layer in enumerate(layers):
        hidden, residual = layer(hidden, residual, rope, attn_meta, readers=readers if index == last else None)
    return add_and_norm(final_norm, hidden, residual)[0]


def pre_norm_layer(
    input_norm: RMSNorm,
    attention: nn.Module,
    post_attention_norm: RMSNorm,
    mlp: nn.Module,
    hidden: torch.Tensor | UnsummedProduct,
    residual: torch.Tensor | None,
    rope: Rope,
    attn_meta: AttentionMetadata,
    readers: torch.Tensor | None,
) -> tuple[torch.Tensor | UnsummedProduct, torch.Tensor]:
    """One pre-norm decoder layer over ``(hidden, residual)``, whatever the family calls its modules (the dense
    layouts, LLaDA2). The attention's and the MLP's outputs go straight into the next norm (the residual add
    folded in), which can sum their K splits itself: they may come unsummed."""
    hidden, residual = add_and_norm(input_norm, hidden, residual)
    hidden = attention(hidden, rope, attn_meta, unsummed=True, readers=readers)
    hidden, residual = post_attention_norm(hidden, residual)
    return mlp(hidden, unsummed=True, readers=readers), residual


def head_projections(
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bias: bool,
    fields: tuple[str, str] = ("num_attention_heads", "num_key_value_heads"),
) -> tuple[HeadParallelLinear, HeadParallelLinear, HeadParallelLinear]:
    """The q, k and v projections, their heads split across the tensor-parallel ranks (K/V heads replicated
    where the ranks outnumber them); an error names the config field (``fields``: the query and K/V head counts'
    names in the family's config.json)."""
    q = HeadParallelLinear(hidden, num_heads, head_dim, bias, fields[0])
    k = HeadParallelLinear(hidden, num_kv_heads, head_dim, bias, fields[1], replicate=True)
    v = HeadParallelLinear(hidden, num_kv_heads, head_dim, bias, fields[1], replicate=True)
    return q, k, v


class DenseAttention(nn.Module):
    """q/k/v projections, optional per-head RMSNorm of q and k, NeoX RoPE, attention, o_proj.

    The norms are this module's parameters (checkpoint names ``self_attn.q_norm.weight``), but `Attention` applies
    them together with the rotation: on CUDA that launch also writes the KV cache.
    """

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch) -> None:
        super().__init__()
        self.head_dim = hd = config.head_dim
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj, self.k_proj, self.v_proj = head_projections(hidden, heads, kv_heads, hd, arch.qkv_bias)
        # this rank's heads (all of them at TP=1; K/V heads replicated where the ranks outnumber them)
        self.num_heads, self.num_kv_heads = self.q_proj.local_heads, self.k_proj.local_heads
        self.o_proj = RowParallelLinear(heads * hd, hidden, bias=arch.o_bias)
        self.qkv = MergedProjection(self.q_proj, self.k_proj, self.v_proj, release_early=True)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, hd, scale=hd**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        attn_meta: AttentionMetadata,
        unsummed: bool = False,
        readers: torch.Tensor | None = None,
    ) -> torch.Tensor | UnsummedProduct:
        """The attention block's output; with ``unsummed`` possibly as o_proj's K splits, for a caller that hands
        it straight to a norm (`RowParallelLinear.forward_unsummed`). ``readers``: `run_decoder`."""
        T = x.shape[0]
        q, k, v = self.qkv(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # the attention layer norms and rotates q/k (writing k/v to the cache in the same launch on CUDA)
        out = self.attn(q, k, v, attn_meta, rope, self.q_norm, self.k_norm)
        return self.o_proj.forward_unsummed(out, readers) if unsummed else self.o_proj(out, readers=readers)


class DenseMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, arch.mlp_bias
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.gate_up = MergedProjection(self.gate_proj, self.up_proj)

    def forward(
        self, x: torch.Tensor, unsummed: bool = False, readers: torch.Tensor | None = None
    ) -> torch.Tensor | UnsummedProduct:
        """The MLP's output; with ``unsummed`` possibly as down_proj's K splits (see `DenseAttention.forward`).
        ``readers``: `run_decoder`."""
        act = self.gate_up.silu_mul(x, readers)
        return self.down_proj.forward_unsummed(act, readers) if unsummed else self.down_proj(act, readers=readers)


class DenseDecoderLayer(nn.Module):
    """Pre-norm block; takes and returns ``(hidden, residual)`` with the residual add folded into the next norm
    (the true stream is ``hidden + residual``; ``residual`` is None before layer 0)."""

    def __init__(self, config: DenseDecoderConfig, arch: DenseArch, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DenseAttention(config, arch)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # the dense SwiGLU, or the family's own (a mixture of experts), called the same way
        self.mlp = mlp if mlp is not None else DenseMLP(config, arch)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``readers``: `run_decoder` (the rows of this layer's output anyone reads; None: all)."""
        parts = (self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)
        return pre_norm_layer(*parts, hidden, residual, rope, attn_meta, readers)


class DenseModel(nn.Module):
    """Embedding, decoder layers and the final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(
        self,
        config: DenseDecoderConfig,
        arch: DenseArch,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """``make_mlp(layer_index)``: that layer's MLP where the family has its own, else None (the dense one)."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DenseDecoderLayer(config, arch, make_mlp(i) if make_mlp is not None else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
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
            input_ids, positions, self.embed_tokens, self.rotary_emb, self.layers, self.norm, attn_meta, readers,
            merge,
        )


class DenseForDiffusionLM(nn.Module):
    """Base of the dense families: ``forward(input_ids [T], positions [T], attn_meta) -> hidden [T, H]`` over a
    flat batch, ``compute_logits(hidden [N, H]) -> [N, vocab_size]``.

    A family's model is a subclass that says what differs in the network: `arch_for` (its layout, one of the
    `DenseArch` constructors); ``load_error_hint`` is appended to a strict loading error, to point at the family the
    checkpoint probably belongs to. What the engine must know beyond the network is the family's registration
    (`diffulex.models.family.Family`).
    """

    arch_for: ClassVar[Callable[[DenseDecoderConfig], DenseArch]]
    # Checkpoint tensors that are derived state, not weights (old HF exports saved the RoPE frequencies).
    ignored_checkpoint_keys: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)
    load_error_hint: ClassVar[str] = ""

    def __init__(self, config: DenseDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_decoder(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.token_embedding())

    def build_decoder(self, config: DenseDecoderConfig) -> nn.Module:
        """The ``model.`` part of the checkpoint: the dense decoder in the family's layout (a family with other
        module names, LLaDA2, builds its own, with the same ``forward``)."""
        return DenseModel(config, self.arch_for(config), self.make_mlp)

    def token_embedding(self) -> VocabEmbedding:
        return self.model.embed_tokens

    def make_mlp(self, layer_index: int) -> nn.Module | None:
        """The MLP of layer `layer_index` where the family's differs from the dense SwiGLU (None: the dense one)."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        readers: torch.Tensor | None = None,
        merge: SoftInputs | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]``; ``readers`` (the rows anyone reads, -1 for none; None: all) and ``merge``
        (soft inputs): see `run_decoder`."""
        return self.model(input_ids, positions, attn_meta, readers, merge)

    def compute_logits(self, hidden: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, readers)
