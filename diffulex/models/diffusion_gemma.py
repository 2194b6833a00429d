"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``, text part): a causal encoder and a canvas-denoising decoder
that share one stack of Gemma-4 MoE layers.

The encoder turns the prompt, and later every finished canvas, into per-layer K/V (`encode`); it writes no logits.
The decoder refines a canvas of ``canvas_length`` tokens (`denoise_step`): the canvas attends bidirectionally to
itself and to the encoder's K/V, reading none of it back into the cache. Its input embeddings are mixed with the
previous step's prediction (self-conditioning): the soft embedding ``softmax(previous logits) @ E * sqrt(hidden)``
goes through a gated MLP and is added to the canvas embeddings before an unscaled RMSNorm.

Per layer (both passes): pre/post-normed attention, then a dense gated MLP and a mixture of experts side by side,
each with its own post-norm, summed, post-normed again, added to the residual and scaled by ``layer_scalar``
(the encoder and decoder keep separate scalars; all other weights are shared). Attention kinds alternate:
``sliding_attention`` layers (``head_dim``, ``num_key_value_heads``, full rotary, a window) and
``full_attention`` layers (``global_head_dim``, ``num_global_key_value_heads``, rotary on a quarter of the
frequencies, no ``v_proj``: values are the key projection before its norm and rotary). Queries and keys are
RMS-normed per head, values normed without a weight, and the attention scale is 1. Every RMSNorm multiplies by
its weight ``w`` (not ``1 + w``). Logits are the tied embedding's, soft-capped by ``final_logit_softcapping``.

Window semantics follow transformers' cache: in the encoder a sliding layer's query at position ``p`` sees keys
``(p - window, p]``; in the decoder it sees the last ``window - 1`` encoded positions and the whole canvas.

Two ways to run it: the dense PyTorch path (`encode`, `denoise_step`, `denoise_hidden`: K/V as dense tensors, the
reference the tests hold to transformers), and the row path the engine's ``diffusion_gemma`` strategy runs
(`encode_rows`, `decode_rows`: the rows of many requests flattened into one batch, attention handed to a
`LayerAttention` that reads and writes the paged cache, with the Triton kernel on a GPU). Weights load under the
checkpoint's names with the strict loader (`load_diffusion_gemma`); the vision tower in the folder is skipped and
image tokens are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from diffulex.layers import ColumnParallelLinear, LMHead, RowParallelLinear, VocabEmbedding
from diffulex.layers.activation import gated, gelu_tanh
from diffulex.layers.dispatch import use_fused_kernels
from diffulex.layers.linear import HeadParallelLinear, MergedProjection
from diffulex.layers.moe import (
    ExpertLayer,
    GatedMLP,
    ScaledSoftmaxRouter,
    fused_experts_win,
    grouped_expert_slots,
    grouped_mm_supported,
    weighted_slots,
)
from diffulex.layers.norm import gemma_rms_norm
from diffulex.layers.parallel_state import (
    SINGLE_RANK,
    expert_parallel_group,
    tensor_parallel_group,
    using_tensor_parallel_group,
)
from diffulex.layers.rotary import apply_rotary
from diffulex.models.diffusion_gemma_config import DiffusionGemmaConfig, LayerGeometry, RopeSpec
from diffulex.models.family import Family, register_family
from diffulex.models.loader import load_checkpoint, materialize, resolve_dtype

# One layer's attention on the row path: ``(layer index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], needs output)``
# -> ``[T, H, D]`` (None when no output is needed: the encoder's last layer only stores its K/V).
LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, bool], "torch.Tensor | None"]

# Checkpoint tensors of the vision tower and its projection into the text model: present in the folder, unused.
VISION_CHECKPOINT_KEYS = (r"^model\.encoder\.vision_tower\.", r"^model\.encoder\.embed_vision\.")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by its weight ``w`` (ones at init), or unscaled (``with_scale=False``: no parameter), with
    Gemma's rounding; ``plus`` is added to the input first and ``then_add`` to the result (`gemma_rms_norm`)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(
        self, x: torch.Tensor, plus: torch.Tensor | None = None, then_add: torch.Tensor | None = None
    ) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps, plus, then_add)


def rotary_inv_freq(spec: RopeSpec, head_dim: int, device: torch.device) -> torch.Tensor:
    """``[head_dim / 2]`` angular frequencies. ``proportional`` keeps exponents over the whole ``head_dim`` for its
    rotated pairs and gives the rest frequency 0 (cos 1, sin 0: passed through unchanged)."""
    if spec.rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        return 1.0 / (spec.theta**exponents)
    rotated = int(spec.partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = torch.zeros(head_dim // 2, dtype=torch.float32, device=device)
    inv_freq[:rotated] = 1.0 / (spec.theta**exponents)
    return inv_freq / spec.factor


def rotary_angles(spec: RopeSpec, head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[n, head_dim / 2]`` float32, for integer ``positions [n]``."""
    angles = positions.float()[:, None] * rotary_inv_freq(spec, head_dim, positions.device)[None, :]
    return angles.cos(), angles.sin()


@dataclass(frozen=True)
class EncoderKV:
    """What the encoder hands the decoder: per layer the keys and values ``[batch, kept, kv_heads, head_dim]`` of
    the last ``kept`` of the ``length`` encoded positions (all of them for full-attention layers, at most
    ``window - 1`` for sliding ones, which is all any later query of that layer can see). Immutable: `encode`
    returns a new one, so a finished canvas can be appended without touching what other callers hold."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    length: int

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]


def _sliding_causal_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """``[n_query, n_key]`` bool, True where the query may attend: causal, and within ``window`` when given."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def _ragged_context(
    context_keys: list[torch.Tensor], context_values: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's context K/V (``[1, S_b, kv_heads, head_dim]``) followed by its canvas K/V (``[B, C, ...]``) as
    one batch ``[B, max S_b + C, ...]``, and the ``[B, 1, C, max S_b + C]`` mask that hides each row's padding
    (None when every row's context has the same length: nothing is padded)."""
    B, C = keys.shape[:2]
    lengths = [k.shape[1] for k in context_keys]
    longest = max(lengths)
    if all(n == longest for n in lengths):
        joined_keys = torch.cat([torch.cat(context_keys), keys], dim=1)
        return joined_keys, torch.cat([torch.cat(context_values), values], dim=1), None
    shape = (B, longest + C, *keys.shape[2:])
    all_keys, all_values = keys.new_zeros(shape), values.new_zeros(shape)
    mask = torch.ones(B, 1, C, longest + C, dtype=torch.bool, device=keys.device)
    for row, n in enumerate(lengths):
        all_keys[row, :n], all_values[row, :n] = context_keys[row][0], context_values[row][0]
        mask[row, :, :, n:longest] = False
    all_keys[:, longest:], all_values[:, longest:] = keys, values
    return all_keys, all_values, mask


class GemmaAttention(nn.Module):
    """One layer's attention; which kind (sliding or full) and its head geometry come from `LayerGeometry`.

    Under tensor parallelism each rank holds its slice of the query heads and the K/V heads they read (a K/V head
    replicated on whole ranks where there are fewer than ranks, as in the global layers); ``num_heads`` and
    ``num_kv_heads`` are this rank's, and `o_proj` sums the ranks' products."""

    def __init__(self, config: DiffusionGemmaConfig, geometry: LayerGeometry) -> None:
        super().__init__()
        hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, geometry.head_dim
        self.is_sliding = geometry.is_sliding
        self.eps = config.rms_norm_eps
        kv_field = "num_key_value_heads" if self.is_sliding else "num_global_key_value_heads"
        self.q_proj = HeadParallelLinear(hidden, heads, head_dim, False, "num_attention_heads")
        self.k_proj = HeadParallelLinear(hidden, geometry.num_kv_heads, head_dim, False, kv_field, replicate=True)
        self.v_proj = (
            HeadParallelLinear(hidden, geometry.num_kv_heads, head_dim, False, kv_field, replicate=True)
            if self.is_sliding
            else None
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.q_proj.local_heads, self.k_proj.local_heads, head_dim
        projections = (self.q_proj, self.k_proj) if self.v_proj is None else (self.q_proj, self.k_proj, self.v_proj)
        self.qkv = MergedProjection(*projections, release_early=True)  # one launch once loaded
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, self.eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, self.eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, n, hidden]`` -> ``q [B, n, H, D]``, ``k, v [B, n, Hkv, D]``, rotated and normed (on CUDA in one
        launch after the projections, `diffulex.kernels.gemma_norm.gemma_attention_inputs`; about thirty here)."""
        B, n, _ = x.shape
        q_raw, k_raw, *rest = self.qkv(x)
        q_raw = q_raw.view(B, n, self.num_heads, self.head_dim)
        k_raw = k_raw.view(B, n, self.num_kv_heads, self.head_dim)
        v_proj = rest[0].view(B, n, self.num_kv_heads, self.head_dim) if rest else None
        if use_fused_kernels(q_raw, k_raw, v_proj, cos, sin, self.q_norm.weight, self.k_norm.weight):
            from diffulex.kernels.gemma_norm import gemma_attention_inputs

            flat = [None if t is None else t.view(B * n, *t.shape[2:]) for t in (q_raw, k_raw, v_proj)]
            q, k, v = gemma_attention_inputs(*flat, self.q_norm.weight, self.k_norm.weight, self.eps, cos, sin)
            return q.view(q_raw.shape), k.view(k_raw.shape), v.view(k_raw.shape)
        q = self.q_norm(q_raw)
        v_raw = k_raw if v_proj is None else v_proj
        k = self.k_norm(k_raw)
        v = gemma_rms_norm(v_raw, None, self.eps)
        q = apply_rotary(q.view(B * n, self.num_heads, self.head_dim), cos.repeat(B, 1), sin.repeat(B, 1))
        k = apply_rotary(k.reshape(B * n, self.num_kv_heads, self.head_dim), cos.repeat(B, 1), sin.repeat(B, 1))
        return q.view(B, n, self.num_heads, self.head_dim), k.view(B, n, self.num_kv_heads, self.head_dim), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Dense attention, scale 1 (the q/k norms set the logits' scale); ``mask [n, S]`` True = visible."""
        B, n = q.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        keys = k.transpose(1, 2).repeat_interleave(groups, dim=1)
        values = v.transpose(1, 2).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=1.0)
        return self.output(out.transpose(1, 2))

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """``[..., H, D]`` attention output -> ``[..., hidden]``."""
        return self.o_proj(heads.reshape(*heads.shape[:-2], self.num_heads * self.head_dim))


class StackedExperts(ExpertLayer):
    """The experts as the checkpoint stores them, stacked: ``gate_up_proj [E, 2 * inter, hidden]`` (gate rows,
    then up rows) and ``down_proj [E, hidden, inter]``; each a gelu-tanh gated MLP of ``top_k`` chosen per row.

    Four ways to compute the same sum (`diffulex.layers.moe.MOE_IMPLS`), chosen per input unless ``impl`` is set:
    ``loop`` (the CPU) is the exact path (each chosen expert over its own tokens, accumulated in expert order as
    transformers does); it asks the host which experts were chosen, so no CUDA graph can capture it. On CUDA:
    ``fused``, the Triton kernels of `diffulex.kernels.fused_moe` with GELU-tanh in the gate_up epilogue, which
    stream each selected expert's weights once per row tile, for bf16/fp16 steps of the rows where they beat the
    grouped GEMM (`diffulex.layers.moe.fused_experts_win`: up to 8 canvases of 256 rows at the 26B-A4B geometry);
    ``grouped`` (bfloat16 on compute capability 9.0+) for larger steps, the grouped GEMM the SDAR-MoE and LLaDA2
    families run (`diffulex.layers.moe`): the (token, slot) pairs sorted by expert, each expert's weights read once
    for its rows; otherwise ``dense``, every expert over every token weighted by the routing (static shapes, for
    small test models in float32). The three are capturable; they sum the slots in slot order, which differs from
    ``loop`` by rounding only (``fused`` rounds each expert's output and its activation as ``grouped`` does).

    Split over ranks as `diffulex.layers.moe.SparseMoE` is: under expert parallelism this rank holds its contiguous
    range of whole experts (``owned``, global indices) and the pairs routed elsewhere are left out; otherwise
    tensor parallelism gives each rank its slice of every expert's intermediate width. Either way each rank's sum
    is partial and one all-reduce adds the ranks'. The stacked checkpoint tensors load through `weight_loader`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.ep = expert_parallel_group()
        self.owned = self.ep.owned_experts(num_experts)
        # experts that expert parallelism places whole on one rank; otherwise each split over the TP ranks
        self.tp = tensor_parallel_group() if self.ep.size == 1 else SINGLE_RANK
        self.inter_start, local_inter = self.tp.shard(intermediate_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.owned), 2 * local_inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(self.owned), hidden_size, local_inter))
        self.impl: str | None = None  # None: chosen per input (`impl_for`)

    def impl_for(self, x: torch.Tensor) -> str:
        if self.impl is not None:
            return self.impl
        if not x.is_cuda:
            return "loop"
        hidden, inter = self.down_proj.shape[1], self.down_proj.shape[2]
        if fused_experts_win(x, self.top_k, self.num_experts, hidden, inter):
            return "fused"
        return "grouped" if grouped_mm_supported(x) else "dense"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, ``weights [T, k]`` (float32), ``experts [T, k]`` (global indices) -> ``[T, hidden]``,
        summed over the ranks."""
        out = self._weighted_sum(self.impl_for(x), x, weights, experts)
        return self.ep.all_reduce(self.tp.all_reduce(out))  # at most one of the two spans several ranks

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's experts, and its slice of their intermediate width, of the checkpoint's whole stacked
        tensor into ``param``."""
        if tuple(loaded.shape) != self.checkpoint_shape(param):
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor of shape {tuple(loaded.shape)} must have shape "
                f"{self.checkpoint_shape(param)}"
            )
        mine = loaded[self.owned.start : self.owned.stop]
        start, length = self.inter_start, self.down_proj.shape[2]
        if param is self.gate_up_proj:  # the gate rows' slice, then the up rows'
            up = self.intermediate_size + start
            mine = torch.cat([mine[:, start : start + length], mine[:, up : up + length]], dim=1)
        else:
            mine = mine[:, :, start : start + length]
        with torch.no_grad():
            param.copy_(mine)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The whole stacked tensor's shape (every expert, the whole width)."""
        if param is self.gate_up_proj:
            return (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        return (self.num_experts, self.hidden_size, self.intermediate_size)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        local, _ = self._local_experts(experts)
        out = torch.zeros_like(x)
        for e in local.unique().tolist():
            if not 0 <= e < len(self.owned):
                continue
            token, slot = torch.where(local == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(gelu_tanh(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The fused Triton kernels over the stacked weights (on the CPU only under the Triton interpreter); they
        skip the pairs of another rank's experts."""
        from diffulex.kernels.fused_moe import fused_moe

        local, _ = self._local_experts(experts)
        return fused_moe(x, weights, local, self.gate_up_proj, self.down_proj, activation="gelu_tanh")

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        local, mine = self._local_experts(experts)
        per_slot = grouped_expert_slots(x, local, mine, len(self.owned), self.gate_up_proj, self.down_proj, gelu_tanh)
        return weighted_slots(per_slot, weights, x.dtype)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        local, _ = self._local_experts(experts)
        per_slot = torch.zeros(x.shape[0], local.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        for e in range(len(self.owned)):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(gelu_tanh(gate) * up, self.down_proj[e])
            chosen = (local == e).to(x.dtype)  # [T, k]: at most one slot per token holds e
            per_slot += chosen[:, :, None] * y[:, None, :]
        return weighted_slots(per_slot, weights, x.dtype)


class DiffusionGemmaLayer(nn.Module):
    """One layer, under the checkpoint's names (``model.decoder.layers.N.*``); the encoder runs the same module
    with its own ``layer_scalar``."""

    def __init__(self, config: DiffusionGemmaConfig, geometry: LayerGeometry) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, geometry)
        self.mlp = GatedMLP(hidden, config.intermediate_size, activation=gelu_tanh, merge_gate_up=True)
        self.router = ScaledSoftmaxRouter(hidden, config.num_experts, config.top_k_experts, eps)
        self.experts = StackedExperts(config.num_experts, hidden, config.moe_intermediate_size, config.top_k_experts)
        for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
            "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2",
        ):  # fmt: skip
            self.add_module(name, GemmaRMSNorm(hidden, eps))
        self.register_buffer("layer_scalar", torch.ones(1))

    def attention_inputs(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(h), cos, sin)

    def finish(
        self, h: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
        mask: torch.Tensor | None, layer_scalar: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The rest of the layer once the visible keys/values are known: attention, the two MLPs, the scalar."""
        return self.after_attention(h, self.self_attn.attend(q, keys, values, mask), layer_scalar)

    def after_attention(self, h: torch.Tensor, attn: torch.Tensor, layer_scalar: torch.Tensor) -> torch.Tensor:
        """The layer after its attention output ``attn`` (``h``'s shape): the two MLPs, the norms, the scalar."""
        residual = self.post_attention_layernorm(attn, then_add=h)
        flat = residual.reshape(-1, residual.shape[-1])
        pre_dense, pre_experts, post_dense, post_experts, post = (
            self.pre_feedforward_layernorm, self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_1,
            self.post_feedforward_layernorm_2, self.post_feedforward_layernorm,
        )  # fmt: skip
        # on CUDA the norms around the two MLPs are two launches (`kernels.gemma_norm`); about ten here
        fused = use_fused_kernels(flat, layer_scalar)
        if fused:
            from diffulex.kernels.gemma_norm import gemma_mlp_inputs, gemma_mlp_outputs

            dense_in, experts_in, router_in = gemma_mlp_inputs(flat, pre_dense.weight, pre_experts.weight,
                                                               self.router.scale, self.router.input_scale, post.eps)
        else:
            dense_in, experts_in, router_in = pre_dense(flat), pre_experts(flat), self.router.inputs(flat)
        dense = self.mlp(dense_in)
        weights, experts = self.router.choose(router_in)
        routed = self.experts(experts_in, weights, experts)
        if fused:
            out = gemma_mlp_outputs(dense, routed, flat, post_dense.weight, post_experts.weight, post.weight,
                                    layer_scalar, post.eps)  # fmt: skip
            return out.view(residual.shape)
        out = post(post_dense(dense), plus=post_experts(routed), then_add=flat)
        return (out * layer_scalar).view(residual.shape)


class SelfConditioning(nn.Module):
    """Mixes the previous step's soft prediction into the canvas embeddings:
    ``post_norm(e + down(gelu_tanh(gate(pre_norm(s))) * up(pre_norm(s))))``, ``post_norm`` without a weight."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.eps = eps
        self.pre_norm = GemmaRMSNorm(hidden, eps)
        self.gate_proj = ColumnParallelLinear(hidden, config.intermediate_size, bias=False)
        self.up_proj = ColumnParallelLinear(hidden, config.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, bias=False)

    def forward(self, embeds: torch.Tensor, soft_embeds: torch.Tensor | None) -> torch.Tensor:
        """``soft_embeds`` None: no previous prediction (first step); the MLP of zeros is zero, so it is skipped."""
        if soft_embeds is None:
            return gemma_rms_norm(embeds, None, self.eps)
        s = self.pre_norm(soft_embeds)
        mixed = self.down_proj(gated(gelu_tanh, self.gate_proj(s), self.up_proj(s)))
        return gemma_rms_norm(embeds, None, self.eps, plus=mixed)


class DiffusionGemmaDecoder(nn.Module):
    """``model.decoder``: the token embedding, the layer stack, the final norm and the self-conditioning block
    (every text weight of the checkpoint).

    The embedding is whole on every rank, not split by vocabulary: the canvas rule, which rank 0 alone runs,
    mixes rows of all of it (the self-conditioning input ``softmax(logits) @ E``), and the LM head tied to it then
    needs no gather either (`diffulex.strategy.diffusion_gemma.runner`)."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        with using_tensor_parallel_group(SINGLE_RANK):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DiffusionGemmaLayer(config, geometry) for geometry in config.layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)


class LayerScalar(nn.Module):
    """The encoder's own ``layer_scalar`` of one layer (its other weights are the decoder's)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("layer_scalar", torch.ones(1))


class EncoderLayerScalars(nn.Module):
    """``model.encoder.language_model``: the checkpoint keeps only the encoder's layer scalars under it."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LayerScalar() for _ in range(num_layers))


class DiffusionGemmaEncoder(nn.Module):
    """``model.encoder``."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.language_model = EncoderLayerScalars(config.num_hidden_layers)


class DiffusionGemmaModel(nn.Module):
    """``model.``; the decoder is registered first so that its names own the shared weights."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.decoder = DiffusionGemmaDecoder(config)
        self.encoder = DiffusionGemmaEncoder(config)


class DiffusionGemmaForDiffusionLM(nn.Module):
    """``encode(prompt ids) -> EncoderKV`` and ``denoise_step(canvas ids, EncoderKV, previous logits) -> logits``.

    `encode` and `denoise_step` take rows of equal length (one `EncoderKV` per batch); `denoise_hidden` batches
    canvases whose contexts differ in length. `encode_rows` and `decode_rows` are the engine's row path (module
    docstring)."""

    ignored_checkpoint_keys = VISION_CHECKPOINT_KEYS
    load_error_hint = "a DiffusionGemmaForBlockDiffusion checkpoint keeps its text weights under model.decoder."

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DiffusionGemmaModel(config)
        with using_tensor_parallel_group(SINGLE_RANK):  # tied to the whole embedding (`DiffusionGemmaDecoder`)
            self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.lm_head.tie_to(self.model.decoder.embed_tokens)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.decoder.layers

    def check_token_ids(self, ids: torch.Tensor, field: str) -> None:
        """Refuse ids outside the vocabulary, and image placeholders (only text inputs are supported)."""
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{field} must be an integer tensor [batch, length], got {ids.dtype} {list(ids.shape)}")
        image = self.config.image_token_id
        if image is not None and bool((ids == image).any()):
            raise ValueError(
                f"{field} contains image_token_id {image}: image inputs are not supported (text only; the "
                "checkpoint's vision tower is not loaded)"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"{field} must hold token ids in [0, {self.config.vocab_size}), got values in "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.decoder.embed_tokens.weight
        return self.model.decoder.embed_tokens(ids) * self._embed_scale(weight.dtype)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """``sqrt(hidden)`` rounded to the model dtype first, as the checkpoint was trained with; a Python number
        (exactly that rounded value), so that no tensor is made from the host inside a captured CUDA graph."""
        return torch.tensor(self.config.hidden_size**0.5, dtype=dtype).item()

    def _angles(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        head_dims = {g.layer_type: g.head_dim for g in self.config.layers}
        return {kind: rotary_angles(self.config.rope[kind], dim, positions) for kind, dim in head_dims.items()}

    @torch.no_grad()
    def encode(
        self, input_ids: torch.Tensor, context: EncoderKV | None = None, keep_all_positions: bool = False
    ) -> EncoderKV:
        """Run the causal encoder over ``input_ids [B, n]`` (positions continue after `context`) and return the
        K/V of everything encoded so far. The encoder's hidden states past the last layer's K/V are never
        needed, so the last layer stops after its projections.

        Sliding layers keep only the last ``window - 1`` positions, unless ``keep_all_positions`` (a paged cache
        stores every position, since a later request sharing a prefix reads the window before its own start)."""
        self.check_token_ids(input_ids, "input_ids")
        B, n = input_ids.shape
        if n == 0:
            raise ValueError("input_ids has no tokens: the encoder needs at least one position per row")
        if context is not None and context.batch_size != B:
            raise ValueError(f"input_ids has {B} rows but the encoder context holds {context.batch_size}")
        start = context.length if context is not None else 0
        device = input_ids.device
        positions = torch.arange(start, start + n, device=device)
        angles = self._angles(positions)
        window = self.config.sliding_window
        scalars = self.model.encoder.language_model.layers
        h = self.embed(input_ids)
        keys, values = [], []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(h, *angles[self.config.layers[i].layer_type])
            if context is not None:
                k = torch.cat([context.keys[i], k], dim=1)
                v = torch.cat([context.values[i], v], dim=1)
            kept = window - 1 if layer.self_attn.is_sliding and not keep_all_positions else k.shape[1]
            keys.append(k[:, -kept:] if kept > 0 else k[:, :0])
            values.append(v[:, -kept:] if kept > 0 else v[:, :0])
            if i == last:
                break
            key_positions = torch.arange(start + n - k.shape[1], start + n, device=device)
            mask = _sliding_causal_mask(positions, key_positions, window if layer.self_attn.is_sliding else None)
            h = layer.finish(h, q, k, v, mask, scalars[i].layer_scalar)
        return EncoderKV(tuple(keys), tuple(values), start + n)

    def soft_embeddings(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``softmax(logits) @ E * sqrt(hidden)`` (softmax in float32); rows where ``mask [B]`` is False are 0."""
        weight = self.model.decoder.embed_tokens.weight
        soft = self.probs_soft_embeddings(logits.softmax(dim=-1, dtype=torch.float32).to(weight.dtype))
        if mask is not None:
            soft = soft * mask.to(soft.dtype)[:, None, None]
        return soft

    def probs_soft_embeddings(self, probs: torch.Tensor) -> torch.Tensor:
        """`soft_embeddings` from the probabilities, already in the model dtype: the canvas rule computes them
        with its own sampling pass (`diffulex.kernels.canvas_sampling`)."""
        weight = self.model.decoder.embed_tokens.weight
        return torch.matmul(probs, weight) * self._embed_scale(weight.dtype)

    @torch.no_grad()
    def denoise_step(
        self,
        canvas_ids: torch.Tensor,
        context: EncoderKV,
        self_conditioning_logits: torch.Tensor | None = None,
        self_conditioning_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder pass: ``canvas_ids [B, canvas_length]`` -> soft-capped logits ``[B, canvas_length, vocab]``
        float32.

        ``self_conditioning_logits [B, canvas_length, vocab]``: the logits the previous step sampled from (after
        its temperature; ``-inf`` entries allowed, so a one-hot row is ``0`` at the token and ``-inf`` elsewhere),
        None on a canvas's first step. ``self_conditioning_mask [B]`` bool: rows with False are treated as first
        steps (their logits are ignored), so canvases at different steps can share a batch."""
        self.check_token_ids(canvas_ids, "canvas_ids")
        B, C = canvas_ids.shape
        if C != self.config.canvas_length:
            raise ValueError(
                f"canvas_ids has {C} positions per row; the checkpoint's canvas_length is {self.config.canvas_length}"
            )
        if context.batch_size != B:
            raise ValueError(f"canvas_ids has {B} rows but the encoder context holds {context.batch_size}")
        soft = None
        if self_conditioning_logits is not None:
            expected = (B, C, self.config.vocab_size)
            if tuple(self_conditioning_logits.shape) != expected:
                raise ValueError(
                    f"self_conditioning_logits must have shape {list(expected)}, got "
                    f"{list(self_conditioning_logits.shape)}"
                )
            if self_conditioning_mask is not None and (
                self_conditioning_mask.dtype != torch.bool or tuple(self_conditioning_mask.shape) != (B,)
            ):
                raise ValueError(
                    f"self_conditioning_mask must be a bool tensor of shape [{B}], got "
                    f"{self_conditioning_mask.dtype} {list(self_conditioning_mask.shape)}"
                )
            soft = self.soft_embeddings(self_conditioning_logits, self_conditioning_mask)
        h = self.model.decoder.self_conditioning(self.embed(canvas_ids), soft)
        positions = torch.arange(context.length, context.length + C, device=canvas_ids.device)
        angles = self._angles(positions)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(h, *angles[self.config.layers[i].layer_type])
            keys = torch.cat([context.keys[i], k], dim=1)
            values = torch.cat([context.values[i], v], dim=1)
            h = layer.finish(h, q, keys, values, None, layer.layer_scalar)
        return self.logits(self.model.decoder.norm(h))

    def token_soft_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """`soft_embeddings` of logits that are one-hot at ``tokens`` (a temperature-0 step's prediction): the
        embedding rows times ``sqrt(hidden)``, without the vocabulary-wide softmax. Bit for bit the same: the
        product of a one-hot row with ``E`` adds exact zeros to the one selected row."""
        weight = self.model.decoder.embed_tokens.weight
        return weight[tokens] * self._embed_scale(weight.dtype)

    @torch.no_grad()
    def denoise_hidden(
        self,
        canvas_ids: torch.Tensor,
        contexts: Sequence[EncoderKV],
        soft_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder pass over the canvases of several requests, each after its own encoded context: row ``b``
        of ``canvas_ids [B, canvas_length]`` attends to ``contexts[b]`` (a one-row `EncoderKV` of any length) and
        to its own canvas. Returns the final-normed hidden states ``[B, canvas_length, hidden]``; `logits` turns
        them into logits, one request at a time if memory asks for it.

        ``soft_embeds [B, canvas_length, hidden]``: each row's self-conditioning input (`soft_embeddings` of its
        previous step's logits); a row of zeros is a canvas's first step (the self-conditioning MLP of zeros adds
        exactly zero), None: every row's first step. Contexts of different lengths are padded between the
        context and the canvas, and the padding is masked; equal lengths need no mask, as in `denoise_step`."""
        self.check_token_ids(canvas_ids, "canvas_ids")
        B, C = canvas_ids.shape
        if C != self.config.canvas_length:
            raise ValueError(
                f"canvas_ids has {C} positions per row; the checkpoint's canvas_length is {self.config.canvas_length}"
            )
        if len(contexts) != B or any(context.batch_size != 1 for context in contexts):
            raise ValueError(f"canvas_ids has {B} rows: denoise_hidden needs {B} one-row encoder contexts")
        if soft_embeds is not None and tuple(soft_embeds.shape) != (B, C, self.config.hidden_size):
            raise ValueError(
                f"soft_embeds must have shape {[B, C, self.config.hidden_size]}, got {list(soft_embeds.shape)}"
            )
        device = canvas_ids.device
        h = self.model.decoder.self_conditioning(self.embed(canvas_ids), soft_embeds)
        offsets = torch.arange(C, device=device)
        positions = torch.cat([offsets + context.length for context in contexts])
        angles = self._angles(positions)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(h.reshape(1, B * C, -1), *angles[self.config.layers[i].layer_type])
            q, k, v = q.view(B, C, *q.shape[2:]), k.view(B, C, *k.shape[2:]), v.view(B, C, *v.shape[2:])
            keys, values, mask = _ragged_context(
                [context.keys[i] for context in contexts], [context.values[i] for context in contexts], k, v
            )
            h = layer.finish(h, q, keys, values, mask, layer.layer_scalar)
        return self.model.decoder.norm(h)

    @torch.no_grad()
    def encode_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention) -> None:
        """The causal encoder over ``input_ids [T]`` at ``positions [T]``: the pieces of several requests, flattened.
        Which keys each row sees, and where its K/V is kept, is ``attention``'s (the engine's paged cache); the
        last layer stops once its K/V is handed over. The ids must have been checked (`check_token_ids`)."""
        h = self.embed(input_ids[None])
        angles = self._angles(positions)
        scalars = self.model.encoder.language_model.layers
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(h, *angles[self.config.layers[i].layer_type])
            out = attention(i, q[0], k[0], v[0], i != last)
            if out is None:
                break
            h = layer.after_attention(h, layer.self_attn.output(out)[None], scalars[i].layer_scalar)

    @torch.no_grad()
    def decode_rows(
        self,
        canvas_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        soft_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`denoise_hidden` on the row path: ``canvas_ids [B, canvas_length]`` at ``positions [B * canvas_length]``,
        attention over each canvas's context left to ``attention``. Returns the final-normed hidden states
        ``[B, canvas_length, hidden]``. No host reads: a CUDA graph captures it (the ids are the runner's own
        draws, always in range)."""
        B, C = canvas_ids.shape
        h = self.model.decoder.self_conditioning(self.embed(canvas_ids), soft_embeds)
        angles = self._angles(positions)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(h.reshape(1, B * C, -1), *angles[self.config.layers[i].layer_type])
            out = attention(i, q[0], k[0], v[0], True)
            h = layer.after_attention(h, layer.self_attn.output(out).view(B, C, -1), layer.layer_scalar)
        return self.model.decoder.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head in the model dtype, then float32 and ``cap * tanh(logits / cap)``."""
        product = F.linear(hidden, self.lm_head.weight)
        cap = self.config.final_logit_softcapping
        if cap is not None and use_fused_kernels(product):  # one pass over the logits (`kernels.logit_softcap`)
            from diffulex.kernels.logit_softcap import softcapped_logits

            return softcapped_logits(product, cap)
        logits = product.float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def load_diffusion_gemma(
    model_dir: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu"
) -> DiffusionGemmaForDiffusionLM:
    """Build the model of a ``DiffusionGemmaForBlockDiffusion`` folder and load its weights strictly (every text
    tensor used, none missing; the vision tower skipped). Reads only ``config.json`` and ``.safetensors`` files:
    nothing in the folder is executed. Built on the meta device, so no memory goes to a random init."""
    config = DiffusionGemmaConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = DiffusionGemmaForDiffusionLM(config)
    model.to(torch_dtype)
    materialize(model, device)
    load_checkpoint(model, model_dir)
    return model.eval()


CANVAS_SIZE = 256  # tokens of the canvas DiffusionGemma denoises as a whole

register_family(
    Family(
        name="diffusion_gemma",
        model=DiffusionGemmaForDiffusionLM,
        read_config=DiffusionGemmaConfig.from_pretrained,
        mask_token_id=None,
        default_strategy="diffusion_gemma",
        model_types=("diffusion_gemma",),
        architectures=("DiffusionGemma",),
        strategies=("diffusion_gemma",),
        canvas_size=CANVAS_SIZE,
    )
)

__all__ = ["DiffusionGemmaForDiffusionLM", "EncoderKV", "load_diffusion_gemma"]
