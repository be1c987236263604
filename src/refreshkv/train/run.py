"""`refreshkv train`: continued pre-training with RefreshKV's attention pattern on transformers' `Trainer`.

The Trainer brings what a training run needs and scales out without new code: `accelerate launch` with a DDP or
FSDP config runs the same command on several GPUs or machines, and `--optim` passes any Trainer optimiser
(the paper: 8-bit AdamW, `adamw_bnb_8bit`). This module adds the pattern (train/pattern.py, passed to every
forward by keyword), the data split (train/data.py) and a run folder that can be killed and resumed:

    OUT/run.json              what determines the run (a folder holding another run is refused)
    OUT/split/                the documents of each split; test.jsonl is what `eval --task ppl` scores
    OUT/checkpoints/          Trainer checkpoints every `save_every` steps (the last two kept)
    OUT/model/                the final model and tokenizer (`--model OUT/model` everywhere in the package)
    OUT/metrics.json          final dev loss, steps, tokens/s

A checkpoint is complete once its trainer_state.json (written last) reads back; `--resume` continues from the
newest complete one, so a run killed at any moment loses at most the last interval. The final model is written
to a temporary folder and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging

from ..core.policy import check_budget, resolve_budget
from ..engine.attention import PATTERN_ARGUMENT, TRAINING_UNSUPPORTED
from ..engine.cache import layer_windows
from ..eval.distributed import current_launch
from ..runtime.output_files import write_text
from ..texts.documents import read_documents
from .pattern import PartialPattern
from .progress import TrainProgress
from .windows import cut_windows, split_documents, write_split

# The training argument that recomputes activations: `activation_checkpointing` since transformers 5.23, which
# deprecates the older `gradient_checkpointing`.
CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)

LOSS_ON = ("all", "suffix")
SCHEDULES = ("linear", "cosine", "constant_with_warmup")
IGNORE = -100  # labels the loss skips


@dataclasses.dataclass
class TrainConfig:
    """What determines a training run (recorded in OUT/run.json)."""

    data: list[str]
    model: str
    prefix_length: int = 1024
    suffix_length: int = 50
    budget: int | None = None  # K; default budget_ratio * L
    budget_ratio: float | None = None
    kernel: int = 7
    window: int = 1
    aggregation: str = "max"
    loss_on: str = "all"  # the paper: next-token loss on every token
    steps: int | None = None  # default: `epochs` (1) over the training windows
    epochs: float | None = None
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 5e-6
    warmup: int = 20
    schedule: str = "linear"
    weight_decay: float = 0.0
    optim: str = "adamw_torch"
    seed: int = 0
    eval_every: int = 50
    save_every: int = 50
    dev_windows: int = 32
    gradient_checkpointing: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"unknown --loss-on '{self.loss_on}'; choose from: {', '.join(LOSS_ON)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown --schedule '{self.schedule}'; choose from: {', '.join(SCHEDULES)}")
        check_budget(self.budget, self.budget_ratio, names=("--budget", "--budget-ratio"))
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either --steps or --epochs, not both")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        self.pattern()  # checks L, S, K, kernel, window, aggregation

    def record(self) -> dict:
        return dataclasses.asdict(self)

    def pattern(self) -> PartialPattern:
        budget = resolve_budget(self.prefix_length, self.budget, self.budget_ratio)
        return PartialPattern(
            self.prefix_length, self.suffix_length, budget, self.kernel, self.window, self.aggregation
        )


class WindowDataset(torch.utils.data.Dataset):
    def __init__(self, windows: list[list[int]], prefix_length: int, loss_on: str):
        self.windows, self.prefix_length, self.loss_on = windows, prefix_length, loss_on

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        ids = torch.tensor(self.windows[index])
        labels = ids.clone()
        if self.loss_on == "suffix":  # score only the last S tokens (predicted from position L - 1 on)
            labels[: self.prefix_length] = IGNORE
        return {"input_ids": ids, "labels": labels}


def complete_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints whose trainer_state.json (the Trainer writes it last) reads back, oldest first."""
    found = []
    for checkpoint in folder.glob("checkpoint-*"):
        try:
            json.loads((checkpoint / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue
        found.append(checkpoint)
    return sorted(found, key=lambda path: int(path.name.rsplit("-", 1)[1]))


def check_out_folder(out: Path, record: dict, resume: bool) -> None:
    """Refuse a folder holding another run, or any run without --resume, before anything is written."""
    run_file = out / "run.json"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if not run_file.exists():
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"--out {out} is not empty and holds no training run; choose an empty or new folder")
        return
    previous = json.loads(run_file.read_text())
    if previous != record:
        changed = sorted(key for key in set(previous) | set(record) if previous.get(key) != record.get(key))
        raise ValueError(
            f"--out {out} holds a different training run (differs in: {', '.join(changed)}); choose another folder"
        )
    if not resume:
        raise ValueError(f"--out {out} already holds this training run; add --resume to continue it")


def prepare_data(config: TrainConfig, tokenizer, log) -> tuple[dict, dict[str, list[list[int]]]]:
    """(documents per split, windows per split), after checking that there is something to train and evaluate on."""
    splits = split_documents(read_documents(config.data), config.seed)
    length = config.pattern().length
    windows = {}
    for split, documents in splits.items():
        cut = cut_windows(tokenizer, documents, length)
        if cut.skipped:
            log(f"{split}: skipped {cut.skipped} of {len(documents)} document(s) shorter than L + S = {length} tokens")
        if not cut.windows:
            raise ValueError(
                f"no {split} document holds L + S = {length} tokens; give longer documents or a smaller --prefix-length"
            )
        windows[split] = cut.windows
    dev = windows["dev"]
    windows["dev"] = dev[:: max(1, len(dev) // config.dev_windows)][: config.dev_windows]  # spread over the dev split
    return splits, windows


def train(
    model,
    tokenizer,
    config: TrainConfig,
    out: str | Path,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    log=print,
    callbacks=(),
) -> dict:
    """Continued pre-training of `model` with the pattern; returns the final metrics (also in OUT/metrics.json).

    `callbacks` are added to the Trainer's (transformers `TrainerCallback`s).
    """
    text_config = model.config.get_text_config()
    spans = [window for window in layer_windows(text_config) if window is not None]
    if getattr(text_config, "attn_logit_softcapping", None) or any(span < config.pattern().length for span in spans):
        raise ValueError(TRAINING_UNSUPPORTED)
    out = Path(out)
    record = config.record()
    primary = current_launch().rank == 0  # under `accelerate launch` / torchrun, rank 0 alone checks and writes OUT
    if primary:
        check_out_folder(out, record, resume)
    pattern = config.pattern()
    splits, windows = prepare_data(config, tokenizer, log)
    checkpoints = out / "checkpoints"
    done = complete_checkpoints(checkpoints) if checkpoints.exists() else []
    if primary:
        out.mkdir(parents=True, exist_ok=True)  # nothing is written before the data has been checked
        write_split(out / "split", splits)
        write_text(out / "run.json", json.dumps(record, indent=1) + "\n", "training record")
        for partial in set(checkpoints.glob("checkpoint-*")) - set(done):
            shutil.rmtree(partial)  # killed while saving: its step is redone from the previous checkpoint
    args = TrainingArguments(
        output_dir=str(checkpoints),
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        warmup_steps=config.warmup,
        lr_scheduler_type=config.schedule,
        weight_decay=config.weight_decay,
        optim=config.optim,
        max_steps=config.steps if config.steps is not None else -1,
        num_train_epochs=config.epochs if config.epochs is not None else 1.0,
        seed=config.seed,
        data_seed=config.seed,
        eval_strategy="steps",
        eval_steps=config.eval_every,
        save_strategy="steps",
        save_steps=config.save_every,
        save_total_limit=2,
        logging_steps=1,
        report_to=[],
        use_cpu=device == "cpu",
        bf16=config.dtype == "bfloat16" and device != "cpu",
        **{CHECKPOINTING: config.gradient_checkpointing, f"{CHECKPOINTING}_kwargs": {"use_reentrant": False}},
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = PatternTrainer(
        pattern=pattern,
        model=model,
        args=args,
        train_dataset=WindowDataset(windows["train"], config.prefix_length, config.loss_on),
        eval_dataset=WindowDataset(windows["dev"], config.prefix_length, config.loss_on),
    )
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    tokens_per_step = config.batch_size * config.grad_accum * pattern.length
    for callback in (TrainProgress(tokens_per_step, enabled=progress, log=log), *callbacks):
        trainer.add_callback(callback)
    started = time.perf_counter()
    first_step = int(done[-1].name.rsplit("-", 1)[1]) if done else 0
    shard_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar: ours (checkpoint writes would add one each)
    try:
        trainer.train(resume_from_checkpoint=str(done[-1]) if done else None)
    finally:
        if shard_bars:
            hf_logging.enable_progress_bar()
    elapsed = time.perf_counter() - started
    steps = trainer.state.global_step
    last = [
        entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry and entry["step"] == steps
    ]
    metrics = {
        "dev_loss": last[-1] if last else trainer.evaluate()["eval_loss"],
        "steps": steps,
        "train_windows": len(windows["train"]),
        "dev_windows": len(windows["dev"]),
        "test_windows": len(windows["test"]),
        "tokens_per_s_this_session": round((steps - first_step) * tokens_per_step / elapsed, 1),
    }
    save_model(trainer, tokenizer, out / "model")
    if trainer.is_world_process_zero():
        write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n", "training record")
    return metrics


def save_model(trainer, tokenizer, target: Path) -> None:
    """The final model and tokenizer, written to a temporary folder and renamed (every rank calls it: FSDP gathers)."""
    primary = trainer.is_world_process_zero()
    trainer.model.config.use_cache = True  # the Trainer turns it off for training; generation wants it back
    staging = target.with_name(target.name + ".partial")
    if primary:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.save_model(str(staging))
    if primary:
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(staging))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


class PatternTrainer(Trainer):
    """A Trainer whose every forward (training and evaluation) attends with the RefreshKV pattern."""

    def __init__(self, *args, pattern: PartialPattern, **kwargs):
        super().__init__(*args, **kwargs)
        self.pattern = pattern

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {**inputs, PATTERN_ARGUMENT: self.pattern}
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
