#!/usr/bin/env python
"""AC-SGD convergence experiment: a small GPT cut into two stages, four runs, loss curves as JSON + PNG.

Runs (same seed, same data order, several epochs over a small corpus so examples repeat):
  fp32            the boundary sends raw float32 both ways (exact)
  acsgd_fw4_bw8   AC-SGD 4-bit activation deltas forward, 8-bit gradients backward
  acsgd_fw2_bw8   AC-SGD 2-bit deltas forward, 8-bit backward
  direct_fw2_bw8  direct 2-bit quantization of the activations forward, 8-bit backward
  (--control adds bf16_control: raw bfloat16 both ways, a tiny stateless perturbation whose gap
   to fp32 shows how much this training run amplifies any perturbation.)
Every boundary crossing is really encoded to bytes and decoded by a separate receiver
(peerd.compress.LoopbackHook inside peerd.pipeline.local.train_pipelined).

    python scripts/convergence_acsgd.py                      # writes out/convergence_acsgd/
    python scripts/convergence_acsgd.py --out-dir /tmp/conv --epochs 10
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from peerd.compress import DeltaConfig, LoopbackHook, QuantConfig
from peerd.data.dataset import WindowDataset
from peerd.data.sources import builtin_corpus
from peerd.models.gpt import GPT, GPTConfig
from peerd.pipeline.local import LocalRunConfig, train_pipelined

BACKWARD = QuantConfig(bits=8, scale="absmax")


def runs(control: bool) -> dict[str, LoopbackHook]:
    extra = {"bf16_control": LoopbackHook("bf16", "bf16")} if control else {}
    return {
        "fp32": LoopbackHook("fp32", "fp32"),
        "acsgd_fw4_bw8": LoopbackHook(DeltaConfig(quant=QuantConfig(bits=4)), "q8", backward_quant=BACKWARD),
        "acsgd_fw2_bw8": LoopbackHook(DeltaConfig(quant=QuantConfig(bits=2)), "q8", backward_quant=BACKWARD),
        "direct_fw2_bw8": LoopbackHook(
            "q2", "q8", forward_quant=QuantConfig(bits=2), backward_quant=BACKWARD
        ),
        **extra,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out/convergence_acsgd", help="where results.json and loss.png go")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--examples", type=int, default=256, help="training windows (each seen once per epoch)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (the cut is in the middle)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW; 3e-3 spikes in fp32 at this size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids stalls on busy machines)")
    p.add_argument("--only", default=None, help="comma-separated subset of runs")
    p.add_argument("--control", action="store_true", help="also run bf16_control (sensitivity reference)")
    return p.parse_args()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results["runs"].items():
        epochs = range(1, len(r["epoch_loss"]) + 1)
        ax1.plot(epochs, r["epoch_loss"], label=name, marker=".")
        gap = [
            100 * (a - b) / b
            for a, b in zip(r["epoch_loss"], results["runs"]["fp32"]["epoch_loss"], strict=True)
        ]
        ax2.plot(epochs, gap, label=name, marker=".")
    ax1.set(xlabel="epoch", ylabel="mean training loss", title="GPT cut in two stages: loss per epoch")
    ax2.set(xlabel="epoch", ylabel="% above fp32", title="gap to the fp32 run")
    ax2.axhline(2.0, color="grey", linestyle="--", linewidth=0.8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = builtin_corpus(args.examples * args.seq_len + 1)
    dataset = WindowDataset(corpus, seq_len=args.seq_len)
    model_cfg = GPTConfig(
        n_layer=args.layers, n_head=args.heads, d_model=args.d_model, max_seq_len=args.seq_len
    )
    n_layers = model_cfg.num_layers
    split = [n_layers // 2, n_layers - n_layers // 2]
    steps_per_epoch = len(dataset) // args.batch
    cfg = LocalRunConfig(
        steps=args.epochs * steps_per_epoch, global_batch=args.batch, micro_batch_size=args.micro_batch,
        layers_per_stage=split, lr=args.lr, data_seed=args.seed,
    )  # fmt: skip
    results: dict = {
        "config": {**vars(args), "layers_per_stage": split, "steps_per_epoch": steps_per_epoch,
                   "examples": len(dataset), "corpus_digest": corpus.digest, "torch": torch.__version__},
        "runs": {},
    }  # fmt: skip
    wanted = set(args.only.split(",")) if args.only else None
    for name, hook in runs(args.control).items():
        if wanted and name not in wanted:
            continue
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        losses = train_pipelined(GPT(model_cfg, seed=args.seed), dataset, cfg, hook=hook)
        wall = time.perf_counter() - t0
        epoch_loss = [
            sum(losses[e * steps_per_epoch : (e + 1) * steps_per_epoch]) / steps_per_epoch
            for e in range(args.epochs)
        ]
        stats = hook.stats()[0]
        results["runs"][name] = {
            "epoch_loss": epoch_loss,
            "step_loss": losses,
            "final_loss": epoch_loss[-1],
            "forward_bits_per_element": round(stats.forward_bits_per_element, 4),
            "backward_bits_per_element": round(stats.backward_bits_per_element, 4),
            "buffers_bit_identical": hook.check_identical(),
            "wall_s": round(wall, 1),
        }
        hook.close()
        print(
            f"{name:16s} final {epoch_loss[-1]:.4f}  fw {stats.forward_bits_per_element:.2f} b/el  {wall:.0f}s",
            flush=True,
        )
    if "fp32" in results["runs"]:
        ref = results["runs"]["fp32"]["epoch_loss"]
        gaps = {
            n: [100 * (a - b) / b for a, b in zip(r["epoch_loss"], ref, strict=True)]
            for n, r in results["runs"].items()
        }
        results["final_gap_vs_fp32_pct"] = {n: round(g[-1], 3) for n, g in gaps.items()}
        results["mean_gap_last5_vs_fp32_pct"] = {
            n: round(sum(g[-5:]) / len(g[-5:]), 3) for n, g in gaps.items()
        }
        results["max_abs_gap_vs_fp32_pct"] = {n: round(max(abs(x) for x in g), 3) for n, g in gaps.items()}
        plot(results, out_dir / "loss.png")
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = {k: v for k, v in results.items() if k != "runs"}
    summary["final_loss"] = {n: round(r["final_loss"], 4) for n, r in results["runs"].items()}
    print(json.dumps(summary, indent=1))
    print(
        f"wrote {out_dir / 'results.json'}"
        + (f" and {out_dir / 'loss.png'}" if "fp32" in results["runs"] else "")
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
