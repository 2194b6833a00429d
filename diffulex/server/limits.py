"""Serving limits shared by the command line (flag defaults) and the app; importing this module costs nothing."""

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # the largest request body the server reads (413 beyond)
