"""``generate``'s arguments, normalized and checked before anything is queued: one list of prompts and one
`SamplingParams` per prompt, shared by the engine and the data-parallel front."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diffulex.prompts import Prompt, all_plain_ints, is_conversation, preview
from diffulex.sampling_params import SamplingParams


def generation_inputs(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[Prompt], list[SamplingParams]]:
    """``generate``'s arguments as one list of prompts (a single prompt, text, token ids or a
    conversation, becomes a list of one) and one `SamplingParams` per prompt (one given for all, or one each).

    The shapes are checked here, before anything is queued, with an error naming the argument (and the prompt's
    index): a malformed call is a programming error, not a prompt to reject among others.
    """
    single = isinstance(prompts, str) or is_conversation(prompts)
    if single or (isinstance(prompts, (list, tuple)) and prompts and _is_token_id(prompts[0])):
        prompts = [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts={preview(prompts)} is invalid: must be a string, a list of token ids, or a list of those"
            + (" (decode bytes to str first)" if isinstance(prompts, (bytes, bytearray)) else "")
        )
    prompts = list(prompts)
    for i, prompt in enumerate(prompts):
        check_prompt_type(prompt, f"prompts[{i}]")
    if isinstance(sampling_params, SamplingParams) or sampling_params is None:
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)):  # a bad entry of a list rejects its prompt only
        raise ValueError(
            f"sampling_params={preview(sampling_params)} is invalid: must be a SamplingParams, or a list of them "
            "with one per prompt"
        )
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(
            f"sampling_params has {len(params)} entries: must be one, or one per prompt ({len(prompts)})"
        )
    return prompts, params


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt_type(prompt: object, name: str = "prompt") -> None:
    """A prompt is a string, a list (or tuple) of integer token ids or a conversation; anything else is refused with
    its name, so that e.g. bytes are never read as a list of small integers."""
    if isinstance(prompt, str) or is_conversation(prompt):  # a conversation's messages: `encode_prompt` checks them
        return
    if isinstance(prompt, (list, tuple)):
        if all_plain_ints(prompt):
            return
        bad = next((t for t in prompt if not _is_token_id(t)), None)
        if bad is not None:
            raise ValueError(
                f"{name} is invalid: token ids must all be integers, got {preview(bad)} ({type(bad).__name__})"
            )
        return
    hint = ""
    if isinstance(prompt, (bytes, bytearray)):
        hint = " (decode bytes to str first)"
    elif isinstance(prompt, Mapping):  # a message among prompts: a conversation with a string in it, or unwrapped
        hint = " (a conversation is one prompt holding only messages; a batch of conversations is a list of them)"
    raise ValueError(
        f"{name}={preview(prompt)} is invalid: must be a string or a list of token ids, not "
        f"{type(prompt).__name__}{hint}"
    )


def check_prompt(prompt: object, name: str = "prompt") -> None:
    """`check_prompt_type`, and the prompt is not empty and is valid Unicode (a lone surrogate cannot be encoded)."""
    check_prompt_type(prompt, name)
    if not prompt:
        raise ValueError(f"{name}={prompt!r} is invalid: must be a non-empty string or list of token ids")
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"{name} is invalid: it is not valid Unicode text ({err.reason} at character {err.start})"
            ) from None
