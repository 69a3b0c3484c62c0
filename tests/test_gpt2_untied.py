"""A GPT-2 saved with tie_word_embeddings=False keeps its own LM head: batchgen used to tie every
GPT-2's head to the token embedding, replacing the checkpoint's lm_head.weight, and gave wrong
tokens without a word. Greedy tokens must equal transformers', on one rank and on two."""

import pytest
from helpers import hf_greedy
from tiny_models import save_tiny_model

from batchgen.engine.sequence import SamplingParams
from batchgen.llm import LLM
from batchgen.model.families.hf_config import config_from_hf, read_hf_config

PROMPTS = [[5, 6, 7], [9, 2]]
PARAMS = SamplingParams(max_new_tokens=5)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return save_tiny_model("gpt2", tmp_path_factory.mktemp("g") / "g", tie_word_embeddings=False)


def test_the_config_says_untied(untied):
    assert not config_from_hf(read_hf_config(untied)).tie_embeddings


@pytest.mark.parametrize("tp", [1, 2])
def test_untied_gpt2_matches_transformers(untied, tp):
    with LLM(untied, dtype="float32", device="cpu", tensor_parallel_size=tp) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == hf_greedy(untied, PROMPTS, 5)
