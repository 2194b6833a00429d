"""Model families. Importing this package registers every family (`diffulex.models.family.FAMILIES`)."""

from diffulex.models import (  # noqa: F401  (each module registers its family)
    diffusion_gemma,
    dream,
    dream_reasoner,
    fast_dllm_v2,
    llada,
    llada2,
    sdar,
    sdar_moe,
    stable_diffcoder,
)
from diffulex.models.dream import DreamForDiffusionLM
from diffulex.models.dream_reasoner import DreamReasonerForDiffusionLM
from diffulex.models.family import FAMILIES, Family, load_hf_config, model_type_to_model_name, register_family
from diffulex.models.fast_dllm_v2 import FastdLLMV2ForDiffusionLM
from diffulex.models.llada import LLaDAForDiffusionLM
from diffulex.models.llada2 import LLaDA2ForDiffusionLM
from diffulex.models.sdar import SDARForDiffusionLM
from diffulex.models.sdar_moe import SDARMoeForDiffusionLM
from diffulex.models.stable_diffcoder import StableDiffCoderForDiffusionLM

__all__ = [
    "FAMILIES",
    "DreamForDiffusionLM",
    "DreamReasonerForDiffusionLM",
    "Family",
    "FastdLLMV2ForDiffusionLM",
    "LLaDA2ForDiffusionLM",
    "LLaDAForDiffusionLM",
    "SDARForDiffusionLM",
    "SDARMoeForDiffusionLM",
    "StableDiffCoderForDiffusionLM",
    "load_hf_config",
    "model_type_to_model_name",
    "register_family",
]
