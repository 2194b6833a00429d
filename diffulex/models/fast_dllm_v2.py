"""Fast-dLLM v2: Qwen2.5 (q/k/v bias, o without) fine-tuned for block diffusion, with shifted logits.

``model_type: "Fast_dLLM_Qwen"``, ``architectures: ["Fast_dLLM_QwenForCausalLM"]``, ``bd_size: 32``. The network
is the Dream one; its mask token ``|<MASK>|`` (151665) is an added token of the Qwen2.5 tokenizer. Under
``multi_bd`` it decodes with the Dream rule on shifted logits; its native ``fast_dllm_v2`` strategy (sub-blocks,
dual cache) is a separate runtime.
"""

from __future__ import annotations

from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("fast_dllm_v2")
class FastdLLMV2ForDiffusionLM(DenseForDiffusionLM):
    arch_for = DenseArch.qwen2
    family_defaults = {"mask_token_id": 151665, "decoding_strategy": "fast_dllm_v2"}
    logits_shift = True
