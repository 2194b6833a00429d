"""SDAR: a block-diffusion LM with the Qwen3 architecture (per-head q/k RMSNorm, GQA, SwiGLU, NeoX RoPE).

The network is an ordinary Qwen3 decoder, the generic one of `diffulex.models.dense` in its Qwen3 layout; what
makes it a block-diffusion model is only the attention mask (block-causal, carried by the attention metadata) and
the sampler. Module and parameter names mirror the HF checkpoint exactly (``model.layers.N.self_attn.q_proj.weight``
...), so weights load without any renaming. No logit shift: the hidden state at a position predicts the token at
that same position.
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseAttention, DenseForDiffusionLM
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import SDARConfig

# The name `diffulex.train.model` gives SDAR's attention modules, whose submodules its batched forward runs.
SDARAttention = DenseAttention


class SDARForDiffusionLM(DenseForDiffusionLM):
    """The SDAR family (``model_type: "sdar"``; SDAR-1.7B/4B/8B-Chat and their ``-bN`` block-size variants)."""

    arch_for = DenseArch.qwen3


register_family(
    Family(
        name="sdar",
        model=SDARForDiffusionLM,
        read_config=SDARConfig.from_pretrained,
        mask_token_id=151669,
        default_strategy="multi_bd",
        model_types=("sdar",),
        architectures=("SDARFor",),
    )
)
