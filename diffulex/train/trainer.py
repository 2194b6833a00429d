"""The trainer of the built-in model: ``python -m diffulex.train train --data DIR --out DIR``.

One process, one device. bf16 autocast on CUDA (float32 master weights, AdamW), float32 on CPU. Deterministic
for a seed on a given machine. Prints progress every ``--log-every`` steps; writes ``<out>/checkpoint`` (a
loadable SDAR folder), ``<out>/loss.json`` and ``<out>/loss.png`` every ``--save-every-s`` seconds and at the
end, so a run cut short still leaves a model.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from diffulex.train.data import TrainData
from diffulex.train.export import model_config, save_checkpoint, sdar_config
from diffulex.train.model import build_model, diffusion_loss


@dataclass
class TrainArgs:
    data: str
    out: str
    steps: int = 6000
    batch_size: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 300
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    text_fraction: float = 0.2
    text_len: int = 80
    block_size: int = 4
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    window_probs: str = "0.5,0.3,0.1,0.1"
    pad_weight: float = 0.3
    seed: int = 0
    device: str = "auto"
    log_every: int = 200
    save_every_s: float = 120.0
    max_minutes: float = 0.0  # 0 = no time limit; otherwise stop (and save) after this many minutes
    compile: bool = False


def lr_at(step: int, args: TrainArgs, time_fraction: float = 0.0) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``. Under a time limit the decay follows whichever
    is further along, the steps or the time, so a time-limited run still ends at the low learning rate."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, max((step - args.warmup) / max(1, args.steps - args.warmup), time_fraction))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def plot_loss(history: list[tuple[int, float]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = np.array([s for s, _ in history])
    losses = np.array([v for _, v in history])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="per log interval")
    if len(losses) >= 10:
        k = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, lw=1.6, label=f"moving mean ({k})")
    ax.set_xlabel("step")
    ax.set_ylabel("masked-token cross entropy")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def train(args: TrainArgs) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)

    data = TrainData.load(args.data)
    if args.text_fraction > 0 and len(data.text_tokens) <= args.text_len:
        raise ValueError(
            f"text_fraction={args.text_fraction} needs prose, but the data folder {args.data} has "
            f"{len(data.text_tokens)} text tokens (prepared with --no-text?): pass --text-fraction 0"
        )
    meta = json.loads((Path(args.data) / "meta.json").read_text(encoding="utf-8"))
    special = meta["special_ids"]
    cfg_dict = model_config(
        vocab_size=data.vocab_size,
        special_ids=special,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        block_size=args.block_size,
    )
    model = build_model(sdar_config(cfg_dict), seed=args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=fused,
    )
    window_probs = tuple(float(x) for x in args.window_probs.split(","))
    loss_fn = diffusion_loss
    if args.compile:
        loss_fn = torch.compile(diffusion_loss, dynamic=True)
    use_bf16 = device.type == "cuda"
    print(
        f"training {n_params / 1e6:.2f}M params on {device} ({platform.node()}), {args.steps} steps x "
        f"{args.batch_size}; data: {meta['n_sft_examples']} SFT examples, {meta['text_tokens']} text tokens",
        flush=True,
    )

    history: list[tuple[int, float]] = []
    start = time.time()
    last_save = start
    running, count, tokens_seen = 0.0, 0, 0
    step = 0

    def save(final: bool) -> None:
        info = {
            "args": asdict(args),
            "step": step,
            "elapsed_s": round(time.time() - start, 1),
            "final_loss": history[-1][1] if history else None,
            "params": n_params,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "finished": final,
        }
        (out / "loss.json").write_text(json.dumps({**info, "history": history}) + "\n", encoding="utf-8")
        save_checkpoint(
            model,
            cfg_dict,
            Path(args.data) / "tokenizer",
            special,
            out / "checkpoint",
            extra_files={"training_info.json": json.dumps(info, indent=2) + "\n"},
        )
        plot_loss(history, out / "loss.png", f"block-diffusion training, {n_params / 1e6:.1f}M params")

    model.train()
    for step in range(args.steps):  # noqa: B007 (save() reads step)
        time_fraction = (time.time() - start) / (args.max_minutes * 60) if args.max_minutes > 0 else 0.0
        lr = lr_at(step, args, time_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens, prompt_len, real_len = data.sample_batch(
            rng, args.batch_size, args.text_fraction, args.text_len, args.block_size
        )
        x0 = torch.from_numpy(tokens).to(device, non_blocking=True)
        pl = torch.from_numpy(prompt_len).to(device)
        rl = torch.from_numpy(real_len).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = loss_fn(
                model,
                x0,
                pl,
                rl,
                args.block_size,
                data.mask_id,
                gen,
                pad_weight=args.pad_weight,
                window_probs=window_probs,
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_seen += tokens.size
        running += float(loss.detach())
        count += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            avg = running / count
            history.append((step + 1, round(avg, 5)))
            elapsed = time.time() - start
            print(
                f"step {step + 1:6d}  loss {avg:.4f}  lr {lr:.2e}  {elapsed:7.1f}s  {tokens_seen / elapsed:,.0f} tok/s",
                flush=True,
            )
            running, count = 0.0, 0
        now = time.time()
        if args.save_every_s > 0 and now - last_save > args.save_every_s:
            save(final=False)
            last_save = now
        if args.max_minutes > 0 and now - start > args.max_minutes * 60:
            print(f"time limit of {args.max_minutes} min reached at step {step + 1}", flush=True)
            break
    step += 1
    save(final=True)
    elapsed = time.time() - start
    print(f"done: {step} steps in {elapsed:.1f}s, final loss {history[-1][1] if history else float('nan')}", flush=True)
    return {"steps": step, "elapsed_s": elapsed, "history": history, "checkpoint": str(out / "checkpoint")}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainArgs(data="", out="")
    parser.add_argument("--data", required=True, help="data folder written by 'prepare'")
    parser.add_argument("--out", required=True, help="output folder (checkpoint/, loss.json, loss.png)")
    for name, value in asdict(defaults).items():
        if name in ("data", "out"):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value, help=f"default {value}")
