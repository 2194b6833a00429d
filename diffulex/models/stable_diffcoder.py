"""Stable-DiffCoder: a Llama decoder (Seed-Coder geometry) trained for block diffusion.

``model_type: "llama"``, ``architectures: ["StableDiffcoderForCausalLM"]`` (the architecture name is what
identifies the family). q/k/v/o biases follow ``attention_bias``, the MLP's ``mlp_bias``; no q/k norm; no logit
shift. The mask token ``<[MASK_TOKEN]>`` (id 5 in the published tokenizer) comes from the tokenizer files.
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import StableDiffCoderConfig


class StableDiffCoderForDiffusionLM(DenseForDiffusionLM):
    arch_for = DenseArch.llama


register_family(
    Family(
        name="stable_diffcoder",
        model=StableDiffCoderForDiffusionLM,
        read_config=StableDiffCoderConfig.from_pretrained,
        mask_token_id=5,
        default_strategy="multi_bd",
        architectures=("StableDiffcoder",),
        force_every_block=True,
    )
)
