"""Dream-v0 / Dream-Coder and DiffuCoder: Qwen2.5 decoders trained as masked diffusion LMs with shifted logits.

``model_type: "Dream"``, ``architectures: ["DreamModel"]``. The network is Qwen2.5: q/k/v projections with bias
(always, whatever the config says, as in the published code), o_proj without, no q/k norm. The authors' sampler
reuses the autoregressive head: the hidden state at position ``p - 1`` predicts the token at ``p``
(``logits_shift``), so the first generated token comes from the last prompt position. DiffuCoder checkpoints
have the same format and run under the same class (``model_name="diffucoder"`` is an alias of ``"dream"``).
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import DreamConfig


class DreamForDiffusionLM(DenseForDiffusionLM):
    arch_for = DenseArch.qwen2
    load_error_hint = (
        "checkpoints with self_attn.q_norm / k_norm tensors are the Qwen3-style Dream reasoner: pass "
        "model_name='dream_reasoner'"
    )


register_family(
    Family(
        name="dream",
        model=DreamForDiffusionLM,
        read_config=DreamConfig.from_pretrained,
        mask_token_id=151666,
        default_strategy="d2f",
        model_types=("Dream",),
        aliases=("diffucoder",),
        logits_shift=True,
    )
)
