import json

import pytest

from batchgen.data.prompts import PromptBuilder
from batchgen.errors import InputError, RowError


def _chat(messages: list[dict]) -> str:
    """A stand-in chat template: one tagged line per message, then the assistant cue."""
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


# -- plain mode


def test_plain_mode_returns_the_prompt_verbatim():
    pb = PromptBuilder()
    assert pb.required_columns() == {"prompt"}
    assert pb.render({"prompt": "  Hello\n", "other": 1}) == "  Hello\n"


def test_plain_mode_custom_column():
    pb = PromptBuilder(prompt_column="question")
    assert pb.required_columns() == {"question"}
    assert pb.render({"question": "Why?"}) == "Why?"


@pytest.mark.parametrize(
    "row, match",
    [
        ({"prompt": None}, "null"),
        ({"prompt": 42}, "int, not a string"),
        ({"prompt": ["a"]}, "list, not a string"),
        ({"prompt": ""}, "empty"),
        ({"prompt": " \n\t"}, "empty"),
        ({"other": "x"}, "no column 'prompt'"),
    ],
)
def test_plain_mode_row_errors(row, match):
    with pytest.raises(RowError, match=match) as e:
        PromptBuilder().render(row)
    assert match.split()[0] in e.value.message


# -- template mode


def test_template_renders_columns():
    pb = PromptBuilder(template="Label the sentiment of: {{ text }} ({{ lang | upper }})")
    assert pb.required_columns() == {"text", "lang"}
    assert pb.render({"text": "great film", "lang": "en", "extra": 1}) == (
        "Label the sentiment of: great film (EN)"
    )


def test_template_required_columns_skip_locals():
    pb = PromptBuilder(template="{% for t in tags %}{{ t }};{% endfor %}{% set n = 1 %}{{ n }}")
    assert pb.required_columns() == {"tags"}
    assert pb.render({"tags": ["a", "b"]}) == "a;b;1"


def test_template_missing_variable_fails_only_that_row():
    pb = PromptBuilder(template="Q: {{ question }}")
    assert pb.render({"question": "ok"}) == "Q: ok"
    with pytest.raises(RowError, match="question") as e:
        pb.render({"querstion": "typo"})
    assert "undefined" in e.value.message  # the jinja message is included
    assert pb.render({"question": "still ok"}) == "Q: still ok"


def test_template_null_value_is_a_row_error_naming_the_column():
    pb = PromptBuilder(template="{{ a }} and {{ b }}")
    with pytest.raises(RowError, match="null value in column.*b"):
        pb.render({"a": "x", "b": None})


def test_template_can_handle_optional_columns_explicitly():
    pb = PromptBuilder(template="{{ q }}{% if ctx is defined %} [{{ ctx }}]{% endif %}")
    assert pb.render({"q": "x", "ctx": None}) == "x"
    assert pb.render({"q": "x", "ctx": "c"}) == "x [c]"


def test_template_rendering_empty_is_a_row_error():
    pb = PromptBuilder(template="{{ text }}")
    with pytest.raises(RowError, match="empty"):
        pb.render({"text": "   "})


def test_template_runtime_error_is_a_row_error():
    pb = PromptBuilder(template="{{ n // d }}")
    assert pb.render({"n": 6, "d": 3}) == "2"
    with pytest.raises(RowError, match="ZeroDivisionError"):
        pb.render({"n": 1, "d": 0})


def test_template_is_sandboxed():
    pb = PromptBuilder(template="{{ text.__class__.__mro__ }}")
    with pytest.raises(RowError, match="template render failed"):
        pb.render({"text": "x"})


def test_template_syntax_error_is_an_input_error():
    with pytest.raises(InputError, match="does not compile"):
        PromptBuilder(template="{{ text ")


def test_template_is_compiled_once(monkeypatch):
    from jinja2.sandbox import SandboxedEnvironment

    pb = PromptBuilder(template="{{ x }}")
    calls = []
    monkeypatch.setattr(SandboxedEnvironment, "from_string", lambda *a, **k: calls.append(a))
    for i in range(3):
        assert pb.render({"x": str(i)}) == str(i)
    assert calls == []


# -- messages mode


def test_messages_mode_passes_messages_to_the_chat_template():
    pb = PromptBuilder(messages_column="messages", chat_template_fn=_chat)
    assert pb.required_columns() == {"messages"}
    row = {
        "messages": [
            {"role": "system", "content": "Be brief.", "name": None},
            {"role": "user", "content": "Hi", "name": "ann"},
        ]
    }
    seen = []
    pb.chat_template_fn = lambda m: seen.append(m) or _chat(m)
    assert pb.render(row) == "<system>Be brief.\n<user>Hi\n<assistant>"
    # Null struct fields are dropped, so templates see absent keys rather than None.
    assert seen == [[{"role": "system", "content": "Be brief."}, row["messages"][1]]]


def test_messages_mode_accepts_json_strings():
    pb = PromptBuilder(messages_column="m", chat_template_fn=_chat)
    row = {"m": json.dumps([{"role": "user", "content": "Hi"}])}
    assert pb.render(row) == "<user>Hi\n<assistant>"


@pytest.mark.parametrize(
    "value, match",
    [
        (None, "null"),
        ([], "non-empty list"),
        ("not json", "not JSON"),
        ({"role": "user", "content": "x"}, "non-empty list"),
        (["hello"], "message 0 is str"),
        ([{"content": "x"}], "message 0 has no string 'role'"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": None}], "message 1"),
    ],
)
def test_malformed_messages_are_row_errors(value, match):
    pb = PromptBuilder(messages_column="m", chat_template_fn=_chat)
    with pytest.raises(RowError, match=match):
        pb.render({"m": value})


def test_chat_template_failure_is_a_row_error():
    def strict(messages):
        if messages[0]["role"] != "user":
            raise ValueError("Conversation roles must alternate user/assistant")
        return _chat(messages)

    pb = PromptBuilder(messages_column="m", chat_template_fn=strict)
    with pytest.raises(RowError, match="roles must alternate"):
        pb.render({"m": [{"role": "assistant", "content": "x"}]})


def test_messages_mode_needs_a_chat_template():
    with pytest.raises(InputError, match="chat template"):
        PromptBuilder(messages_column="m")


@pytest.mark.parametrize("mode", [{}, {"template": "{{ x }}"}])
def test_a_chat_template_is_for_messages_mode_only(mode):
    with pytest.raises(InputError, match="messages column only"):
        PromptBuilder(chat_template_fn=_chat, **mode)


def test_conflicting_modes_are_refused():
    with pytest.raises(InputError):
        PromptBuilder(messages_column="m", template="{{ x }}", chat_template_fn=_chat)
    with pytest.raises(InputError):
        PromptBuilder(prompt_column=None)
