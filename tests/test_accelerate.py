"""Hugging Face Accelerate (``accelerate`` 1.15, installed with the dev extras) on 2 real gloo ranks,
following the README's "Hugging Face Accelerate" recipe: the Monitor given what ``prepare`` returned,
``accelerator.accumulate`` over 3 micro-batches of unequal token counts, the clip only where
``sync_gradients`` (elsewhere refused), the step's token-weighted loss, and an evaluation whose
per-sample sums are gathered per batch with ``gather_for_metrics``. Truth: float64 from the gradients
and parameters themselves, every rank's losses and tokens gathered, and the whole evaluation set run
through the unwrapped model in one process."""

from __future__ import annotations

import math

import pytest

from tests.dist_utils import quiet_config, run_ranks

ACCUMULATE = 3
VOCAB, WIDTH, SEQ = 16, 8, 6


def _model():
    import types

    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.l1, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)

        def forward(self, input_ids, labels):
            logits = self.head(torch.tanh(self.l1(self.emb(input_ids))))
            ce = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                             reduction="none").reshape(labels.shape)
            valid = labels != -100
            return types.SimpleNamespace(loss=ce.sum() / valid.sum(), tokens=valid.sum(),
                                         sample_sums=ce.sum(-1), sample_tokens=valid.sum(-1))

    return Tiny()


def _dataset(n: int, seed: int):
    """Samples with 1 to SEQ label tokens (the rest -100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)
    for i in range(n):
        y[i, 1 + (7 * i + seed) % SEQ:] = -100
    return [{"input_ids": x[i], "labels": y[i]} for i in range(n)]


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def _accelerate_run(rank: int, world: int, root: str) -> dict:
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    import distmetrics as dm

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = torch.utils.data.DataLoader(_dataset(48, 1), batch_size=2)
    evaluation = torch.utils.data.DataLoader(_dataset(7, 2), batch_size=2)  # 7: the last batches padded
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    config = quiet_config(log_interval=2, log_update_norm=True, log_throughput=True, json_log=True, output_dir=root)
    monitor = dm.Monitor(config, model=model, optimizer=optimizer)
    steps, refused, step, loss_sum, tokens = [], [], 0, 0.0, 0
    before = [p.detach().double().clone() for p in model.parameters()]
    for batch in train:
        with accelerator.accumulate(model):
            out = model(**batch)
            accelerator.backward(out.loss)
            loss_sum, tokens = loss_sum + out.loss.detach() * out.tokens, tokens + int(out.tokens)
            if accelerator.sync_gradients:
                grad_truth = _norm(p.grad for p in model.parameters())
                monitor.clip_grad_norm_(1e9)  # measured, not clipping: the update is AdamW's alone
            else:
                try:
                    monitor.clip_grad_norm_(1e9)
                    refused.append(None)
                except ValueError as err:
                    refused.append(str(err))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            after = [p.detach().double().clone() for p in model.parameters()]
            monitor.step(step, loss=loss_sum / tokens, tokens=tokens)
            steps.append({"loss_sum": float(loss_sum), "tokens": tokens, "grad": grad_truth,
                          "update": _norm(a - b for a, b in zip(after, before))})
            before, loss_sum, tokens = after, 0.0, 0
    model.eval()
    eval_sum = eval_tokens = 0.0
    with torch.no_grad():
        for batch in evaluation:
            out = model(**batch)
            sums, counts = accelerator.gather_for_metrics((out.sample_sums.double(), out.sample_tokens.double()))
            eval_sum, eval_tokens = eval_sum + float(sums.sum()), eval_tokens + float(counts.sum())
    if accelerator.is_main_process:
        monitor.log_eval(step, loss=eval_sum / eval_tokens, tokens=eval_tokens)
    else:
        monitor.log_eval(step, loss=None, tokens=0)
    monitor.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, steps)
    unwrapped = accelerator.unwrap_model(model)
    samples = _dataset(7, 2)
    with torch.no_grad():
        whole = unwrapped(torch.stack([s["input_ids"] for s in samples]), torch.stack([s["labels"] for s in samples]))
    records = list(dm.read_jsonl(Path(root) / "metrics.jsonl")) if rank == 0 else []
    return {"steps": gathered, "refused": refused, "records": records,
            "eval_truth": float(whole.sample_sums.double().sum() / whole.sample_tokens.sum())}


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    return run_ranks(_accelerate_run, 2, str(tmp_path_factory.mktemp("accelerate")), timeout=240)


def test_the_accelerate_recipe_measures_real_steps_against_float64(accelerate_run):
    """grad_norm at the steps that sync, update_norm of real optimizer steps only (Accelerate's optimizer
    wrapper turns the other micro-batches' ``optimizer.step()`` into no-ops), and train/loss the
    token-weighted mean over every micro-batch of both ranks in the interval."""
    result = accelerate_run[0]
    steps = result["steps"]  # per rank, per step
    train = [r for r in result["records"] if r["kind"] == "train"]
    assert len(steps[0]) == 4 and [r["step"] for r in train] == [2, 4]  # 12 micro-batches a rank
    for record in train:
        n = record["step"] - 1  # the log step's index
        assert record["grad_norm"] == pytest.approx(steps[0][n]["grad"], rel=1e-6)
        assert steps[1][n]["grad"] == pytest.approx(steps[0][n]["grad"], rel=1e-12)  # reduced: one norm
        assert record["update_norm"] == pytest.approx(steps[0][n]["update"], rel=1e-5)
        interval = [s for per_rank in steps for s in per_rank[n - 1:n + 1]]
        assert record["train/loss"] == pytest.approx(sum(s["loss_sum"] for s in interval) /
                                                     sum(s["tokens"] for s in interval), rel=1e-6)
        assert record["train/consumed_tokens"] == sum(s["tokens"] for per_rank in steps for s in per_rank[:n + 1])


def test_accelerate_measurements_outside_the_synced_micro_batch_are_refused_on_every_rank(accelerate_run):
    for rank_result in accelerate_run:
        assert len(rank_result["refused"]) == 4 * (ACCUMULATE - 1)
        assert all(message is not None and "no_sync" in message for message in rank_result["refused"]), \
            rank_result["refused"][:1]


def test_accelerate_evaluation_gathered_per_batch_counts_each_sample_once(accelerate_run):
    """The evaluation loader pads its last batches with repeated samples; ``gather_for_metrics`` per
    batch drops them, so eval/loss is the whole set's token-weighted mean, on the tokens of the set."""
    result = accelerate_run[0]
    [evaluation] = [r for r in result["records"] if r["kind"] == "eval"]
    assert evaluation["eval/loss"] == pytest.approx(result["eval_truth"], rel=1e-9)
