"""SamplingParams validation: one test per rule."""

from __future__ import annotations

import pytest

from diffulex.sampling_params import SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1.0, 1.0, 0, 512)
    assert sp.max_nfe is None and sp.max_repetition_run is None and sp.seed is None and sp.stop is None
    assert sp.ignore_eos is False
    assert not sp.greedy


def test_temperature_zero_means_greedy():
    assert SamplingParams(temperature=0).greedy
    assert isinstance(SamplingParams(temperature=0).temperature, float)


@pytest.mark.parametrize(
    "value", [-0.1, float("nan"), float("inf"), 1e308, 100.5, 10**400, "0.5", "Infinity", None, True]
)
def test_temperature_must_be_a_number_from_zero_to_the_maximum(value):
    with pytest.raises(ValueError, match=r"^temperature=.* is invalid: must be a number in \[0, 100\]$"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value", [1e-40, 1e-320, 5e-324, 9.9e-6])
def test_temperatures_too_small_to_draw_with_are_greedy(value):
    sp = SamplingParams(temperature=value)
    assert sp.temperature == 0.0 and sp.greedy


def test_the_smallest_drawing_temperature_and_the_maximum_are_kept():
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    assert SamplingParams(temperature=100).temperature == 100.0


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("temperature", -1, "temperature=-1 is invalid"),
        ("top_k", "x", "top_k='x' is invalid"),
        ("max_tokens", 0, "max_tokens=0 is invalid"),
        ("stop", "", "stop='' is invalid"),
    ],
)
def test_assigning_a_field_after_construction_is_validated_too(field, value, pattern):
    sp = SamplingParams()
    with pytest.raises(ValueError, match=pattern):
        setattr(sp, field, value)
    assert getattr(sp, field) == getattr(SamplingParams(), field)  # the bad value never landed


def test_assigning_a_valid_value_normalizes_it_like_the_constructor():
    sp = SamplingParams()
    sp.top_k = -1
    sp.temperature = 1e-30
    assert (sp.top_k, sp.temperature, sp.greedy) == (0, 0.0, True)


def test_a_misspelled_field_is_refused_naming_the_real_ones():
    sp = SamplingParams()
    with pytest.raises(AttributeError, match="no field 'temprature'.*temperature"):
        sp.temprature = 0.5  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [0, -0.5, 1.01])
def test_top_p_must_be_in_zero_one(value):
    with pytest.raises(ValueError, match=r"^top_p=.* is invalid: must be a number in \(0, 1\]$"):
        SamplingParams(top_p=value)


def test_top_p_of_one_is_accepted():
    assert SamplingParams(top_p=1).top_p == 1.0


def test_top_k_minus_one_is_normalized_to_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("value", [-2, 1.5, True])
def test_top_k_must_be_disabled_or_positive(value):
    with pytest.raises(
        ValueError, match=r"^top_k=.* is invalid: must be 0 or -1 \(disabled\) or an integer >= 1$"
    ):
        SamplingParams(top_k=value)


def test_positive_top_k_is_kept():
    assert SamplingParams(top_k=50).top_k == 50


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_tokens_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="^max_tokens=.* is invalid: must be an integer > 0$"):
        SamplingParams(max_tokens=value)


def test_string_max_tokens_is_rejected_with_the_value_quoted():
    with pytest.raises(ValueError) as e:
        SamplingParams(max_tokens="10")
    assert str(e.value) == "max_tokens='10' is invalid: must be an integer > 0"


@pytest.mark.parametrize("value", [0, -3, 2.0, False])
def test_max_nfe_must_be_a_positive_integer_when_set(value):
    with pytest.raises(ValueError, match="^max_nfe=.* is invalid: must be an integer > 0$"):
        SamplingParams(max_nfe=value)


@pytest.mark.parametrize("value", [1, 0, -3, 2.0, False])
def test_a_repetition_run_is_at_least_two_tokens(value):
    # a run of one token is every answer's first token: 1 would end each request there
    with pytest.raises(ValueError, match="^max_repetition_run=.* is invalid: must be an integer >= 2$"):
        SamplingParams(max_repetition_run=value)


def test_optional_caps_are_kept_when_valid():
    sp = SamplingParams(max_nfe=64, max_repetition_run=8)
    assert (sp.max_nfe, sp.max_repetition_run) == (64, 8)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_ignore_eos_must_be_a_bool(value):
    with pytest.raises(ValueError, match="^ignore_eos=.* is invalid: must be True or False$"):
        SamplingParams(ignore_eos=value)


@pytest.mark.parametrize("value", [-1, 1.0, True, 2**63])
def test_seed_must_be_a_non_negative_64_bit_integer(value):
    with pytest.raises(ValueError, match=r"^seed=.* is invalid: must be an integer in \[0, 9223372036854775807\]$"):
        SamplingParams(seed=value)


def test_seed_is_kept():
    assert SamplingParams(seed=1234).seed == 1234


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


def test_stop_lists_and_tuples_become_lists():
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_an_empty_stop_list_means_no_stop_strings():
    assert SamplingParams(stop=[]).stop is None


@pytest.mark.parametrize("value", ["", ["ok", ""], [1], 3])
def test_empty_or_non_string_stop_values_are_rejected(value):
    with pytest.raises(
        ValueError, match="^stop=.* is invalid: must be a non-empty string or a list of non-empty"
    ):
        SamplingParams(stop=value)
