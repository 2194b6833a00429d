"""The Dream reasoner: a Qwen3-style decoder published under ``model_type: "Dream"``.

Per-head RMSNorm of q and k before RoPE, biases on q/k/v/o as ``attention_bias`` says, SwiGLU MLP. Unlike
Dream-v0 its logits are not shifted: the hidden state at ``p`` predicts the token at ``p``. Its config shares
``model_type`` with Dream-v0; ``architectures: ["DreamForCausalLM"]`` selects it (Dream-v0 says
``"DreamModel"``), and ``model_name="dream_reasoner"`` always does.
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import DreamReasonerConfig


class DreamReasonerForDiffusionLM(DenseForDiffusionLM):
    arch_for = DenseArch.qwen3
    load_error_hint = (
        "checkpoints without self_attn.q_norm / k_norm tensors and with q/k/v biases are Qwen2.5-style Dream-v0 "
        "or DiffuCoder: pass model_name='dream'"
    )


register_family(
    Family(
        name="dream_reasoner",
        model=DreamReasonerForDiffusionLM,
        read_config=DreamReasonerConfig.from_pretrained,
        mask_token_id=151669,
        default_strategy="multi_bd",
        architectures=("DreamForCausalLM",),
    )
)
