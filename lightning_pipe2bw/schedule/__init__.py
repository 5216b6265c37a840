"""Pipeline schedules: actions, generators, communication and offload passes, validator and
simulator."""

from __future__ import annotations

from .action import (
    Action,
    ActionKind,
    format_actions,
    parse_action,
    parse_actions,
    parse_stages,
    partner,
)
from .comm import add_communication, one_channel_per_pair, with_communication
from .generators import (
    Schedule,
    check_sizes,
    format_grid,
    forward_only,
    gpipe,
    one_f_one_b,
    pipedream,
    two_bw,
    two_bw_version,
)
from .offload import (
    ActivationBudget,
    add_offload,
    add_offload_schedule,
    evict_share,
    offload_stages,
    stashed_microbatches,
)
from .passes import (
    CUT_OVERHEAD,
    cut_overhead,
    cuts_that_pay,
    early_input_grads,
    merge_backward,
    split_backward,
    training_schedule,
)
from .registry import (
    REGISTRY,
    SCHEDULES,
    VIRTUAL_SCHEDULES,
    ScheduleSpec,
    get_schedule,
    placement_of,
    schedule_spec,
    virtual_schedule,
)
from .simulate import Costs, DeadlockError, SimResult, simulate
from .stream import OneFOneBStream, VListStream
from .validate import ScheduleError, validate
from .virtual import (
    dualpipe_v,
    interleaved_1f1b,
    looped_placement,
    two_bw_v,
    v_placement,
    zb_v,
    zb_v_pattern,
)
from .zerobubble import zb_h1

__all__ = [
    "CUT_OVERHEAD",
    "REGISTRY",
    "SCHEDULES",
    "VIRTUAL_SCHEDULES",
    "Action",
    "ActionKind",
    "ActivationBudget",
    "Costs",
    "DeadlockError",
    "OneFOneBStream",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimResult",
    "VListStream",
    "add_communication",
    "add_offload",
    "add_offload_schedule",
    "check_sizes",
    "cut_overhead",
    "cuts_that_pay",
    "dualpipe_v",
    "early_input_grads",
    "evict_share",
    "format_actions",
    "format_grid",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "looped_placement",
    "merge_backward",
    "offload_stages",
    "one_channel_per_pair",
    "one_f_one_b",
    "parse_action",
    "parse_actions",
    "parse_stages",
    "partner",
    "pipedream",
    "placement_of",
    "schedule_spec",
    "simulate",
    "split_backward",
    "stashed_microbatches",
    "training_schedule",
    "two_bw",
    "two_bw_v",
    "two_bw_version",
    "v_placement",
    "validate",
    "virtual_schedule",
    "with_communication",
    "zb_h1",
    "zb_v",
    "zb_v_pattern",
]
