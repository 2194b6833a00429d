"""Shared checks for the model-family tests (``test_families.py`` for what every family does, ``test_<family>.py``
for what is particular to one).

* `CASES` is the table of what the shared tests need to know about each family; the checkpoints they use are
  written once per session by the ``family_checkpoint`` fixture (``conftest.py``).
* `reference_forward` recomputes a checkpoint's hidden states with plain torch ops in float64, straight from
  its files (config.json + safetensors), written independently of ``diffulex.models``: HF names (Qwen2 / Qwen3
  / Llama; which biases and norms exist is read off the tensors present) or LLaDA's OLMo names.
* `hf_hidden` runs the same weights through a transformers model class, when this transformers can build it.
* `assert_engine_matches_reference` runs a batch through the engine and each prompt alone through the naive
  reference decoder, token for token.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffulex import Diffulex, SamplingParams
from diffulex.attention import DenseAttentionMetadata, visibility_mask
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.reference_decoder import ReferenceResult, reference_for_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


# ----- the families -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyCase:
    """What the shared tests need to know about one family, beyond what its model class says."""

    name: str  # the engine model_name, also write_tiny_checkpoint's family
    mask_token: str  # the mask token string of its tiny tokenizer
    peaky_seed: int  # seed of its checkpoint with confident predictions (init_std 1.0), which the engine decodes
    small: dict = field(default_factory=dict)  # write_tiny_checkpoint arguments of its small-weights checkpoint
    transformers: str | None = None  # transformers' model for the same tensors (None: the names differ)
    engine: dict = field(default_factory=dict)  # engine arguments it needs (DiffuCoder is not detected as itself)
    force_always: bool = False  # the reference decoder forces top-1 in every block (the Stable-DiffCoder rule)
    runs_d2f: bool = True  # Fast-dLLM v2 turns d2f into its native strategy
    decodes_here: bool = True  # False: its engine-vs-reference tests are tests/engine's (SDAR)


CASES = (
    FamilyCase("sdar", "<|MASK|>", peaky_seed=1, transformers="Qwen3", decodes_here=False),
    FamilyCase("sdar_moe", "<|MASK|>", peaky_seed=8, small={"mlp_only_layers": (1,)}),
    FamilyCase("llada", "<|mdm_mask|>", peaky_seed=3),
    FamilyCase("llada2", "<|mask|>", peaky_seed=9),
    FamilyCase("dream", "<|mask|>", peaky_seed=2, transformers="Qwen2"),
    FamilyCase("diffucoder", "<|mask|>", peaky_seed=7, transformers="Qwen2", engine={"model_name": "diffucoder"}),
    FamilyCase("dream_reasoner", "<|MASK|>", peaky_seed=4, small={"attention_bias": True}, transformers="Qwen3"),
    FamilyCase(
        "stable_diffcoder", "<[MASK_TOKEN]>", peaky_seed=5, transformers="Llama", force_always=True,
        small={"attention_bias": True, "mlp_bias": True, "head_dim": 8},
    ),  # fmt: skip
    FamilyCase("fast_dllm_v2", "|<MASK>|", peaky_seed=6, transformers="Qwen2", runs_d2f=False),
)


def write_family_checkpoint(folder: Path, case: FamilyCase, kind: str) -> Path:
    """The ``"small"`` checkpoint of a family (weights of std 0.1: forwards compare closely) or its ``"peaky"`` one
    (std 1.0: confident predictions, so several tokens pass the thresholds in a step)."""
    if kind == "small":
        return write_tiny_checkpoint(folder, family=case.name, seed=1, init_std=0.1, **case.small)
    return write_tiny_checkpoint(folder, family=case.name, seed=case.peaky_seed, init_std=1.0)


def write_real_vocab_checkpoint(tmp_path: Path, family: str) -> Path:
    """A one-layer checkpoint of a Qwen-based `family` with its real tokenizer and real number of embedding rows
    (about 152k, hence the tiny width)."""
    return write_tiny_checkpoint(
        tmp_path / "real-vocab", family=family, real_tokenizer=True, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    )  # fmt: skip


# ----- dense forward by hand ------------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _attend(q, k, v, allowed, nh, nkv, hd):
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], nh * hd)


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return {k: v.double() for k, v in tensors.items()}


def reference_forward(
    ckpt: Path, ids: torch.Tensor, allowed: torch.Tensor, weights: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """Final hidden states [T, hidden] (after the last norm), float64, from the checkpoint files."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = weights if weights is not None else load_weights(ckpt)
    if cfg["model_type"] == "llada":
        return _llada_forward(cfg, w, ids, allowed)
    if cfg["model_type"] == "llada2_moe":
        return _llada2_forward(cfg, w, ids, allowed)
    nh, nkv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    T = ids.shape[0]
    cos, sin = _rope_tables(torch.arange(T), hd, cfg["rope_theta"])

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        bias = w.get(name + ".bias")
        return x @ w[name + ".weight"].T + (0 if bias is None else bias)

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = linear(h, p + "self_attn.q_proj").view(T, nh, hd)
        k = linear(h, p + "self_attn.k_proj").view(T, nkv, hd)
        v = linear(h, p + "self_attn.v_proj").view(T, nkv, hd)
        if p + "self_attn.q_norm.weight" in w:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        x = x + linear(_attend(q, k, v, allowed, nh, nkv, hd), p + "self_attn.o_proj")
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if p + "mlp.gate.weight" in w:
            x = x + _moe(cfg, w, h, p + "mlp.")
            continue
        gate, up = linear(h, p + "mlp.gate_proj"), linear(h, p + "mlp.up_proj")
        x = x + linear(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")
    return _rms(x, w["model.norm.weight"], eps)


def _moe(cfg: dict, w: dict[str, torch.Tensor], h: torch.Tensor, p: str) -> torch.Tensor:
    """Qwen3-MoE's sparse MLP, token by token: softmax over the router's scores, the top-k experts (their weights
    renormalized under ``norm_topk_prob``), each a SwiGLU."""
    probs = (h @ w[p + "gate.weight"].T).softmax(-1)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        weights, experts = probs[t].topk(cfg["num_experts_per_tok"])
        if cfg.get("norm_topk_prob"):
            weights = weights / weights.sum()
        for weight, e in zip(weights.tolist(), experts.tolist(), strict=True):
            q = f"{p}experts.{e}."
            act = torch.nn.functional.silu(h[t] @ w[q + "gate_proj.weight"].T) * (h[t] @ w[q + "up_proj.weight"].T)
            out[t] += weight * (act @ w[q + "down_proj.weight"].T)
    return out


def _llada2_forward(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Ling-MoE: fused q/k/v rows (q heads, k heads, v heads), per-head q/k norm, rotary on the first
    ``partial_rotary_factor`` of each head; dense MLP in the first ``first_k_dense_replace`` layers, else sigmoid
    routing with expert bias inside the best ``topk_group`` groups, weights renormalized and scaled, plus the
    shared expert."""
    nh, nkv, eps, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"], cfg["head_dim"]
    rot = int(hd * cfg["partial_rotary_factor"])
    T = ids.shape[0]
    cos, sin = _rope_tables(torch.arange(T), rot, cfg["rope_theta"])

    def rope(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([_rope(x[..., :rot], cos, sin), x[..., rot:]], -1)

    def swiglu(h: torch.Tensor, p: str) -> torch.Tensor:
        act = torch.nn.functional.silu(h @ w[p + "gate_proj.weight"].T) * (h @ w[p + "up_proj.weight"].T)
        return act @ w[p + "down_proj.weight"].T

    x = w["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        qkv = h @ w[p + "attention.query_key_value.weight"].T
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        q = rope(_rms(q.reshape(T, nh, hd), w[p + "attention.query_layernorm.weight"], eps))
        k = rope(_rms(k.reshape(T, nkv, hd), w[p + "attention.key_layernorm.weight"], eps))
        x = x + _attend(q, k, v.reshape(T, nkv, hd), allowed, nh, nkv, hd) @ w[p + "attention.dense.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu(h, p + "mlp.")
            continue
        out = swiglu(h, p + "mlp.shared_experts.")
        scores = (h @ w[p + "mlp.gate.weight"].T).sigmoid()
        group_size = cfg["num_experts"] // cfg["n_group"]
        for t in range(T):
            biased = scores[t] + w[p + "mlp.gate.expert_bias"]
            groups = biased.view(cfg["n_group"], group_size)
            best = groups.topk(2, -1).values.sum(-1).topk(cfg["topk_group"]).indices.tolist()
            candidates = [g * group_size + j for g in best for j in range(group_size)]
            chosen = sorted(candidates, key=lambda e: -biased[e].item())[: cfg["num_experts_per_tok"]]
            weights = scores[t, chosen] / scores[t, chosen].sum() * cfg["routed_scaling_factor"]
            for weight, e in zip(weights.tolist(), chosen, strict=True):
                out[t] += weight * swiglu(h[t], f"{p}mlp.experts.{e}.")
        x = x + out
    return _rms(x, w["model.norm.weight"], eps)


def _llada_forward(cfg: dict, w: dict[str, torch.Tensor], ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The OLMo "llama" block: x += attn_out(attn(attn_norm(x))); x += ff_out(silu(ff_proj(h)) * up_proj(h))."""
    nh, eps, d = cfg["n_heads"], cfg["rms_norm_eps"], cfg["d_model"]
    nkv = cfg.get("n_kv_heads") or nh
    hd = d // nh
    T = ids.shape[0]
    cos, sin = _rope_tables(torch.arange(T), hd, cfg["rope_theta"])

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        bias = w.get(name + ".bias")
        return x @ w[name + ".weight"].T + (0 if bias is None else bias)

    t = "model.transformer."
    x = w[t + "wte.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"{t}blocks.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = _rope(linear(h, p + "q_proj").view(T, nh, hd), cos, sin)
        k = _rope(linear(h, p + "k_proj").view(T, nkv, hd), cos, sin)
        v = linear(h, p + "v_proj").view(T, nkv, hd)
        x = x + linear(_attend(q, k, v, allowed, nh, nkv, hd), p + "attn_out")
        h = _rms(x, w[p + "ff_norm.weight"], eps)
        x = x + linear(torch.nn.functional.silu(linear(h, p + "ff_proj")) * linear(h, p + "up_proj"), p + "ff_out")
    return _rms(x, w[t + "ln_f.weight"], eps)


def lm_head_weight(ckpt: Path, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg["model_type"] == "llada":
        tied = cfg.get("weight_tying", False)
        return weights["model.transformer.wte.weight" if tied else "model.transformer.ff_out.weight"]
    embeddings = "model.word_embeddings.weight" if cfg["model_type"] == "llada2_moe" else "model.embed_tokens.weight"
    return weights[embeddings if cfg.get("tie_word_embeddings") else "lm_head.weight"]


def block_causal(n: int, block_size: int = 4, prefix_full: bool = False, prompt_len: int = 0) -> torch.Tensor:
    pos = torch.arange(n)
    return visibility_mask(pos, pos, block_size, prefix_full, prompt_len)


@torch.inference_mode()
def assert_forward_matches_reference(model, ckpt: Path, vocab: int, seed: int = 0) -> None:
    """The model's hidden states and logits equal the by-hand float64 forward under a block-causal mask."""
    ids = torch.randint(0, vocab, (11,), generator=torch.Generator().manual_seed(seed))
    allowed = block_causal(11)
    hidden = model(ids, torch.arange(11), DenseAttentionMetadata(allowed=allowed))
    weights = load_weights(ckpt)
    expected = reference_forward(ckpt, ids, allowed, weights)
    torch.testing.assert_close(hidden.double(), expected, atol=1e-5, rtol=1e-5)
    logits = model.compute_logits(hidden)
    assert hidden.dtype == logits.dtype == next(model.parameters()).dtype
    torch.testing.assert_close(logits.double(), expected @ lm_head_weight(ckpt, weights).T, atol=1e-5, rtol=1e-5)


# ----- transformers cross-check ---------------------------------------------------------------------------


@torch.inference_mode()
def assert_matches_transformers(model, kind: str, config_kwargs: dict, state_dict: dict, vocab: int) -> None:
    """Hidden states under a causal mask equal those of transformers' ``kind`` (Qwen2 / Qwen3 / Llama) model
    loaded strictly with `state_dict`; skipped where this transformers cannot build the model."""
    transformers = pytest.importorskip("transformers")
    theta = config_kwargs.pop("rope_theta")
    try:
        config_cls = getattr(transformers, f"{kind}Config")
        model_cls = getattr(transformers, f"{kind}ForCausalLM")
        rope = {"rope_type": "default", "rope_theta": theta}
        hf_config = config_cls(**config_kwargs, rope_parameters=rope, rope_theta=theta)
        hf_config._attn_implementation = "eager"
        hf = model_cls(hf_config).eval()
    except (TypeError, AttributeError, ValueError) as e:
        pytest.skip(f"cannot build transformers' {kind} here: {e}")
    hf.load_state_dict(state_dict, strict=True)
    ids = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)
    hidden = model(ids, pos, DenseAttentionMetadata(visibility_mask(pos, pos, 1, False, 0)))
    out = hf(input_ids=ids[None], output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.compute_logits(hidden), out.logits[0], atol=1e-5, rtol=1e-5)


# The config.json keys each transformers config class takes (Qwen2 derives head_dim and has no attention_bias).
TRANSFORMERS_CONFIG_KEYS = {
    "Qwen2": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "rms_norm_eps max_position_embeddings tie_word_embeddings rope_theta".split(),
}
TRANSFORMERS_CONFIG_KEYS["Qwen3"] = [*TRANSFORMERS_CONFIG_KEYS["Qwen2"], "head_dim", "attention_bias"]
TRANSFORMERS_CONFIG_KEYS["Llama"] = [*TRANSFORMERS_CONFIG_KEYS["Qwen3"], "mlp_bias"]


def assert_checkpoint_matches_transformers(model, kind: str, ckpt: Path, vocab: int) -> None:
    """`assert_matches_transformers` for a checkpoint whose config.json and tensor names are transformers' own."""
    cfg = json.loads((ckpt / "config.json").read_text())
    config_kwargs = {k: cfg[k] for k in TRANSFORMERS_CONFIG_KEYS[kind]}
    assert_matches_transformers(model, kind, config_kwargs, load_file(str(ckpt / "model.safetensors")), vocab)


# ----- engine vs reference decoder ------------------------------------------------------------------------


def make_engine(model_dir: Path, **overrides) -> Diffulex:
    fields = dict(
        decoding_strategy="multi_bd", block_size=4, page_size=8, buffer_size=2, max_model_len=96,
        max_num_batched_tokens=512, max_num_reqs=16, accept_threshold=0.7,
    )  # fmt: skip
    fields.update(overrides)
    return Diffulex(str(model_dir), **fields)


def random_prompts(llm: Diffulex, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


# On the GPU the engine's kernels sum in other orders than the reference's PyTorch ops (about 1e-6 apart in
# float32), so a comparison of tokens tests the engine only where no decision of the reference hangs on rounding
# (`ReferenceResult.min_margin`). Checked on every machine, so that a comparison that would be a coin toss on the
# GPU is caught by the CPU tests, where both sides round alike and it would pass by construction.
WELL_POSED_MARGIN = 1e-5


def assert_well_posed(ref: ReferenceResult, what: str) -> None:
    assert ref.min_margin > WELL_POSED_MARGIN, (
        f"{what}: a decision of the reference is {ref.min_margin:.2e} from flipping, below the rounding of other "
        "kernels; the comparison would be a coin toss on the GPU: choose other prompts"
    )


def assert_engine_matches_reference(
    llm: Diffulex, prompts: list[list[int]], params: SamplingParams, force_always: bool = False
) -> list:
    """Run the batch through the engine, then each prompt alone through the reference decoder."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
        ref = reference_for_engine(llm, prompt, params, force_always=force_always)
        assert_well_posed(ref, f"prompt of length {len(prompt)}")
        assert traj.token_ids == ref.token_ids, f"prompt of length {len(prompt)}"
        assert traj.completion_reason == ref.completion_reason
        assert traj.nfe == ref.nfe
        assert [s.num_new_tokens for s in traj.steps] == ref.tokens_per_step
    return outputs.trajectories


def check_multi_bd_batch_with_preemption(model_dir: Path, force_always: bool = False, **overrides) -> list:
    """Eight prompts (most not multiples of the block size) on 10 pages of 8 tokens: requests get preempted
    and rebuilt, and every one still decodes exactly like the reference."""
    fields = dict(num_pages=10, max_model_len=64, accept_threshold=0.8)
    fields.update(overrides)
    with make_engine(model_dir, **fields) as llm:
        prompts = random_prompts(llm, [3, 6, 9, 12, 14, 5, 7, 2], seed=22)
        params = SamplingParams(temperature=0, max_tokens=30)
        trajectories = assert_engine_matches_reference(llm, prompts, params, force_always)
    assert sum(t.num_preemptions for t in trajectories) > 0, "the page pool should have forced a preemption"
    steps = [s for t in trajectories for s in t.steps]
    assert max(s.num_new_tokens for s in steps) >= 2, "peaky weights should accept several tokens in some step"
    return trajectories


def check_prefix_cache_hit(model_dir: Path, force_always: bool = False, **overrides) -> None:
    """A second prompt sharing 24 tokens with the first reuses their cached pages and still matches."""
    with make_engine(model_dir, **overrides) as llm:
        assert llm.config.enable_prefix_caching is True
        (first,) = random_prompts(llm, [26], seed=6)
        assert_engine_matches_reference(llm, [first], GREEDY, force_always)
        second = first[:24] + first[:5]
        (traj,) = assert_engine_matches_reference(llm, [second], GREEDY, force_always)
    assert traj.steps[0].query_len < 24, "the prefix cache should have supplied 24 tokens"


def check_d2f(model_dir: Path, force_always: bool = False, **overrides) -> None:
    with make_engine(model_dir, decoding_strategy="d2f", **overrides) as llm:
        assert llm.config.enable_prefix_caching is False and llm.config.multi_block_prefix_full is True
        prompts = random_prompts(llm, [3, 10, 17, 8], seed=16)
        assert_engine_matches_reference(llm, prompts, GREEDY, force_always)


@torch.inference_mode()
def check_first_token_comes_from_the_last_prompt_position(model_dir: Path, **overrides) -> None:
    """Shifted families: with a block-aligned prompt, the token generated at position L is the argmax (over
    the allowed vocabulary) of the logits at L - 1, computed here by hand from the checkpoint files. Row L - 1
    sees only the prompt, so this holds whatever step the token is accepted in."""
    with make_engine(model_dir, **overrides) as llm:
        prompts = random_prompts(llm, [8, 12, 16, 4], seed=12)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        mask_id, vocab_limit = llm.mask_token_id, llm.vocab_limit
        prefix_full = bool(llm.config.multi_block_prefix_full)
    weights = load_weights(model_dir)
    head = lm_head_weight(model_dir, weights)
    differs = 0
    for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
        L = len(prompt)
        ids = torch.tensor(prompt + [mask_id] * 4)
        allowed = block_causal(L + 4, 4, prefix_full, L)
        logits = reference_forward(model_dir, ids, allowed, weights) @ head.T
        logits[:, vocab_limit:] = float("-inf")
        logits[:, mask_id] = float("-inf")
        assert traj.token_ids[0] == int(logits[L - 1].argmax()), f"prompt of length {L}"
        differs += int(logits[L].argmax()) != traj.token_ids[0]
    assert differs > 0, "the unshifted row should disagree somewhere, or the check has no teeth"
