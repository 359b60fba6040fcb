"""What every benchmark records with its numbers: the machine and software it ran on, appended to RESULTS.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's total."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> str:
    return " / ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def machine_line() -> str:
    """``machine: <arch>, <CPU>, <n> usable cores (<m> logical); <platform>; load average at start a / b / c``."""
    return (
        f"machine: {platform.machine()}, {cpu_name()}, {usable_cores()} usable cores ({os.cpu_count()} logical); "
        f"{platform.platform()}; load average at start {load_average()}"
    )


def software_line(*, opacus: bool = False) -> str:
    """``software: python ..., torch ..., lightning ...`` (and opacus)."""
    import lightning
    import torch

    line = f"software: python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}"
    if opacus:
        import opacus as opacus_module

        line += f", opacus {opacus_module.__version__}"
    return line


def append_results(text: str, results: Path) -> None:
    """Append ``text`` (a markdown section) to the results file and say so."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write(text)
    print(f"appended to {results}")
