"""The paged-attention kernel's variants compiled for a GPU target on any machine (no GPU: Triton's own ptxas), with
their registers, spills and shared memory; with ``--against FILE``, whether each variant's PTX equals the one
compiled from another version of the kernel module (debug sections aside).

    PYTHONPATH=. python bench/attention_compile_check.py [--arch 90] [--variants decode long] \\
        [--against <(git show main:diffulex/kernels/paged_attention.py)]

Why: a tile shape that spills registers or overflows shared memory shows here in seconds, before a device call;
and ``--against`` shows that a change leaves the decode-sized variants' code as it was (the same PTX: the same bits
out, the same speed).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

os.environ.pop("TRITON_INTERPRET", None)  # real compiles, before triton is imported

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_POINTERS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "out_ptr": "*bf16", "cu_seqlens_q_ptr": "*i32", "context_lens_ptr": "*i32", "prefix_lens_ptr": "*i32",
    "page_tables_ptr": "*i32", "part_ml_ptr": "*fp32", "part_acc_ptr": "*fp32", "counters_ptr": "*i32",
    "key_lens_ptr": "*i32", "qk_scale": "fp32",
}  # fmt: skip
_NOT_SPECIALIZED = ("qk_scale", "stride_pt_r", "split_slots")  # as the launch compiles them
# SDAR-1.7B heads (2 query heads per KV head), head_dim 128, bf16, pages of 16, blocks of 4
_BASE = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_SIZE=4, PREFIX_FULL=False, IEEE=False,
             MIN_SPLIT_KEYS=64, PREFETCH_KEYS=0, LINE_ELEMS=64)  # fmt: skip
# name -> (constexprs over _BASE, warps, stages); "decode": the classes decode steps launch, "long": prompts'
VARIANTS: dict[str, dict[str, tuple[dict[str, object], int, int]]] = {
    "decode": {
        "16 rows, split, PDL": (dict(BLOCK_Q=8, SPLIT=True, USE_PDL=True, PRELOAD_TILE=True, PREFETCH_KEYS=128), 4, 1),
        "16 rows, unsplit": (dict(BLOCK_Q=8, SPLIT=False, USE_PDL=False), 4, 2),
        "64 rows (8B heads), PDL": (dict(BLOCK_Q=16, GROUP=4, GROUP_PAD=4, SPLIT=False, USE_PDL=True,
                                         PREFETCH_KEYS=128), 4, 2),
        "64 rows, split, key tails": (dict(BLOCK_Q=32, SPLIT=True, USE_PDL=False, PRELOAD_TILE=True, KEY_TAIL=True),
                                      4, 1),
        "16 rows, window, prefix-full": (dict(BLOCK_Q=8, SPLIT=False, USE_PDL=False, WINDOW=512, PREFIX_FULL=True),
                                         4, 2),
    },
    "long": {
        "long 128x64, 3 stages": (dict(BLOCK_Q=64, SPLIT=False, USE_PDL=False, FULL_TILES=True), 8, 3),
        "long 128x64, 8B heads": (dict(BLOCK_Q=32, GROUP=4, GROUP_PAD=4, SPLIT=False, USE_PDL=False,
                                       FULL_TILES=True), 8, 3),
        "long 128x128, 2 stages": (dict(BLOCK_Q=64, BLOCK_N=128, SPLIT=False, USE_PDL=False, FULL_TILES=True), 8, 2),
        "long 128x64, window, fp32": (dict(BLOCK_Q=64, SPLIT=False, USE_PDL=False, FULL_TILES=True, WINDOW=512,
                                           IEEE=True), 8, 2),
    },
}  # fmt: skip


def default_long_variant(module: ModuleType) -> tuple[dict[str, object], int, int]:
    """The long-query class as the module launches it by default (`LongQueryTiles` defaults), SDAR-1.7B heads."""
    tiles = module._LONG_QUERY_TILES
    constexprs = dict(BLOCK_Q=tiles.rows // _BASE["GROUP_PAD"], BLOCK_N=tiles.block_n, SPLIT=False, USE_PDL=False,
                      FULL_TILES=True)  # fmt: skip
    return constexprs, tiles.num_warps, tiles.num_stages


def load_module(path: Path) -> ModuleType:
    """A paged-attention module from a file (another version of it), under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"paged_attention_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def compile_variant(module: ModuleType, constexprs: dict[str, object], warps: int, stages: int, arch: int):
    """Compile `module`'s kernel with `constexprs` (every other argument specialized as a launch would) for
    sm_`arch`."""
    kernel = module._paged_attention_kernel
    params = inspect.signature(kernel.fn).parameters
    constexprs = {"BLOCK_N": 64, **_BASE, **constexprs}
    signature: dict[str, str] = {}
    values: dict[tuple[int, ...], object] = {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
        elif name in _POINTERS:
            signature[name] = _POINTERS[name]
        elif params[name].default is not inspect.Parameter.empty:
            signature[name], values[(i,)] = "constexpr", params[name].default
        else:
            signature[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr" and name not in _NOT_SPECIALIZED}  # fmt: skip
    source = ASTSource(kernel, signature, values, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                              "num_stages": stages})


def resource_usage(compiled) -> dict[str, int]:
    """Registers, stack (spilled registers) and shared memory of a compiled kernel, from its cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", dump))
    shared = compiled.metadata.shared
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]), "shared_bytes": shared}


def code(compiled) -> str:
    """The PTX without what names source files and lines: its debug sections, ``.loc`` / ``.file`` lines, the
    ``$L__tmp`` labels only those sections refer to (numbered by inlined call sites, so a helper called instead of
    its body written out renumbers them) and comments."""
    text = compiled.asm["ptx"].split(".section\t.debug")[0].split(".section .debug")[0]
    lines = (re.sub(r"\s*//.*$", "", line) for line in text.splitlines())
    return "\n".join(line for line in lines if not re.match(r"\s*(\.(loc|file)\b|\$L__tmp\d+:\s*$)", line))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    ap.add_argument("--only", default=None, help="variants whose name contains this")
    ap.add_argument("--against", type=Path, default=None, help="another paged_attention.py to compare PTX with")
    args = ap.parse_args()
    from diffulex.kernels import paged_attention

    other = load_module(args.against) if args.against else None
    differ = 0
    for group in args.variants:
        variants = dict(VARIANTS[group])
        if group == "long":
            variants = {"long default (LongQueryTiles())": default_long_variant(paged_attention), **variants}
        for name, (constexprs, warps, stages) in variants.items():
            if args.only and args.only not in name:
                continue
            compiled = compile_variant(paged_attention, constexprs, warps, stages, args.arch)
            usage = resource_usage(compiled)
            line = (f"{name:32s} {usage['registers']:4d} registers, {usage['stack_bytes']:5d} B stack, "
                    f"{usage['shared_bytes'] // 1024:4d} KiB shared")  # fmt: skip
            if other is not None and group == "decode":
                same = code(compiled) == code(compile_variant(other, constexprs, warps, stages, args.arch))
                differ += not same
                line += f"; PTX {'identical to' if same else 'DIFFERS from'} {args.against}"
            print(line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
