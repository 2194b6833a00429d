"""DiffusionGemma against transformers' own `DiffusionGemmaForBlockDiffusion`, on a tiny random checkpoint that
transformers itself wrote (five layers of both attention kinds, MoE on, float32; every norm weight, layer scalar
and router scale redrawn away from 1 so that a wrong or missing use of any of them shows).

The comparisons are of the same network on the same inputs: both models read the same safetensors file, so any
difference beyond float32 rounding (different summation orders: about 1e-6 here) is a bug in ours.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file
from transformers import DiffusionGemmaConfig as HFDiffusionGemmaConfig
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.cache_utils import DynamicCache

from diffulex.layers.dispatch import triton_available
from diffulex.layers.moe import grouped_mm_supported
from diffulex.models.diffusion_gemma import (
    DiffusionGemmaForDiffusionLM,
    EncoderKV,
    StackedExperts,
    load_diffusion_gemma,
)
from diffulex.models.diffusion_gemma_config import DiffusionGemmaConfig
from diffulex.testing.checkpoints import (
    DIFFUSION_GEMMA_26B_CONFIG,
    DIFFUSION_GEMMA_26B_TEXT_CONFIG,
    write_tiny_diffusion_gemma_checkpoint,
)
from diffulex.testing.diffusion_gemma_reference import greedy_generate

# float32 logits of the same network summed in different orders (observed: ~1.2e-6; logits are capped at 30).
ATOL = 1e-5
PROMPT_LEN = 13  # longer than the tiny sliding window (8), so the window masks something
FIRST_TOKEN = 7  # prompts avoid the special ids (0-6)
# Where the fused expert kernels run: natively on a GPU, else under the Triton interpreter (conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 outputs of two expert paths that round alike may differ by this many units in the last place of the largest
# output (a GEMM's float32 sum in another order landing across a rounding boundary)
BF16_ULPS = 4


# The direct calls into transformers' encoder/decoder and its cache layout were verified against 5.24; 5.17 (the
# GPU machine's) has another calling convention for them. Its generation loop is compared on every version.
current_transformers = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason=f"the direct encoder/decoder calls follow transformers >= 5.24 (installed: {transformers.__version__})",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is ~30x faster than two on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("dgemma") / "tiny", seed=0)


@pytest.fixture(scope="module")
def settling_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers that only nudge the residual: greedy canvases settle after a few steps (some, not all)."""
    path = tmp_path_factory.mktemp("dgemma") / "settling"
    return write_tiny_diffusion_gemma_checkpoint(path, seed=0, layer_output_scale=0.5)


def _pair(folder: Path) -> tuple[DiffusionGemmaForBlockDiffusion, DiffusionGemmaForDiffusionLM]:
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder), dtype=torch.float32).eval()
    return reference, load_diffusion_gemma(folder)


@pytest.fixture(scope="module")
def models(folder: Path) -> tuple[DiffusionGemmaForBlockDiffusion, DiffusionGemmaForDiffusionLM]:
    return _pair(folder)


def _tokens(
    generator: torch.Generator, rows: int, length: int, low: int = FIRST_TOKEN, high: int = 380
) -> torch.Tensor:
    return torch.randint(low, high, (rows, length), generator=generator)


def _hf_cache(reference: DiffusionGemmaForBlockDiffusion) -> DynamicCache:
    return DynamicCache(config=reference.config.get_text_config(decoder=True))


def _assert_kv_equal(cache: DynamicCache, context: EncoderKV, window: int) -> None:
    for index, layer in enumerate(cache.layers):
        ours_k, ours_v = context.keys[index], context.values[index]
        assert ours_k.shape[1] == (min(window - 1, context.length) if layer.is_sliding else context.length)
        torch.testing.assert_close(ours_k, layer.keys.transpose(1, 2), atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_v, layer.values.transpose(1, 2), atol=ATOL, rtol=0)


@current_transformers
def test_encoder_kv_equals_transformers_cache_for_prompt_and_appended_canvas(models) -> None:
    """What the encoder produces is per-layer K/V, so that is what is compared: after encoding a 13-token prompt
    (2 rows), and again after appending a 16-token canvas, every layer's keys and values equal the
    `DynamicCache` transformers' encoder filled from the same ids. Sliding layers keep the last ``window - 1``
    positions, as transformers' cache does, and full layers all of them."""
    reference, ours = models
    g = torch.Generator().manual_seed(0)
    prompt, canvas = _tokens(g, 2, PROMPT_LEN), _tokens(g, 2, ours.config.canvas_length)
    cache = _hf_cache(reference)
    with torch.no_grad():
        reference.model.encoder(input_ids=prompt, cache=cache)
    context = ours.encode(prompt)
    _assert_kv_equal(cache, context, ours.config.sliding_window)
    with torch.no_grad():
        reference.model.encoder(input_ids=canvas, cache=cache)
    extended = ours.encode(canvas, context)
    assert extended.length == PROMPT_LEN + ours.config.canvas_length and context.length == PROMPT_LEN
    _assert_kv_equal(cache, extended, ours.config.sliding_window)


@current_transformers
@pytest.mark.parametrize("self_conditioning", ["none", "logits", "per-row mask"])
def test_decoder_logits_equal_transformers(models, self_conditioning: str) -> None:
    """One decoder pass over a random canvas after the same encoded prompt: ours equals
    ``DiffusionGemmaForBlockDiffusion(decoder_input_ids=..., cache=...)`` logits (soft-capped, float32), without
    self-conditioning (a canvas's first step), with previous-step logits, and with transformers'
    ``self_conditioning_mask`` turning it off for one row of two."""
    reference, ours = models
    g = torch.Generator().manual_seed(1)
    prompt, canvas = _tokens(g, 2, PROMPT_LEN), _tokens(g, 2, ours.config.canvas_length, low=0, high=384)
    previous = torch.randn(2, ours.config.canvas_length, ours.config.vocab_size, generator=g) * 4
    kwargs: dict[str, torch.Tensor] = {}
    if self_conditioning != "none":
        kwargs["self_conditioning_logits"] = previous
    if self_conditioning == "per-row mask":
        kwargs["self_conditioning_mask"] = torch.tensor([True, False])
    cache = _hf_cache(reference)
    with torch.no_grad():
        reference.model.encoder(input_ids=prompt, cache=cache)
        expected = reference(decoder_input_ids=canvas, cache=cache, **kwargs).logits
    got = ours.denoise_step(canvas, ours.encode(prompt), **kwargs)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    if self_conditioning == "per-row mask":
        first_step = ours.denoise_step(canvas[1:], ours.encode(prompt[1:]))
        torch.testing.assert_close(got[1:], first_step, atol=ATOL, rtol=0)


def test_each_denoising_step_equals_transformers_under_teacher_forcing(models) -> None:
    """Transformers' own generation loop at the published temperatures (0.8 down to 0.4, seeded sampling,
    entropy-bound acceptance with re-noising) drives; every encoder call it makes and every decoder step it takes
    is also run by ours on exactly its inputs (the ids it encodes; the canvas and the temperature-scaled
    self-conditioning logits it feeds the decoder). So each step is compared on transformers' trajectory
    (teacher forcing) and float32 rounding cannot compound through self-conditioning: every step's logits must be
    equal, over three canvases."""
    reference, ours = models
    state: dict[str, EncoderKV | None] = {"context": None}
    compared: list[float] = []
    encoder_forward, decoder_forward = reference.model.encoder.forward, reference.forward

    def encode_both(**kwargs):
        state["context"] = ours.encode(kwargs["input_ids"], state["context"])
        return encoder_forward(**kwargs)

    def decode_both(**kwargs):
        out = decoder_forward(**kwargs)
        got = ours.denoise_step(kwargs["decoder_input_ids"], state["context"], kwargs["self_conditioning_logits"])
        compared.append((got - out.logits).abs().max().item())
        return out

    g = torch.Generator().manual_seed(2)
    prompt = _tokens(g, 2, PROMPT_LEN)
    reference.model.encoder.forward, reference.forward = encode_both, decode_both
    try:
        torch.manual_seed(0)
        reference.generate(prompt, max_new_tokens=3 * ours.config.canvas_length, max_denoising_steps=5,
                           eos_token_id=None, t_min=0.4, t_max=0.8)  # fmt: skip
    finally:
        del reference.model.encoder.forward, reference.forward
    assert len(compared) == 15  # 3 canvases x 5 steps: nothing converges at these temperatures
    assert max(compared) < ATOL


def _greedy_with_transformers(
    reference: DiffusionGemmaForBlockDiffusion, prompt: torch.Tensor, noise: list[torch.Tensor], **settings
) -> torch.Tensor:
    """Transformers' ``generate`` in its temperature-0 limit, starting each canvas from the given noise.

    It refuses ``t_max <= t_min``, so the schedule runs from 1e-20 down to 0: logits / T then put every
    probability it computes at exactly 0 or 1 in float32, so its multinomial draw is the argmax, every position's
    entropy is 0 (all accepted, nothing re-noised, always confident) and the self-conditioning softmax is one-hot,
    which is what ``greedy_generate`` does at temperature 0."""
    canvases = iter(noise)
    prepare = reference._prepare_denoiser_inputs

    def with_noise(**kwargs):
        kwargs["model_kwargs"]["decoder_input_ids"] = next(canvases).clone()
        return prepare(**kwargs)

    reference._prepare_denoiser_inputs = with_noise
    try:
        return reference.generate(prompt, t_min=0.0, t_max=1e-20, **settings).sequences
    finally:
        del reference._prepare_denoiser_inputs


@pytest.fixture(scope="module")
def settling_models(settling_folder: Path) -> tuple[DiffusionGemmaForBlockDiffusion, DiffusionGemmaForDiffusionLM]:
    return _pair(settling_folder)


GREEDY_SETTINGS = {"max_new_tokens": 64, "max_denoising_steps": 8}


def _greedy_inputs(canvas_length: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    prompt = _tokens(g, 2, 11)
    return prompt, [_tokens(g, 2, canvas_length, low=0, high=384) for _ in range(4)]


@pytest.mark.parametrize("stability_threshold", [1, 2])
def test_greedy_generation_equals_transformers_generate(settling_models, stability_threshold: int) -> None:
    """At temperature 0, from the same canvas noise, `greedy_generate` over our model gives transformers'
    ``generate`` tokens exactly (2 rows, 4 canvases of 16, at most 8 steps each). The checkpoint's canvases settle
    at different steps, so adaptive stopping (an argmax canvas equal to the ``stability_threshold`` before it) ends
    some canvases early, rows of one batch at different steps, while others run all 8 steps."""
    reference, ours = settling_models
    prompt, noise = _greedy_inputs(ours.config.canvas_length)
    ours_run = greedy_generate(ours, prompt, noise, 64, 8, stability_threshold, (), pad_token_id=0)
    theirs = _greedy_with_transformers(
        reference, prompt, noise, eos_token_id=None, stability_threshold=stability_threshold, **GREEDY_SETTINGS
    )
    assert torch.equal(ours_run.tokens, theirs)
    steps = [s for canvas in ours_run.steps for s in canvas]
    assert len(ours_run.steps) == 4 and min(steps) < 8 and max(steps) == 8
    assert any(rows[0] != rows[1] for rows in ours_run.steps)


def test_greedy_generation_stops_on_a_stop_token_like_transformers(settling_models) -> None:
    """With a stop token that row 0 produces in its second canvas, both cut each row after its first stop token
    and pad the rest of it and every later canvas of it: the same tokens, row 0 all padding after the stop."""
    reference, ours = settling_models
    prompt, noise = _greedy_inputs(ours.config.canvas_length)
    free_run = greedy_generate(ours, prompt, noise, 64, 8, 1, (), pad_token_id=0)
    stop = int(free_run.tokens[0, 11 + 16 + 5])
    ours_run = greedy_generate(ours, prompt, noise, 64, 8, 1, (stop,), pad_token_id=0)
    theirs = _greedy_with_transformers(
        reference, prompt, noise, eos_token_id=[stop], stability_threshold=1, **GREEDY_SETTINGS
    )
    assert torch.equal(ours_run.tokens, theirs)
    generated = ours_run.tokens[0, 11:]
    first_stop = int((generated == stop).nonzero()[0])
    assert first_stop <= 16 + 5 and (generated[first_stop + 1 :] == 0).all()


@current_transformers
def test_published_geometry_gives_transformers_tensor_names_and_shapes() -> None:
    """Built on the meta device from the DiffusionGemma-26B-A4B-it config, our model's tensors are exactly the
    names and shapes transformers' model of that config saves: its decoder's text weights and the encoder's layer
    scalars (lm_head and the encoder's other weights are tied to the decoder's, so not saved); full-attention
    layers have no ``v_proj``."""
    config = DiffusionGemmaConfig.from_dict(DIFFUSION_GEMMA_26B_CONFIG)
    with torch.device("meta"):
        ours = DiffusionGemmaForDiffusionLM(config)
        reference = DiffusionGemmaForBlockDiffusion(
            HFDiffusionGemmaConfig(**{k: v for k, v in DIFFUSION_GEMMA_26B_CONFIG.items() if k != "model_type"})
        )
    saved = {
        name: tuple(t.shape)
        for name, t in reference.state_dict().items()
        if name.startswith("model.decoder.")
        or (name.startswith("model.encoder.language_model.") and "layer_scalar" in name)
    }
    mine = {name: tuple(t.shape) for name, t in ours.state_dict().items() if name != "lm_head.weight"}
    assert mine == saved
    assert "model.decoder.layers.5.self_attn.v_proj.weight" not in mine
    assert mine["model.decoder.layers.5.self_attn.k_proj.weight"] == (2 * 512, 2816)


def test_vision_weights_are_skipped_and_loading_is_otherwise_strict(folder: Path, tmp_path: Path) -> None:
    """The folder holds a vision tower (loaded by nobody); any missing or extra text tensor is an error that
    names it."""
    tensors = load_file(str(folder / "model.safetensors"))
    assert any(name.startswith("model.encoder.vision_tower.") for name in tensors)
    for case, edit in {
        "missing": lambda t: t.pop("model.encoder.language_model.layers.2.layer_scalar"),
        "unexpected": lambda t: t.__setitem__("model.decoder.layers.2.self_attn.v_proj.weight", torch.zeros(32, 64)),
    }.items():
        broken = tmp_path / case
        broken.mkdir()
        (broken / "config.json").write_text((folder / "config.json").read_text())
        edited = dict(tensors)
        edit(edited)
        save_file(edited, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=case) as error:
            load_diffusion_gemma(broken)
        assert "layers.2." in str(error.value)


def test_bad_inputs_are_refused_with_the_field_named(models) -> None:
    """Image placeholders (text only), ids outside the vocabulary, an empty prompt, a canvas of the wrong length
    and a malformed self-conditioning mask."""
    _, ours = models
    image = ours.config.image_token_id
    assert image is not None
    with pytest.raises(ValueError, match=f"image_token_id {image}"):
        ours.encode(torch.tensor([[FIRST_TOKEN, image]]))
    with pytest.raises(ValueError, match=r"input_ids must hold token ids in \[0, 384\)"):
        ours.encode(torch.tensor([[FIRST_TOKEN, 384]]))
    with pytest.raises(ValueError, match="input_ids has no tokens"):
        ours.encode(torch.zeros(1, 0, dtype=torch.long))
    context = ours.encode(torch.tensor([[FIRST_TOKEN, FIRST_TOKEN + 1]]))
    with pytest.raises(ValueError, match="canvas_length is 16"):
        ours.denoise_step(torch.zeros(1, 8, dtype=torch.long), context)
    canvas, previous = torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, ours.config.vocab_size)
    with pytest.raises(ValueError, match=r"self_conditioning_mask must be a bool tensor of shape \[1\]"):
        ours.denoise_step(canvas, context, previous, self_conditioning_mask=torch.ones(1))


def test_batched_denoising_over_contexts_of_different_lengths_equals_one_row_at_a_time(models) -> None:
    """`denoise_hidden` (the engine's batched decoder pass) over three canvases whose prompts differ in length
    (one shorter than the sliding window, two longer), with self-conditioning on for two rows and off for one,
    gives each row the logits `denoise_step` gives it alone."""
    _, ours = models
    g = torch.Generator().manual_seed(5)
    C = ours.config.canvas_length
    contexts = [ours.encode(_tokens(g, 1, n)) for n in (5, 13, 21)]
    canvases = _tokens(g, 3, C)
    vocab = ours.config.vocab_size
    previous = [None, torch.randn(1, C, vocab, generator=g), torch.randn(1, C, vocab, generator=g)]
    soft = torch.cat([
        torch.zeros(1, C, ours.config.hidden_size) if p is None else ours.soft_embeddings(p) for p in previous
    ])  # fmt: skip
    batched = ours.logits(ours.denoise_hidden(canvases, contexts, soft))
    for row, (context, logits) in enumerate(zip(contexts, previous, strict=True)):
        alone = ours.denoise_step(canvases[row : row + 1], context, logits)
        torch.testing.assert_close(batched[row : row + 1], alone, atol=ATOL, rtol=0)


def _experts_impl(model: DiffusionGemmaForDiffusionLM, impl: str | None) -> None:
    for layer in model.layers:
        layer.experts.impl = impl


@pytest.fixture(scope="module")
def device_model(folder: Path) -> DiffusionGemmaForDiffusionLM:
    return load_diffusion_gemma(folder, device=DEVICE)


def test_encoder_and_decoder_on_the_fused_experts_equal_the_exact_loop(device_model) -> None:
    """Every layer's experts on the fused Triton kernels (GELU-tanh epilogue): the encoder's K/V and a decoder
    pass with self-conditioning give what the exact per-expert loop gives, float32, up to summation order."""
    model = device_model
    g = torch.Generator().manual_seed(6)
    prompt = _tokens(g, 2, PROMPT_LEN).to(DEVICE)
    canvas = _tokens(g, 2, model.config.canvas_length, low=0, high=384).to(DEVICE)
    previous = (torch.randn(2, model.config.canvas_length, model.config.vocab_size, generator=g) * 4).to(DEVICE)
    try:
        _experts_impl(model, "loop")
        context = model.encode(prompt)
        expected = model.denoise_step(canvas, context, previous)
        _experts_impl(model, "fused")
        fused_context = model.encode(prompt)
        got = model.denoise_step(canvas, fused_context, previous)
    finally:
        _experts_impl(model, None)
    for ours, theirs in zip(fused_context.keys + fused_context.values, context.keys + context.values, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _bf16_experts(rows: int, seed: int) -> tuple[StackedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    experts = StackedExperts(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(8, 64, 64, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(8, 64, 32, generator=g) * 0.3)
    x = torch.randn(rows, 64, generator=g)
    chosen = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    return experts.to(DEVICE, torch.bfloat16), x.to(DEVICE, torch.bfloat16), weights.to(DEVICE), chosen.to(DEVICE)


@pytest.mark.parametrize("rows", [1, 40])
def test_bf16_fused_experts_round_like_the_static_paths(rows: int) -> None:
    """bf16: the fused kernels round each expert's GEMMs, its GELU and the product as the static paths' separate
    ops do and sum the slots in float32 in slot order, so they agree with every expert over every row (and the
    grouped GEMM where torch has one) to a few units in the last place."""
    experts, x, weights, chosen = _bf16_experts(rows, seed=rows)
    experts.impl = "fused"
    out = experts(x, weights, chosen)
    impls = ["dense"] + (["grouped"] if grouped_mm_supported(x) else [])
    for impl in impls:
        experts.impl = impl
        expected = experts(x, weights, chosen)
        atol = BF16_ULPS * torch.finfo(torch.bfloat16).eps * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0, msg=impl)


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="the choice is CUDA's")
def test_canvases_of_the_published_geometry_take_the_fused_experts_up_to_eight_per_step() -> None:
    """DiffusionGemma-26B-A4B's experts (128 of 2816 x 704, top 8) over 256-row canvases in bf16: 1 to 8 canvases
    per step on the fused kernels (measured faster there), more on the grouped GEMM (or every expert without one);
    float32 never on the fused kernels' decode tiles."""
    text = DIFFUSION_GEMMA_26B_TEXT_CONFIG
    with torch.device("meta"):
        experts = StackedExperts(
            text["num_experts"], text["hidden_size"], text["moe_intermediate_size"], text["top_k_experts"]
        )
    canvas = DIFFUSION_GEMMA_26B_CONFIG["canvas_length"]

    def rows(canvases: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(canvases * canvas, text["hidden_size"], device="cuda", dtype=dtype)

    larger = "grouped" if grouped_mm_supported(rows(1)) else "dense"
    assert all(experts.impl_for(rows(canvases)) == "fused" for canvases in (1, 2, 4, 8))
    assert experts.impl_for(rows(9)) == larger and experts.impl_for(rows(16)) == larger
    assert experts.impl_for(rows(1, torch.float32)) == "dense"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_experts_captured_in_a_graph_replay_with_new_routing_gpu() -> None:
    """The fused path asks the host nothing: a graph captured on one routing computes another's, as an eager call
    on it does (bit for bit: the same kernels on the same inputs)."""
    experts, x, weights, chosen = _bf16_experts(40, seed=3)
    experts.impl = "fused"
    experts(x, weights, chosen)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, weights, chosen)
    _, new_x, new_weights, new_chosen = _bf16_experts(40, seed=4)
    x.copy_(new_x)
    weights.copy_(new_weights)
    chosen.copy_(new_chosen)
    graph.replay()
    torch.testing.assert_close(out, experts(x, weights, chosen), atol=0, rtol=0)
