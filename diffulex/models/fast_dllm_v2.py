"""Fast-dLLM v2: Qwen2.5 (q/k/v bias, o without) fine-tuned for block diffusion, with shifted logits.

``model_type: "Fast_dLLM_Qwen"``, ``architectures: ["Fast_dLLM_QwenForCausalLM"]``, ``bd_size: 32``. The network
is the Dream one; its mask token ``|<MASK>|`` (151665) is an added token of the Qwen2.5 tokenizer. Under
``multi_bd`` it decodes with the Dream rule on shifted logits; its native ``fast_dllm_v2`` strategy (sub-blocks,
dual cache) is a separate runtime.
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import FastdLLMV2Config


class FastdLLMV2ForDiffusionLM(DenseForDiffusionLM):
    arch_for = DenseArch.qwen2


register_family(
    Family(
        name="fast_dllm_v2",
        model=FastdLLMV2ForDiffusionLM,
        read_config=FastdLLMV2Config.from_pretrained,
        mask_token_id=151665,
        default_strategy="fast_dllm_v2",
        model_types=("Fast_dLLM_Qwen", "fast_dllm_v2"),
        architectures=("Fast_dLLM_Qwen", "FastdLLMV2"),
        logits_shift=True,
        strategies=("fast_dllm_v2", "multi_bd"),
        # its config.json names the trained block (bd_size, 32) but no block_size: the authors' sub-block is 8, and
        # the default buffer of 4 sub-blocks then spans the trained block
        default_block_size=8,
    )
)
