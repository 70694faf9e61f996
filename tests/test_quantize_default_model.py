"""w8a16/w4a16 on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF): the int8 model's
answers on the five chat prompts, log-probabilities within a stated tolerance."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.weights import DEFAULT_MODEL
from tests.test_default_model import CHAT_PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    from services.engine.engine import LLMEngine

    # int8 keeps the file's weights exactly and the activations unrounded: the float
    # model up to summation order (tests/test_default_model.py checks that).
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, kv_cache_bytes=64 << 20,
                                    quantization="int8"))
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS]
    return prompts, engine.generate(prompts, _params())


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("method", ["w8a16", "w4a16"])
def test_integer_activations_answer_as_int8(reference, method):
    from services.engine.engine import LLMEngine

    prompts, want = reference
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, kv_cache_bytes=64 << 20,
                                    quantization=method))
    got = engine.generate(prompts, _params())
    # The Q4_1 projections and the Q8_0 head come back on their own grids; only the
    # activations' rounding (max|x| / 32512 per group) moves the logits.
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    got_lp = [lp.logprob for o in got for lp in o.logprobs]
    want_lp = [lp.logprob for o in want for lp in o.logprobs]
    assert len(got_lp) == 5 * 24
    assert got_lp == pytest.approx(want_lp, abs=1e-2)
