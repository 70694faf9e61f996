"""Decode graphs where no CUDA is needed: the batch ladder, the padding, the setting,
and the padded decode path run eagerly (Triton's interpreter) against the plain one."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.cuda_graphs import (
    DecodeGraphs,
    batch_ladder,
    bucket_for,
    make_decode_graphs,
    pad_decode,
)
from services.engine.model_runner import StepInputs

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_batch_ladder_and_buckets():
    assert batch_ladder(1) == (1,)
    assert batch_ladder(4) == (1, 2, 4)
    assert batch_ladder(20) == (1, 2, 4, 8, 16, 20)
    ladder = batch_ladder(128)
    assert ladder[:5] == (1, 2, 4, 8, 16) and ladder[-2:] == (120, 128) and len(ladder) == 19
    assert [bucket_for(n, ladder) for n in (1, 3, 8, 9, 121, 128, 129)] == \
        [1, 4, 8, 16, 128, 128, None]


def test_pad_decode_fills_rows_that_write_nothing():
    inputs = StepInputs(ids=[7, 8, 9], positions=[4, 9, 2], slots=[20, 41, 6],
                        decode_groups=[(0, 2, [[5], [10, 3]], [5, 10], 10),
                                       (2, 1, [[1]], [3], 3)],
                        prefills=[], logits_rows=[0, 1, 2])
    padded = pad_decode(inputs, 4, 3)
    assert padded.ids == [7, 8, 9, 0] and padded.positions == [4, 9, 2, 0]
    assert padded.slots == [20, 41, 6, -1]
    assert padded.tables == [[5, 0, 0], [10, 3, 0], [1, 0, 0], [0, 0, 0]]
    assert padded.context_lens == [5, 10, 3, 1]
    assert pad_decode(inputs, 4, 1) is None  # a table wider than the graph's
    assert pad_decode(inputs, 2, 3) is None  # more rows than the rung
    with_prefill = inputs._replace(prefills=[(3, 2, 2, [4])])
    assert pad_decode(with_prefill, 8, 3) is None


def test_cuda_graphs_setting():
    assert not EngineConfig(device="cpu").use_cuda_graphs
    assert EngineConfig(device="cuda:1").use_cuda_graphs
    assert not EngineConfig(device="cuda", cuda_graphs=False).use_cuda_graphs
    with pytest.raises(ValueError, match="CUDA"):
        EngineConfig(device="cpu", cuda_graphs=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_padded_decode_path_gives_the_eager_tokens(tiny_dirs, make_engine):
    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40], [1, 77, 78], [1, 2, 3, 4, 5, 6]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    plain = make_engine(tiny_dirs["llama3"], dtype="float32", block_size=4, num_kv_blocks=32,
                        attention_backend="torch")
    want = [c.token_ids for c in plain.generate(prompts, params)]
    engine = make_engine(tiny_dirs["llama3"], dtype="float32", block_size=4, num_kv_blocks=32,
                         attention_backend="triton", max_num_seqs=4, max_model_len=32)
    runner = engine.executor.runner
    assert runner.graphs is None  # the CPU never captures
    assert make_decode_graphs(runner.model, runner.kv_cache, torch.device("cpu"), 4, 32) is None
    runner.graphs = graphs = DecodeGraphs(runner.model, runner.kv_cache, torch.device("cpu"),
                                          max_num_seqs=4, max_model_len=32, capture=False)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert got == want
    assert graphs.ladder == (1, 2, 4) and graphs.width == 8
    assert graphs.eager_steps == 4  # every step after the prefill, 3 rows padded to 4
