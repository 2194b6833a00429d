"""What every family does, checked the same way for each family of `family_harness.CASES`: its checkpoint loads
under the checkpoint's own tensor names, its forward is the network written out by hand (and transformers' one),
the engine takes the family's defaults, and it decodes exactly like the reference decoder under each strategy the
family runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from family_harness import (
    CASES,
    FamilyCase,
    assert_checkpoint_matches_transformers,
    assert_forward_matches_reference,
    check_d2f,
    check_first_token_comes_from_the_last_prompt_position,
    check_multi_bd_batch_with_preemption,
    check_prefix_cache_hit,
    make_engine,
)
from safetensors.torch import load_file

from diffulex.models.family import FAMILIES, Family
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import tiny_special_token_ids, tiny_tokenizer_len


def _cases(keep: Callable[[FamilyCase], bool] = lambda case: True) -> list:
    return [pytest.param(case, id=case.name) for case in CASES if keep(case)]


def _family(case: FamilyCase) -> Family:
    return FAMILIES.get(case.name)


DECODED = _cases(lambda case: case.decodes_here)
SHIFTED = [
    pytest.param(case, strategy, id=f"{case.name}-{strategy}")
    for case in CASES
    if _family(case).logits_shift
    for strategy in ("multi_bd", "d2f")[: 2 if case.runs_d2f else 1]
]


@pytest.mark.parametrize("case", _cases())
def test_weights_round_trip_under_the_checkpoint_names(case, family_checkpoint):
    ckpt = family_checkpoint(case.name, "small")
    model = build_model(case.name, ckpt, torch.float32, "cpu")
    saved = load_file(str(ckpt / "model.safetensors"))
    assert set(model.state_dict()) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("case", _cases())
def test_forward_equals_the_network_written_out_by_hand(case, family_checkpoint):
    ckpt = family_checkpoint(case.name, "small")
    model = build_model(case.name, ckpt, torch.float32, "cpu")
    assert_forward_matches_reference(model, ckpt, tiny_tokenizer_len(case.name))


@pytest.mark.parametrize("case", _cases(lambda case: case.transformers is not None))
def test_forward_equals_the_transformers_model_of_the_same_tensors(case, family_checkpoint):
    ckpt = family_checkpoint(case.name, "small")
    model = build_model(case.name, ckpt, torch.float32, "cpu")
    assert_checkpoint_matches_transformers(model, case.transformers, ckpt, tiny_tokenizer_len(case.name))


@pytest.mark.parametrize(
    "case", _cases(lambda case: _family(case).default_strategy in ("multi_bd", "d2f"))
)
def test_the_engine_takes_the_family_strategy_logit_shift_and_mask_token(case, family_checkpoint):
    family = _family(case)
    with make_engine(family_checkpoint(case.name, "peaky"), decoding_strategy=None, **case.engine) as llm:
        assert llm.config.decoding_strategy == family.default_strategy
        assert llm.settings.logits_shift == family.logits_shift
        assert llm.mask_token_id == tiny_special_token_ids(case.name)[case.mask_token]


@pytest.mark.parametrize("case", DECODED)
def test_engine_matches_reference_with_preemption(case, family_checkpoint):
    check_multi_bd_batch_with_preemption(family_checkpoint(case.name, "peaky"), case.force_always, **case.engine)


@pytest.mark.parametrize("case", DECODED)
def test_engine_matches_reference_with_a_prefix_cache_hit(case, family_checkpoint):
    check_prefix_cache_hit(family_checkpoint(case.name, "peaky"), case.force_always, **case.engine)


@pytest.mark.parametrize("case", _cases(lambda case: case.decodes_here and case.runs_d2f))
def test_engine_matches_reference_under_d2f(case, family_checkpoint):
    check_d2f(family_checkpoint(case.name, "peaky"), case.force_always, **case.engine)


@pytest.mark.parametrize(("case", "strategy"), SHIFTED)
def test_a_shifted_family_generates_its_first_token_from_the_last_prompt_position(case, strategy, family_checkpoint):
    peaky = family_checkpoint(case.name, "peaky")
    check_first_token_comes_from_the_last_prompt_position(peaky, decoding_strategy=strategy, **case.engine)
