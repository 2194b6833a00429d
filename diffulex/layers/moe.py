"""A sparse mixture-of-experts MLP: each token's hidden state goes through the `top_k` SwiGLU experts its router
scores highest, and their outputs are summed with the router's weights (the Qwen3-MoE layout of SDAR-MoE).

Checkpoints store every expert's gate/up/down matrices separately (``mlp.experts.N.gate_proj.weight``), and the
loader and LoRA address them by those names, so each expert stays a module of its own. After loading,
`ExpertStack.merge` copies them into two stacked tensors (``[experts, 2 * inter, hidden]`` for gate/up,
``[experts, hidden, inter]`` for down) and turns each expert's weights into views of them, as
`diffulex.layers.linear.MergedProjection` does for q/k/v.

Four ways to run the experts, all giving the result of `SparseMoE.reference` up to rounding:
* ``"fused"``: `diffulex.kernels.fused_moe`, the Triton kernels for decode-sized steps over the stacked weights:
  the pairs sorted and padded to row tiles on the device, gate_up with SiLU-and-mul in its epilogue, down with
  the router weight applied, the top-k slots summed in a fixed order. Graph-safe; it streams each selected
  expert's weights once per row tile. Used on CUDA with triton in bf16/fp16 while the rows are decode-sized
  (`diffulex.kernels.fused_moe.fused_wins`).
* ``"grouped"``: the token-expert pairs sorted by expert, two grouped GEMMs (``torch._grouped_mm``) over the
  stacked weights. Every shape is static and nothing syncs with the host, so a CUDA graph can capture it; it reads
  only the weights of experts that have tokens. Used on CUDA devices whose grouped GEMM supports the dtype, for
  the steps the fused kernels do not take.
* ``"dense"``: every expert over every token, weighted by the routing (zero for experts not chosen). Also static,
  but it reads every expert: the graph-safe fallback of other CUDA devices, and of experts a LoRA hook keeps
  unstacked (they run as modules then, so the hook applies).
* ``"loop"``: the experts that have tokens, one after another, each over its own tokens. Exact and cheap on the CPU;
  it asks the host which experts were chosen, so no graph may capture it.

Expert parallelism (`diffulex.layers.parallel_state.expert_parallel_group`, size > 1): each rank holds a contiguous
range of whole experts, registered under their global index (``experts.5...`` on the rank owning expert 5 only), and
every rank sees every token (the layout tensor parallelism leaves the hidden states in). Each rank runs the same
path over the token-expert pairs routed to its own experts, the other pairs masked out, and one all-reduce over the
group adds the ranks' partial sums (with a shared expert split by TP over the same ranks, its slice's partial
product joins that sum: still one all-reduce). Why not an all-to-all dispatch: with the tokens already replicated on
every rank, sending each pair to its owner would move the same data the all-reduce moves, plus two exchanges of
per-rank counts that the host must read (breaking CUDA graphs); the all-reduce keeps every shape static and the
per-rank compute on the grouped GEMM, sized by the pairs it owns. An all-to-all pays off when the ranks hold
different tokens (data parallelism across the expert group), which this engine does not do.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffulex.layers.activation import gated
from diffulex.layers.dispatch import use_fused_kernels
from diffulex.layers.linear import (
    ColumnParallelLinear,
    JoinedWeights,
    MergedProjection,
    ReplicatedLinear,
    RowParallelLinear,
)
from diffulex.layers.norm import gemma_rms_norm
from diffulex.layers.parallel_state import (
    SINGLE_RANK,
    ExpertParallelGroup,
    expert_parallel_group,
    tensor_parallel_group,
)

MOE_IMPLS = ("fused", "grouped", "dense", "loop")


def route(
    router_logits: torch.Tensor, top_k: int, normalize: bool, expert_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] float32, experts [T, top_k] int64)``: softmax over all experts in float32, the `top_k`
    largest, renormalized to sum to 1 when `normalize` (``norm_topk_prob``), then each times its expert's entry of
    ``expert_scale`` where given. On CUDA one launch (`diffulex.kernels.moe_routing`); this torch code elsewhere
    and as the reference."""
    if (
        router_logits.dim() == 2
        and router_logits.shape[-1] <= _MAX_FUSED_ROUTED_EXPERTS
        and use_fused_kernels(router_logits, expert_scale)
        and (expert_scale is None or expert_scale.is_contiguous())
    ):
        from diffulex.kernels.moe_routing import softmax_topk

        return softmax_topk(router_logits, top_k, normalize, expert_scale=expert_scale)
    probs = router_logits.float().softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        weights = weights * expert_scale[experts]
    return weights, experts


# Most experts the fused routing kernels (`diffulex.kernels.moe_routing`) hold per row, a row of logits in
# registers; more take the torch path.
_MAX_FUSED_ROUTED_EXPERTS = 1024


def float32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 (a router's scores, from inputs of the model dtype). On CUDA with two-byte inputs,
    one tensor-core GEMM with a float32 output: their products are exact in its float32 accumulation, so it computes
    what casting both to float32 first computes, up to the order of the sums, without a float32 copy of the weight
    and a SIMT float32 GEMM every step (LLaDA2-mini on an H100: 0.3 ms of a 2.7 ms step)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return torch.mm(x, weight.T, out_dtype=torch.float32)
    return x.float() @ weight.float().T


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")


class SoftmaxRouter(ReplicatedLinear):
    """Qwen3-MoE's router (SDAR-MoE): a bias-free linear scoring every expert, then `route`. Checkpoint name
    ``mlp.gate.weight``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        _check_top_k(top_k, num_experts)
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self(x), self.top_k, self.normalize)


class GroupLimitedRouter(nn.Module):
    """LLaDA2's router: sigmoid scores in float32; the experts are chosen on the scores plus a per-expert
    ``expert_bias`` (a load-balancing offset learned in training), and only from the `topk_group` of `n_group`
    expert groups whose two best biased scores sum highest; the chosen experts' weights are their unbiased scores,
    renormalized to sum to 1 (with more than one expert) and multiplied by `scaling`. Checkpoint names
    ``mlp.gate.weight``, ``mlp.gate.expert_bias``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        scaling: float,
        expert_bias: bool = True,
    ) -> None:
        """``expert_bias=False`` (``moe_router_enable_expert_bias: false``): the checkpoint has no bias, selection
        is on the scores alone."""
        super().__init__()
        _check_top_k(top_k, num_experts)
        if num_experts % n_group != 0:
            raise ValueError(f"n_group ({n_group}) must divide num_experts ({num_experts})")
        if not 1 <= topk_group <= n_group or topk_group * (num_experts // n_group) < top_k:
            raise ValueError(
                f"topk_group must be in [1, n_group={n_group}] and its groups must hold num_experts_per_tok={top_k} "
                f"experts, got {topk_group}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        group_size = num_experts // n_group
        # the fused selection holds a row as [groups, experts per group], both powers of two
        self._fused_selection = num_experts <= _MAX_FUSED_ROUTED_EXPERTS and all(
            n > 0 and n & (n - 1) == 0 for n in (n_group, group_size)
        )
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32) if expert_bias else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = float32_logits(x, self.weight)
        if self._fused_selection and use_fused_kernels(logits):
            from diffulex.kernels.moe_routing import group_limited_topk

            return group_limited_topk(logits, self.expert_bias, self.n_group, self.topk_group, self.top_k,
                                      self.scaling, _WEIGHT_SUM_FLOOR)  # fmt: skip
        scores = logits.sigmoid()
        biased = scores if self.expert_bias is None else scores + self.expert_bias.float()
        T = x.shape[0]
        groups = biased.view(T, self.n_group, -1)
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
        chosen_groups = group_scores.topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
        allowed = allowed.unsqueeze(-1).expand_as(groups).reshape(T, -1)
        experts = biased.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _WEIGHT_SUM_FLOOR)
        return weights * self.scaling, experts

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}, scaling={self.scaling}")  # fmt: skip


class ScaledSoftmaxRouter(nn.Module):
    """DiffusionGemma's router: the input RMS-normalized without a learned weight, times a learned per-channel
    ``scale`` and ``hidden_size ** -0.5``, scored by a bias-free ``proj``; then `route` (float32 softmax, top-k,
    renormalized), and each chosen weight times its expert's learned ``per_expert_scale``. The scaling happens
    before the projection so that the router sees a normalized input whatever the residual's magnitude.
    Checkpoint names ``router.proj.weight``, ``router.scale``, ``router.per_expert_scale``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        _check_top_k(top_k, num_experts)
        self.num_experts, self.top_k, self.eps = num_experts, top_k, eps
        self.input_scale = hidden_size**-0.5
        self.proj = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose(self.inputs(x))

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What `proj` scores: ``x`` normed without a weight, times ``scale``, times ``hidden_size ** -0.5`` (a
        DiffusionGemma layer computes it beside its other norms of the same rows in one launch on CUDA)."""
        return gemma_rms_norm(x, None, self.eps) * self.scale * self.input_scale

    def choose(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and their weights from `inputs`' scores."""
        return route(self.proj(inputs), self.top_k, normalize=True, expert_scale=self.per_expert_scale)


# Added to the sum of the chosen experts' sigmoid scores before dividing by it, as LLaDA2's router does.
_WEIGHT_SUM_FLOOR = 1e-20
Router = SoftmaxRouter | GroupLimitedRouter


class GatedMLP(nn.Module):
    """A gated MLP under the checkpoint's names, ``down(act(gate(x)) * up(x))`` (SiLU: SwiGLU): one expert of a
    mixture, a shared expert, or a dense MLP beside the experts. ``sharded=False`` holds whole weights whatever
    the tensor-parallel group (an expert that expert parallelism already places on one rank). ``merge_gate_up``
    (a shared expert or a dense MLP; never an expert, whose weights its layer's `ExpertStack` joins) computes gate
    and up in one launch once loaded (`MergedProjection`), with SiLU in its epilogue where that applies."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
        sharded: bool = True,
        merge_gate_up: bool = False,
    ) -> None:
        super().__init__()
        column = ColumnParallelLinear if sharded else ReplicatedLinear
        self.gate_proj = column(hidden_size, intermediate_size, bias=False)
        self.up_proj = column(hidden_size, intermediate_size, bias=False)
        row = RowParallelLinear if sharded else ReplicatedLinear
        self.down_proj = row(intermediate_size, hidden_size, bias=False)
        self.activation = activation
        self.gate_up = MergedProjection(self.gate_proj, self.up_proj) if merge_gate_up else None

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate(x)) * up(x)``: down_proj's input."""
        if self.gate_up is None:
            return gated(self.activation, self.gate_proj(x), self.up_proj(x))
        if self.activation is F.silu:
            return self.gate_up.silu_mul(x)
        return gated(self.activation, *self.gate_up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activated(x))


class ExpertRange(nn.Module):
    """The experts one rank holds, each registered under its global index so that its parameters keep the
    checkpoint's names (``experts.5.gate_proj.weight``). Indexed by global index; iterates in index order."""

    def __init__(self, owned: range, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.owned = owned
        for index in owned:
            self.add_module(str(index), make())

    def __getitem__(self, index: int) -> nn.Module:
        if index not in self.owned:
            raise IndexError(
                f"expert {index} is not held here: this rank holds experts {self.owned.start}..{self.owned.stop - 1}"
            )
        return self._modules[str(index)]

    def __iter__(self):
        return (self._modules[str(index)] for index in self.owned)

    def __len__(self) -> int:
        return len(self.owned)


# A checkpoint tensor of one expert, named relative to its mixture layer.
_EXPERT_TENSOR = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class ExpertStack(JoinedWeights):
    """The experts' weights joined into two stacked tensors once loaded (`merge`); not an ``nn.Module``, so the
    state dict keeps the per-expert names."""

    def __init__(self, experts: ExpertRange) -> None:
        self.experts = experts
        self.gate_up: torch.Tensor | None = None  # [local experts, 2 * inter, hidden]: gate rows, then up rows
        self.down: torch.Tensor | None = None  # [local experts, hidden, inter]

    def merge(self) -> bool:
        """Join the weights; False (and the experts stay separate) where a hook must see each expert's own
        output (LoRA applied per forward) or the weights are not materialized on one device in one dtype."""
        modules = [m for e in self.experts for m in (e.gate_proj, e.up_proj, e.down_proj)]
        if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
            return False
        if any(m.weight.is_meta for m in modules) or len({(m.weight.device, m.weight.dtype) for m in modules}) > 1:
            return False
        gate_up = torch.stack([torch.cat([e.gate_proj.weight.data, e.up_proj.weight.data]) for e in self.experts])
        down = torch.stack([e.down_proj.weight.data for e in self.experts])
        inter = next(iter(self.experts)).gate_proj.out_features
        for index, expert in enumerate(self.experts):
            expert.gate_proj.weight.data = gate_up[index, :inter]
            expert.up_proj.weight.data = gate_up[index, inter:]
            expert.down_proj.weight.data = down[index]
        self.gate_up, self.down = gate_up, down
        return True


def fused_experts_win(x: torch.Tensor, top_k: int, num_experts: int, hidden: int, inter: int) -> bool:
    """Whether the fused kernels take a step of experts over ``x [T, hidden]``: triton present, a half-precision
    input outside autograd and ``torch.compile`` tracing (`use_fused_kernels`), and a row count
    `diffulex.kernels.fused_moe.fused_wins` gives them for this geometry. Shared by every family whose experts
    are stacked (`SparseMoE`, DiffusionGemma's `StackedExperts`)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or not use_fused_kernels(x):
        return False
    from diffulex.kernels.fused_moe import fused_wins

    return fused_wins(x.shape[0], top_k, num_experts, hidden, inter)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether this torch has a grouped GEMM for `x`'s device and dtype: CUDA from compute capability 9.0 in
    bfloat16 (the kernels torch ships); on the CPU, where a tiny probe runs (some supported torch versions have
    no CPU kernel)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return _cpu_grouped_mm(x.dtype)


@functools.cache
def _cpu_grouped_mm(dtype: torch.dtype) -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8, dtype=dtype), torch.ones(1, 8, 8, dtype=dtype),
                          offs=torch.tensor([2], dtype=torch.int32))  # fmt: skip
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class ExpertLayer(nn.Module):
    """A layer of routed experts, whatever its family: what expert parallelism splits and ``moe_gemm_impl`` picks
    the path of. ``num_experts`` is the layer's whole count; ``ep`` the expert-parallel group it was built over and
    ``owned`` the global indices of the experts this rank holds (``ep.owned_experts``); ``impl`` one of `MOE_IMPLS`
    that every step takes (None: each step's own choice). Each path is a method ``_<impl>(x, weights, experts)``."""

    num_experts: int
    ep: ExpertParallelGroup
    owned: range
    impl: str | None = None

    def _local_experts(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``experts`` as indices into this rank's experts (outside ``[0, len(owned))``: another rank's), and which
        pairs are this rank's (None: all of them)."""
        if len(self.owned) == self.num_experts:
            return experts, None
        local = experts - self.owned.start
        return local, (local >= 0) & (local < len(self.owned))

    def _weighted_sum(
        self, impl: str, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The chosen experts' weighted sum on the path ``impl``."""
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe impl must be one of {', '.join(MOE_IMPLS)}, got {impl!r}")
        return getattr(self, f"_{impl}")(x, weights, experts)


class SparseMoE(ExpertLayer):
    """Router (``gate``) and ``experts``, and optionally an always-on ``shared_experts`` MLP added to their sum
    (LLaDA2), under the checkpoint's names (``mlp.gate.weight``, ``mlp.experts.N.{gate,up,down}_proj.weight``,
    ``mlp.shared_experts...``). Input and output ``[T, hidden]``.

    Under expert parallelism only this rank's experts exist (``experts.owned``, global indices); the router and
    the shared experts are on every rank. Load expert tensors with `expert_weight_loader`."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, gate: Router, shared_experts: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.num_experts = gate.num_experts
        self.top_k = gate.top_k
        self.gate = gate
        self.ep = expert_parallel_group()
        # Experts the EP group places on one rank are whole there; at EP=1 they split over the TP group like any MLP.
        sharded = self.ep.size == 1
        self.owned = self.ep.owned_experts(self.num_experts)
        self.experts = ExpertRange(self.owned, lambda: GatedMLP(hidden_size, intermediate_size, sharded=sharded))
        # The group over which a product of the stacked weights is partial (the modules' own forward sums it).
        self.expert_tp = tensor_parallel_group() if sharded else SINGLE_RANK
        self.shared_experts = shared_experts
        # Shared experts split by TP over the expert ranks themselves (TP = EP): their partial product joins the
        # experts' partial sum, so that the layer makes one all-reduce instead of two.
        self.shared_joins_reduce = (
            isinstance(shared_experts, GatedMLP)
            and self.ep.size > 1
            and isinstance(shared_experts.down_proj, RowParallelLinear)
            and shared_experts.down_proj.tp.size == self.ep.size
            and shared_experts.down_proj.tp.process_group is self.ep.process_group
            and shared_experts.down_proj.bias is None
        )
        self.stack = ExpertStack(self.experts)
        self.impl: str | None = None  # None: chosen per input (`_impl_for`); tests force one of MOE_IMPLS

    def forward(self, x: torch.Tensor, unsummed: bool = False, readers: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum; ``unsummed`` and ``readers`` are the dense MLP's arguments, accepted so that a
        decoder layer calls either MLP alike (this one always returns a tensor and computes every row)."""
        weights, experts = self.gate.route(x)
        out = self._weighted_sum(self.impl or self._impl_for(x), x, weights, experts)
        if self.shared_joins_reduce:
            shared = self.shared_experts
            out = out + shared.down_proj.partial(shared.activated(x))
            return self.ep.all_reduce(out)  # the other ranks' experts and shared-expert slices
        out = self.ep.all_reduce(out)  # the other ranks' experts' contributions
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def expert_weight_loader(self, name: str, loaded: torch.Tensor) -> bool:
        """Load a full checkpoint's expert tensor, ``name`` relative to this layer
        (``experts.<index>.<gate_proj|up_proj|down_proj>.weight``), into this rank's expert; True when loaded,
        False when another rank owns that expert (the loader skips the tensor)."""
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            raise ValueError(
                f"expert tensor name {name!r} is invalid: must be experts.<index>.<gate_proj|up_proj|down_proj>.weight"
            )
        index = int(match[1])
        if index >= self.num_experts:
            raise ValueError(f"expert tensor {name!r} is invalid: the layer has {self.num_experts} experts")
        if index not in self.experts.owned:
            return False
        projection = getattr(self.experts[index], match[2])
        projection.weight_loader(projection.weight, loaded)
        return True

    def _impl_for(self, x: torch.Tensor) -> str:
        """Unstacked experts (a LoRA hook on one of them) run as modules, so that their hooks apply: the loop on
        the CPU; on CUDA every expert over every token (``dense``, which calls the modules when unstacked), which a
        CUDA graph can capture. Stacked ones on CUDA take the fused kernels where they win, else the grouped
        GEMM where this torch has one."""
        if not x.is_cuda:
            return "loop"
        if self.stack.gate_up is None or self.stack.down is None:
            return "dense"
        if self._fused_wins(x):
            return "fused"
        return "grouped" if grouped_mm_supported(x) else "dense"

    def _fused_wins(self, x: torch.Tensor) -> bool:
        inter, hidden = self.stack.down.shape[2], self.stack.down.shape[1]
        # the pairs per expert are the same on every rank of an expert-parallel group: the whole layer's count
        return fused_experts_win(x, self.top_k, self.num_experts, hidden, inter)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stack.gate_up is None or self.stack.down is None:
            gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            return gate_up, torch.stack([e.down_proj.weight for e in self.experts])
        return self.stack.gate_up, self.stack.down

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._stacked()
        per_slot = grouped_expert_slots(x, *self._local_experts(experts), len(self.experts), gate_up, down, F.silu)
        return self.expert_tp.all_reduce(weighted_slots(per_slot, weights, x.dtype))

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The Triton kernels over the stacked weights; another rank's pairs fall outside this rank's local
        indices, which the kernels skip (as `_grouped` masks them)."""
        from diffulex.kernels.fused_moe import fused_moe

        gate_up, down = self._stacked()
        return self.expert_tp.all_reduce(fused_moe(x, weights, self._local_experts(experts)[0], gate_up, down))

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by the routing (zero where not chosen): static shapes. Stacked
        experts multiply the stacked weights; unstacked ones (hooked) run as modules."""
        T = x.shape[0]
        per_expert = torch.zeros(T, self.num_experts, dtype=torch.float32, device=x.device)
        per_expert.scatter_(1, experts, weights)
        total = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        stacked = self.stack.gate_up is not None and self.stack.down is not None
        for i, e in enumerate(self.experts.owned):
            if stacked:
                h = x @ self.stack.gate_up[i].T
                inter = h.shape[-1] // 2
                y = (F.silu(h[:, :inter]) * h[:, inter:]) @ self.stack.down[i].T
            else:
                y = self.experts[e](x)
            total += per_expert[:, e : e + 1] * y.float()
        out = total.to(x.dtype)
        return self.expert_tp.all_reduce(out) if stacked else out

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        T, k = experts.shape
        out = torch.zeros(T, k, x.shape[1], dtype=x.dtype, device=x.device)
        for e in experts.unique().tolist():
            if e not in self.experts.owned:
                continue
            token, slot = (experts == e).nonzero(as_tuple=True)
            out[token, slot] = self.experts[e](x[token])
        return weighted_slots(out, weights, x.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The definition, token by token (tests); this rank's experts, summed over the expert-parallel group."""
        weights, experts = self.gate.route(x)
        rows = []
        for t in range(x.shape[0]):
            total = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
            for j in range(self.top_k):
                if int(experts[t, j]) in self.experts.owned:
                    total += weights[t, j] * self.experts[int(experts[t, j])](x[t : t + 1])[0].float()
            rows.append(total)
        out = self.ep.all_reduce(torch.stack(rows).to(x.dtype))
        return out if self.shared_experts is None else out + self.shared_experts(x)


def mixture_layers(model: nn.Module) -> dict[str, SparseMoE]:
    """The model's mixture-of-experts layers by their name prefix (``model.layers.3.mlp.``): where expert
    parallelism holds only some of the checkpoint's experts (the loader and LoRA skip the others' tensors)."""
    return {f"{name}.": module for name, module in model.named_modules() if isinstance(module, SparseMoE)}


def expert_of(name: str, layers: dict[str, SparseMoE]) -> tuple[SparseMoE, str] | None:
    """The mixture layer a tensor (or module) name of a routed expert belongs to and its name relative to that
    layer (``experts.5.up_proj.weight``), when it names one of that layer's experts (index below its global
    count); else None."""
    head, found, tail = name.partition(".experts.")
    if not found:
        return None
    layer = layers.get(f"{head}.")
    index = tail.partition(".")[0]
    if layer is None or not index.isdigit() or int(index) >= layer.num_experts:
        return None
    return layer, f"experts.{tail}"


def held_elsewhere(name: str, layers: dict[str, SparseMoE]) -> bool:
    """Whether ``name`` is a routed expert's tensor (or module) that another expert-parallel rank holds."""
    found = expert_of(name, layers)
    if found is None:
        return False
    layer, relative = found
    return int(relative.split(".")[1]) not in layer.experts.owned


def grouped_expert_slots(
    x: torch.Tensor,
    local: torch.Tensor,
    mine: torch.Tensor | None,
    held: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each (token, slot) pair's expert output ``[T, k, hidden]`` by two grouped GEMMs over this rank's ``held``
    stacked experts (``gate_up [held, 2 * inter, hidden]``, gate rows then up rows; ``down [held, hidden, inter]``):
    the pairs sorted by their expert ``local [T, k]`` (`ExpertLayer._local_experts`), another rank's pairs (``mine``
    False) last, past the last group, and zero in the result. ``offs[e]`` ends expert ``e``'s rows, counted by a
    scatter rather than ``bincount``, whose output size would be read back to the host."""
    T, k = local.shape
    flat = (local if mine is None else torch.where(mine, local, held)).reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(held + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = counts[:held].cumsum(0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offs)
    out = torch._grouped_mm(gated(activation, *h.chunk(2, dim=-1)), down.transpose(1, 2), offs=offs)
    unsorted = torch.empty_like(out)  # back to (token, slot) order
    unsorted[order] = out
    per_slot = unsorted.view(T, k, -1)
    if mine is not None:  # rows past the last group are never written: select, not multiply, them away
        per_slot = torch.where(mine.unsqueeze(-1), per_slot, 0.0)
    return per_slot


def weighted_slots(per_slot: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j weights[:, j] * per_slot[:, j]`` in float32, slot by slot: the same order on every path (no
    atomics), and the fused kernels' combine's."""
    total = per_slot[:, 0].float() * weights[:, :1]
    for j in range(1, per_slot.shape[1]):
        total += per_slot[:, j].float() * weights[:, j : j + 1]
    return total.to(dtype)
