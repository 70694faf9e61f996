"""Which weights an engine runs: the one choice between loading and drawing them."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.weights import LoadedWeights, load_weights
from services.engine.weights.random_init import random_weights


def weights_for(config: EngineConfig) -> LoadedWeights:
    """The weights ``config`` asks for, in its dtype: a preset's random ones
    (``random_weights``) or ``config.model`` read from disk. On the device of rank 0
    with one rank (no host copy on the way); on the CPU when tensor-parallel ranks are
    sliced out of them (each rank moves only its slices)."""
    device = config.rank_device(0) if config.tensor_parallel_size == 1 else torch.device("cpu")
    if config.random_weights:
        return random_weights(config.random_weights, config.seed, dtype=config.torch_dtype,
                              device=device)
    return load_weights(config.model, config.torch_dtype, device)
