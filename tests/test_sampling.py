"""Sampling: the on-device sampler on fixed logits, and per-row seeds through LLM.generate.

The sampler's noise is a pure function of (seed, step, vocab index), so every test here is
deterministic: the statistical checks either always pass or always fail.
"""

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.sampler import SamplingTensors, row_uniforms, sample
from batchgen.engine.sequence import FinishReason, SamplingParams
from batchgen.llm import LLM


def _params(b: int, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> SamplingTensors:
    def col(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.expand(b).clone() if t.dim() == 0 else t

    return SamplingTensors(
        temperature=col(temperature, torch.float32),
        top_k=col(top_k, torch.int64),
        top_p=col(top_p, torch.float32),
        seed=col(seed, torch.int64),
    )


def _logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


STEPS = torch.zeros(64, dtype=torch.long)


# --- the sampler ----------------------------------------------------------------------------


def test_greedy_only_is_argmax():
    logits = _logits(64, 1000)
    got = sample(logits, _params(64, temperature=0.0), STEPS, greedy_only=True)
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_top_k_1_is_greedy(temperature):
    logits = _logits(64, 1000)
    seeds = torch.arange(64) * 7919
    for step in range(5):
        got = sample(logits, _params(64, temperature, top_k=1, seed=seeds), STEPS + step, False)
        assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_tiny_top_p_is_greedy(temperature):
    logits = _logits(64, 1000, seed=1)
    seeds = torch.arange(64) * 31
    for step in range(5):
        got = sample(logits, _params(64, temperature, top_p=1e-6, seed=seeds), STEPS + step, False)
        assert torch.equal(got, logits.argmax(-1))


def test_temperature_zero_rows_stay_greedy_in_a_sampled_batch():
    logits = _logits(64, 1000, seed=2, scale=0.1)  # flat: sampled rows rarely hit the argmax
    temps = torch.tensor([0.0, 1.0] * 32)
    got = sample(logits, _params(64, temps, seed=torch.arange(64)), STEPS, False)
    greedy = logits.argmax(-1)
    assert torch.equal(got[0::2], greedy[0::2])
    assert (got[1::2] != greedy[1::2]).sum() > 16


def test_uniform_never_rounds_to_one():
    """Regression: with 31 hash bits, float32 rounded the largest ones to exactly 1.0, so
    -log(u) was -0.0 and a filtered-out token (p = 0) gave 0 / -0.0 = NaN, which argmax
    picked. These (seed, step 0) rows each had such an entry in a 4096-token vocabulary."""
    seeds = torch.tensor([19849, 27623, 37439])
    u = row_uniforms(seeds, torch.zeros(3, dtype=torch.long), 4096)
    assert bool((u > 0).all()) and bool((u < 1).all())
    logits = _logits(3, 4096, seed=3)
    got = sample(
        logits, _params(3, 1.0, top_k=1, seed=seeds), torch.zeros(3, dtype=torch.long), False
    )
    assert torch.equal(got, logits.argmax(-1))


def test_uniforms_depend_only_on_seed_and_step():
    seeds, steps = torch.tensor([5, 9, 5, 2**31 - 1]), torch.tensor([3, 3, 4, 1000])
    batch = row_uniforms(seeds, steps, 257)
    for i in range(4):
        assert torch.equal(batch[i], row_uniforms(seeds[i : i + 1], steps[i : i + 1], 257)[0])
    assert not torch.equal(batch[0], batch[1])  # other seed
    assert not torch.equal(batch[0], batch[2])  # other step
    u = row_uniforms(torch.arange(256), torch.zeros(256, dtype=torch.long), 4096)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.01


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
N = 20000


def _draws(temperature=1.0, top_k=0, top_p=1.0, across="steps") -> torch.Tensor:
    """N draws from LOGITS: one row per draw, each with its own step (or its own seed)."""
    logits = LOGITS.expand(N, -1).contiguous()
    if across == "steps":
        seed, steps = torch.tensor(1234), torch.arange(N)
    else:
        seed, steps = torch.arange(N), torch.full((N,), 7)
    params = _params(N, temperature, top_k, top_p, seed)
    return torch.bincount(sample(logits, params, steps, False), minlength=len(LOGITS))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# chi-square with <= 7 degrees of freedom: P(X > 40) < 1e-5, and the draws are deterministic
CHI2_LIMIT = 40.0


@pytest.mark.parametrize("across", ["steps", "seeds"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature, across):
    counts = _draws(temperature, across=across)
    assert _chi2(counts, (LOGITS / temperature).softmax(-1)) < CHI2_LIMIT


def test_top_k_distribution():
    counts = _draws(temperature=0.7, top_k=3)
    assert counts[3:].sum() == 0
    probs = torch.zeros(8)
    probs[:3] = (LOGITS[:3] / 0.7).softmax(-1)
    assert _chi2(counts, probs) < CHI2_LIMIT


def test_top_p_distribution():
    p = LOGITS.softmax(-1)  # 0.53, 0.19, 0.12, ...: mass before token 2 is 0.72, before 3 is 0.84
    counts = _draws(top_p=0.8)
    assert counts[3:].sum() == 0 and counts[2] > 0
    probs = torch.zeros(8)
    probs[:3] = p[:3] / p[:3].sum()
    assert _chi2(counts, probs) < CHI2_LIMIT


# --- per-row seeds through the engine -------------------------------------------------------

SEEDED = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=50, top_p=0.9, seed=1234)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tiny_dirs):
    return tiny_dirs[request.param]


def test_seeded_row_same_alone_and_in_a_mixed_batch(model_dir):
    prompt = _prompt(5, seed=0)
    alone_llm = LLM(
        model_dir, dtype="float32", device="cpu", compile=False, engine=EngineConfig(max_num_seqs=1)
    )
    (alone,) = alone_llm.generate([prompt], SEEDED)
    assert len(alone.token_ids) == 20 and alone.finish_reason == FinishReason.LENGTH

    # Another block size, batch size (5 vs 1), step budget (prefills in chunks), position,
    # and neighbours that are greedy or sampled with other seeds and settings.
    mixed_llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        compile=False,
        engine=EngineConfig(block_size=4, max_num_batched_tokens=8),
    )
    neighbours = [_prompt(n, seed=n) for n in (9, 2, 30, 14)]
    params = [
        SamplingParams(max_new_tokens=20),
        SamplingParams(max_new_tokens=40, temperature=1.3, seed=7),
        SamplingParams(max_new_tokens=5, temperature=0.8, top_k=50, top_p=0.9, seed=1235),
        SamplingParams(max_new_tokens=33, temperature=0.5, top_p=0.5, seed=1234),
    ]
    outs = mixed_llm.generate(
        [*neighbours[:2], prompt, *neighbours[2:]], [*params[:2], SEEDED, *params[2:]]
    )
    assert outs[2].token_ids == alone.token_ids

    # the greedy neighbour is what it is on its own, too
    (greedy_alone,) = alone_llm.generate([neighbours[0]], SamplingParams(max_new_tokens=20))
    assert outs[0].token_ids == greedy_alone.token_ids
    # and sampling really sampled
    (greedy_same,) = alone_llm.generate([prompt], SamplingParams(max_new_tokens=20))
    assert alone.token_ids != greedy_same.token_ids


def test_different_seeds_differ_same_seeds_agree(tiny_dirs):
    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", compile=False)
    prompt = _prompt(6, seed=1)
    params = [
        SamplingParams(max_new_tokens=16, temperature=1.0, seed=s, ignore_eos=True)
        for s in (1, 2, 1, 3)
    ]
    rows = [o.token_ids for o in llm.generate([prompt] * 4, params)]
    assert rows[0] == rows[2]
    assert rows[0] != rows[1] and rows[0] != rows[3] and rows[1] != rows[3]
    again = llm.generate([prompt], params[1])[0].token_ids
    assert again == rows[1]
