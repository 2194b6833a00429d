"""Small models that drive the reference decoders in their own tests.

* `StandInModel`, a tiny real transformer layer (embedding + one `diffulex.attention.Attention` over the dense
  mask + a peaky linear head), for end-to-end behaviour, with optional per-position logit overrides;
* `ScriptedModel`, whose logits at each position are chosen by a Python function of the current sequence, for
  hand-made schedules whose every step can be worked out on paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffulex.attention import Attention, DenseAttentionMetadata

VOCAB = 32
MASK = VOCAB - 1


class StandInModel(nn.Module):
    """``layers`` pre-norm attention layers (one by default) over the dense mask, with a head scaled so that many
    confidences exceed 0.9. With one layer every K/V depends on its own token and position only.

    The position of each row travels as the last hidden channel, so that `compute_logits` can apply
    per-position overrides: ``forced[p] = t`` makes ``t`` the argmax at ``p``; ``suppressed`` tokens lose.
    """

    def __init__(
        self, seed: int = 0, hidden: int = 32, heads: int = 4, kv_heads: int = 2, max_len: int = 256, layers: int = 1
    ):
        super().__init__()
        head_dim = hidden // heads
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, hidden)
            self.pos = nn.Embedding(max_len, hidden)
            self.qkv = nn.ModuleList(
                nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False) for _ in range(layers)
            )
            self.attn = nn.ModuleList(Attention(heads, kv_heads, head_dim, head_dim**-0.5) for _ in range(layers))
            self.o_proj = nn.ModuleList(nn.Linear(heads * head_dim, hidden, bias=False) for _ in range(layers))
            self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.logit_scale = 15.0
        self.forced: dict[int, int] = {}
        self.suppressed: set[int] = set()
        self.seen_masks: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: DenseAttentionMetadata):
        self.seen_masks.append(attn_meta.allowed.clone())
        n = input_ids.shape[0]
        h = self.embed(input_ids) + self.pos(positions)
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        for qkv, attn, o_proj in zip(self.qkv, self.attn, self.o_proj, strict=True):
            q, k, v = qkv(F.layer_norm(h, h.shape[-1:])).split(sizes, dim=-1)
            out = attn(
                q.view(n, self.heads, self.head_dim),
                k.view(n, self.kv_heads, self.head_dim),
                v.view(n, self.kv_heads, self.head_dim),
                attn_meta,
            )
            h = h + o_proj(out)
        return torch.cat([h, positions.unsqueeze(1).to(h.dtype)], dim=1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h, pos = hidden[:, :-1], hidden[:, -1].long().tolist()
        logits = self.head(F.layer_norm(h, h.shape[-1:])) * self.logit_scale
        for row, p in enumerate(pos):
            for token in self.suppressed:
                logits[row, token] -= 100.0
            if p in self.forced:
                logits[row, self.forced[p]] += 200.0
        return logits


Script = Callable[[list[int], int], tuple[int, float]]


def peak_logits(token: int, confidence: float) -> torch.Tensor:
    """Logits whose softmax over the allowed ids (all but the mask) gives ``token`` ``confidence``."""
    logits = torch.zeros(VOCAB)
    allowed = VOCAB - 1
    logits[token] = math.log(confidence * (allowed - 1) / (1.0 - confidence))
    return logits


class ScriptedModel(nn.Module):
    """Hidden states are the logits themselves: ``script(tokens, q) -> (token, confidence)`` at position q."""

    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self.seen_inputs: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: DenseAttentionMetadata):
        tokens = input_ids.tolist()
        self.seen_inputs.append(tokens)
        return torch.stack([peak_logits(*self.script(tokens, q)) for q in positions.tolist()])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden
