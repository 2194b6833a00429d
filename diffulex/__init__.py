"""Diffulex: a serving engine for diffusion language models.

    from diffulex import Diffulex, SamplingParams
    llm = Diffulex(model="/path/to/checkpoint")
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=64))
    print(out.trajectories[0].text)
"""

from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.sampling_params import SamplingParams

__version__ = "0.1.0"


def Diffulex(model: str, **kwargs: object):  # noqa: N802  (the public constructor reads like a class)
    """Build an engine for the checkpoint folder ``model``.

    Keywords that are engine fields configure it (validated and normalized by `diffulex.config.Config`); other
    keywords are ignored with one warning naming them. With ``data_parallel_size > 1`` the result is a
    `diffulex.engine.data_parallel.DataParallelEngine`: that many replicas behind one ``generate``.
    """
    from diffulex.engine.build_phases import BuildPhases

    build = BuildPhases()  # the engine's log line covers the whole call, these imports and the config included
    from diffulex.config import Config
    from diffulex.engine.engine import DiffulexEngine

    build.done("engine imports")
    config = Config.from_kwargs(model, **kwargs)
    build.done("config")
    if config.data_parallel_size > 1:
        from diffulex.engine.data_parallel import DataParallelEngine

        return DataParallelEngine(model, kwargs, config)
    return DiffulexEngine(config, build)


# The folder of the built-in model (a trained SDAR checkpoint shipped in the package; docs/training.md).
BUILTIN_MODEL: str = __path__[0] + "/builtin_model"

__all__ = ["BUILTIN_MODEL", "Diffulex", "GenerationOutputs", "SamplingParams", "Trajectory", "__version__"]
