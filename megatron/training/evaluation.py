"""Evaluation as Megatron runs it: the validation split every --eval-interval iterations and at the
end of training, the test split at the end, or both at the loaded iteration with --skip-train.

- One evaluation reads --eval-iters batches of --eval-global-batch-size samples, in micro-batches of
  --eval-micro-batch-size (both default to the training sizes).
- The loss is weighted by loss tokens: summed over every loss token of the evaluation (all
  micro-batches, all data-parallel ranks) and divided by their count, as Megatron's ``evaluate``
  reduces its (loss sum, tokens) pairs.
- The validation stream goes on from one evaluation to the next and across a resume (the train state
  saves ``consumed_valid_samples``); the test split, and validation with --skip-train, start at 0.
- TensorBoard and W&B get both splits under ``lm loss validation``, as Megatron writes them, and
  nothing with --skip-train; the metrics file keeps them apart (``lm loss validation`` / ``lm loss test``).
- Graphed regions run eagerly here (the graph manager routes eval and no-grad calls around the
  graphs), so evaluation never disturbs the replay order.
"""

import math

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.schedules import NUM_TOKENS
from megatron.training import logging_utils as logs


class Evaluation:
    """Trainer mixin: evaluation of the validation and test splits."""

    def evaluate(self, data_iterator, where: str, *, split: str = "validation", verbose: bool = False) -> float:
        """Token-weighted mean lm loss over --eval-iters batches of ``split`` (no grad); prints and logs it.

        Args:
            data_iterator: Micro-batches of the split, --eval-micro-batch-size each.
            where: The log line's place, e.g. ``iteration 20`` or ``iteration 20 on test set``.
            split: ``validation`` (advances ``consumed_valid_samples``) or ``test``.
            verbose: Print Megatron's "Evaluating on N samples" and per-batch progress lines.
        """
        t = self.cfg.training
        if verbose:
            logs.print_rank_0(f"Evaluating on {t.eval_iters * t.eval_global_batch_size} samples")
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss summed over tokens, tokens]
        with self.on_stream(), torch.no_grad():
            for i in range(t.eval_iters):
                if verbose:
                    logs.print_rank_0(f"Evaluating iter {i + 1}/{t.eval_iters}")
                loss_sum, metrics = self.eval_schedule(
                    forward_step=self.forward_step,
                    next_batch=lambda: self._next_batch(data_iterator),
                    model=self.model,
                    num_microbatches=self.cfg.eval_num_microbatches,
                    forward_only=True,
                    per_token_loss=True,
                )
                sums += torch.stack([loss_sum.double(), metrics[NUM_TOKENS].double()])
            if self.pg.dp is not None:
                dist.all_reduce(sums, group=self.pg.dp)
            loss_total, tokens = sums.tolist()
        self.model.train()
        if split == "validation" and not t.skip_train:
            self.consumed_valid_samples += t.eval_iters * t.eval_global_batch_size
        loss = loss_total / max(tokens, 1.0)
        ppl = math.exp(min(20.0, loss))
        line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        rule = "-" * (len(line) + 1)  # Megatron's width
        logs.print_last_rank(rule + "\n" + line + "\n" + rule)
        name = "lm loss validation" if split == "validation" else "lm loss test"
        record = {name: loss, f"{name} ppl": ppl}
        self.metrics.write(self.iteration, record, samples=self.consumed_samples, tensorboard=False)
        if not t.skip_train:  # Megatron's tags: the test split's loss too is "lm loss validation"
            tb = {"lm loss validation": loss}
            if self.cfg.logging.log_validation_ppl_to_tensorboard:
                tb["lm loss validation ppl"] = ppl
            self.metrics.write(self.iteration, tb, samples=self.consumed_samples, jsonl=False)
        return loss

    def evaluate_at_end(self, valid_iter, test_iter) -> None:
        """Megatron's evaluations after training (or instead of it, with --skip-train)."""
        if valid_iter is not None:
            self.evaluate(valid_iter, f"iteration {self.iteration} on validation set", verbose=True)
        if test_iter is not None:
            self.evaluate(test_iter, f"iteration {self.iteration} on test set", split="test", verbose=True)
