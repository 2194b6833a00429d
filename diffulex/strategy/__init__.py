"""Built-in decoding strategies. Importing this package registers every one of them.

Each strategy is a small package: ``config.py`` registers the config normalizer (its invariants), and
``__init__.py`` registers the runtime components it uses — the shared ones unless it changes them.
"""

from diffulex.strategy import d2f, diffusion_gemma, dmax, fast_dllm_v2, multi_bd  # noqa: F401
