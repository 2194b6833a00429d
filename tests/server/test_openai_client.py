"""The official ``openai`` client talks to the server: completions and chat, streaming and not."""

from __future__ import annotations

import pytest

from diffulex import SamplingParams

from .conftest import MODEL_NAME, RunningServer

openai = pytest.importorskip("openai")


def client(server: RunningServer):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30.0)


def alone(engine, prompt, **params) -> object:
    """What ``generate`` returns for this prompt (text as it is, or a conversation) by itself (greedy)."""
    return engine.generate([prompt], SamplingParams(temperature=0.0, **params), use_tqdm=False,
                           apply_chat_template=False).trajectories[0]


def test_models_lists_the_served_name(server: RunningServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion(server: RunningServer, reference_engine) -> None:
    out = client(server).completions.create(model=MODEL_NAME, prompt="The old lighthouse", max_tokens=12,
                                            temperature=0)
    expected = alone(reference_engine, "The old lighthouse", max_tokens=12)
    choice = out.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert choice.model_extra["diffulex_completion_reason"] == "max_new_tokens_reached"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == expected.num_generated_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.model_extra["nfe"] == expected.nfe
    assert out.usage.model_extra["tpf"] == pytest.approx(expected.tpf)


def test_streaming_completion_concatenates_to_the_answer(server: RunningServer, reference_engine) -> None:
    stream = client(server).completions.create(model=MODEL_NAME, prompt="Every evening the keeper", max_tokens=24,
                                               temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expected = alone(reference_engine, "Every evening the keeper", max_tokens=24)
    assert text == expected.text
    assert finishes == ["length"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2, "committed text should arrive in pieces"
    assert chunks[-1].usage.completion_tokens == expected.num_generated_tokens


def test_chat(server: RunningServer, reference_engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How far is the pier?"}]
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    expected = alone(reference_engine, messages, max_tokens=16)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming_chat(server: RunningServer, reference_engine) -> None:
    messages = [{"role": "user", "content": "Count the boats."}]
    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20,
                                                    temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == alone(reference_engine, messages, max_tokens=20).text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_extras_and_n(server: RunningServer) -> None:
    out = client(server).completions.create(
        model=MODEL_NAME, prompt="One, two, three", max_tokens=30, temperature=0.8, seed=7, n=2,
        extra_body={"max_nfe": 5, "ignore_eos": True, "top_k": 20},
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "length"
        assert choice.model_extra["diffulex_completion_reason"] == "max_nfe_reached"
    assert out.usage.model_extra["nfe"] == 10


def test_client_sees_errors_as_exceptions(server: RunningServer) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=-1)
    assert info.value.body["param"] == "temperature"
