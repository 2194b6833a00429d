"""The block-diffusion training objective on the engine's own SDAR module.

The network trained is `diffulex.models.sdar.SDARForDiffusionLM` itself (same parameter names as the shipped
checkpoint). Its inference forward takes one flat sequence; `train_forward` here is a batched path over the
same submodules and weights (``[B, S]`` tokens, one position vector shared by the batch, a ``[B, 1, S, S]``
boolean attention mask, PyTorch SDPA), for training only.

Objective (BD3-LM / SDAR style, see docs/training.md): a sequence ``x0`` of length ``T`` (a multiple of the
block size) becomes the ``2T`` input ``[x_t ; x0]``: a noisy copy, where each block masks its answer positions
with its own rate ``t ~ U(eps, 1)``, followed by the clean copy. Both copies use positions ``0 .. T-1``.
Blocks are grouped into *windows* of ``w`` consecutive blocks (``w = 1`` for plain block diffusion):

* a noisy block attends to the noisy blocks of its window up to itself (bidirectionally inside itself) and to
  the clean blocks before its window;
* a clean block attends to the clean blocks up to itself (block-causal), never to the noisy copy.

With ``w >= 2`` (multi-block teacher forcing) a block is predicted while the blocks before it in the window
are still partially masked (at a smaller rate), which is exactly what the engine's running set of
``buffer_size >= 2`` blocks shows the model. The loss is the cross entropy of the masked positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffulex.layers import apply_rotary
from diffulex.models.hf_config import SDARConfig
from diffulex.models.sdar import SDARAttention, SDARForDiffusionLM


def build_model(config: SDARConfig, seed: int = 0) -> SDARForDiffusionLM:
    """A freshly initialized SDAR model (normal(0, 0.02) matrices, output projections scaled down by depth,
    norms at 1)."""
    torch.manual_seed(seed)
    model = SDARForDiffusionLM(config)
    depth_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        elif p.dim() == 2:
            std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            nn.init.normal_(p, std=std)
        else:
            nn.init.zeros_(p)
    return model


def _attention(attn: SDARAttention, x: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
    B, S, _ = x.shape
    hd = attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(B, S, attn.num_heads, hd))
    k = attn.k_norm(attn.k_proj(x).view(B, S, attn.num_kv_heads, hd))
    v = attn.v_proj(x).view(B, S, attn.num_kv_heads, hd)
    cos, sin = rope  # [S, hd / 2]: broadcast over the batch and the heads
    q = apply_rotary(q, cos, sin).transpose(1, 2)
    k = apply_rotary(k, cos, sin).transpose(1, 2)
    v = v.transpose(1, 2)
    groups = attn.num_heads // attn.num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, attn.num_heads * hd))


def train_forward(
    model: SDARForDiffusionLM, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Hidden states ``[B, S, hidden]`` of ``input_ids [B, S]`` at ``positions [S]`` under ``mask [B, 1, S, S]``
    (True = may attend); the same computation as the model's inference forward, batched."""
    m = model.model
    hidden = m.embed_tokens(input_ids)
    rope = m.rotary_emb(positions)
    residual = None
    for layer in m.layers:
        if residual is None:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        hidden = _attention(layer.self_attn, hidden, rope, mask)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    hidden, _ = m.norm(hidden, residual)
    return hidden


def window_groups(num_blocks: int, windows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Window id of every block: ``(block + offset) // w`` per example -> ``[B, num_blocks]`` (non-decreasing)."""
    blocks = torch.arange(num_blocks, device=windows.device)
    return (blocks[None, :] + offsets[:, None]) // windows[:, None]


def build_train_mask(T: int, block_size: int, groups: torch.Tensor) -> torch.Tensor:
    """The ``[B, 1, 2T, 2T]`` attention mask of ``[x_t ; x0]`` for window ids ``groups [B, T / block_size]``."""
    device = groups.device
    blk = torch.arange(T, device=device) // block_size
    g = groups[:, blk]  # [B, T] window of every position
    causal = blk[None, :] <= blk[:, None]  # [T(q), T(k)] block-causal
    same_window = g[:, :, None] == g[:, None, :]
    noisy_noisy = same_window & causal[None]
    noisy_clean = g[:, None, :] < g[:, :, None]
    clean_clean = causal[None].expand_as(noisy_noisy)
    clean_noisy = torch.zeros_like(noisy_noisy)
    top = torch.cat([noisy_noisy, noisy_clean], dim=2)
    bottom = torch.cat([clean_noisy, clean_clean], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]


def noise_batch(
    x0: torch.Tensor,
    prompt_len: torch.Tensor,
    block_size: int,
    mask_id: int,
    generator: torch.Generator,
    *,
    eps: float = 0.05,
    window_probs: tuple[float, ...] = (0.5, 0.3, 0.1, 0.1),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample windows and masks for clean tokens ``x0 [B, T]``.

    Returns ``(x_t [B, T], masked [B, T] bool, groups [B, T / block_size])``. ``window_probs[i]`` is the
    probability of windows of ``i + 1`` blocks. Each block's rate is ``U(eps, 1)``; inside a window every block
    but the newest has its rate multiplied by ``U(0, 1)`` (older blocks of the engine's running set are further
    along). Positions before ``prompt_len`` are never masked.
    """
    B, T = x0.shape
    device = x0.device
    n = T // block_size
    probs = torch.tensor(window_probs, dtype=torch.float)
    windows = (torch.multinomial(probs, B, replacement=True, generator=generator) + 1).to(device)
    offsets = (torch.rand(B, generator=generator) * windows.cpu()).long().to(device)
    groups = window_groups(n, windows, offsets)
    rates = eps + (1 - eps) * torch.rand(B, n, generator=generator).to(device)
    newest = torch.ones_like(groups, dtype=torch.bool)
    newest[:, :-1] = groups[:, 1:] != groups[:, :-1]
    shrink = torch.rand(B, n, generator=generator).to(device)
    rates = torch.where(newest, rates, rates * shrink)
    blk = torch.arange(T, device=device) // block_size
    u = torch.rand(B, T, generator=generator).to(device)
    pos = torch.arange(T, device=device)
    masked = (u < rates[:, blk]) & (pos[None, :] >= prompt_len[:, None])
    x_t = torch.where(masked, torch.full_like(x0, mask_id), x0)
    return x_t, masked, groups


def diffusion_loss(
    model: SDARForDiffusionLM,
    x0: torch.Tensor,
    prompt_len: torch.Tensor,
    real_len: torch.Tensor,
    block_size: int,
    mask_id: int,
    generator: torch.Generator,
    *,
    pad_weight: float = 0.3,
    window_probs: tuple[float, ...] = (0.5, 0.3, 0.1, 0.1),
) -> torch.Tensor:
    """Mean cross entropy over the masked positions of one batch (padding positions weigh `pad_weight`)."""
    B, T = x0.shape
    x_t, masked, groups = noise_batch(x0, prompt_len, block_size, mask_id, generator, window_probs=window_probs)
    mask = build_train_mask(T, block_size, groups)
    positions = torch.arange(T, device=x0.device).repeat(2)
    hidden = train_forward(model, torch.cat([x_t, x0], dim=1), positions, mask)[:, :T]
    logits = model.compute_logits(hidden[masked]).float()
    ce = F.cross_entropy(logits, x0[masked], reduction="none")
    pos = torch.arange(T, device=x0.device)
    weight = torch.where(pos[None, :] >= real_len[:, None], pad_weight, 1.0)[masked]
    return (ce * weight).sum() / weight.sum().clamp_min(1e-6)
