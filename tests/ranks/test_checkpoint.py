"""Checkpoints resume exactly: 6 steps equal 3 steps + ModelCheckpoint + a new Trainer resumed
from the file for 3 more (max abs parameter difference <= 1e-6, fp32, CPU). The consolidated
file loads on one device; 2BW's second weight version travels in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import RegressionModel, default_balance, max_abs_diff

TOL = 1e-6
SAMPLES = 24  # 3 batches of 8: the checkpoint after step 3 is at an epoch boundary


def _fit(
    schedule: str,
    steps: int,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    strip_second_version: bool = False,
    flush_every: int | None = None,
    microbatches: int = 2,
    state_dict_type: str = "full",
    data_parallel: int = 1,
    optimizer: str = "adamw",
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers.models import loader, quiet_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pipe2bw import Pipe2BWStrategy

    callbacks: list[Any] = []
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1
            )
        )
    strategy = Pipe2BWStrategy(
        schedule=schedule,
        microbatches=microbatches,
        flush_every=flush_every,
        state_dict_type=state_dict_type,  # type: ignore[arg-type]
        data_parallel=data_parallel,
        **strategy_kwargs,
    )
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
    )
    if resume is not None and strip_second_version:
        ckpt = torch.load(resume, weights_only=True)
        del ckpt["pipe2bw"]
        resume = resume.replace(".ckpt", "-stripped.ckpt")
        if dist.get_rank() == 0:
            torch.save(ckpt, resume)
        dist.barrier()
    model = RegressionModel(optimizer=optimizer)
    # every replica reads 3 batches of 8 per epoch
    trainer.fit(model, loader(8, n=SAMPLES * data_parallel), ckpt_path=resume)
    state = strategy.full_state_dict()
    return {"state": state if dist.get_rank() == 0 else None, "global_step": trainer.global_step}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw", "pipedream"])
def test_resume_is_exact(pools: Any, tmp_path: Path, schedule: str) -> None:
    pool = pools(2)
    # a checkpoint is a flush point. 1F1B and 2BW mean the same with or without one; PipeDream
    # does not (after a drain every stage computes with its newest weights), so its straight
    # run flushes where the other one checkpoints
    flush_every = 3 if schedule == "pipedream" else None
    straight = pool.run(_fit, schedule, 6, flush_every=flush_every)[0]
    pool.run(_fit, schedule, 3, str(tmp_path))
    ckpt = tmp_path / "step=3.ckpt"
    assert ckpt.is_file()
    assert not list(tmp_path.glob("*.tmp"))  # written under a temporary name, then renamed
    resumed = pool.run(_fit, schedule, 6, None, str(ckpt))[0]
    assert resumed["global_step"] == 6
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME {schedule}: 6 steps vs 3 + checkpoint + 3: max|dW| = {diff:.3e}")
    assert diff <= TOL

    # a normal Lightning checkpoint: it loads on one device, safely
    single = RegressionModel.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True)
    raw = torch.load(ckpt, weights_only=True)
    assert raw["global_step"] == 3
    assert max_abs_diff(single.state_dict(), raw["state_dict"]) == 0.0
    stages = raw["optimizer_states"][0]["pipe2bw_stages"]
    assert len(stages) == 2 and all(s["state"] for s in stages)  # every stage's AdamW state
    meta = raw["pipe2bw"]
    assert (meta["schedule"], meta["num_stages"], meta["balance"]) == (schedule, 2, [4, 4])
    if schedule == "2bw":
        # batch 3 runs with version 2: the checkpoint holds it beside the newest (version 3)
        assert meta["batches"] == 3
        assert meta["previous_weights"].keys() == raw["state_dict"].keys()
        assert max_abs_diff(meta["previous_weights"], raw["state_dict"]) > 1e-4


def test_2bw_resume_needs_the_second_version(pools: Any, tmp_path: Path) -> None:
    """The test above can fail: without the second version, the resumed run restarts the
    version rule (batch 3 would run with the newest weights) and drifts from the straight run."""
    pool = pools(2)
    straight = pool.run(_fit, "2bw", 6)[0]
    pool.run(_fit, "2bw", 3, str(tmp_path))
    ckpt = str(tmp_path / "step=3.ckpt")
    resumed = pool.run(_fit, "2bw", 6, None, ckpt, True)[0]
    assert max_abs_diff(resumed["state"], straight["state"]) > 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_sharded_checkpoint_reloads_with_fewer_stages(
    pools: Any, tmp_path: Path, schedule: str
) -> None:
    """Saved by 4 stages (torch.distributed.checkpoint, one file per rank, original names),
    resumed by 2: the same weights as 6 straight steps on 2 stages."""
    m = 4
    straight = pools(2).run(_fit, schedule, 6, microbatches=m)[0]
    pools(4).run(_fit, schedule, 3, str(tmp_path), microbatches=m, state_dict_type="sharded")
    ckpt = tmp_path / "step=3.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file()
    assert len(list(ckpt.glob("*.distcp"))) == 4  # one shard per rank
    resumed = pools(2).run(
        _fit, schedule, 6, None, str(ckpt), microbatches=m, state_dict_type="sharded"
    )[0]
    assert resumed["global_step"] == 6
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME sharded {schedule}: 4 stages x 3 steps + 2 stages x 3 vs 6 steps: {diff:.3e}")
    assert diff <= TOL


def _resume_wrong_model(path: str) -> str:
    import torch.distributed as dist
    from helpers.models import loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2, state_dict_type="sharded"),
        max_steps=4,
    )
    try:
        trainer.fit(RegressionModel(num_blocks=10), loader(8, n=SAMPLES), ckpt_path=path)
    except KeyError as err:
        return str(err)
    return "no error"


def test_sharded_checkpoint_of_another_model_is_refused(pools: Any, tmp_path: Path) -> None:
    pools(2).run(_fit, "1f1b", 3, str(tmp_path), state_dict_type="sharded")
    for message in pools(2).run(_resume_wrong_model, str(tmp_path / "step=3.ckpt")):
        assert "lacks" in message and "'state_dict.body." in message, message


def _resume_expecting_error(path: str, num_blocks: int, balance: list[int] | None) -> str:
    import torch.distributed as dist
    from helpers.models import loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2, balance=balance),
        max_steps=4,
    )
    try:
        trainer.fit(RegressionModel(num_blocks=num_blocks), loader(8, n=SAMPLES), ckpt_path=path)
    except (KeyError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_consolidated_checkpoint_mismatches_are_refused(pools: Any, tmp_path: Path) -> None:
    pool = pools(2)
    pool.run(_fit, "1f1b", 3, str(tmp_path))
    ckpt = str(tmp_path / "step=3.ckpt")
    for message in pool.run(_resume_expecting_error, ckpt, 10, None):  # another model
        assert message.startswith("KeyError") and "lacks" in message, message
    for message in pool.run(_resume_expecting_error, ckpt, 8, [3, 5]):  # another partition
        assert message.startswith("ValueError"), message
        assert "balance=[4, 4]" in message and "state_dict_type='sharded'" in message, message


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_data_parallel_resume_is_exact(pools: Any, tmp_path: Path, state_dict_type: str) -> None:
    """Two replicas of two 2BW stages: 6 steps equal 3 + checkpoint + 3. Replicas hold the same
    weights, so the checkpoint keeps one copy per name (consolidated: gathered once; sharded:
    torch.distributed.checkpoint writes each replicated tensor once)."""
    pool = pools(4)
    kwargs: dict[str, Any] = {"state_dict_type": state_dict_type, "data_parallel": 2}
    straight = pool.run(_fit, "2bw", 6, **kwargs)[0]
    pool.run(_fit, "2bw", 3, str(tmp_path), **kwargs)
    ckpt = tmp_path / "step=3.ckpt"
    assert ckpt.exists()
    resumed = pool.run(_fit, "2bw", 6, None, str(ckpt), **kwargs)[0]
    assert resumed["global_step"] == 6
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME dp=2 x pp=2 2bw {state_dict_type}: max|dW| = {diff:.3e}")
    assert diff <= TOL


def _resume_in(folders: dict[int, str], path: str) -> str:
    """Resume from ``path`` with each rank in its own working directory (``folders`` by rank):
    a relative path then names a different file on each rank, as a node's local disk does."""
    import os
    import socket

    import torch.distributed as dist

    here = os.getcwd()
    os.chdir(folders[dist.get_rank()])
    try:
        _fit("1f1b", 4, resume=path)
    except (FileNotFoundError, ValueError) as err:
        return f"{type(err).__name__}: {err}".replace(socket.gethostname(), "HOST")
    finally:
        os.chdir(here)
    return "no error"


def test_a_checkpoint_not_every_rank_can_read_is_named_at_once(pools: Any, tmp_path: Path) -> None:
    """A checkpoint on the disk of the node that wrote it only: the rank that cannot read it is
    named, with its host and the path, on every rank, before any rank waits on another."""
    pool = pools(2)
    pool.run(_fit, "1f1b", 3, str(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    folders = {0: str(tmp_path / "a"), 1: str(tmp_path / "b")}
    for message in pool.run(_resume_in, folders, "step=3.ckpt"):
        assert message.startswith(
            "FileNotFoundError: cannot resume from 'step=3.ckpt': rank 1 (stage 0) on host HOST: "
            "no such file or directory. every rank reads the checkpoint"
        ), message
        assert "copy it to the same path on each node" in message


def test_a_truncated_checkpoint_is_named(pools: Any, tmp_path: Path) -> None:
    pool = pools(2)
    pool.run(_fit, "1f1b", 3, str(tmp_path))
    path = tmp_path / "step=3.ckpt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    folders = {0: str(tmp_path), 1: str(tmp_path)}
    for message in pool.run(_resume_in, folders, str(path)):
        assert message.startswith(
            f"ValueError: cannot resume from '{path}': rank 0 (stage 1) on host HOST: a damaged "
            f"or truncated file of {len(data) // 2} bytes"
        ), message
        assert "rank 1 (stage 0) on host HOST: a damaged" in message
        assert "resume from an earlier checkpoint" in message


@pytest.mark.parametrize(
    ("schedule", "plain"), [("interleaved-1f1b", "1f1b"), ("zb-v", "1f1b"), ("2bw-v", "2bw")]
)
def test_virtual_stages_resume_and_reshard(
    pools: Any, tmp_path: Path, schedule: str, plain: str
) -> None:
    """Two stages per rank: a consolidated checkpoint resumes exactly (the optimizer's state of
    both stages of a rank travels with it; under 2BW, the second weight version too), and a
    sharded one saved by this placement resumes with one stage per rank (``plain``), to the
    weights of 6 straight steps of ``plain``."""
    pool = pools(2)
    straight = pool.run(_fit, plain, 6)[0]
    pool.run(_fit, schedule, 3, str(tmp_path / "full"))
    ckpt = tmp_path / "full" / "step=3.ckpt"
    raw = torch.load(ckpt, weights_only=True)
    meta = raw["pipe2bw"]
    expected = list(default_balance(RegressionModel().body, schedule, 2))
    assert (meta["schedule"], meta["balance"]) == (schedule, expected)
    resumed = pool.run(_fit, schedule, 6, None, str(ckpt))[0]
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME {schedule}: 6 steps of {plain} vs 3 + checkpoint + 3: max|dW| = {diff:.3e}")
    assert resumed["global_step"] == 6 and diff <= TOL

    pool.run(_fit, schedule, 3, str(tmp_path / "sharded"), state_dict_type="sharded")
    sharded = tmp_path / "sharded" / "step=3.ckpt"
    assert len(list(sharded.glob("*.distcp"))) == 2  # one shard per rank
    for other in (plain, schedule):
        resumed = pool.run(_fit, other, 6, None, str(sharded), state_dict_type="sharded")[0]
        diff = max_abs_diff(resumed["state"], straight["state"])
        print(f"RESUME sharded {schedule} -> {other}: max|dW| = {diff:.3e}")
        assert diff <= TOL
