"""The package's own decoding strategies: importing this module registers each of them (`STRATEGIES` does so the
first time it is read). Edit decoding is reached through ``multi_bd`` with ``sampling_mode="edit"``."""

from diffulex.strategy import d2f, diffusion_gemma, dmax, fast_dllm_v2, multi_bd  # noqa: F401
