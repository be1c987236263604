"""One progress bar for a training run: steps, with the last loss, tokens/s and the last dev loss beside it."""

from __future__ import annotations

import time

from tqdm.auto import tqdm
from transformers import TrainerCallback


class TrainProgress(TrainerCallback):
    def __init__(self, tokens_per_step: int, enabled: bool = True, log=print):
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self.log = log
        self.bar = None
        self.started = None
        self.first_step = 0
        self.shown: dict[str, str] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(
            total=state.max_steps, initial=state.global_step, desc="train", unit="step", disable=not self.enabled
        )
        self.started, self.first_step = time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(state.global_step - self.bar.n)
        elapsed = time.perf_counter() - self.started
        self.shown["tok/s"] = f"{(state.global_step - self.first_step) * self.tokens_per_step / elapsed:.0f}"
        self.bar.set_postfix(self.shown, refresh=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            self.shown["loss"] = f"{logs['loss']:.3f}"
        if "eval_loss" in logs:
            self.shown["dev"] = f"{logs['eval_loss']:.3f}"
            self.log(f"step {state.global_step}: dev loss {logs['eval_loss']:.4f}")
        if self.bar is not None:
            self.bar.set_postfix(self.shown)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()
