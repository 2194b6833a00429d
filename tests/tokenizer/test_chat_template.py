"""Chat templates render as transformers renders them (block trimming, loop controls, generation blocks, tojson,
namespaces, special-token variables, continued final messages), and a template is sandboxed: it reaches no
interpreter internals and cannot change what it is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex.testing import write_tiny_checkpoint
from diffulex.tokenizer import load_tokenizer
from diffulex.tokenizer.chat_template import ChatTemplate

transformers = pytest.importorskip("transformers")

MESSAGES = [
    {"role": "system", "content": "Sei breve. ünïcode ✓"},
    {"role": "user", "content": "What is <b>3 + 4</b>?", "extra": None},
    {"role": "assistant", "content": "7", "reasoning_content": "3 + 4 = 7"},
    {"role": "user", "content": "  And 5 + 6?  "},
]
TEMPLATES = {
    "plain blocks and newlines": (
        "{% for m in messages %}\n  {% if m.role == 'system' %}\n[SYS] {{ m.content }}\n  {% else %}\n"
        "<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n  {% endif %}\n{% endfor %}\n"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    "loop controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ loop.index }}:{{ m.content }};{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    ),
    "generation block": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "tojson and namespace": (
        "{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% set ns.last = m.role %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}{% endfor %}"
        "{{ ns.n }}{{ ns.last }}{{ dict(a=1) | tojson }}{{ tools | tojson }}"
    ),
    "special tokens and reasoning": (
        "{{ bos_token or '' }}{% for m in messages %}{{ m.role }}{{ m.thinking is defined }}"
        "{{ m.reasoning_content | default('-') }}{{ m.extra is defined }}{{ m.content | trim }}{{ eos_token }}"
        "{% endfor %}{{ pad_token }}{{ mask_token }}"
    ),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), family="dream")
    return load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_a_template_renders_as_transformers_renders_it(tokenizers, name, add_generation_prompt) -> None:
    ours, hf = tokenizers
    template = TEMPLATES[name]
    kwargs = dict(chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(MESSAGES, **kwargs) == hf.apply_chat_template(MESSAGES, **kwargs)


def test_continuing_a_final_message_cuts_where_its_content_ends(tokenizers) -> None:
    ours, hf = tokenizers
    conversation = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,   "}]
    for template in (TEMPLATES["plain blocks and newlines"], TEMPLATES["special tokens and reasoning"]):
        kwargs = dict(chat_template=template, tokenize=False, continue_final_message=True)
        rendered = ours.apply_chat_template(conversation, **kwargs)
        assert rendered == hf.apply_chat_template(conversation, **kwargs)
        assert rendered.rstrip().endswith("one, two,")


def test_raise_exception_in_a_template_is_its_message(tokenizers) -> None:
    ours, _ = tokenizers
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('the first message must be the user') }}{% endif %}"
    )
    with pytest.raises(Exception, match="the first message must be the user"):
        ours.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._hidden = 1 %}{{ ns._hidden }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
    ids=["class", "subclasses", "namespace-underscore", "list-append", "dict-update"],
)
def test_a_template_cannot_reach_internals_or_change_its_inputs(template) -> None:
    from jinja2.exceptions import SecurityError, UndefinedError

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises((SecurityError, UndefinedError), match="unsafe|namespace attribute"):
        _render(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


def _render(template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    return ChatTemplate(template).render(
        messages, add_generation_prompt=False, continue_final_message=False, tools=tools, documents=None,
        variables={},
    )  # fmt: skip


def test_a_function_s_internals_render_as_nothing() -> None:
    template = "[{{ raise_exception.__globals__ }}{{ strftime_now.__code__ }}{{ namespace.__init__ }}]"
    assert _render(template, [{"role": "user", "content": "x"}]) == "[]"


def test_objects_reach_a_template_only_as_placeholders() -> None:
    class Secret:
        def __str__(self) -> str:
            return "leaked"

    rendered = _render("{{ messages[0].content }}|{{ tools[0].fn }}", [{"role": "user", "content": Secret()}],
                       tools=[{"fn": Secret()}])  # fmt: skip
    assert rendered == "<Secret>|<Secret>"


def test_a_tokenizer_without_a_template_says_so(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    (folder / "chat_template.jinja").unlink()
    tok = load_tokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
