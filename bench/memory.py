"""Per-rank model-state memory, DDP against FSDP full sharding, tensor parallelism 2,
pipeline parallelism 2 and both (4 workers): the GPT at 50M+ parameters; and the step time
of tensor parallelism against FSDP.

    python bench/memory.py [--dim 768 --layers 8 --steps 8]

Three real 2-worker raytrain runs of ``raytrain.models.tinygpt`` (CPU, gloo): DDP, FSDP
(``sharding: full``, each block its own unit) and ``model_parallel`` with
``tensor_parallel_size: 2`` (TinyGPT's plan: both workers hold half of every block, the
embeddings whole), each trained ``--steps`` steps on the stdlib text on the same 4 rows a
step (2 per worker under DDP and FSDP, 4 on the one tensor-parallel or pipeline replica;
``pipeline_parallel_size: 2`` cuts the blocks in half, embeddings with the first stage, the
norm and the tied head, with a copy of the token embedding, with the last; TP2xPP2 does
both on 4 workers). Just before
the second optimizer step every rank measures the bytes of its parameters, gradients and
optimizer state (``bench.models.MemoryProbeGPT``); rank 0 times every step. Prints the
per-rank figures (the largest rank) with their ratios to DDP, and the median step time of
the steps after the second, tensor parallel over FSDP; writes JSON.
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


def _mp(tp: int = 1, pp: int = 1) -> dict:
    return {
        "name": "model_parallel",
        "model_parallel": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
    }


# name: (strategy, rows per worker batch, workers)
STRATEGIES = {
    "ddp": ({"name": "ddp"}, 2, 2),
    "fsdp": ({"name": "fsdp", "fsdp": {"sharding": "full", "auto_wrap": ["Block"]}}, 2, 2),
    "tp2": (_mp(tp=2), 4, 2),
    "pp2": (_mp(pp=2), 4, 2),
    "tp2pp2": (_mp(tp=2, pp=2), 4, 4),
}
LABELS = {"ddp": "DDP", "fsdp": "FSDP full", "tp2": "TP 2", "pp2": "PP 2", "tp2pp2": "TP2xPP2"}


def measure(strategy: str, work: Path, gpt: dict, steps: int) -> dict:
    """One run's per-rank model-state bytes (the largest rank), the parameter count and the
    median step time after the second step."""
    import statistics

    import raytrain

    out = work / strategy
    out.mkdir()
    section, batch, workers = STRATEGIES[strategy]
    spec = {
        "name": f"memory-{strategy}",
        "model": {
            "class_path": "bench.models:MemoryProbeGPT",
            "init_args": {"out_dir": str(out), **gpt},
        },
        "data": {
            "train": {"uri": str(work / "text" / "train")},
            "columns": ["tokens"],
            "batch_size": batch,
        },
        # 4 workers share this 2-core machine's CPUs (half a CPU slot each)
        "scaling": {"num_workers": workers}
        | ({"resources_per_worker": {"CPU": 0.5}} if workers > 2 else {}),
        "strategy": section,
        "trainer": {
            "max_steps": steps,
            "max_epochs": 1,
            "log_every_n_steps": 1,
            "precision": "32-true",
        },
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": None, "keep": 1},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }
    raytrain.fit(spec, progress=False)
    ranks = [json.loads((out / f"memory-rank{r}.json").read_text()) for r in range(workers)]
    worst = {k: max(r[k] for r in ranks) for k in KINDS}
    worst["total"] = max(sum(r[k] for k in KINDS) for r in ranks)
    worst["numel"] = ranks[0]["numel"]
    times = json.loads((out / "steps.json").read_text())
    worst["step_s"] = statistics.median(times[2:] or times)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args()
    from raytrain.datasets.text import write_splits

    gpt = {"block": 128, "layers": args.layers, "heads": args.heads, "dim": args.dim}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_splits(str(work / "text" / "train"), None, max_bytes=200_000)
        results = {s: measure(s, work, gpt, args.steps) for s in STRATEGIES}
    params = results["ddp"]["numel"]
    print(
        f"GPT: {params / 1e6:.1f}M parameters (dim {args.dim}, {args.layers} layers), fp32, AdamW"
    )
    header = f"{'per rank, MB':<26}" + "".join(f"{LABELS[s]:>11}" for s in STRATEGIES)
    header += "".join(f"{LABELS[s] + ' / DDP':>17}" for s in STRATEGIES if s != "ddp")
    print(header)
    print("-" * len(header))
    for kind in (*KINDS, "total"):
        row = f"{kind:<26}" + "".join(f"{results[s][kind] / 1e6:>11.1f}" for s in STRATEGIES)
        ddp = results["ddp"][kind]
        row += "".join(f"{results[s][kind] / ddp:>17.2f}" for s in STRATEGIES if s != "ddp")
        print(row)
    step = {s: results[s]["step_s"] for s in STRATEGIES}
    ratio = step["tp2"] / step["fsdp"]
    print("median step, s: " + ", ".join(f"{LABELS[s]} {t:.3f}" for s, t in step.items()))
    print(f"TP 2 / FSDP step time: {ratio:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "gpt": gpt,
                "parameters": params,
                "bytes": results,
                "fsdp_over_ddp_total": results["fsdp"]["total"] / results["ddp"]["total"],
                "tp2_over_ddp_total": results["tp2"]["total"] / results["ddp"]["total"],
                "tp2_over_fsdp_step_time": ratio,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
