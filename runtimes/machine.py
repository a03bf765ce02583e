"""Which machine the runtime is on, in the words that decide what a decode pass costs.

What a pass of T rows costs against one row depends on the CPU's vector units (AVX-512 VNNI,
AVX2, NEON), its memory and the thread count, so a decoding choice measured by `build` holds on
the machine it was measured on. The fingerprint is what `build` records beside that choice and
what `run` compares it with (runtimes/rows_recheck.py): the CPU's model name, the vector
extensions that pick kernels, the CPU count and the threads a session runs.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "asimd", "asimddp")
MAX_NAME = 200


@dataclass(frozen=True)
class MachineId:
    """The build's or this machine's fingerprint (manifest `prompt_rows.measured.machine`)."""

    cpu: str
    flags: str  # the KERNEL_FLAGS present, space-separated
    cpus: int
    threads: int  # a session's intra-op threads (0, ONNX Runtime's default, counts as every CPU)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.cpu} ({self.cpus} CPUs, {self.threads} threads)"


@cache
def _cpu() -> tuple[str, str]:
    """(model name, kernel flags) from /proc/cpuinfo, else the platform's processor string."""
    try:
        text = CPUINFO.read_text(errors="replace")[:1_000_000]
    except OSError:
        return (platform.processor() or platform.machine())[:MAX_NAME], ""
    name, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "CPU part") and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    present = " ".join(flag for flag in KERNEL_FLAGS if flag in flags)
    return (name or platform.machine())[:MAX_NAME], present


def this_machine(threads: int) -> MachineId:
    """This machine, running sessions of `threads` intra-op threads."""
    cpus = os.cpu_count() or 1
    name, flags = _cpu()
    return MachineId(name, flags, cpus, threads if threads > 0 else cpus)
