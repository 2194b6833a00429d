"""PEFT LoRA adapters: merged == unmerged == the adapter applied by hand; mismatched adapters are clear errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex import Diffulex, SamplingParams
from diffulex.attention import DenseAttentionMetadata, visibility_mask
from diffulex.lora import apply_lora
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import write_tiny_checkpoint, write_tiny_lora_adapter
from diffulex.testing.reference_decoder import reference_generate
from diffulex.testing.tolerance import assert_close_up_to_reordering

# (family, targets): D2F-Dream and D2F-LLaDA are published as adapters on these two families. The LLaDA case
# targets the MLP names, whose "ff_out" also selects the LM head model.transformer.ff_out (PEFT suffix match).
CASES = [
    ("dream", ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    ("llada", ["q_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]),
    ("stable_diffcoder", ["gate_proj", "up_proj", "down_proj", "lm_head"]),
]
TOKENS, RANK = 13, 4
# The float32 reductions that feed one logit of the tiny checkpoints (2 layers, hidden 64, 4 heads of 16,
# intermediate 128): per layer q/k/v (64), q.k (16), the weighted sum of values (TOKENS), o_proj (64), gate/up (64),
# down (128) and an unmerged adapter (RANK); then the LM head (64). Merged, unmerged and by-hand models add them
# in different orders.
LOGIT_TERMS = 2 * (64 + 16 + TOKENS + 64 + 64 + 128 + RANK) + 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    out = {}
    for family, targets in CASES:
        root = tmp_path_factory.mktemp(f"lora-{family}")
        base = write_tiny_checkpoint(root / "base", family=family, seed=11, init_std=1.0)
        adapter = write_tiny_lora_adapter(root / "adapter", base, family, r=RANK, targets=targets, seed=3)
        out[family] = (base, adapter)
    return out


def by_hand(family: str, base: Path, adapter: Path) -> torch.nn.Module:
    """A plain model whose weights are W + (alpha / r) * B @ A, computed here from the two folders' files."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    model = build_model(family, base, torch.float32, "cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    updated = 0
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = module + ".weight"
        state[name] = (state[name].double() + scaling * (b.double() @ a.double())).float()
        updated += 1
    assert updated == len(lora) // 2
    model.load_state_dict(state, strict=True)
    return model


def logits_of(model: torch.nn.Module, n: int = TOKENS) -> torch.Tensor:
    ids = torch.randint(0, 370, (n,), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(n)
    with torch.inference_mode():
        hidden = model(ids, pos, DenseAttentionMetadata(visibility_mask(pos, pos, 4, False, 0)))
        return model.compute_logits(hidden)


def decode(model: torch.nn.Module, prompt: list[int], mask_id: int, shift: bool) -> list[int]:
    return reference_generate(
        model, prompt, mask_token_id=mask_id, block_size=4, buffer_size=2, max_tokens=16, max_model_len=64,
        accept_threshold=0.7, vocab_limit=370, logits_shift=shift, ignore_eos=True,
    ).token_ids  # fmt: skip


@pytest.mark.parametrize(("family", "targets"), CASES)
def test_merged_unmerged_and_by_hand_agree(folders, family, targets):
    base_dir, adapter = folders[family]
    base = build_model(family, base_dir, torch.float32, "cpu")
    merged = build_model(family, base_dir, torch.float32, "cpu", lora_path=adapter, merge_lora=True)
    unmerged = build_model(family, base_dir, torch.float32, "cpu", lora_path=adapter, merge_lora=False)
    hand = by_hand(family, base_dir, adapter)

    # Unmerged keeps the base weights (state_dict unchanged), merged holds the by-hand weights.
    for name, tensor in base.state_dict().items():
        assert torch.equal(unmerged.state_dict()[name], tensor), name
        torch.testing.assert_close(merged.state_dict()[name], hand.state_dict()[name], atol=1e-5, rtol=1e-5)
    assert sorted(merged.lora_modules) == sorted(unmerged.lora_modules)
    assert all(any(m == t or m.endswith("." + t) for t in targets) for m in merged.lora_modules)

    expected = logits_of(hand)
    scale = expected.abs().max().item()  # peaky weights: logits in the hundreds, float32 rounding scales with them
    assert_close_up_to_reordering(logits_of(merged), expected, LOGIT_TERMS, magnitude=scale)
    assert_close_up_to_reordering(logits_of(unmerged), expected, LOGIT_TERMS, magnitude=scale)
    assert (logits_of(base) - expected).abs().max() > 0.1 * scale, "the adapter should change the model"

    mask_id, shift = base.config.mask_token_id, bool(getattr(base, "logits_shift", False))
    prompts = [[7, 21, 5, 99, 3], [42, 8, 17, 250, 31, 6, 9, 1]]
    changed = 0
    for prompt in prompts:
        tokens = decode(hand, prompt, mask_id, shift)
        assert decode(merged, prompt, mask_id, shift) == tokens
        assert decode(unmerged, prompt, mask_id, shift) == tokens
        changed += decode(base, prompt, mask_id, shift) != tokens
    assert changed, "the adapter should change the decoded tokens"


def test_the_llada_lm_head_is_adapted_through_its_checkpoint_name(folders):
    base_dir, adapter = folders["llada"]
    model = build_model("llada", base_dir, torch.float32, "cpu", lora_path=adapter)
    assert "model.transformer.ff_out" in model.lora_modules
    assert "model.transformer.blocks.1.ff_out" in model.lora_modules


# ----- errors -------------------------------------------------------------------------------------------------


@pytest.fixture()
def dream(folders, tmp_path) -> tuple[Path, Path]:
    """The Dream base and a private copy of its adapter that a test may break."""
    base, adapter = folders["dream"]
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    return base, copy


def edit_config(adapter: Path, **changes) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))


def edit_tensors(adapter: Path, edit) -> None:
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))


def load(base: Path, adapter: Path, merge: bool = False) -> torch.nn.Module:
    return build_model("dream", base, torch.float32, "cpu", lora_path=adapter, merge_lora=merge)


def test_missing_files_are_named(dream):
    base, adapter = dream
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(ValueError, match="no adapter_model.safetensors.*adapter_model.bin.*pickle"):
        load(base, adapter)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load(base, adapter)
    with pytest.raises(ValueError, match="does not exist"):
        load(base, adapter / "nope")


def test_target_modules_that_match_nothing_are_named(dream):
    base, adapter = dream
    edit_config(adapter, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "c_attn"])
    with pytest.raises(ValueError, match="target_modules that match no layer of the model: c_attn"):
        load(base, adapter)


def test_tensors_outside_the_targets_are_named(dream):
    base, adapter = dream
    edit_config(adapter, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(ValueError, match=r"outside target_modules.*model\.layers\.0\.mlp\.down_proj"):
        load(base, adapter)


def test_targeted_layers_without_tensors_are_named(dream):
    base, adapter = dream
    edit_config(adapter, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "gate_proj"])
    with pytest.raises(ValueError, match=r"targeted layers without adapter tensors: model\.layers\.0\.mlp\.gate_proj"):
        load(base, adapter)


def test_keys_that_name_no_layer_are_named(dream):
    base, adapter = dream

    def rename(tensors):
        for which in ("A", "B"):
            old = f"base_model.model.model.layers.1.self_attn.q_proj.lora_{which}.weight"
            tensors[old.replace("layers.1", "layers.7")] = tensors.pop(old)

    edit_tensors(adapter, rename)
    with pytest.raises(ValueError, match=r"layers the model does not have: model\.layers\.7\.self_attn\.q_proj.*"
                                         r"without adapter tensors: model\.layers\.1\.self_attn\.q_proj"):
        load(base, adapter)


def test_an_adapter_for_another_model_size_is_a_shape_error(folders, tmp_path):
    base, _ = folders["dream"]
    other = write_tiny_checkpoint(tmp_path / "wide", family="dream", hidden_size=32, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=48)
    adapter = write_tiny_lora_adapter(tmp_path / "a", other, "dream", targets=["q_proj"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: lora_A \[4, 32\].*do not fit"):
        build_model("dream", base, torch.float32, "cpu", lora_path=adapter)


def test_unsupported_adapter_kinds_are_refused(dream):
    base, adapter = dream
    edit_config(adapter, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        load(base, adapter)
    edit_config(adapter, use_dora=False, peft_type="IA3")
    with pytest.raises(ValueError, match="only LoRA"):
        load(base, adapter)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("target_parameters", ["mlp.experts.gate_up_proj"], "adapted parameters"),
     ("trainable_token_indices", [3, 4], "trained token embeddings"),
     ("alora_invocation_tokens", [7, 8], "activated LoRA")],
)  # fmt: skip
def test_peft_features_this_engine_does_not_compute_are_refused_by_name(dream, field, value, message):
    base, adapter = dream
    edit_config(adapter, **{field: value})
    with pytest.raises(ValueError, match=rf"not supported: {field} \({message}\)"):
        load(base, adapter)


def test_excluded_modules_are_not_targeted(dream):
    base, adapter = dream
    expected = logits_of(load(base, adapter))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "gate_proj"]
    edit_config(adapter, target_modules=targets, exclude_modules=["gate_proj"])  # the file has no gate_proj tensors
    assert torch.equal(logits_of(load(base, adapter)), expected)
    edit_config(adapter, exclude_modules=r".*layers\.0\.mlp\.gate_proj")  # a regex excludes layer 0's only
    with pytest.raises(ValueError, match=r"without adapter tensors: model\.layers\.1\.mlp\.gate_proj$"):
        load(base, adapter)
    edit_config(adapter, target_modules=targets[:-1], exclude_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"outside target_modules=.*exclude_modules=\['q_proj'\]: .*q_proj"):
        load(base, adapter)
    edit_config(adapter, exclude_modules="(")
    with pytest.raises(ValueError, match="exclude_modules.*not a valid regular expression"):
        load(base, adapter)


def test_applying_twice_is_an_error(folders):
    base, adapter = folders["dream"]
    model = load(base, adapter)
    with pytest.raises(ValueError, match="already carries a LoRA"):
        apply_lora(model, adapter)


def test_rslora_and_rank_pattern_set_the_scale(dream):
    base, adapter = dream
    plain = logits_of(load(base, adapter))
    edit_config(adapter, use_rslora=True, lora_alpha=4)  # r = 4: alpha / sqrt(r) = 2 = the default alpha / r
    torch.testing.assert_close(logits_of(load(base, adapter)), plain)


# ----- engine -------------------------------------------------------------------------------------------------


def test_use_lora_without_a_path_is_a_clear_error(folders):
    base, _ = folders["dream"]
    with pytest.raises(ValueError, match="use_lora=True requires lora_path"):
        Diffulex(str(base), use_lora=True)


def test_the_engine_decodes_like_the_reference_with_either_lora_path(folders):
    """The engine hands ``lora_path``/``pre_merge_lora`` to ``build_model``: merged or added per forward, it decodes
    as the reference decoder over the adapted model."""
    base, adapter = folders["dream"]
    outputs = {}
    for merge in (True, False):
        llm = Diffulex(str(base), use_lora=True, lora_path=str(adapter), pre_merge_lora=merge,
                       decoding_strategy="d2f", block_size=4, page_size=8, buffer_size=2, max_model_len=64,
                       max_num_batched_tokens=256, accept_threshold=0.7)  # fmt: skip
        with llm:
            assert llm.model.lora_merged is merge and llm.model.lora_modules
            prompts = [[7, 21, 5, 99, 3], [42, 8, 17, 250, 31, 6, 9, 1]]
            out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
            outputs[merge] = [t.token_ids for t in out.trajectories]
            for prompt, tokens in zip(prompts, outputs[merge], strict=True):
                ref = reference_generate(
                    llm.model, prompt, mask_token_id=llm.mask_token_id, block_size=4, buffer_size=2, max_tokens=12,
                    max_model_len=64, accept_threshold=0.7, vocab_limit=llm.vocab_limit, logits_shift=True,
                    prefix_full=True, ignore_eos=True,
                )  # fmt: skip
                assert tokens == ref.token_ids
    assert outputs[True] == outputs[False]


# ----- adapter_config.json values and adapter tensors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora_alpha": float("inf")}, r"lora_alpha=inf is invalid: must be a finite number > 0"),
        ({"lora_alpha": float("nan")}, r"lora_alpha=nan is invalid: must be a finite number > 0"),
        ({"lora_alpha": 0}, r"lora_alpha=0 is invalid: must be a finite number > 0"),
        ({"alpha_pattern": {"q_proj": 0}}, r"alpha_pattern\['q_proj'\]=0 is invalid: must be a finite number > 0"),
        ({"alpha_pattern": {"q_proj": float("inf")}}, r"alpha_pattern\['q_proj'\]=inf is invalid"),
        ({"alpha_pattern": {"q_proj": -2}}, r"alpha_pattern\['q_proj'\]=-2 is invalid"),
        # finite, but lora_alpha / r = 2.5e307 is far beyond float32, the precision the scale is applied in
        ({"lora_alpha": 1e308}, r"model\.layers\.0\.\S+: the scale lora_alpha / r = 1e\+308 / 4 = 2\.5e\+307 is "
                                r"outside float32's range"),
        # positive, but a scale below float32's normal range would silently drop the adapter
        ({"lora_alpha": 1e-40}, r"the scale lora_alpha / r = 1e-40 / 4 = 2\.5e-41 is outside float32's range"),
    ],
)
def test_non_finite_or_non_positive_scales_are_refused(dream, changes, message):
    """Before: Infinity/NaN/1e308 loaded and every request decoded nothing (NaN logits); alpha_pattern 0 loaded."""
    base, adapter = dream
    edit_config(adapter, **changes)
    for merge in (False, True):
        with pytest.raises(ValueError, match=message):
            load(base, adapter, merge)


def test_a_delta_beyond_the_layer_dtype_is_refused(dream):
    """Every adapter value is finite, but s·B@A overflows float16: merged it would be Inf weights, per forward Inf
    activations."""
    base, adapter = dream

    def grow(tensors):
        key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
        tensors[key] = tensors[key] * 1e5

    edit_tensors(adapter, grow)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: s·B@A reaches [0-9.e+]+, beyond the "
                                         r"largest float16 value 6\.55e\+04"):
        build_model("dream", base, torch.float16, "cpu", lora_path=adapter)
    load(base, adapter)  # float32 holds it


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_adapter_tensors_are_named_with_their_file(dream, bad):
    base, adapter = dream
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def poison(tensors):
        tensors[key][0, :3] = bad

    edit_tensors(adapter, poison)
    with pytest.raises(ValueError, match=rf"adapter_model\.safetensors has non-finite values \(NaN or Inf\).*"
                                         rf"{key.replace('.', '[.]')} \(3 of 256 values\)"):
        load(base, adapter)


def test_an_unreadable_safetensors_file_is_a_value_error_naming_it(dream):
    base, adapter = dream
    (adapter / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors cannot be read as safetensors"):
        load(base, adapter)


BAD_CONFIG_VALUES = [
    ({"target_modules": "q_proj["}, r"target_modules='q_proj\[' is invalid: not a valid regular expression"),
    ({"target_modules": ["q_proj", 3]}, r"target_modules=\['q_proj', 3\] is invalid"),
    ({"target_modules": ["q_proj", ""]}, r"target_modules=\['q_proj', ''\] is invalid"),
    ({"alpha_pattern": {"q_proj[": 2}}, r"alpha_pattern has the key 'q_proj\[', which is not a valid regular"),
    ({"rank_pattern": {"(q_proj": 4}}, r"rank_pattern has the key '\(q_proj', which is not a valid regular"),
    ({"modules_to_save": 3}, r"modules_to_save=3 is invalid: must be a list of module names"),
    ({"modules_to_save": "lm_head"}, r"modules_to_save='lm_head' is invalid: must be a list of module names"),
    ({"layers_pattern": 5}, r"layers_pattern=5 is invalid"),
    ({"layers_pattern": ["layers", ""]}, r"layers_pattern=\['layers', ''\] is invalid"),
    ({"rank_pattern": [1, 2]}, r"rank_pattern=\[1, 2\] is invalid: must be a mapping"),
    ({"alpha_pattern": "q_proj"}, r"alpha_pattern='q_proj' is invalid: must be a mapping"),
    ({"rank_pattern": {"q_proj": "abc"}}, r"rank_pattern\['q_proj'\]='abc' is invalid: must be an integer > 0"),
    ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\]=0 is invalid: must be an integer > 0"),
    ({"rank_pattern": {"q_proj": -4}}, r"rank_pattern\['q_proj'\]=-4 is invalid: must be an integer > 0"),
    ({"rank_pattern": {"q_proj": 4.0}}, r"rank_pattern\['q_proj'\]=4\.0 is invalid: must be an integer > 0"),
    ({"alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\]='x' is invalid: must be a finite number > 0"),
    ({"layers_to_transform": "0"}, r"layers_to_transform='0' is invalid: must be a layer index"),
    ({"layers_to_transform": [0, -1]}, r"layers_to_transform=\[0, -1\] is invalid: must be a layer index"),
    ({"layers_to_transform": []}, r"layers_to_transform=\[\] is invalid: .*an empty list selects no layer"),
    ({"r": "4"}, r"r='4' is invalid: must be an integer > 0"),
    ({"r": 0}, r"r=0 is invalid: must be an integer > 0"),
    ({"lora_alpha": "8"}, r"lora_alpha='8' is invalid: must be a finite number > 0"),
    ({"lora_alpha": 10**400}, r"lora_alpha=1000\d+\.\.\. \(401 characters\) is invalid: must be a finite number"),
    ({"use_rslora": "false"}, r"use_rslora='false' is invalid: must be true or false"),
    ({"use_dora": "no"}, r"use_dora='no' is invalid: must be true or false"),
    ({"bias": 3}, r"bias=3 is invalid: must be 'none'"),
    ({"base_model_name_or_path": 7}, r"base_model_name_or_path=7 is invalid: must be a string"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_CONFIG_VALUES)
def test_bad_config_values_are_value_errors_naming_the_file_and_field(dream, changes, message):
    """Before: re.error, TypeError, int()/float() messages without the field, or a silently wrong reading."""
    base, adapter = dream
    edit_config(adapter, **changes)
    with pytest.raises(ValueError) as e:
        load(base, adapter)
    assert type(e.value) is ValueError
    assert re.search(rf"{re.escape(str(adapter / 'adapter_config.json'))}: {message}", str(e.value)), str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="deep"),
        pytest.param(b'{"r": 4, "lora_alpha": "\xff"}', r"not UTF-8 text \(byte 0xff at offset 24\)", id="utf8"),
        pytest.param("[4, 8]", "does not hold a JSON object", id="list"),
        pytest.param('{"r": 4,', "is not valid JSON", id="truncated"),
    ],
)
def test_an_unreadable_config_file_is_a_value_error_naming_it(dream, text, message):
    base, adapter = dream
    path = adapter / "adapter_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as e:
        load(base, adapter)
    assert type(e.value) is ValueError
    assert str(path) in str(e.value) and re.search(message, str(e.value)), str(e.value)


def test_pattern_keys_are_matched_as_peft_does(dream):
    """PEFT matches a rank/alpha pattern key as ``(.*\\.)?(key)$``: an alternation applies to the whole suffix."""
    base, adapter = dream
    plain = logits_of(load(base, adapter))
    edit_config(adapter, r=8, lora_alpha=16, rank_pattern={"q_proj|k_proj|v_proj|o_proj|down_proj": 4},
                alpha_pattern={"q_proj|k_proj|v_proj|o_proj|down_proj": 8})  # fmt: skip
    torch.testing.assert_close(logits_of(load(base, adapter)), plain)


def test_a_file_holding_two_adapters_is_refused_naming_them(dream):
    """Before: both names' tensors went to the same layer and whichever came last was used."""
    base, adapter = dream

    def two_names(tensors):
        for key in list(tensors):
            value = tensors.pop(key)
            for name in ("default", "other"):
                tensors[key.replace(".weight", f".{name}.weight")] = value.clone()

    edit_tensors(adapter, two_names)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors holds the tensors of 2 adapters "
                                         r"\('default', 'other'\)"):
        load(base, adapter)


def test_one_named_adapter_loads_like_the_unnamed_one(dream):
    base, adapter = dream
    plain = logits_of(load(base, adapter))
    edit_tensors(adapter, lambda t: t.update({k.replace(".weight", ".default.weight"): t.pop(k) for k in list(t)}))
    torch.testing.assert_close(logits_of(load(base, adapter)), plain)


def test_lora_settings_without_use_lora_warn_that_they_have_no_effect(folders):
    """The original's YAML files may carry a lora_path with use_lora false: say it is not applied, and how it is."""
    base, adapter = folders["dream"]
    with pytest.warns(UserWarning) as record:
        llm = Diffulex(str(base), lora_path=str(adapter), pre_merge_lora=True, decoding_strategy="d2f", block_size=4,
                       page_size=8, buffer_size=2, max_model_len=64, max_num_batched_tokens=256)  # fmt: skip
    with llm:
        assert not getattr(llm.model, "lora_modules", None)
    messages = [str(w.message) for w in record]
    assert any(m.startswith(f"lora_path={str(adapter)!r} has no effect") and "use_lora=True" in m for m in messages)
    assert any(m.startswith("pre_merge_lora=True has no effect") and "use_lora=True" in m for m in messages)


def test_integer_adapter_tensors_are_refused(dream):
    base, adapter = dream
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    edit_tensors(adapter, lambda t: t.update({key: t[key].to(torch.int32)}))
    with pytest.raises(ValueError, match=rf"adapter_model\.safetensors has tensors that are not floating point: "
                                         rf"{key.replace('.', '[.]')} \(torch\.int32\)"):
        load(base, adapter)
