"""The visibility rule of block diffusion, defined once on absolute positions.

Every strategy's attention is one of these rules, stated for a query at absolute position ``i`` and a key at
absolute position ``j`` of the same request:

* block-causal (``multi_bd``): ``j`` is visible iff ``block(j) <= block(i)``. Inside a block attention is
  bidirectional; later blocks are invisible. The K/V of a block therefore depends only on the tokens of that
  block and earlier ones, which is what makes committed blocks cacheable and sharable between requests.
* prefix-full (``d2f``): a prompt token (``i < prompt_len``) sees exactly the prompt (``j < prompt_len``); a
  generated token sees what it would see block-causally. The prompt is encoded bidirectionally, as the D2F
  models were trained, and its K/V depends on the whole prompt, so prompt pages are not sharable.

The rule applies to cached keys as to new ones: a request's committed blocks precede its rows and are visible
under both rules; cached keys after its rows (Fast-dLLM v2 refining one sub-block inside its cached block) lie in
the rows' own block, visible block-causally.
"""

from __future__ import annotations

import torch


def visibility_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    block_size: int,
    prefix_full: bool,
    prompt_len: int,
) -> torch.Tensor:
    """Boolean ``[len(query_positions), len(key_positions)]``: may the query attend to the key."""
    q = query_positions.view(-1, 1)
    k = key_positions.view(1, -1)
    allowed = torch.div(k, block_size, rounding_mode="floor") <= torch.div(q, block_size, rounding_mode="floor")
    if prefix_full:
        q_in_prompt = q < prompt_len
        k_in_prompt = k < prompt_len
        allowed = torch.where(q_in_prompt, k_in_prompt, allowed)
    return allowed
