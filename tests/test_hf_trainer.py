"""Hugging Face ``Trainer`` (``transformers`` 5.24, installed with the dev extras) on 2 real gloo ranks,
with the callback the README's "Hugging Face Trainer" recipe describes: the Monitor made in
``on_train_begin`` from ``trainer.model_wrapped`` and the optimizer, the clip in
``on_pre_optimizer_step`` with ``max_grad_norm=0``, the lr read there, the step's loss summed in a
``with_kwargs`` forward hook (weighted by ``num_items_in_batch``, which Trainer gives a causal LM),
``monitor.step`` in ``on_step_end``, pauses around evaluation and saving. A tiny ``LlamaForCausalLM``
made from a config (nothing downloaded), labels of unequal lengths, 3 micro-batches a step. Truth:
each micro-batch's cross-entropy summed in float64 from its logits in the same hook, gathered from
both ranks; the gradients' float64 norm before the clip."""

from __future__ import annotations

import math

import pytest

from tests.dist_utils import quiet_config, run_ranks

ACCUMULATE = 3
VOCAB = 32


def _trainer_run(rank: int, world: int, root: str) -> dict:
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import distmetrics as dm

    class Samples(torch.utils.data.Dataset):
        def __init__(self, n: int, seed: int):
            self.x = torch.randint(0, VOCAB, (n, 8), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            labels = self.x[i].clone()
            labels[2 + (5 * i) % 7:] = -100  # 1 to 7 label tokens after the shift
            return {"input_ids": self.x[i], "labels": labels}

    truth: dict = {}

    class MonitorCallback(TrainerCallback):
        def __init__(self):
            self.trainer = self.monitor = None
            self.loss_sum, self.tokens, self.true_sum = 0.0, 0, 0.0

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            config = quiet_config(log_interval=2, json_log=True, output_dir=root)
            self.monitor = dm.Monitor(config, model=self.trainer.model_wrapped, optimizer=optimizer)

            def count(module, inputs, kwargs, output):
                if module.training and torch.is_grad_enabled():
                    shifted = kwargs["labels"][..., 1:]
                    n = int((shifted != -100).sum())
                    items = kwargs.get("num_items_in_batch")
                    self.loss_sum = self.loss_sum + output.loss.detach() * (items if items is not None else n)
                    self.tokens += n
                    logits = output.logits[..., :-1, :].reshape(-1, VOCAB).detach().double()
                    self.true_sum += float(torch.nn.functional.cross_entropy(
                        logits, shifted.reshape(-1), ignore_index=-100, reduction="sum"))

            model.register_forward_hook(count, with_kwargs=True)

        def on_step_begin(self, args, state, control, **kwargs):
            self.monitor.resume()
            self.loss_sum, self.tokens, self.true_sum = 0.0, 0, 0.0

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.grad = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                                      if p.grad is not None))
            self.monitor.clip_grad_norm_(1.0)
            self.lr = optimizer.param_groups[0]["lr"]

        def on_step_end(self, args, state, control, **kwargs):
            self.monitor.step(state.global_step, loss=self.loss_sum / self.tokens, tokens=self.tokens, lr=self.lr)
            truth[state.global_step] = {"sum": self.true_sum, "tokens": self.tokens, "grad": self.grad}
            if control.should_evaluate or control.should_save:
                self.monitor.pause()

        def on_epoch_end(self, args, state, control, **kwargs):
            self.monitor.pause()

        def on_train_end(self, args, state, control, **kwargs):
            self.monitor.close()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    callback = MonitorCallback()
    args = TrainingArguments(output_dir=str(Path(root) / "hf"), use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=ACCUMULATE, max_grad_norm=0, learning_rate=1e-2,
                             num_train_epochs=1, eval_strategy="steps", eval_steps=3, save_strategy="no",
                             report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Samples(48, 1), eval_dataset=Samples(6, 2),
                      callbacks=[callback])
    callback.trainer = trainer
    trainer.train()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, truth)
    records = [r for r in dm.read_jsonl(Path(root) / "metrics.jsonl") if r["kind"] == "train"] if rank == 0 else []
    return {"truth": gathered, "records": records}


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    return run_ranks(_trainer_run, 2, str(tmp_path_factory.mktemp("trainer")), timeout=300)[0]


def test_the_trainer_recipe_writes_the_token_weighted_loss_and_the_unclipped_norm(trainer_run):
    """train/loss was 5-6x too small (about micro-batches x ranks) where the hook weighed Trainer's loss by the
    micro-batch's tokens: a causal LM given num_items_in_batch returns its sum over the whole step's tokens
    (both ranks')."""
    truth, records = trainer_run["truth"], trainer_run["records"]
    assert [r["step"] for r in records] == [2, 4]  # 12 micro-batches a rank: 4 steps
    for record in records:
        steps = (record["step"] - 1, record["step"])
        total = sum(t[s]["sum"] for t in truth for s in steps)
        tokens = sum(t[s]["tokens"] for t in truth for s in steps)
        assert record["train/loss"] == pytest.approx(total / tokens, rel=1e-5), record["step"]
        assert record["grad_norm"] == pytest.approx(truth[0][record["step"]]["grad"], rel=1e-5)
        assert truth[1][record["step"]]["grad"] == pytest.approx(truth[0][record["step"]]["grad"], rel=1e-9)
