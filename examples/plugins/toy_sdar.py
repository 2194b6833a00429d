"""A model family from outside the package: checkpoints whose ``config.json`` says ``"model_type": "toy_sdar"`` are
SDAR checkpoints under another name (a fine-tune published with its own model type, say). The alias keeps SDAR's
network, config reader, mask token and default strategy; only the name and how a checkpoint is recognised change.

Load it like any plugin (``plugins=["toy_sdar"]``, ``--plugin toy_sdar``, ``plugins: [toy_sdar]``). A new family
with its own network is the same call with its own `Family` (see any module of ``diffulex/models/``).
"""

from diffulex.models.family import FAMILIES, register_family

register_family(FAMILIES.get("sdar").renamed("toy_sdar", model_types=("toy_sdar",)))
