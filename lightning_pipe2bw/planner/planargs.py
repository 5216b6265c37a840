"""What both planners share: checking their arguments, the profiles they take, and how plans
rank (by predicted throughput toward the target loss, then less memory, fewer recomputing
stages, shallower, smaller micro-batches)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from lightning_pipe2bw.planner.costmodel import Cluster
from lightning_pipe2bw.planner.plans import Plan, PlanResult
from lightning_pipe2bw.planner.profile import Profile, ProfileSet

__all__ = [
    "ProfilesLike",
    "as_profiles",
    "check_int",
    "check_ratio",
    "check_search",
    "divisors",
    "even",
    "rank",
    "ranked_result",
]

RECOMPUTE_MODES = ("search", "off", "on", "per_stage")

ProfilesLike = Profile | ProfileSet | Sequence[Profile]


def as_profiles(profiles: object) -> ProfileSet:
    if isinstance(profiles, ProfileSet):
        return profiles
    if isinstance(profiles, Profile):
        return ProfileSet.of(profiles)
    if (
        isinstance(profiles, Sequence)
        and profiles
        and all(isinstance(p, Profile) for p in profiles)
    ):
        return ProfileSet.of(list(profiles))
    raise TypeError(
        f"profiles must be a Profile, a ProfileSet or a list of Profiles, got {type(profiles).__name__}; "
        "measure one with lightning_pipe2bw.planner.measure or build it by hand"
    )


def check_int(label: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an int >= 1, got {value!r}; {fix}")
    return value


def check_search(
    profiles: object,
    cluster: object,
    global_batch_size: object,
    recompute: object,
    optimizer_bytes_per_param_byte: object,
    keep: object,
) -> tuple[ProfileSet, Cluster, int, float]:
    """The arguments both searches take, checked: the profiles, the cluster, the batch and the
    optimizer's bytes per parameter byte as the search uses them."""
    pset = as_profiles(profiles)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    batch = check_int("global_batch_size", global_batch_size, "give the samples per optimizer step")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE_MODES)}, got {recompute!r}")
    ratio = check_ratio(optimizer_bytes_per_param_byte)
    check_int("keep", keep, "keep at least the best plan")
    return pset, cluster, batch, ratio


def check_ratio(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"optimizer_bytes_per_param_byte must be a number >= 0, got {value!r}; use 2.0 for "
            "Adam's two moments in the parameter dtype, 0.0 for plain SGD"
        )
    return float(value)


def rank(p: Plan) -> tuple[float, float, int, int, int]:
    """Best first: the most samples per second toward the target loss (throughput over the step
    multiplier: throughput alone among plans of one schedule), then less memory, fewer
    recomputing stages, shallower, smaller micro-batches."""
    return (-p.target_rate, max(p.memory_bytes), sum(p.recompute), p.depth, p.microbatch_size)


def even(n: int, d: int) -> tuple[int, ...]:
    return tuple(n // d + (1 if s < n % d else 0) for s in range(d))


def divisors(k: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(k) + 1) if k % i == 0]
    return sorted({*small, *(k // i for i in small)})


def ranked_result(
    found: list[Plan],
    keep: int,
    cluster: Cluster,
    global_batch_size: int,
    configurations: int,
    infeasible: int,
    started: float,
) -> PlanResult:
    """The ``keep`` best of ``found`` (not empty), ranked by :func:`rank`, as a result whose
    search began at ``time.perf_counter()`` value ``started``."""
    found = sorted(found, key=rank)
    return PlanResult(
        best=found[0],
        alternatives=tuple(found[1:keep]),
        cluster=cluster,
        global_batch_size=global_batch_size,
        configurations=configurations,
        infeasible=infeasible,
        search_time_s=time.perf_counter() - started,
    )
