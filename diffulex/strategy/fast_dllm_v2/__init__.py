"""Fast-dLLM v2 dual-cache decoding. Importing the package registers its config normalizer."""

from diffulex.strategy.fast_dllm_v2 import config  # noqa: F401
