"""``early_input_grad``: in a flush schedule each stage after the first computes its last
micro-batch's input gradient on its own and sends it before the weights' gradients (the pass
``schedule.early_input_grads`` turns that B into I, SEND_B, W). Runs with and without it must
train to bitwise equal weights and log bitwise equal losses; the send must run between the I and
the W; the backward is cut in two passes (``SplitBackward``) where the graph allows, and the
call's last I takes one more input pass where it does not (a weight applied to its own result);
stages whose backward must run once (module backward hooks, recomputation) run it whole in the
I, and their hooks run once per micro-batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

STEPS = 3


def _fit(
    schedule: str, microbatches: int, early: bool, model_name: str = "regression", **options: Any
) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers.models import make_loader, make_model, quiet_trainer
    from helpers.workers import RecordLoss

    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.schedule import ActionKind

    hooked = options.pop("hook_block", None)
    if options.pop("own_backward", False):
        model = _own_backward_model()
    elif model_name == "nested":
        model = _nested_model()
    else:
        model = make_model(model_name)
    calls: list[int] = []
    if hooked is not None:  # a module backward hook, which must not run twice
        model.body[hooked].register_full_backward_hook(lambda *_: calls.append(1))
    strategy = Pipe2BWStrategy(
        schedule=schedule, microbatches=microbatches, early_input_grad=early, **options
    )
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS, callbacks=[record]
    )
    trainer.fit(model, make_loader("regression" if model_name == "nested" else model_name, 8))
    engine = strategy.engine
    assert engine is not None
    # every gradient sent, as it ran: whether it left before its micro-batch's weights'
    # gradients (I, SEND_B, W) or after its whole backward (B, SEND_B)
    early_sends: list[int] = []  # the micro-batches, step after step
    late_sends: list[int] = []
    last_backward: dict[int, ActionKind] = {}
    for entry in engine.stats.timeline:
        kind, i = entry.action.kind, entry.action.microbatch
        if kind in (ActionKind.BACKWARD, ActionKind.INPUT_GRAD):
            last_backward[i] = kind
        elif kind is ActionKind.SEND_B:
            split = last_backward.pop(i) is ActionKind.INPUT_GRAD
            (early_sends if split else late_sends).append(i)
    state = strategy.full_state_dict()  # collective
    return {
        "stage": strategy.stage,
        "state": state if dist.get_rank() == 0 else None,
        "losses": record.losses,
        "early_sends": early_sends,
        "late_sends": late_sends,
        "hook_calls": len(calls),
        "split": engine.stats.split_backwards,
        "repeated": engine.stats.repeated_input_passes,
    }


def _own_backward_model() -> Any:
    from helpers.models import RegressionModel

    class OwnBackward(RegressionModel):
        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            loss.backward(*args, **kwargs)  # what Lightning's does, but the engine cannot know

    return OwnBackward()


def _nested_model() -> Any:
    from helpers.models import RegressionModel

    class Twice(torch.nn.Module):
        """One linear layer applied to its own result: its bias's accumulator is fed by two
        nodes, one below the other, so the backward cannot be cut without repeating work."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(torch.tanh(self.fc(x))))

    model = RegressionModel()
    torch.manual_seed(5)
    model.body[6] = Twice(model.body[6].fc.in_features)  # on the last stage
    return model


def _assert_same_training(with_it: list[dict[str, Any]], without: list[dict[str, Any]]) -> None:
    a, b = with_it[0]["state"], without[0]["state"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise
    for x, y in zip(with_it, without, strict=True):
        assert x["losses"] == y["losses"]  # every rank's logged loss, bitwise


CASES = [
    ("1f1b", 2, 2, "regression", None),
    ("1f1b", 3, 5, "regression", None),  # a middle stage splits too
    ("gpipe", 2, 4, "regression", None),
    ("1f1b", 2, 4, "conv", None),  # batch norm
    # stage 1 starts with ReLU(inplace=True), then with a block adding to its input in place:
    # both modify the received activation (through the engine's alias) before the split
    ("1f1b", 2, 2, "conv", [2, 6]),
    ("gpipe", 2, 2, "conv", [5, 3]),
    ("1f1b", 2, 2, "tied", None),  # a weight shared by both stages
    ("gpipe", 2, 2, "nested", None),  # the last stage cannot cut its backward: one more pass
]


@pytest.mark.parametrize(
    ("schedule", "p", "m", "model", "balance"),
    CASES,
    ids=[f"{s}-p{p}-m{m}-{n}" + (f"-{b[0]}" if b else "") for s, p, m, n, b in CASES],
)
def test_early_input_grad_is_exact_and_goes_first(
    pools: Any, schedule: str, p: int, m: int, model: str, balance: list[int] | None
) -> None:
    pool = pools(p)
    with_it = pool.run(_fit, schedule, m, True, model, balance=balance)
    without = pool.run(_fit, schedule, m, False, model, balance=balance)
    _assert_same_training(with_it, without)
    for result in with_it:
        if result["stage"] == 0:  # sends no gradient
            assert result["early_sends"] == result["late_sends"] == []
        elif schedule == "1f1b":  # the last micro-batch's gradient of each step leaves first
            assert result["early_sends"] == [m - 1] * STEPS, result
            assert len(result["late_sends"]) == (m - 1) * STEPS, result
        else:  # gpipe: the first and the last gradient of each step leave first
            assert result["early_sends"] == [0, m - 1] * STEPS, result
            assert len(result["late_sends"]) == (m - 2) * STEPS, result
    for result in with_it:
        # cut in two passes, except where the graph does not allow it: there only the last I
        # of a step sends first, after one more pass for its inputs' gradient (GPipe's first I
        # runs the whole backward)
        sent = 0 if result["stage"] == 0 else STEPS * (2 if schedule == "gpipe" else 1)
        cut = model != "nested" or result["stage"] < p - 1
        assert (result["split"], result["repeated"]) == ((sent, 0) if cut else (0, STEPS)), result
    for result in without:
        assert result["early_sends"] == [], result
        assert result["split"] == result["repeated"] == 0


def test_stages_whose_backward_must_run_once_do_not_split(pools: Any) -> None:
    # block 6 is on the last stage (balance 4 + 4); stage 0 has no input gradient to send.
    # The list still says I, SEND_B, W; the I runs the whole backward (nothing cut, no pass
    # repeated) and the W finds nothing left
    hooked = pools(2).run(_fit, "1f1b", 2, True, "regression", hook_block=6)
    last = next(r for r in hooked if r["stage"] == 1)
    assert (last["split"], last["repeated"]) == (0, 0), last
    assert last["hook_calls"] == STEPS * 2  # once per micro-batch
    # a LightningModule with its own backward: the last stage cannot reproduce it
    own = pools(2).run(_fit, "1f1b", 2, True, "regression", own_backward=True)
    last = next(r for r in own if r["stage"] == 1)
    assert (last["split"], last["repeated"]) == (0, 0), last
    recomputed = pools(2).run(_fit, "1f1b", 2, True, "regression", recompute=True)
    assert all((r["split"], r["repeated"]) == (0, 0) for r in recomputed)
    plain = pools(2).run(_fit, "1f1b", 2, False, "regression", recompute=True)
    _assert_same_training(recomputed, plain)
