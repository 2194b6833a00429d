"""Decoding strategies. `diffulex.strategy.strategy` says what a strategy is to the engine; each folder here is one
strategy (its options, normalizer, request class and sampler rules); `diffulex.strategy.builtin` lists the
package's own. Shared block state is `diffulex.strategy.request` and `diffulex.strategy.block`."""
