"""The lm-eval model class ``diffulex``: lm-eval tasks drive a Diffulex engine through ``generate_until``.

Importing this module imports lm-eval (slow) and registers the class under the name ``diffulex``::

    from diffulex.bench.lm_eval_model import DiffulexLM
    lm = DiffulexLM(pretrained="/models/SDAR-1.7B-Chat", max_num_reqs=64)        # or engine=<a built engine>
    lm_eval.simple_evaluate(model=lm, tasks=["gsm8k_diffulex"], task_manager=bundled_task_manager())

All requests of one ``generate_until`` call go to the engine in one ``generate`` call, which batches them
(continuous batching up to ``max_num_reqs``). Every call's ``GenerationOutputs`` is kept in ``batches`` and
every request's trajectory in ``records``, for the metrics of `diffulex.bench.metrics`. Diffusion LMs served
here only generate: ``loglikelihood`` requests (multiple-choice, perplexity tasks) raise an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from diffulex import Diffulex, SamplingParams
from diffulex.bench.config import normalize_engine_fields
from diffulex.outputs import GenerationOutputs, Trajectory

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # when neither the run nor the task sets a generation length
_TASK_LENGTH_KEYS = ("max_gen_toks", "max_tokens", "max_new_tokens")

LOGLIKELIHOOD_UNSUPPORTED = (
    "the diffulex model does not support {kind} requests: Diffulex serves diffusion language models for "
    "generation only, so multiple-choice and perplexity tasks cannot run; use a generate_until task "
    "(gsm8k_diffulex, math500_diffulex, humaneval_diffulex, mbpp_diffulex, arithmetic_diffulex)"
)


@dataclass
class RequestRecord:
    """One lm-eval request and what the engine did with it."""

    task: str | None
    doc_id: int | None
    prompt: str
    response: str
    trajectory: Trajectory


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None or value == "" else int(value)


def cut_at_stops(text: str, stops: list[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = len(text)
    for stop in stops:
        i = text.find(stop)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]


@register_model("diffulex")
class DiffulexLM(LM):
    """lm-eval model backed by a Diffulex engine (``pretrained=<dir>`` plus engine fields, or ``engine=``)."""

    def __init__(
        self,
        pretrained: str | None = None,
        engine: Any = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        max_nfe: int | None = None,
        max_repetition_run: int | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        for alias in ("max_new_tokens", "max_gen_toks"):
            if alias in engine_kwargs:
                value = engine_kwargs.pop(alias)
                max_tokens = max_tokens if max_tokens is not None else value
        for name in ("batch_size", "device", "max_batch_size"):  # lm-eval passes these; the engine batches itself
            engine_kwargs.pop(name, None)
        self._owns_engine = engine is None
        if engine is None:
            model, fields = normalize_engine_fields({"model_path": pretrained, **engine_kwargs}, where="model_args")
            if not model:
                raise ValueError("the diffulex model needs pretrained=<checkpoint directory> (or engine=)")
            engine = Diffulex(model, **fields)
        elif engine_kwargs:
            raise ValueError(f"engine fields {sorted(engine_kwargs)} cannot be applied to an already built engine")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.temperature = float(temperature)
        self.max_tokens = _optional_int(max_tokens)
        self.max_nfe = _optional_int(max_nfe)
        self.max_repetition_run = _optional_int(max_repetition_run)
        self.ignore_eos = _as_bool(ignore_eos)
        self.use_tqdm = _as_bool(use_tqdm)
        self.batches: list[GenerationOutputs] = []
        self.records: list[RequestRecord] = []

    # ----- what lm-eval asks of a model ---------------------------------------------------------------------

    def sampling_params(self, gen_kwargs: dict[str, Any] | None) -> tuple[SamplingParams, list[str]]:
        """A request's SamplingParams and stop strings: the run's settings, the task's length and ``until``.

        The run's ``max_tokens`` wins over the task's ``max_gen_toks``; the run's temperature always applies.
        """
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        stops = [s for s in until if isinstance(s, str) and s]
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = next((int(gen_kwargs[k]) for k in _TASK_LENGTH_KEYS if gen_kwargs.get(k)), None)
        sp = SamplingParams(
            temperature=self.temperature,
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            max_nfe=self.max_nfe,
            max_repetition_run=self.max_repetition_run,
            ignore_eos=self.ignore_eos,
            stop=stops or None,
        )
        return sp, stops

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        prompts: list[str] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        for req in requests:
            context, gen_kwargs = req.args[0], (req.args[1] if len(req.args) > 1 else {})
            sp, until = self.sampling_params(gen_kwargs)
            prompts.append(context)
            params.append(sp)
            stops.append(until)
        # lm-eval hands over finished contexts (rendered by `apply_chat_template` when the run asks for it): they are
        # sent as they are, their chat markup acting as special tokens.
        outputs = self.engine.generate(prompts, params, use_tqdm=self.use_tqdm and not disable_tqdm,
                                       apply_chat_template=False, parse_special_tokens=True)
        self.batches.append(outputs)
        texts = []
        for req, prompt, until, traj in zip(requests, prompts, stops, outputs.trajectories, strict=True):
            if traj.error is not None:
                logger.warning("request %s/%s was rejected: %s", req.task_name, req.doc_id, traj.error)
                text = ""
            else:
                text = cut_at_stops(traj.text, until)
            self.records.append(RequestRecord(req.task_name, req.doc_id, prompt, text, traj))
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        raise NotImplementedError(LOGLIKELIHOOD_UNSUPPORTED.format(kind="loglikelihood"))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(LOGLIKELIHOOD_UNSUPPORTED.format(kind="loglikelihood_rolling"))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template; a trailing assistant message (a task's answer prefix) is continued."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"eval.apply_chat_template=True but the tokenizer of {self.engine.config.model} has no chat "
                "template; set apply_chat_template: false for this model"
            )
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.config.tokenizer_path or self.engine.config.model).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def close(self) -> None:
        """Release the engine when this object built it."""
        if self._owns_engine:
            self.engine.exit()
