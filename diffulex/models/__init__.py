"""Model families. Importing this package registers every family's model class and config reader."""

from diffulex.models import sdar  # noqa: F401  (registers "sdar")
from diffulex.models.hf_config import load_hf_config, model_type_to_model_name
from diffulex.models.sdar import SDARForDiffusionLM

__all__ = ["SDARForDiffusionLM", "load_hf_config", "model_type_to_model_name"]
