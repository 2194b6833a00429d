"""The generalisation report of a trained checkpoint: two disjoint test sets and the issue's targets."""

from __future__ import annotations

import pytest

from diffulex.train.evaluate import check_targets, evaluate_setting, evaluation_sets


def row(name: str, k: int, tau: float, accuracy: float, tpf: float) -> dict:
    return {"set": name, "buffer_size": k, "accept_threshold": tau, "accuracy": accuracy, "tpf": tpf}


def test_the_test_sets_are_unseen_problems_and_unseen_structures() -> None:
    from diffulex.train.data import training_problems

    sets = evaluation_sets(100)
    assert set(sets) == {"train-templates", "held-out-templates", "held-out-pieces"}
    assert all(len(v) == 100 for v in sets.values())
    trained = {p["question"] for p in training_problems(5000)}
    assert not trained & {p["question"] for v in sets.values() for p in v}
    # same seed, other templates: problems of the same kind share their numbers but not their sentences
    assert not {p["question"] for p in sets["train-templates"]} & {p["question"] for p in sets["held-out-templates"]}


def test_targets_hold_only_when_both_accuracies_and_the_tpf_hold_at_one_buffer_size_1_setting() -> None:
    good = [row("train-templates", 1, 0.9, 0.97, 3.1), row("held-out-templates", 1, 0.9, 0.85, 3.0),
            row("train-templates", 2, 0.9, 0.40, 6.0), row("held-out-templates", 2, 0.9, 0.30, 6.0)]  # fmt: skip
    t = check_targets(good)
    assert t["all_met"] and t["accept_threshold"] == 0.9 and t["tpf"] == 3.0  # buffer 2 rows do not count
    slow = [row("train-templates", 1, 0.9, 0.97, 2.4), row("held-out-templates", 1, 0.9, 0.85, 3.0)]
    assert check_targets(slow)["met"] == {"train-templates": True, "held-out-templates": True,
                                          "tpf_buffer_size_1": False}  # fmt: skip
    weak = [row("train-templates", 1, 0.5, 0.99, 3.0), row("held-out-templates", 1, 0.5, 0.79, 3.0),
            row("train-templates", 1, 0.9, 0.94, 3.0), row("held-out-templates", 1, 0.9, 0.78, 3.0)]  # fmt: skip
    t = check_targets(weak)
    assert t["accept_threshold"] == 0.5 and t["met"]["held-out-templates"] is False and not t["all_met"]
    assert check_targets([row("train-templates", 2, 0.9, 1.0, 6.0)])["checked"] is False


def test_an_unknown_prompt_format_is_refused_before_building_an_engine() -> None:
    with pytest.raises(ValueError, match=r"prompt_format='raw' is invalid: must be one of chat, qa"):
        evaluate_setting("/nonexistent", {}, buffer_size=1, accept_threshold=0.9, prompt_format="raw")
