"""The host CPU as a run records it: its name, family/model and whether it computes bf16 natively.

The same seed gives other numbers on another CPU, and bf16 is fast only where the CPU has it (AVX512-BF16 or
AMX; emulated elsewhere), so every measurement names the CPU it ran on (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of a CPU that computes bf16 natively (AMD Zen 4+, Intel Cooper Lake+ / Sapphire Rapids)."""


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def cpu_bf16_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> list[str]:
    """The :data:`BF16_FLAGS` this CPU reports ([] when the file is missing: not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [f for f in BF16_FLAGS if f in flags]


def cpu_description() -> str:
    """One line naming the CPU well enough to tell Zen 3 from Zen 5, e.g.
    ``"AMD EPYC (family 25 model 1), AVX2, no native bf16"``."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    fam = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info and "model" in info else ""
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = "+".join(f for f in BF16_FLAGS if f in flags) or "no native bf16"
    return f"{name}{fam}, {isa}, {bf16}"
