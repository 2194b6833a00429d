"""From logits rows to one candidate token and its confidence per row.

Greedy rows (temperature 0) are handled in one vectorized pass; sampled rows are drawn per request from a
generator seeded by ``(request seed, step)``, so a request's tokens do not depend on what else is in the batch
or on whether it was preempted.
"""

from __future__ import annotations

import torch

from diffulex.layers.dispatch import triton_available


def ban_tokens(logits: torch.Tensor, vocab_limit: int, banned_id: int | None) -> torch.Tensor:
    """Never propose padding-vocabulary ids (beyond the tokenizer) or the mask token itself.

    Returns float32 logits. Float32 input is edited in place: the sampler owns the logits it is handed, and a
    copy of ``[rows, vocab]`` would cost more than the ban. Other dtypes are converted, which copies anyway.
    """
    logits = logits.float()
    if vocab_limit < logits.shape[-1]:
        logits[:, vocab_limit:] = float("-inf")
    if banned_id is not None and 0 <= banned_id < logits.shape[-1]:
        logits[:, banned_id] = float("-inf")
    return logits


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax (lowest id among ties) and its softmax probability; the torch path and the kernel's reference.

    Ties go to the lowest id because ``max`` over a dim returns the first maximal index (documented for CPU and
    CUDA alike; `tests/sampler/test_sampling.py` pins it). The fused kernel computes the same probability as
    ``1 / sum(exp(x - max))`` without forming the others (equal up to float32 rounding); here the softmax is
    kept because on the CPU that route costs the same, and the CPU path keeps its exact confidences.
    """
    probs = torch.softmax(logits, dim=-1)
    conf, tokens = probs.max(dim=-1)
    return tokens, conf


def propose_greedy(
    logits: torch.Tensor,
    vocab_limit: int,
    banned_id: int | None,
    source_rows: torch.Tensor | None = None,
    tokens_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy` over the allowed ids: the fused Triton kernel on CUDA, `ban_tokens` then `greedy` elsewhere.

    On CUDA the kernel reads the logits once in their own dtype and writes two numbers per row; the torch path
    would write a banned float32 copy and the exponentials of every id. With ``source_rows`` (int64) the answer
    is for ``logits[source_rows]``; negative entries are rows not to sample: their tokens are undefined and their
    confidence is ``-inf``, which no acceptance rule takes. With ``tokens_out`` (contiguous int64, one entry per
    answered row) the tokens are written there and it is returned in their place.
    """
    if logits.is_cuda and triton_available():
        from diffulex.kernels.top1 import triton_top1

        return triton_top1(logits, vocab_limit, banned_id, source_rows=source_rows, tokens_out=tokens_out)
    if source_rows is None:
        tokens, conf = greedy(ban_tokens(logits, vocab_limit, banned_id))
    else:
        tokens, conf = greedy(ban_tokens(logits.index_select(0, source_rows.clamp(min=0)), vocab_limit, banned_id))
        conf = conf.masked_fill(source_rows < 0, float("-inf"))
    return (tokens if tokens_out is None else tokens_out.copy_(tokens)), conf


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the ``top_k`` best tokens (0 = all), then the smallest set whose probability reaches ``top_p``. The best
    token is always kept: a ``top_p`` below float32's smallest number rounds to 0, which every token's preceding mass
    reaches, and would otherwise mask the whole row (no token could ever be accepted)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly better tokens
        dropped = before >= top_p
        dropped[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(dropped, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from the tempered, filtered distribution; confidence = its probability there.

    The row maximum is subtracted before dividing by the temperature: every tempered logit is then <= 0 and the
    best is exactly 0, so no temperature that `SamplingParams` accepts can overflow to ``inf`` (or turn a row into
    NaN), however small or large the model's logits are.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    filtered = filter_top_k_top_p(shifted / temperature, top_k, top_p)
    probs = torch.softmax(filtered, dim=-1)
    # The exponential race: argmax of p_i / E_i with E_i ~ Exp(1) is distributed as p. Unlike `torch.multinomial`
    # it has no invalid input (a NaN row yields some token instead of a device-side assert, which would end every
    # later CUDA call of the process), and it reads the probabilities once.
    # E_i = 0 has a small but real chance in float32; the clamp keeps 0 / E_i at 0 instead of NaN.
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    tokens = (probs / race).argmax(dim=-1)
    conf = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, conf


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator for one request's draws in one step: reproducible from the seed and the step alone."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g
