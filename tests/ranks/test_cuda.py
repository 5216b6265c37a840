"""On a GPU: stage processes that share one GPU train exactly as one device does (the delay
corrections of 2BW and ``MuonAdamW`` too), host swap runs on its CUDA stream, ``16-mixed`` (with
its real GradScaler) and ``bf16-mixed`` equal Lightning on one GPU, and the memory monitor
reports CUDA peaks.

NCCL refuses two ranks on one device, so the stages of these tests run on gloo and exchange
activations and gradients through host memory (the strategy chooses gloo when stage processes
share a GPU). Skipped without CUDA: CI has no GPU. The figures printed (``-s``, lines starting
with ``CUDA``) are recorded in ``benchmarks/README.md`` with the device that gave them.

Tolerances: the flush schedules against single-device gradient accumulation on the same GPU, and
2BW against its delayed reference, max |dW| <= 1e-5 after 5 AdamW steps (the CPU contract);
mixed precision against Lightning on one GPU with ``accumulate_grad_batches = m``, the same.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import workers
from helpers.models import (
    IN,
    OUT,
    Block,
    RegressionModel,
    dataset,
    loader,
    max_abs_diff,
    quiet_trainer,
    reference_2bw,
    reference_train,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe2bw import Pipe2BWStrategy, StageMemoryMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = 5
TOL = 1e-5
GPU = torch.device("cuda", 0)
TASK_S = 120  # the longest one fit on the GPU may take


class WideModel(RegressionModel):
    """Activations large enough to see on the allocator (1024 wide, batches of 1024)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        width = 1024
        self.body = nn.Sequential(
            nn.Linear(IN, width), *[Block(width) for _ in range(6)], nn.Linear(width, OUT)
        )


def _fit_on_one_gpu(
    schedule: str,
    microbatches: int,
    steps: int,
    *,
    wide: bool = False,
    precision: str = "32-true",
    transport: str | None = None,
    optimizer: str = "adamw",
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Every rank of the pool runs its stage on GPU 0; rank 0 returns the whole state."""
    world = dist.get_world_size()
    # the pool's processes run fit after fit: what an earlier fit left for the collector would
    # count in this one's allocator peaks
    gc.collect()
    torch.cuda.synchronize(GPU)
    before = torch.cuda.memory_allocated(GPU)
    old = os.environ.get("PIPE2BW_TRANSPORT")
    if transport is not None:
        os.environ["PIPE2BW_TRANSPORT"] = transport
    try:
        model = WideModel() if wide else RegressionModel(optimizer=optimizer)
        strategy = Pipe2BWStrategy(
            schedule=schedule,
            microbatches=microbatches,
            parallel_devices=[GPU] * world,
            **strategy_kwargs,
        )
        monitor = StageMemoryMonitor(log_every_n_steps=1, plot=False)
        record = workers.RecordLoss()
        trainer = quiet_trainer(
            accelerator="gpu",
            strategy=strategy,
            precision=precision,
            max_steps=steps,
            callbacks=[record, monitor],
        )
        data = loader(1024, n=1024 * steps) if wide else loader(8)
        trainer.fit(model, data)
        state = strategy.full_state_dict()
        engine = strategy.engine
        assert engine is not None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return {
            "state": {k: v.detach().cpu() for k, v in state.items()}
            if dist.get_rank() == 0
            else None,
            "stage": strategy.stage,
            "device": str(strategy.root_device),
            "backend": dist.get_backend(),
            "transport": type(engine.transport).__name__,
            "bytes_received": engine.transport.bytes_received,
            "swap_stream": engine.stash._side is not None,
            "scale": float(scaler.get_scale()) if scaler is not None else None,
            "peaks": monitor.peaks() if dist.get_rank() == 0 else None,
            "losses": record.losses,
            "gpu": torch.cuda.get_device_name(GPU),
            "allocated_before": before,
        }
    finally:
        if old is None:
            os.environ.pop("PIPE2BW_TRANSPORT", None)
        else:
            os.environ["PIPE2BW_TRANSPORT"] = old


def _on_gpu(pools: Any, p: int, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """``_fit_on_one_gpu`` on a pool of ``p`` ranks (a fit takes seconds: a hang fails soon)."""
    return pools(p).run(_fit_on_one_gpu, *args, timeout=TASK_S, **kwargs)


def _check_shared(results: list[dict[str, Any]], transport: str = "SharedMemoryTransport") -> None:
    for r in results:
        assert r["device"] == "cuda:0", r["device"]
        assert r["backend"] == "gloo", r["backend"]
        assert r["transport"] == transport, r["transport"]
    assert sum(r["bytes_received"] for r in results) > 0


FLUSH_CASES = [
    ("1f1b", 2, 4),
    ("gpipe", 2, 2),
    ("1f1b", 4, 4),
    ("gpipe", 4, 8),
    # two stages per rank: the hand-over on a rank and one queue per pair of ranks, on the GPU
    ("interleaved-1f1b", 2, 4),
    ("zb-v", 2, 4),
    ("zb-v", 4, 8),
]


@pytest.mark.parametrize(("schedule", "p", "m"), FLUSH_CASES)
def test_stages_sharing_a_gpu_equal_one_device(pools: Any, schedule: str, p: int, m: int) -> None:
    results = _on_gpu(pools, p, schedule, m, STEPS)
    _check_shared(results)
    ref, _ = reference_train(STEPS, m, device=GPU)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"CUDA EXACTNESS {schedule} p={p} m={m} on {results[0]['gpu']}: max|dW| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize(
    ("schedule", "p", "m"),
    [("2bw", 2, 2), ("2bw", 2, 4), ("2bw", 4, 4), ("2bw-v", 2, 4), ("2bw-v", 4, 4)],
)
def test_2bw_sharing_a_gpu_equals_the_delayed_reference(
    pools: Any, schedule: str, p: int, m: int
) -> None:
    results = _on_gpu(pools, p, schedule, m, STEPS)
    _check_shared(results)
    ref = reference_2bw(STEPS, m, device=GPU)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"CUDA EXACTNESS {schedule} p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff <= TOL


def test_the_process_group_transport_stages_through_the_host(pools: Any) -> None:
    results = _on_gpu(pools, 2, "1f1b", 4, STEPS, transport="gloo")
    _check_shared(results, transport="P2PTransport")
    ref, _ = reference_train(STEPS, 4, device=GPU)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"CUDA EXACTNESS 1f1b p=2 m=4 over gloo's P2P through the host: max|dW| = {diff:.3e}")
    assert diff <= TOL


def test_bpipe_eviction_through_the_host_is_exact(pools: Any) -> None:
    plain = _on_gpu(pools, 2, "1f1b", 4, 3, wide=True)
    moved = _on_gpu(pools, 2, "1f1b", 4, 3, wide=True, balance_activations=True)
    before = [s["activations_peak"] for s in plain[0]["peaks"]]
    after = [s["activations_peak"] for s in moved[0]["peaks"]]
    print(f"CUDA BPIPE p=2 m=4: peak saved bytes per stage {before} -> {after}")
    assert max_abs_diff(moved[0]["state"], plain[0]["state"]) == 0.0
    assert after[0] < before[0]


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_host_swap_runs_on_its_cuda_stream_and_is_exact(pools: Any, schedule: str) -> None:
    plan = {1: "swap", 2: "swap", 3: "swap"}  # stage 0's blocks (8 blocks on 2 stages)
    keep = _on_gpu(pools, 2, schedule, 4, 3, wide=True)
    swap = _on_gpu(pools, 2, schedule, 4, 3, wide=True, memory_plan=plan)
    assert max_abs_diff(swap[0]["state"], keep[0]["state"]) == 0.0
    by_stage = {r["stage"]: r for r in swap}
    assert by_stage[0]["swap_stream"]  # the copies ran on the stash's side stream
    assert not by_stage[1]["swap_stream"]
    saved = [[s["activations_peak"] for s in run[0]["peaks"]] for run in (keep, swap)]
    # the allocator's peak during the fit, over what the process held when it started
    cuda = [
        [
            s["cuda_allocated_peak"] - next(r for r in run if r["stage"] == i)["allocated_before"]
            for i, s in enumerate(run[0]["peaks"])
        ]
        for run in (keep, swap)
    ]
    print(
        f"CUDA SWAP {schedule} p=2 m=4: peak saved bytes on the GPU per stage {saved[0]} -> "
        f"{saved[1]}; allocator peak over the start {cuda[0]} -> {cuda[1]} (held at the start: "
        f"{[r['allocated_before'] for r in keep]}, {[r['allocated_before'] for r in swap]})"
    )
    assert saved[1][0] < 0.7 * saved[0][0]
    assert cuda[1][0] < cuda[0][0]


def _lightning_on_one_gpu(precision: str, microbatches: int, steps: int) -> dict[str, Any]:
    """The reference: Lightning on one GPU, accumulating the same micro-batches."""
    model = RegressionModel()
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=microbatches,
    )
    trainer.fit(model, DataLoader(dataset(64), batch_size=8 // microbatches))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "scale": float(scaler.get_scale()) if scaler is not None else None,
    }


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_mixed_precision_equals_lightning_on_one_gpu(
    pools: Any, precision: str, schedule: str
) -> None:
    results = _on_gpu(pools, 2, schedule, 4, STEPS, precision=precision)
    _check_shared(results)
    ref = _lightning_on_one_gpu(precision, 4, STEPS)
    diff = max_abs_diff(results[0]["state"], ref["state"])
    print(
        f"CUDA PRECISION {precision} {schedule} p=2 m=4 vs Lightning on one GPU: "
        f"max|dW| = {diff:.3e}, scale {[r['scale'] for r in results]} vs {ref['scale']}"
    )
    assert diff <= TOL
    if precision == "16-mixed":  # a real GradScaler on every stage, in step with Lightning's
        assert all(r["scale"] == ref["scale"] for r in results)
    # the weights moved: the comparison is not between two untrained models
    assert max_abs_diff(ref["state"], RegressionModel().state_dict()) > 1e-3


def test_memory_monitor_reports_cuda_peaks(pools: Any) -> None:
    results = _on_gpu(pools, 2, "2bw", 4, 3, wide=True)
    peaks = results[0]["peaks"]
    print(
        "CUDA MONITOR 2bw p=2 m=4 (wide): allocator peak / reserved per stage (MiB) "
        + ", ".join(
            f"{s['cuda_allocated_peak'] / 2**20:.1f}/{s['cuda_reserved'] / 2**20:.1f}"
            for s in peaks
        )
    )
    assert len(peaks) == 2
    for figures in peaks:
        held = figures["weight_versions"] + figures["optimizer_state"]
        assert figures["cuda_allocated_peak"] >= held, figures
        assert figures["cuda_reserved"] >= figures["cuda_allocated_peak"], figures


CORRECTED = [
    (c, o)
    for c in ("predict", "error_feedback", "nesterov", "predict+error_feedback=0.5")
    for o in ("adamw", "muon")
]


@pytest.mark.parametrize(("correction", "optimizer"), CORRECTED)
def test_delay_corrections_and_muon_on_a_gpu(pools: Any, correction: str, optimizer: str) -> None:
    results = _on_gpu(pools, 2, "2bw", 4, STEPS, optimizer=optimizer, delay_correction=correction)
    _check_shared(results)
    ref = reference_2bw(STEPS, 4, optimizer=optimizer, correction=correction, device=GPU)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"CUDA EXACTNESS 2bw {correction} {optimizer} p=2 m=4: max|dW| = {diff:.3e}")
    assert diff <= TOL


def test_muon_under_1f1b_on_a_gpu(pools: Any) -> None:
    results = _on_gpu(pools, 2, "1f1b", 4, STEPS, optimizer="muon")
    ref, _ = reference_train(STEPS, 4, optimizer="muon", device=GPU)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"CUDA EXACTNESS 1f1b muon p=2 m=4: max|dW| = {diff:.3e}")
    assert diff <= TOL


def _fit_fsdp_on_own_gpus(fsdp: bool) -> dict[str, Any]:
    """2 replicas x 2 stages, a GPU per rank (NCCL), with or without ``fsdp``."""
    return workers.fit(
        "1f1b", 2, STEPS, batch_size=4, data_parallel=2, fsdp=fsdp,
        trainer_kwargs={"accelerator": "gpu"},
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs: a rank per GPU (NCCL)")
def test_fsdp_on_a_gpu_per_rank_equals_the_same_replicas_without_it(pools: Any) -> None:
    """FSDP2 inside each stage over NCCL: the weights of the same replicas without it (the CPU
    contract, 1e-5 here: NCCL's reduce-scatter may add in another order than its all-reduce),
    and each rank holds about half its stage."""
    plain = pools(4).run(_fit_fsdp_on_own_gpus, False, timeout=TASK_S)
    sharded = pools(4).run(_fit_fsdp_on_own_gpus, True, timeout=TASK_S)
    diff = max_abs_diff(sharded[0]["state"], plain[0]["state"])
    shares = [
        s["local_param_elements"] / p["local_param_elements"]
        for s, p in zip(sharded, plain, strict=True)
    ]
    print(f"CUDA FSDP 1f1b 2x2 on {torch.cuda.get_device_name(0)}: max|dW| = {diff:.3e}, {shares}")
    assert diff <= TOL
    assert all(0.4 <= x <= 0.65 for x in shares), shares
