"""Per-rank model-state memory, DDP against FSDP full sharding: the GPT at 50M+ parameters.

    python bench/memory.py [--dim 768 --layers 8]

Two real 2-worker raytrain runs of ``raytrain.models.tinygpt`` (CPU, gloo), one DDP and one
FSDP (``sharding: full``, each block its own unit), each trained 2 steps on the stdlib text.
Just before the second optimizer step every rank measures the bytes of its parameters,
gradients and optimizer state (``bench.models.MemoryProbeGPT``). Prints a table of the
per-rank figures (the largest rank) and the FSDP/DDP ratio, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("parameters", "gradients", "optimizer")


def measure(strategy: str, work: Path, gpt: dict) -> dict:
    """One run's per-rank model-state bytes (the largest rank), and the parameter count."""
    import raytrain

    out = work / strategy
    out.mkdir()
    spec = {
        "name": f"memory-{strategy}",
        "model": {"class_path": "bench.models:MemoryProbeGPT",
                  "init_args": {"out_dir": str(out), **gpt}},
        "data": {"train": {"uri": str(work / "text" / "train")}, "columns": ["tokens"],
                 "batch_size": 2},
        "scaling": {"num_workers": 2},
        "strategy": {"name": strategy} if strategy == "ddp" else {
            "name": "fsdp", "fsdp": {"sharding": "full", "auto_wrap": ["Block"]}},
        "trainer": {"max_steps": 2, "max_epochs": 1, "log_every_n_steps": 1},
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": None, "keep": 1},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }  # fmt: skip
    raytrain.fit(spec, progress=False)
    ranks = [json.loads((out / f"memory-rank{r}.json").read_text()) for r in (0, 1)]
    worst = {k: max(r[k] for r in ranks) for k in KINDS}
    worst["total"] = max(sum(r[k] for k in KINDS) for r in ranks)
    worst["numel"] = ranks[0]["numel"]
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args()
    from raytrain.datasets.text import write_splits

    gpt = {"block": 128, "layers": args.layers, "heads": args.heads, "dim": args.dim}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_splits(str(work / "text" / "train"), None, max_bytes=200_000)
        results = {s: measure(s, work, gpt) for s in ("ddp", "fsdp")}
    params = results["ddp"]["numel"]
    header = f"{'per rank, MB (2 workers)':<26} {'DDP':>10} {'FSDP full':>10} {'ratio':>7}"
    print(
        f"GPT: {params / 1e6:.1f}M parameters (dim {args.dim}, {args.layers} layers), fp32, AdamW"
    )
    print(header)
    print("-" * len(header))
    for kind in (*KINDS, "total"):
        ddp, fsdp = results["ddp"][kind], results["fsdp"][kind]
        print(f"{kind:<26} {ddp / 1e6:>10.1f} {fsdp / 1e6:>10.1f} {fsdp / ddp:>7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ratio = results["fsdp"]["total"] / results["ddp"]["total"]
    out.write_text(json.dumps({"gpt": gpt, "parameters": params, "bytes": results,
                               "fsdp_over_ddp_total": ratio}, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
