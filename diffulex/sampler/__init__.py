"""Sampling machinery every strategy shares: proposals, top-1 and drawing (`token_sampling`), the confidence
acceptance of a whole step on the device (`acceptance`), a step's row layout and writes (`rows`), and samplers
whose rule is decided on the host (`host`). The rules themselves belong to the strategies (`diffulex.strategy`)."""
