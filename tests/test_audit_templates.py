"""A prompt template's render is bounded in size, steps and time (audit, issue 32): a runaway
row becomes that row's error record, found before the value is built, and the job goes on.

Each runaway template here would build 16 MB of text or 128 MB of list unbounded (sixteen times
the bound), so a regression shows as a render that succeeds, never as gigabytes in the test."""

import tracemalloc

import pytest
from helpers import read_output, run_job, write_parquet

import batchgen.data.render_bounds
from batchgen.data import PromptBuilder
from batchgen.data.render_bounds import MAX_PROMPT_CHARS
from batchgen.errors import RowError

RUNAWAY = {
    "doubling with ~": "{% set ns = namespace(s='a') %}{% for i in range(24) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "replace filter": "{{ (('a' * 100000)|replace('a', 'a' * 160))|length }}",
    "str.replace": "{{ ('a' * 100000).replace('a', 'a' * 160)|length }}",
    "join filter": "{{ ((['a' * 100000] * 160)|join)|length }}",
    "str.join": "{{ ''.join(['a' * 100000] * 160)|length }}",
    "doubling a list with +": "{% set ns = namespace(s=[1]) %}{% for i in range(24) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "list.extend": "{% set l = [1] %}{% for i in range(24) %}{{ l.extend(l) or '' }}"
    "{% endfor %}{{ l|length }}",
    "printing shared references": "{{ [['a' * 100000] * 40] * 4 }}",
    "center": "{{ ('a'|center(16000000))|length }}",
    "format width": "{{ ('%16000000d'|format(1))|length }}",
    "% width": "{{ ('%16000000d' % 1)|length }}",
    "str.format width": "{{ '{:>16000000}'.format(1)|length }}",
    "batch fill": "{{ ([1]|batch(16000000, 0)|first)|length }}",
    "squaring a number": "{% set ns = namespace(n=3) %}{% for i in range(24) %}"
    "{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n > 0 }}",
}


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_a_runaway_template_is_a_row_error_found_before_building(name):
    builder = PromptBuilder(template=RUNAWAY[name])
    tracemalloc.start()
    try:
        with pytest.raises(RowError, match="simplify the template"):
            builder.render({"text": "x"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Bytes: about the bound's size (a list's item is 8), not the runaway's.
    assert peak < 16 * MAX_PROMPT_CHARS, peak


def test_time_is_checked_at_every_step(monkeypatch):
    """Fewer than 1024 slow loop steps, and a macro that calls itself twice (no loop at all):
    each would take seconds."""
    monkeypatch.setattr(batchgen.data.render_bounds, "MAX_RENDER_SECONDS", 0.2)
    loop = "{% for i in range(1000) %}{% set x = ('a' * 1000000)|replace('a', 'b') %}{% endfor %}x"
    macro = (
        "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(20) }}x"
    )
    for template in (loop, macro):
        with pytest.raises(RowError, match="took over 0.2 s"):
            PromptBuilder(template=template).render({"text": "x"})


def test_ordinary_templates_render_as_before():
    template = (
        "{{ text ~ '!' }} {{ (text + '?')|upper }} {{ text|replace('o', '0') }} "
        "{{ ['a', 'b']|join(',') }} {{ '%3d'|format(7) }} {{ '%s/%s' % (1, 2) }} "
        "{{ '{}-{}'.format(1, 2) }} {{ 'x'|center(5) }}|{{ [1, 2, 3]|batch(2)|list }} "
        "{% for w in text.split() %}[{{ loop.index }}{{ w * 2 }}]{% endfor %} {{ 2 ** 10 }} "
        "{{ 'ab' * 3 }} {{ [1] + [2] }} {{ ['a', 'b'] }} {{ [[1], [2]]|sum(start=[]) }} "
        "{% autoescape true %}{{ '<b>' ~ text }}{% endautoescape %}"
    )
    assert PromptBuilder(template=template).render({"text": "good food"}) == (
        "good food! GOOD FOOD? g00d f00d a,b   7 1/2 1-2   x  |[[1, 2], [3]] "
        "[1goodgood][2foodfood] 1024 ababab [1, 2] ['a', 'b'] [1, 2] &lt;b&gt;good food"
    )


def test_the_job_goes_on_past_a_runaway_row(tmp_path, model):
    src = write_parquet(tmp_path / "in.parquet", {"text": ["short", "big", "also short"]})
    template = (
        "{% if text == 'big' %}{{ ('a' * 100000)|replace('a', 'a' * 160) }}"
        "{% else %}Say: {{ text }}{% endif %}"
    )
    run_job(src, tmp_path / "out", model, "-t", template, "--max-new-tokens", 2)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows[0]["error"] is None and rows[2]["error"] is None
    assert "simplify the template" in rows[1]["error"]
