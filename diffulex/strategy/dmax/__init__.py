"""DMax token-merge edit decoding. Importing the package registers its config normalizer."""

from diffulex.strategy.dmax import config  # noqa: F401
