"""The Dream reasoner: a Qwen3-style decoder published under ``model_type: "Dream"``.

Per-head RMSNorm of q and k before RoPE, biases on q/k/v/o as ``attention_bias`` says, SwiGLU MLP. Unlike
Dream-v0 its logits are not shifted: the hidden state at ``p`` predicts the token at ``p``. Its config shares
``model_type`` with Dream-v0; ``architectures: ["DreamForCausalLM"]`` selects it (Dream-v0 says
``"DreamModel"``), and ``model_name="dream_reasoner"`` always does.
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("dream_reasoner")
class DreamReasonerForDiffusionLM(DenseForDiffusionLM):
    arch_for = DenseArch.qwen3
    family_defaults = {"mask_token_id": 151669, "decoding_strategy": "multi_bd"}
    logits_shift = False
    load_error_hint = (
        "checkpoints without self_attn.q_norm / k_norm tensors and with q/k/v biases are Qwen2.5-style Dream-v0 "
        "or DiffuCoder: pass model_name='dream'"
    )
