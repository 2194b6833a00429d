"""How many KV pages an engine gets: the explicit ``num_pages``, else what memory leaves after the weights, the
measured activation peak and the CUDA graphs (GPU), or a share of the host's available memory (CPU)."""

from __future__ import annotations

import logging

import torch

from diffulex.config import Config
from diffulex.engine.cpu_resources import available_memory
from diffulex.engine.cuda_graph import graph_requests
from diffulex.engine.graph_policy import GraphPolicy
from diffulex.engine.model_runner import ModelRunner
from diffulex.engine.prefill_graphs import CHUNK_EXTRA_ROWS_PER_REQUEST
from diffulex.layers.parallel_state import engine_ranks

logger = logging.getLogger("diffulex")

# Share of the host's available memory a CPU page pool may take at most (the rest: activations, other processes).
CPU_KV_MEMORY_FRACTION = 0.5
GIB = float(1 << 30)


def plan_num_pages(
    config: Config, runner: ModelRunner, device: torch.device, dtype: torch.dtype, policy: GraphPolicy
) -> int:
    """Pages that fit (on every rank of the engine); a clear error when not even one request of
    ``max_model_len`` does."""
    if config.num_pages > 0:
        return config.num_pages
    page_bytes = runner.page_bytes()
    pages_per_req = -(-config.max_model_len // config.page_size)
    wanted = pages_per_req * config.max_num_reqs
    if device.type == "cuda":
        budget, report = gpu_kv_budget(config, runner, device, dtype, policy)
    else:
        budget, report = cpu_kv_budget(wanted * page_bytes)
    # the engine's ranks hold the same pages (each its heads' slice of them): as many as the fullest rank fits,
    # agreed before the check so that every rank refuses alike
    affordable = engine_ranks().min_over_ranks(max(budget, 0) // page_bytes, device)
    if affordable < pages_per_req:
        raise ValueError(
            f"not enough memory for the KV cache: one request of max_model_len={config.max_model_len} needs "
            f"{pages_per_req} pages of {page_bytes} bytes ({pages_per_req * page_bytes / GIB:.2f} GiB) but "
            f"only {affordable} fit ({report}); lower max_model_len, max_num_batched_tokens or max_num_reqs, "
            "raise gpu_memory_utilization, or use a smaller model"
        )
    return int(min(wanted, affordable))


def cpu_kv_budget(wanted_bytes: int) -> tuple[int, str]:
    """Bytes a CPU page pool may take: `CPU_KV_MEMORY_FRACTION` of the memory the host has available (cgroup
    limit included). The pool is allocated as untouched zero pages, so it costs memory only as pages fill."""
    available = available_memory()
    if available is None:
        return wanted_bytes, "the host's available memory is unknown"
    budget = int(available * CPU_KV_MEMORY_FRACTION)
    report = f"{available / GIB:.2f} GiB of host memory available x {CPU_KV_MEMORY_FRACTION} = {budget / GIB:.2f} GiB"
    return budget, report


def profile_shape(config: Config, policy: GraphPolicy) -> tuple[int, int, int]:
    """`ModelRunner.profile_run`'s arguments on a GPU: the largest step the scheduler can build
    (``max(max_num_batched_tokens, max_model_len)`` rows, in requests of at most ``max_model_len``) and the logits
    rows of every running request."""
    num_tokens = max(config.max_num_batched_tokens, config.max_model_len)
    return num_tokens, config.max_model_len, config.max_num_reqs * policy.max_rows_per_request


def graph_pool_tokens(config: Config, policy: GraphPolicy) -> tuple[int, int]:
    """Rows the CUDA graphs' memory is sized by: ``(graph_tokens, pool_tokens)``. Each decode-shaped set (the decode
    graphs; the short steps', at their largest bucket; the chunk graphs'; the straggler graphs') holds one forward of
    its largest bucket in a pool of its own and its sampling graph's logits over every row of it: ``graph_tokens``
    rows of each. The prefill graphs share the decode graphs' pool (one runs at a time), so the pool's largest
    forward is ``pool_tokens``, the larger of those rows and the largest prefill bucket (a prompt's rows and a
    running set's, `diffulex.engine.prefill_graphs`)."""
    requests, rows = graph_requests(config.max_num_reqs), policy.max_rows_per_request
    graph_tokens = requests * rows
    if policy.short_rows_per_request is not None:
        graph_tokens += max(policy.short_buckets) * policy.short_rows_per_request
    if policy.chunk_graph_rows:
        graph_tokens += requests * (rows + CHUNK_EXTRA_ROWS_PER_REQUEST)
    if policy.straggler_graphs:
        graph_tokens += requests * rows
    prefill_tokens = policy.prefill_graph_rows + rows if policy.prefill_graph_rows else 0
    return graph_tokens, max(graph_tokens, prefill_tokens)


def gpu_kv_budget(
    config: Config, runner: ModelRunner, device: torch.device, dtype: torch.dtype, policy: GraphPolicy
) -> tuple[int, str]:
    """Bytes left for pages: ``total * gpu_memory_utilization`` minus what the process and others already hold,
    minus the measured activation peak of the largest forward, minus the CUDA graphs' pool.

    The peak is measured, not estimated: one eager forward over the largest step the scheduler can build
    (``max(max_num_batched_tokens, max_model_len)`` rows) and the sampler's logits for every running row.
    """
    shape = profile_shape(config, policy)
    num_tokens = shape[0]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    runner.allocate_kv_cache(1)  # attention needs a bound cache; the profile stores nothing
    runner.profile_run(*shape)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    runner.release_kv_cache()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = (total - free) - torch.cuda.memory_reserved(device)  # other processes, CUDA context, NCCL
    activations = peak - weights
    graphs = 0
    if policy.cuda_graphs:
        graph_tokens, pool_tokens = graph_pool_tokens(config, policy)
        graphs = int(activations * min(1.0, pool_tokens / num_tokens))
        embedding = runner.token_embedding()  # the logits are the whole vocabulary's, also on a sharded rank
        graphs += graph_tokens * getattr(embedding, "vocab_size", embedding.num_embeddings) * dtype.itemsize
    budget = int(total * config.gpu_memory_utilization) - others - peak - graphs
    report = (
        f"{total / GIB:.1f} GiB x gpu_memory_utilization={config.gpu_memory_utilization} = "
        f"{total * config.gpu_memory_utilization / GIB:.1f} GiB; weights {weights / GIB:.2f} GiB, activation "
        f"peak {activations / GIB:.2f} GiB ({num_tokens} tokens), CUDA graphs {graphs / GIB:.2f} GiB, other "
        f"processes and the CUDA context {others / GIB:.2f} GiB; {max(budget, 0) / GIB:.2f} GiB left"
    )
    logger.info("memory plan: %s", report)
    return budget, report
