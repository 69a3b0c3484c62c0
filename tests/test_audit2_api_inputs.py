"""Audit 2, item 10, and issue 38: prompts the engine cannot run (empty, a lone surrogate,
token ids outside the vocabulary) are refused before anything runs, naming the prompt, as
vLLM raises, and the LLM keeps working; a NaN temperature is refused where it is given."""

import math

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine import sequence
from batchgen.errors import RequestError


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, device="cpu", compile=False)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("", "prompt 1 is empty"),
        ([], "prompt 1 is empty"),
        ("\ud800", "prompt 1 is not valid Unicode"),
        ([10**9], "prompt 1: token id 1000000000 is not in the model's vocabulary"),
    ],
)
def test_bad_prompts_are_refused_and_the_llm_keeps_working(llm, bad, says):
    sp = SamplingParams(max_tokens=2, temperature=0)
    good = llm.generate("the lazy dog", sp)[0].outputs[0]
    with pytest.raises(RequestError, match=says):
        llm.generate(["the lazy dog", bad], sp)
    assert llm.generate("the lazy dog", sp)[0].outputs[0].token_ids == good.token_ids


def test_a_nan_temperature_is_refused(llm):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ValueError, match="finite"):
        llm.generate("the lazy dog", sequence.DecodeParams(temperature=math.nan))
