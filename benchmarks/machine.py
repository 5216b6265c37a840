"""How busy the machine is, for the benchmarks' notes on their figures."""

from __future__ import annotations


def cpu_pressure_60s() -> float | None:
    """The share of the last 60 s in which some task waited for a CPU (Linux PSI), or None
    where the kernel does not report it."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("avg60=")[1].split()[0]) / 100
    except (OSError, IndexError, ValueError):
        return None
