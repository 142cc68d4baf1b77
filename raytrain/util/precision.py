"""``trainer.precision: auto``, and the cost of bf16 where the hardware only emulates it.

``auto`` is bf16-mixed where the hardware computes bf16 natively (CUDA GPUs from Ampere on;
CPUs with AMX or AVX512-BF16) and 32-true elsewhere. Each worker decides on its own
hardware (a cluster's nodes are alike in practice); rank 0's decision is reported with its
first metrics and tagged on the MLflow run (``raytrain.precision``). Nothing here imports
Lightning: the driver reads ``bf16_warning`` before Ray starts.
"""

from __future__ import annotations

from typing import Literal

from raytrain.spec.trainer import Precision

# The CPU flags (Linux /proc/cpuinfo) of native bf16 matrix arithmetic.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# What emulated bf16 cost, measured on this project's AVX2-only machines (AMD EPYC).
EMULATED_BF16_COST = (
    "bf16 autocast of a 768-3072-768 MLP ran 40x slower than fp32 there (11.9 s against "
    "0.30 s a step), and jobs/tinygpt.yaml trained at 7 samples/s"
)


def cpu_bf16_flag(cpuinfo: str | None = None) -> str | None:
    """The CPU's native-bf16 flag (``amx_bf16``, ``avx512_bf16``), or None: read from
    ``cpuinfo`` (the text of /proc/cpuinfo; read here when None, empty off Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
                cpuinfo = handle.read()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


def gpu_bf16() -> bool:
    """Whether this process's CUDA GPU computes bf16 natively (Ampere and later)."""
    import torch

    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 8


def decide(
    requested: Precision | Literal["auto"], on_gpu: bool, cpuinfo: str | None = None
) -> tuple[Precision, str]:
    """The precision to train at and why: ``requested`` itself unless it is ``auto``."""
    if requested != "auto":
        return requested, "as the spec says"
    if on_gpu:
        native = gpu_bf16()
        return ("bf16-mixed" if native else "32-true"), (
            "auto: the GPU computes bf16" if native else "auto: the GPU predates bf16 (Ampere)"
        )
    flag = cpu_bf16_flag(cpuinfo)
    if flag:
        return "bf16-mixed", f"auto: the CPU computes bf16 ({flag})"
    return "32-true", "auto: the CPU has no native bf16 (no AMX or AVX512-BF16)"


def bf16_warning(requested: str, on_gpu: bool, cpuinfo: str | None = None) -> str | None:
    """A warning for a spec that asks for bf16 on CPU workers whose CPU (this machine's)
    only emulates it; None otherwise."""
    if on_gpu or not requested.startswith("bf16") or cpu_bf16_flag(cpuinfo):
        return None
    return (
        f"trainer.precision: {requested} on a CPU without native bf16 (no AMX or "
        f"AVX512-BF16) is emulated: on this project's AVX2 machines {EMULATED_BF16_COST}; "
        "32-true (or auto) trains at full speed"
    )
