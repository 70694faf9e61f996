"""The engine's sampling parameters are the wire record in :mod:`common.sampling_params`
(one class from the client to the sampler); this name stays for existing imports."""

from common.sampling_params import MAX_LOGPROBS, SEED_LIMIT, SamplingParams

__all__ = ["MAX_LOGPROBS", "SEED_LIMIT", "SamplingParams"]
