"""The `refreshkv train` command (train/run.py does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..runtime.prepare import check_runtime, load_checked
from .options import DeviceOpt, DtypeOpt, ModelOpt


def register(app, user_errors) -> None:
    """Add `train` to the CLI app; `user_errors` turns ValueErrors into one line and exit code 2."""

    @app.command("train")
    @user_errors
    def train_command(
        data: Annotated[
            list[Path], typer.Option(help="Text file, folder of .txt files or JSONL with 'text' (repeatable).")
        ],
        out: Annotated[Path, typer.Option(help="Run folder: split, checkpoints, final model (OUT/model).")],
        model: ModelOpt = None,
        prefix_length: Annotated[int, typer.Option(min=2, help="L: tokens attended causally (the prefill).")] = 1024,
        suffix_length: Annotated[
            int, typer.Option(min=1, help="S: last tokens that attend with the partial cache.")
        ] = 50,
        budget: Annotated[Optional[int], typer.Option(min=1, help="K: prefix tokens in the partial cache.")] = None,
        budget_ratio: Annotated[Optional[float], typer.Option(help="K as a fraction of L (default 0.125).")] = None,
        kernel: Annotated[int, typer.Option(help="Max-pooling kernel of the selection (odd).")] = 7,
        window: Annotated[int, typer.Option(min=1, help="Last prefix tokens whose attention selects.")] = 1,
        aggregation: Annotated[str, typer.Option(help="GQA aggregation: max, mean or first.")] = "max",
        loss_on: Annotated[
            str, typer.Option(help="Tokens in the loss: all (the paper) or suffix (the last S).")
        ] = "all",
        steps: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps (default: --epochs 1).")] = None,
        epochs: Annotated[Optional[float], typer.Option(min=0.0, help="Passes over the training windows.")] = None,
        batch_size: Annotated[int, typer.Option(min=1, help="Windows per device per forward.")] = 1,
        grad_accum: Annotated[int, typer.Option(min=1, help="Forwards per optimizer step.")] = 1,
        lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 5e-6,
        warmup: Annotated[int, typer.Option(min=0, help="Warm-up steps.")] = 20,
        schedule: Annotated[str, typer.Option(help="linear, cosine or constant_with_warmup.")] = "linear",
        weight_decay: Annotated[float, typer.Option(min=0.0)] = 0.0,
        optim: Annotated[
            str, typer.Option(help="Trainer optimizer name (e.g. adamw_torch, adamw_bnb_8bit).")
        ] = "adamw_torch",
        eval_every: Annotated[int, typer.Option(min=1, help="Dev loss every N steps.")] = 50,
        save_every: Annotated[int, typer.Option(min=1, help="Checkpoint every N steps (what a kill can lose).")] = 50,
        dev_windows: Annotated[int, typer.Option(min=1, help="Dev windows the dev loss averages over.")] = 32,
        seed: Annotated[int, typer.Option(help="Seed of the split, the data order and the initialisation.")] = 0,
        dtype: DtypeOpt = "float32",
        device: DeviceOpt = "cpu",
        gradient_checkpointing: Annotated[
            bool, typer.Option(help="Recompute activations in the backward pass.")
        ] = False,
        threads: Annotated[Optional[int], typer.Option(min=1, help="torch CPU threads.")] = None,
        resume: Annotated[
            bool, typer.Option(help="Continue the run in OUT from its newest complete checkpoint.")
        ] = False,
    ):
        """Continued pre-training with RefreshKV's attention pattern (refreshkv.txt §6); docs/training.md."""
        from ..eval.config import model_identity
        from ..texts.documents import read_documents
        from ..train.run import TrainConfig, check_out_folder, train
        from ..train.windows import split_documents

        config = TrainConfig(
            data=[str(path.resolve()) for path in data],
            model=model_identity(model),
            prefix_length=prefix_length,
            suffix_length=suffix_length,
            budget=budget,
            budget_ratio=budget_ratio,
            kernel=kernel,
            window=window,
            aggregation=aggregation,
            loss_on=loss_on,
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            grad_accum=grad_accum,
            lr=lr,
            warmup=warmup,
            schedule=schedule,
            weight_decay=weight_decay,
            optim=optim,
            seed=seed,
            eval_every=eval_every,
            save_every=save_every,
            dev_windows=dev_windows,
            gradient_checkpointing=gradient_checkpointing,
            dtype=dtype,
        )
        runtime = check_runtime(dtype, device, threads=threads)
        check_out_folder(out, config.record(), resume)  # before the model loads: a wrong folder fails at once
        split_documents(read_documents(config.data), seed)  # and so does data that cannot be split
        lm, tokenizer, _ = load_checked(model, runtime)
        limit = lm.config.max_position_embeddings
        if prefix_length + suffix_length > limit:
            raise ValueError(f"L + S = {prefix_length + suffix_length} exceeds the model's context of {limit} tokens")
        metrics = train(lm, tokenizer, config, out, resume=resume, device=device)
        typer.echo(
            f"dev loss {metrics['dev_loss']:.4f} after {metrics['steps']} steps; model in {out / 'model'} "
            f"(use --model {out / 'model'}); test split in {out / 'split' / 'test.jsonl'}"
        )
