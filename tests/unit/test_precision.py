"""``trainer.precision: auto`` and the warning for emulated bf16 (``worker.precision``)."""

from __future__ import annotations

from raytrain.spec import load_spec
from raytrain.util.precision import bf16_warning, cpu_bf16_flag, decide

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


def test_auto_is_bf16_only_where_the_cpu_computes_it() -> None:
    assert cpu_bf16_flag(AVX2) is None and cpu_bf16_flag("") is None
    assert cpu_bf16_flag(SAPPHIRE) == "amx_bf16" and cpu_bf16_flag(ZEN4) == "avx512_bf16"
    assert decide("auto", False, SAPPHIRE) == (
        "bf16-mixed",
        "auto: the CPU computes bf16 (amx_bf16)",
    )
    assert decide("auto", False, AVX2)[0] == "32-true"
    assert decide("16-mixed", False, AVX2) == ("16-mixed", "as the spec says")
    assert load_spec("jobs/lightning_cli.yaml").trainer.precision == "auto"  # the default


def test_bf16_on_a_cpu_that_emulates_it_is_warned_with_its_cost() -> None:
    warning = bf16_warning("bf16-mixed", False, AVX2)
    assert warning is not None and "40x slower than fp32" in warning
    assert "11.9 s against 0.30 s" in warning
    assert bf16_warning("bf16-mixed", False, ZEN4) is None
    assert bf16_warning("bf16-true", True, AVX2) is None  # GPU workers
    assert bf16_warning("32-true", False, AVX2) is None
    assert bf16_warning("auto", False, AVX2) is None  # auto picks 32-true there
