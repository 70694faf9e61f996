"""Sampling parameters and the batched sampler: validation, determinism, every filter."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine.sampler import (
    Sampler,
    SamplingState,
    apply_penalties,
    apply_top_p,
    check_stop,
)

EOS = 7

# probabilities 0.5, 0.3, 0.15, 0.05, as logits
HAND_LOGITS = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def state(prompt=(), output=(), **params) -> SamplingState:
    s = SamplingState.create(SamplingParams(**params), list(prompt))
    s.output_token_ids.extend(output)
    return s


def generate(sampler, logits_row, st, steps):
    """Sample ``steps`` tokens for one state from a fixed logits row."""
    for _ in range(steps):
        token = sampler.sample(logits_row.unsqueeze(0), [st]).token_ids[0]
        st.output_token_ids.append(token)
    return st.output_token_ids


# ----------------------------------------------------------------- parameters

INVALID = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", True), ("max_tokens", 2.0),
    ("max_tokens", "8"),
    ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"), ("temperature", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan), ("top_p", "x"),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", [0.1]),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "1"),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5), ("frequency_penalty", None),
    ("seed", -1), ("seed", 1.5), ("seed", "1"), ("seed", 2**64), ("seed", True),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", "12"),
    ("stop_token_ids", 5), ("stop_token_ids", [1.0]),
    ("ignore_eos", "yes"), ("ignore_eos", 1),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 0.5),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_every_field_has_an_invalid_case():
    from dataclasses import fields

    assert {f.name for f in fields(SamplingParams)} == {name for name, _ in INVALID}


def test_normalization_and_greedy():
    p = SamplingParams(top_k=-1, stop_token_ids=[3, 4], temperature=1, presence_penalty=1)
    assert p.top_k == 0
    assert p.stop_token_ids == (3, 4)
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert hash(p) == hash(SamplingParams(top_k=0, stop_token_ids=(3, 4), presence_penalty=1))


def test_from_dict():
    p = SamplingParams.from_dict({"max_tokens": 4, "seed": 9, "stop_token_ids": [1]})
    assert p == SamplingParams(max_tokens=4, seed=9, stop_token_ids=(1,))
    with pytest.raises(ValueError, match="'top_q'.*'zzz'"):
        SamplingParams.from_dict({"zzz": 1, "top_q": 0.5, "top_p": 0.5})
    with pytest.raises(ValueError, match="object"):
        SamplingParams.from_dict([("top_p", 0.5)])


# ----------------------------------------------------------------- seeds


def test_same_seed_same_tokens_different_seed_different_tokens():
    torch.manual_seed(0)
    logits = torch.randn(200) * 0.5  # flat-ish: many tokens are plausible
    sampler = Sampler([EOS])
    first = generate(sampler, logits, state(seed=1234, max_tokens=50), 50)
    torch.rand(10)  # moving the global generator must not matter
    again = generate(sampler, logits, state(seed=1234, max_tokens=50), 50)
    other = generate(sampler, logits, state(seed=4321, max_tokens=50), 50)
    assert first == again
    assert first != other
    assert len(set(first)) > 20


@pytest.mark.parametrize("params", [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "min_p": 0.01,
     "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3},
])
def test_seeded_row_is_independent_of_its_batch(params):
    torch.manual_seed(1)
    vocab, steps = 300, 50
    rows = torch.randn(4, vocab)
    sampler = Sampler([EOS])
    alone = generate(sampler, rows[0], state(prompt=[1, 2, 3], seed=77, **params), steps)

    batch = [
        state(prompt=[1, 2, 3], seed=77, **params),
        state(seed=5, top_p=0.5),  # seeded, other filters
        state(repetition_penalty=1.5, min_p=0.2),  # unseeded
        state(temperature=0.0),  # greedy
    ]
    for _ in range(steps):
        result = sampler.sample(rows, batch)
        for s, token in zip(batch, result.token_ids, strict=True):
            s.output_token_ids.append(token)
    assert batch[0].output_token_ids == alone


def test_sampled_frequencies_follow_the_distribution():
    torch.manual_seed(2)
    n = 20000
    states = [state() for _ in range(n)]
    tokens = Sampler([]).sample(HAND_LOGITS.expand(n, 4), states).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)


# ----------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    torch.manual_seed(3)
    logits = torch.randn(5, 1000)
    before = logits.clone()
    states = [state(temperature=0.0), state(top_k=1), state(top_k=1, temperature=1.0),
              state(temperature=0.0, seed=3), state(top_k=1, top_p=0.5, min_p=0.3)]
    tokens = Sampler([EOS]).sample(logits, states).token_ids
    assert tokens == logits.argmax(dim=1).tolist()
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_greedy_in_mixed_batch_and_bfloat16():
    torch.manual_seed(4)
    logits = torch.randn(3, 500).to(torch.bfloat16)
    states = [state(temperature=0.0), state(temperature=0.9), state(top_k=1)]
    tokens = Sampler([EOS]).sample(logits, states).token_ids
    expected = logits.float().argmax(dim=1).tolist()
    assert tokens[0] == expected[0] and tokens[2] == expected[2]
    assert 0 <= tokens[1] < 500


def test_greedy_with_penalties_is_argmax_of_penalized_logits():
    # Raw argmax is token 0; the penalties move it.
    logits = torch.tensor([[4.0, 3.5, -1.0, 3.0, 0.5]])
    st = state(prompt=[0], output=[1, 1, 2], temperature=0.0, repetition_penalty=2.0,
               presence_penalty=0.5, frequency_penalty=0.25)
    # 0: 4/2 = 2.0; 1: 3.5/2 - 0.25*2 - 0.5 = 0.75; 2: -1*2 - 0.25 - 0.5 = -2.75
    hand = [2.0, 0.75, -2.75, 3.0, 0.5]
    assert apply_penalties(logits.clone(), [st])[0].tolist() == hand
    assert Sampler([EOS]).sample(logits, [st]).token_ids == [3]


# ----------------------------------------------------------------- penalties


def test_penalties_exact_values_per_row():
    raw = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0]).expand(4, 6).clone()
    prompt, output = [0, 1, 5], [3, 3, 4]
    states = [
        state(prompt, output, repetition_penalty=2.0),
        state(prompt, output, presence_penalty=0.5),
        state(prompt, output, frequency_penalty=0.25),
        state(prompt, output),
    ]
    out = apply_penalties(raw.clone(), states)
    # repetition: seen positive / 2, seen negative * 2, zero stays, unseen (2) untouched
    assert out[0].tolist() == [1.0, -2.0, 0.5, 1.5, -4.0, 0.0]
    # presence: once per distinct output token, prompt tokens untouched
    assert out[1].tolist() == [2.0, -1.0, 0.5, 2.5, -2.5, 0.0]
    # frequency: count x penalty over output tokens
    assert out[2].tolist() == [2.0, -1.0, 0.5, 2.5, -2.25, 0.0]
    assert torch.equal(out[3], raw[3])


def test_repetition_penalty_lowers_a_repeated_token():
    logits = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    base = logits.softmax(dim=1)[0]
    penalized = apply_penalties(logits.clone(), [state([0, 2], [], repetition_penalty=1.5)])
    probs = penalized.softmax(dim=1)[0]
    assert probs[0] < base[0] and probs[2] < base[2]
    assert probs[1] > base[1] and probs[3] > base[3]


def test_negative_penalties_raise_logits():
    out = apply_penalties(torch.zeros(1, 3), [state([], [1, 1], presence_penalty=-1.0,
                                                    frequency_penalty=-0.5)])
    assert out[0].tolist() == [0.0, 2.0, 0.0]


def test_out_of_range_token_is_rejected():
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(torch.zeros(1, 4), [state([9], [], repetition_penalty=1.2)])
    with pytest.raises(ValueError, match="rows"):
        Sampler([]).sample(torch.zeros(2, 4), [state()])


# ----------------------------------------------------------------- filters


@pytest.mark.parametrize(("params", "allowed"), [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7 <= 0.5 + 0.3
    ({"top_p": 0.9}, {0, 1, 2}),
    ({"top_p": 0.4}, {0}),
    ({"min_p": 0.35}, {0, 1}),  # floor 0.175
    ({"min_p": 0.25}, {0, 1, 2}),  # floor 0.125
    ({"top_k": 3, "top_p": 0.7}, {0, 1}),
])
def test_filters_never_sample_outside_the_kept_set(params, allowed):
    st = state(seed=11, max_tokens=400, **params)
    seen = set(generate(Sampler([]), HAND_LOGITS, st, 400))
    assert seen == allowed


def test_top_p_matches_a_full_sort_for_any_nucleus_width():
    torch.manual_seed(5)
    vocab = 6000
    # From peaked (nucleus of a few tokens) to flat (nucleus wider than 4096).
    logits = torch.randn(6, vocab) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [0.3], [0.05]])
    states = [state(top_p=p) for p in (0.9, 0.95, 0.8, 0.99, 0.9, 0.5)]
    kept = torch.isfinite(apply_top_p(logits.clone(), states))
    for row, s in enumerate(states):
        probs = logits[row].softmax(dim=0)
        desc = probs.sort(descending=True).values
        above = desc.cumsum(dim=0) - desc
        floor = desc[(above < s.params.top_p).sum() - 1]
        assert torch.equal(kept[row], probs >= floor), row
    widths = kept.sum(dim=1).tolist()
    assert widths[0] < 256 and 256 < widths[2] < 4096 and widths[4] > 4096, widths


def test_top_p_keeps_ties_with_the_last_nucleus_token():
    kept = torch.isfinite(apply_top_p(torch.zeros(1, 10), [state(top_p=0.5)]))
    assert kept.all()


# ----------------------------------------------------------------- logprobs


def test_logprobs_come_from_the_raw_distribution():
    torch.manual_seed(6)
    logits = torch.randn(3, 50)
    states = [
        state([1, 2], [3], logprobs=5, temperature=0.5, repetition_penalty=1.5, seed=1),
        state(logprobs=0, temperature=0.0),
        state(),
    ]
    result = Sampler([EOS]).sample(logits, states)
    raw = logits.log_softmax(dim=1)
    for row in (0, 1):
        lp = result.logprobs[row]
        token = result.token_ids[row]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert lp.rank == int((raw[row] > raw[row, token]).sum()) + 1
    assert result.logprobs[1].rank == 1 and result.logprobs[1].top == []
    top = result.logprobs[0].top
    assert len(top) == 5
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    values, ids = raw[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert result.logprobs[2] is None


# ----------------------------------------------------------------- min_tokens


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(10)
    logits[EOS], logits[9], logits[4] = 10.0, 9.0, 8.0
    greedy = state(temperature=0.0, min_tokens=3, stop_token_ids=[9], max_tokens=10)
    assert generate(Sampler([EOS]), logits, greedy, 4) == [4, 4, 4, EOS]

    # Sampling: EOS holds nearly all the mass but never appears before min_tokens,
    # even with ignore_eos.
    logits = torch.zeros(10)
    logits[EOS] = 30.0
    sampled = state(seed=0, min_tokens=30, max_tokens=40, ignore_eos=True)
    tokens = generate(Sampler([EOS]), logits, sampled, 31)
    assert EOS not in tokens[:30]
    assert tokens[30] == EOS


# ----------------------------------------------------------------- check_stop


def finish(st, token):
    st.output_token_ids.append(token)
    return check_stop(st, token, [EOS])


def test_check_stop():
    assert finish(state(), EOS) == "stop"
    assert finish(state(), 3) is None
    assert finish(state(ignore_eos=True), EOS) is None
    assert finish(state(ignore_eos=True, stop_token_ids=[3]), 3) == "stop"
    assert finish(state(output=[1], max_tokens=2), 3) == "length"
    assert finish(state(output=[1], max_tokens=2), EOS) == "stop"
    # min_tokens=2: the token at index 1 may not stop, the one at index 2 may.
    assert finish(state(output=[1], min_tokens=2), EOS) is None
    assert finish(state(output=[1, 1], min_tokens=2), EOS) == "stop"
    with pytest.raises(ValueError, match="appended"):
        check_stop(state(), EOS, [EOS])
