"""DiffusionGemma canvas denoising. Importing the package registers its config normalizer."""

from diffulex.strategy.diffusion_gemma import config  # noqa: F401
