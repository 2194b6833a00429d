"""SDAR-MoE (SDAR-30B-A3B): SDAR's block diffusion on the Qwen3-MoE decoder.

The attention, norms and rotary are SDAR's (`diffulex.models.sdar`); the MLP of the sparse layers is a top-k
mixture of SwiGLU experts (`diffulex.layers.moe.SparseMoE`), the others keep the dense SwiGLU
(`SDARMoeConfig.is_sparse_layer`). Parameter names are the checkpoint's (``model.layers.N.mlp.gate.weight``,
``model.layers.N.mlp.experts.E.gate_proj.weight`` ...).
"""

from __future__ import annotations

from torch import nn

from diffulex.layers.moe import SoftmaxRouter, SparseMoE
from diffulex.models.dense import DenseArch, DenseForDiffusionLM
from diffulex.models.family import Family, register_family
from diffulex.models.hf_config import SDARMoeConfig


class SDARMoeForDiffusionLM(DenseForDiffusionLM):
    """The SDAR-MoE family (``model_type: "sdar_moe"``, ``SDARMoeForCausalLM``)."""

    arch_for = DenseArch.qwen3

    def make_mlp(self, layer_index: int) -> nn.Module | None:
        config = self.config
        assert isinstance(config, SDARMoeConfig)
        if not config.is_sparse_layer(layer_index):
            return None
        assert config.moe_intermediate_size is not None and config.num_experts is not None
        assert config.num_experts_per_tok is not None
        gate = SoftmaxRouter(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, normalize=config.norm_topk_prob
        )
        return SparseMoE(config.hidden_size, config.moe_intermediate_size, gate)


register_family(
    Family(
        name="sdar_moe",
        model=SDARMoeForDiffusionLM,
        read_config=SDARMoeConfig.from_pretrained,
        mask_token_id=151669,
        default_strategy="multi_bd",
        model_types=("sdar_moe",),
        architectures=("SDARMoe",),
    )
)
