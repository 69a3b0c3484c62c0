"""Audit 2, item 10: prompts the engine cannot run (empty, a lone surrogate, token ids outside
the vocabulary) come back as error results, as the command line writes error rows, and the LLM
keeps working; a NaN temperature is refused where it is given."""

import math

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine import sequence


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, device="cpu", compile=False)


def test_bad_prompts_are_error_results_and_the_llm_keeps_working(llm):
    sp = SamplingParams(max_tokens=2)
    good = llm.generate("the lazy dog", sp)[0].outputs[0]
    outs = llm.generate(["", "\ud800", [], [10**9], "the lazy dog"], sp)
    errors = [o.outputs[0].error for o in outs]
    assert [o.outputs[0].finish_reason.value for o in outs[:4]] == ["error"] * 4
    assert errors[0] == errors[2] == "prompt tokenized to zero tokens"
    assert "not valid Unicode" in errors[1] and "vocabulary" in errors[3]
    assert errors[4] is None and outs[4].outputs[0].token_ids == good.token_ids
    # samples of a bad prompt are each an error, in sample order
    two = llm.generate([""], SamplingParams(n=2, max_tokens=2, temperature=0.5))[0]
    assert [c.index for c in two.outputs] == [0, 1]
    assert llm.generate("the lazy dog", sp)[0].outputs[0].token_ids == good.token_ids


def test_a_nan_temperature_is_refused(llm):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ValueError, match="finite"):
        llm.generate("the lazy dog", sequence.SamplingParams(temperature=math.nan))
