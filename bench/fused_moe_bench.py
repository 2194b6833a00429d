"""The fused MoE kernels against the grouped GEMM on the SDAR-30B-A3B, LLaDA2-mini and DiffusionGemma-26B-A4B
expert geometries (the last also as one rank of tensor_parallel_size=2 holds it, each expert half as wide), against
the floor of the experts each step selects.

For each geometry and decode row count (SDAR-30B-A3B: block 4 at batch 1, 8 and 32; LLaDA2-mini: block 32 at the
same batches; DiffusionGemma: 1, 2, 4 and 8 canvases of 256 rows, and the sweep's layout 1 to 128 canvases of 16),
with uniform random routing: the experts of
one layer through the model's own fused and grouped paths (`SparseMoE._fused` / `_grouped` with SiLU,
`StackedExperts._fused` / `_grouped` with GELU-tanh), each timed as a CUDA graph of back-to-back calls replayed,
consecutive calls reading different copies of the stacked weights so that they come from HBM, not from the L2 the
previous call filled (a real forward reads another layer's). The floor is the bytes of the selected experts'
weights over the measured copy bandwidth (read + write bytes per second, as `diffulex.bench.roofline` counts), and
the flops over 790 TFLOP/s (the H100's dense bf16 peak); the max error of both paths is taken against a float32
computation of the same pairs. LLaDA2-mini's shared expert runs outside the kernels; its time and floor are
reported beside. A few other tile configs of the fused kernels are timed too, within a time budget, to fill
`diffulex.kernels.fused_moe`'s tables (``dispatch_takes_fused`` says what `fused_wins` picks for each row count
today; ``fused_speedup`` above 1 where the fused kernels should take it).

    PYTHONPATH=. python bench/fused_moe_bench.py OUT_DIR [--geometries diffusion-gemma-26b-a4b ...]

Writes ``OUT_DIR/fused_moe.json``; exits 1 when the fused result is off the reference by more than bf16 rounding
(after writing), 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from diffulex.bench.hardware import measure_copy_bandwidth, time_graph_calls
from diffulex.kernels.fused_moe import FusedMoEConfig, config_for, fused_moe, fused_wins
from diffulex.layers.moe import SoftmaxRouter, SparseMoE, route
from diffulex.models.diffusion_gemma import StackedExperts

GEOMETRIES = {
    "sdar-30b-a3b": {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768, "shared_inter": 0,
                     "activation": "silu", "rows": (4, 32, 128)},
    "llada2-mini": {"experts": 256, "top_k": 8, "hidden": 2048, "inter": 512, "shared_inter": 512,
                    "activation": "silu", "rows": (32, 256, 1024)},
    "diffusion-gemma-26b-a4b": {"experts": 128, "top_k": 8, "hidden": 2816, "inter": 704, "shared_inter": 0,
                                "activation": "gelu_tanh", "rows": (256, 512, 1024, 2048)},
    # one rank's experts of DiffusionGemma-26B-A4B at tensor_parallel_size=2 (each expert's width halved)
    "diffusion-gemma-26b-a4b-tp2": {"experts": 128, "top_k": 8, "hidden": 2816, "inter": 352, "shared_inter": 0,
                                    "activation": "gelu_tanh", "rows": (256, 512, 1024, 2048)},
    # the performance sweep's DiffusionGemma layout (`diffulex.bench.sweep_models.DIFFUSION_GEMMA_TEXT`): 1 to 128
    # canvases of 16 rows
    "diffusion-gemma-sweep": {"experts": 32, "top_k": 4, "hidden": 2048, "inter": 512, "shared_inter": 0,
                              "activation": "gelu_tanh", "rows": (16, 128, 256, 512, 1024, 2048)},
}  # fmt: skip
# The activation each geometry's experts apply to their gate, in PyTorch (the float32 reference).
TORCH_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}
PEAK_FLOPS = 790e12
DTYPE = torch.bfloat16
# Weight copies cycled through: each call's selected experts are hundreds of MB, so the previous call's copy has
# left the L2 by the time the same copy comes round again.
COPIES = 3
CALLS = 6  # calls per captured graph
REPLAYS = 5
# The fused result may be off the float32 computation by this many bf16 units in the last place of the output's
# largest value, or by twice the grouped GEMM's error, whichever is larger.
MAX_ULPS = 8
# Tile configs timed beside `config_for`'s, while the sweep's budget lasts: (row tile as a multiple of
# `config_for`'s, block_n gate_up, block_n down, block_k, warps, stages). Row tiles of 2x and 4x are tried where an
# expert's pairs would otherwise span several tiles (each tile streams the expert's weights again), up to
# `MAX_BLOCK_M` rows; half as many rows, where the busiest experts' second tile costs less than every tile's padding.
VARIANTS = [(1, 64, 64, 128, 4, 4), (1, 32, 64, 128, 4, 4), (1, 64, 128, 128, 4, 3), (1, 32, 32, 256, 4, 3),
            (1, 128, 128, 64, 8, 4), (2, 64, 64, 64, 4, 3), (2, 128, 128, 64, 8, 3), (2, 64, 128, 64, 8, 4),
            (4, 64, 64, 64, 8, 3), (4, 128, 128, 64, 8, 3), (4, 64, 128, 32, 8, 4),
            (1, 64, 256, 64, 8, 3), (1, 128, 256, 64, 8, 3), (1, 32, 128, 128, 4, 3), (1, 64, 128, 64, 4, 4),
            (1, 64, 64, 128, 8, 3), (0.5, 64, 64, 128, 4, 3), (0.5, 64, 128, 128, 4, 3),
            (1, 64, 256, 128, 8, 2), (1, 128, 256, 128, 8, 2), (1, 64, 256, 64, 8, 4),
            (1, 64, 256, 64, 4, 3)]  # fmt: skip
MAX_BLOCK_M = 256
MIN_BLOCK_M = 16  # the MMA's fewest rows


def time_graph(call: Callable[[int], object]) -> float:
    """Microseconds per call of ``call(i)`` for i in range(CALLS), captured once and replayed (the best replay)."""
    return time_graph_calls(call, CALLS, REPLAYS, warmup=2)


def reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, activation: str) -> torch.Tensor:  # fmt: skip
    """float32 ``sum_j w[t, j] * down_e(act(gate_e x_t) * up_e x_t)``, expert by expert."""
    inter = down.shape[2]
    act = TORCH_ACTIVATIONS[activation]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        token, slot = (experts == e).nonzero(as_tuple=True)
        h = x[token].float() @ gate_up[e].float().T
        y = (act(h[:, :inter]) * h[:, inter:]) @ down[e].float().T
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
    return out


def layer(geometry: dict) -> SparseMoE | StackedExperts:
    """The experts of the geometry without weights of their own (meta device): `use_weights` sets the stacked
    weights, the only ones the fused and grouped paths read. SiLU geometries are a `SparseMoE`, Gemma's a
    `StackedExperts`."""
    E, k, H, inter = geometry["experts"], geometry["top_k"], geometry["hidden"], geometry["inter"]
    with torch.device("meta"):
        if geometry["activation"] == "gelu_tanh":
            return StackedExperts(E, H, inter, k)
        return SparseMoE(H, inter, SoftmaxRouter(H, E, k, True))


def use_weights(moe: SparseMoE | StackedExperts, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Point the layer's stacked weights at one copy (no data moves)."""
    if isinstance(moe, StackedExperts):
        moe.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        moe.down_proj = torch.nn.Parameter(down, requires_grad=False)
    else:
        moe.stack.gate_up, moe.stack.down = gate_up, down


def measure(name: str, geometry: dict, rows: int, stacks: list, moe: SparseMoE | StackedExperts, bandwidth: float,
            sweep_until: float) -> dict:  # fmt: skip
    E, k, H, inter = geometry["experts"], geometry["top_k"], geometry["hidden"], geometry["inter"]
    activation = geometry["activation"]
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, H, device="cuda", generator=gen).to(DTYPE)
    weights, experts = route(torch.randn(rows, E, device="cuda", generator=gen), k, normalize=True)

    def run(path: Callable, i: int) -> torch.Tensor:
        use_weights(moe, *stacks[i % COPIES])
        return path(x, weights, experts)

    expected = reference(x, weights, experts, *stacks[0], activation)
    scale = expected.abs().max().item()
    fused_err = (run(moe._fused, 0).float() - expected).abs().max().item()
    grouped_err = (run(moe._grouped, 0).float() - expected).abs().max().item()
    tolerance = max(2 * grouped_err, MAX_ULPS * torch.finfo(DTYPE).eps * scale)
    fused_us = time_graph(lambda i: run(moe._fused, i))
    grouped_us = time_graph(lambda i: run(moe._grouped, i))
    selected = experts.unique().numel()
    expert_bytes = selected * 3 * H * inter * torch.finfo(DTYPE).bits // 8
    flops = 2 * rows * k * 3 * H * inter
    floor_us = max(expert_bytes / bandwidth, flops / PEAK_FLOPS) * 1e6
    default = config_for(rows * k, E, H, inter)
    variants = {}
    for scale, n_gu, n_down, block_k, warps, stages in VARIANTS:
        if time.monotonic() > sweep_until:
            break
        block_m = int(default.block_m * scale)
        if scale > 1 and (block_m > MAX_BLOCK_M or rows * k < E * block_m // 2):
            continue  # no expert's pairs would fill half of the larger tile
        if block_m < MIN_BLOCK_M:
            continue
        cfg = FusedMoEConfig(block_m, n_gu, n_down, block_k, warps, stages)
        try:
            variants[str(tuple(cfg))] = time_graph(lambda i, cfg=cfg: fused_moe(
                x, weights, experts, *stacks[i % COPIES], config=cfg, activation=activation))  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a tile that does not fit (shared memory) is reported, not fatal
            print(f"  {name} T={rows} {tuple(cfg)} failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
    row = {
        "geometry": name, "activation": activation, "rows": rows, "pairs": rows * k, "selected_experts": selected,
        "expert_bytes": expert_bytes, "flops": flops,
        "memory_floor_us": expert_bytes / bandwidth * 1e6, "compute_floor_us": flops / PEAK_FLOPS * 1e6,
        "floor_us": floor_us, "fused_us": fused_us, "grouped_us": grouped_us,
        "fused_x_floor": fused_us / floor_us, "grouped_x_floor": grouped_us / floor_us,
        "fused_speedup": grouped_us / fused_us, "dispatch_takes_fused": fused_wins(rows, k, E, H, inter),
        "config": list(default), "variants_us": variants,
        "fused_max_err": fused_err, "grouped_max_err": grouped_err, "ref_max_abs": scale,
        "error_ok": fused_err <= tolerance,
    }  # fmt: skip
    if geometry["shared_inter"]:
        row.update(shared_expert(x, geometry["shared_inter"], bandwidth))
    return row


def shared_expert(x: torch.Tensor, inter: int, bandwidth: float) -> dict:
    """LLaDA2's shared expert (a SwiGLU MLP over every row, outside the kernels): graph time and floor."""
    H = x.shape[1]
    copies = [(torch.randn(2 * inter, H, device="cuda", dtype=DTYPE) * 0.02,
               torch.randn(H, inter, device="cuda", dtype=DTYPE) * 0.02) for _ in range(16)]  # fmt: skip

    def call(i: int) -> torch.Tensor:
        gate_up, down = copies[i % len(copies)]
        h = F.linear(x, gate_up)
        return F.linear(F.silu(h[:, :inter]) * h[:, inter:], down)

    nbytes = 3 * H * inter * torch.finfo(DTYPE).bits // 8
    floor = max(nbytes / bandwidth, 2 * x.shape[0] * 3 * H * inter / PEAK_FLOPS) * 1e6
    return {"shared_us": time_graph(call), "shared_floor_us": floor}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sweep-seconds", type=float, default=60.0, help="time budget of the config variants")
    parser.add_argument("--geometries", nargs="+", choices=sorted(GEOMETRIES), default=list(GEOMETRIES),
                        help="expert geometries to time (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_moe_bench: no CUDA device; this benchmark times GPU kernels", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = measure_copy_bandwidth(torch.device("cuda"), 1 << 30)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    sweep_until = time.monotonic() + args.sweep_seconds
    results = []
    for name in args.geometries:
        geometry = GEOMETRIES[name]
        E, H, inter = geometry["experts"], geometry["hidden"], geometry["inter"]
        stacks = [(torch.empty(E, 2 * inter, H, device="cuda", dtype=DTYPE).normal_(0.0, 0.02),
                   torch.empty(E, H, inter, device="cuda", dtype=DTYPE).normal_(0.0, 0.02))
                  for _ in range(COPIES)]  # fmt: skip
        moe = layer(geometry)
        for rows in geometry["rows"]:
            row = measure(name, geometry, rows, stacks, moe, bandwidth, sweep_until)
            results.append(row)
            best = min(row["variants_us"].items(), key=lambda kv: kv[1], default=("-", float("nan")))
            shared = ""
            if "shared_us" in row:
                shared = f" shared {row['shared_us']:.1f} us (floor {row['shared_floor_us']:.1f})"
            print(f"{name} T={rows:5d} experts {row['selected_experts']:3d}: fused {row['fused_us']:8.1f} us "
                  f"grouped {row['grouped_us']:8.1f} us floor {row['floor_us']:7.1f} us "
                  f"(fused {row['fused_x_floor']:.2f}x, grouped {row['grouped_x_floor']:.2f}x) "
                  f"err fused {row['fused_max_err']:.2e} grouped {row['grouped_max_err']:.2e} "
                  f"best variant {best[0]} {best[1]:.1f} us{shared}", flush=True)  # fmt: skip
        del stacks, moe
        torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "python": platform.python_version(), "dtype": str(DTYPE),
        "copy_bandwidth_GBps": bandwidth / 1e9, "peak_flops": PEAK_FLOPS, "rows": results,
    }  # fmt: skip
    path = args.out_dir / "fused_moe.json"
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"wrote {path}")
    bad = [f"{r['geometry']} T={r['rows']}" for r in results if not r["error_ok"]]
    if bad:
        print(f"fused_moe_bench: FAILED: fused result off the float32 reference beyond bf16 rounding at {bad}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
