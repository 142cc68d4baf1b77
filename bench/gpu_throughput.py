"""GPT throughput on one GPU, bf16: raytrain against a plain PyTorch loop of the same model.

    bash bench/gpu.sh        # or: python bench/gpu_throughput.py [--steps 60]

Both sides train ``raytrain.models.tinygpt.TinyGPT`` (default 12 layers, dim 768, block
512: about 85M parameters) with AdamW on random bytes, batch 16, bf16 autocast: the plain
loop by hand, raytrain through ``raytrain.fit`` (1 GPU worker, ``bf16-mixed``). Each side's
steps after ``--warmup`` are timed on the GPU (synchronised). Prints tokens/s for each and
the ratio, the model FLOPs utilisation (6 x parameters x tokens/s over the GPU's peak bf16
FLOPs, ``--peak-tflops``, guessed from the GPU's name) and peak memory; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def plain_loop(gpt: dict, batch: int, steps: int, warmup: int) -> dict:
    """Tokens/s and peak memory of a hand-written bf16 training loop."""
    from raytrain.models.tinygpt import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(**gpt).cuda()
    optimizer = model.configure_optimizers()
    tokens = torch.randint(0, 256, (batch, gpt["block"] + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model._loss(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - began)
    per_step = sorted(times)[len(times) // 2]
    return {"tokens_per_s": batch * gpt["block"] / per_step,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}  # fmt: skip


def raytrain_run(gpt: dict, batch: int, steps: int, warmup: int, work: Path) -> dict:
    """The same model and batch through ``raytrain.fit`` on one GPU worker."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import raytrain

    rows = batch * (steps + 1)
    data = torch.randint(0, 256, (rows, gpt["block"] + 1), dtype=torch.uint8).numpy()
    (work / "train").mkdir()
    table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(
        pa.array(data.ravel()), gpt["block"] + 1)})  # fmt: skip
    pq.write_table(table, work / "train" / "part-0.parquet")
    spec = {
        "name": "gpu-throughput",
        "model": {"class_path": "bench.models:TimedGPT",
                  "init_args": {"out": str(work / "steps.json"), "warmup": warmup, **gpt}},
        "data": {"train": {"uri": str(work / "train")}, "columns": ["tokens"],
                 "batch_size": batch, "shuffle": None},
        "scaling": {"num_workers": 1, "use_gpu": True},
        "trainer": {"max_steps": steps, "max_epochs": 1, "precision": "bf16-mixed",
                    "gradient_clip_val": 1.0, "log_every_n_steps": 50},
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": None},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }  # fmt: skip
    raytrain.fit(spec, progress=False)
    return json.loads((work / "steps.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_throughput.py needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    gpt = {"block": args.block, "layers": args.layers, "heads": args.heads, "dim": args.dim}
    from raytrain.models.tinygpt import TinyGPT

    params = sum(p.numel() for p in TinyGPT(**gpt).parameters())
    plain = plain_loop(gpt, args.batch, args.steps, args.warmup)
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        ours = raytrain_run(gpt, args.batch, args.steps, args.warmup, Path(tmp))
    peak = args.peak_tflops or peak_tflops(name)
    print(f"{name}: GPT {params / 1e6:.0f}M parameters, batch {args.batch} x {args.block}, bf16")
    header = f"{'':<22} {'raytrain':>12} {'plain loop':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    r, p = ours["tokens_per_s"], plain["tokens_per_s"]
    print(f"{'tokens/s':<22} {r:>12,.0f} {p:>12,.0f} {r / p:>7.2f}")
    if peak:
        mfu = {k: 6 * params * v / (peak * 1e12) for k, v in (("raytrain", r), ("plain", p))}
        print(f"{'MFU':<22} {mfu['raytrain']:>12.1%} {mfu['plain']:>12.1%}")
    print(
        f"{'peak memory, GB':<22} {ours['peak_memory_gb']:>12.2f} {plain['peak_memory_gb']:>12.2f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": name, "parameters": params, "gpt": gpt,
                               "batch": args.batch, "raytrain": ours, "plain": plain,
                               "peak_tflops": peak}, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
