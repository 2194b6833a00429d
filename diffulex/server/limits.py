"""Serving limits shared by the command line (flag defaults and checks), the engine loop and the app; importing this
module costs nothing."""

import math

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # the largest request body the server reads (413 beyond)


def is_seconds(value: object) -> bool:
    """Whether ``value`` is a wait the server can keep: a finite number of seconds >= 0 (a NaN or negative wait
    would make every deadline meaningless, an infinite shutdown grace a shutdown that never ends)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


SECONDS_RULE = "must be a finite number of seconds >= 0"
