"""GPT throughput on one GPU, bf16: raytrain against a plain PyTorch loop of the same model.

    bash bench/gpu.sh        # or: python bench/gpu_throughput.py [--steps 60]

Both sides train ``raytrain.models.tinygpt.TinyGPT`` (default 12 layers, dim 768, block
512: about 85M parameters) with AdamW on random bytes, batch 16, bf16 autocast: the plain
loop by hand, raytrain through ``raytrain.fit`` (1 GPU worker, ``bf16-mixed``). Each side's
steps after ``--warmup`` are timed on the GPU (synchronised). Prints tokens/s for each and
the ratio, the model FLOPs utilisation (6 x parameters x tokens/s over the GPU's peak bf16
FLOPs, ``--peak-tflops``, guessed from the GPU's name) and peak memory; writes JSON.

    python bench/gpu_throughput.py --dry-run [--ray]

A dry run checks everything but the CUDA parts on a machine without a GPU, in seconds: a
tiny GPT (``DRY``, each size still overridable) trains ``--steps 3`` on the CPU in the plain
loop, the raytrain side's data and spec are written and checked by ``raytrain.validate``
and its model is built from the spec; with ``--ray`` the raytrain side also runs
``raytrain.fit`` on one CPU worker. The table and the JSON are written as on a GPU (the
figures mean nothing). ``--device cpu`` alone runs the full-size benchmark on the CPU.
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

# The dry run's sizes: a GPT of one block that trains a step on a CPU in milliseconds.
DRY = {"layers": 1, "dim": 32, "heads": 2, "block": 16, "batch": 2, "steps": 3, "warmup": 1}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def plain_loop(gpt: dict, batch: int, steps: int, warmup: int, device: str = "cuda") -> dict:
    """Tokens/s and peak memory (None on a CPU) of a hand-written bf16 training loop."""
    from bench.models import peak_memory_gb, reset_peak_memory, synchronize
    from raytrain.models.tinygpt import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(**gpt).to(device)
    optimizer = model.configure_optimizers()
    tokens = torch.randint(0, 256, (batch, gpt["block"] + 1), device=device)
    reset_peak_memory(model.device)
    times = []
    for step in range(steps):
        synchronize(model.device)
        began = time.perf_counter()
        with torch.autocast(model.device.type, dtype=torch.bfloat16):
            loss = model._loss(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(model.device)
        if step >= warmup:
            times.append(time.perf_counter() - began)
    per_step = sorted(times)[len(times) // 2]
    return {
        "tokens_per_s": batch * gpt["block"] / per_step,
        "peak_memory_gb": peak_memory_gb(model.device),
    }


def raytrain_spec(gpt: dict, batch: int, steps: int, warmup: int, work: Path, gpu: bool) -> dict:
    """The raytrain side's job, and its train set written under ``work``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = batch * (steps + 1)
    data = torch.randint(0, 256, (rows, gpt["block"] + 1), dtype=torch.uint8).numpy()
    (work / "train").mkdir()
    table = pa.table(
        {"tokens": pa.FixedSizeListArray.from_arrays(pa.array(data.ravel()), gpt["block"] + 1)}
    )
    pq.write_table(table, work / "train" / "part-0.parquet")
    spec = {
        "name": "gpu-throughput",
        "model": {
            "class_path": "bench.models:TimedGPT",
            "init_args": {"out": str(work / "steps.json"), "warmup": warmup, **gpt},
        },
        "data": {
            "train": {"uri": str(work / "train")},
            "columns": ["tokens"],
            "batch_size": batch,
            "shuffle": None,
        },
        "scaling": {"num_workers": 1, "use_gpu": gpu},
        "trainer": {
            "max_steps": steps,
            "max_epochs": 1,
            "precision": "bf16-mixed",
            "gradient_clip_val": 1.0,
            "log_every_n_steps": 50,
        },
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": None},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }
    return spec


def raytrain_run(
    gpt: dict, batch: int, steps: int, warmup: int, work: Path, device: str = "cuda"
) -> dict:
    """The same model and batch through ``raytrain.fit`` on one GPU (or CPU) worker."""
    import raytrain

    spec = raytrain_spec(gpt, batch, steps, warmup, work, gpu=device == "cuda")
    raytrain.fit(spec, progress=False)
    return json.loads((work / "steps.json").read_text())


def raytrain_checked(gpt: dict, batch: int, steps: int, warmup: int, work: Path) -> None:
    """The raytrain side as far as a dry run goes without Ray: its data and spec pass
    ``raytrain.validate`` (as ``fit`` checks them), and the spec builds its model."""
    import raytrain
    from raytrain.util.imports import import_object

    job = raytrain.validate(raytrain_spec(gpt, batch, steps, warmup, work, gpu=False))
    import_object(job.model.class_path)(**job.model.init_args)


def _args() -> argparse.Namespace:
    """The command line, each size defaulted for a full run or for a dry run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="default 12 (dry run: 1)")
    parser.add_argument("--dim", type=int, default=None, help="default 768 (dry run: 32)")
    parser.add_argument("--heads", type=int, default=None, help="default 12 (dry run: 2)")
    parser.add_argument("--block", type=int, default=None, help="default 512 (dry run: 16)")
    parser.add_argument("--batch", type=int, default=None, help="default 16 (dry run: 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 60 (dry run: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="default 10 (dry run: 1)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default cuda (dry run: cpu)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="a tiny GPT, a few steps, on the CPU: all but CUDA"
    )
    parser.add_argument(
        "--ray", action="store_true", help="with --dry-run: run raytrain.fit too (starts Ray)"
    )
    parser.add_argument(
        "--out", default=None, help="default bench/results/gpu.json (dry run: gpu-dry.json)"
    )
    args = parser.parse_args()
    full = {
        "layers": 12,
        "dim": 768,
        "heads": 12,
        "block": 512,
        "batch": 16,
        "steps": 60,
        "warmup": 10,
    }
    for key, value in (DRY if args.dry_run else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = _args()
    device = args.device or ("cpu" if args.dry_run else "cuda")
    default_out = "gpu-dry.json" if args.dry_run else "gpu.json"
    out = Path(args.out or ROOT / "bench" / "results" / default_out)
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_throughput.py needs a CUDA GPU (or --dry-run, or --device cpu)")
    name = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    gpt = {"block": args.block, "layers": args.layers, "heads": args.heads, "dim": args.dim}
    from raytrain.models.tinygpt import TinyGPT

    params = sum(p.numel() for p in TinyGPT(**gpt).parameters())
    plain = plain_loop(gpt, args.batch, args.steps, args.warmup, device)
    if device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run and not args.ray:
            raytrain_checked(gpt, args.batch, args.steps, args.warmup, Path(tmp))
            ours = None
        else:
            ours = raytrain_run(gpt, args.batch, args.steps, args.warmup, Path(tmp), device)
    peak = args.peak_tflops or peak_tflops(name)
    _table(name, params, args.batch, args.block, peak, ours, plain)
    if ours is None:
        print("raytrain: data and spec checked, model built; raytrain.fit not run (add --ray)")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "gpu": name,
        "parameters": params,
        "gpt": gpt,
        "batch": args.batch,
        "raytrain": ours,
        "plain": plain,
        "peak_tflops": peak,
        "dry_run": args.dry_run,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


def _table(
    name: str,
    params: int,
    batch: int,
    block: int,
    peak: float | None,
    ours: dict | None,
    plain: dict,
) -> None:
    """The comparison as a table; a side not run (``ours`` None) or a figure not measured
    (peak memory on a CPU) is shown as ``-``."""

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"{name}: GPT {params / 1e6:.0f}M parameters, batch {batch} x {block}, bf16")
    header = f"{'':<22} {'raytrain':>12} {'plain loop':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    r, p = (ours or {}).get("tokens_per_s"), plain["tokens_per_s"]
    ratio = r / p if r is not None else None
    print(f"{'tokens/s':<22} {cell(r, ',.0f'):>12} {cell(p, ',.0f'):>12} {cell(ratio, '.2f'):>7}")
    if peak:
        mfu = {
            k: None if v is None else 6 * params * v / (peak * 1e12)
            for k, v in (("raytrain", r), ("plain", p))
        }
        print(f"{'MFU':<22} {cell(mfu['raytrain'], '.1%'):>12} {cell(mfu['plain'], '.1%'):>12}")
    mem = (ours or {}).get("peak_memory_gb"), plain["peak_memory_gb"]
    print(f"{'peak memory, GB':<22} {cell(mem[0], '.2f'):>12} {cell(mem[1], '.2f'):>12}")


if __name__ == "__main__":
    main()
