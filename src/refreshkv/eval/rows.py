"""What a result row holds: the fields that identify it (`row_for`) and the measured fields of each kind of run
(generation, a conversation's turn, teacher forcing), from a generation's output and its cache."""

from __future__ import annotations

import time

from ..core.policy import BUILT_IN, PROVIDERS
from ..measure.budget_report import budget_report
from .config import RunConfig
from .examples import Prepared

FULL_FIDELITY = {"kl_to_full": 0.0, "top1_agreement": 1.0, "first_divergence": None}  # full against itself


def cache_fields(cache) -> dict:
    per_layer = cache.nbytes_per_layer()
    kept = budget_report(cache)
    return {
        "decode_steps": cache.step,
        "full_step_fraction": round(cache.full_step_fraction(), 4),
        "full_steps_per_layer": [round(v, 4) for v in cache.stats.per_layer()],
        "kv_bytes_full": sum(per_layer),
        "kv_bytes_per_layer": per_layer,
        "kv_bytes_attended_mean": round(cache.attended_bytes_mean()),
        "budget": cache.budget,
        "budget_ratio": round(kept["budget_ratio"], 4),
        "budget_per_layer": [round(v, 2) for v in kept["budget_per_layer"]],
    }


def is_full(config: RunConfig) -> bool:
    return config.method == "full" and not config.params


def timing_fields(out) -> dict:
    return {
        "prefill_s": round(out.prefill_s, 4),
        "prefill_shared_by": out.prefill_shared_by,
        "decode_ms_per_token": round(out.decode_ms_per_token, 3),
    }


def forced_fields(example: dict, forced) -> dict:
    return {
        "prediction": "",
        "reference": example.get("reference"),
        "prompt_tokens": example["target_start"],
        "new_tokens": len(forced.losses),
        **timing_fields(forced),
        **cache_fields(forced.cache),
        "losses": [round(v, 6) for v in forced.losses],
    }


def generation_fields(item: Prepared, out, prediction: str, score: float, fidelity: dict | None) -> dict:
    """The measured fields of a generation (`out`, a `GenerationOutput`) on `item`; `fidelity`: its fields to `full`
    (None: not measured)."""
    return {
        "prediction": prediction,
        "reference": item.example["reference"],
        "score": score,
        "prompt_tokens": len(item.input_ids),
        "new_tokens": len(out.tokens[0]),
        **timing_fields(out),
        **cache_fields(out.cache),
        **(fidelity or {}),
    }


def turn_fields(number: int, turns: list[dict], prediction: str, score: float, conversation, asked) -> dict:
    """The measured fields of a conversation's turn `number` (from 1) of `turns`: `asked`, its answer in
    `conversation` (runtime/conversation.py)."""
    return {
        "turn": number,
        "turns": len(turns),
        "prediction": prediction,
        "reference": turns[number - 1]["reference"],
        "score": score,
        "prompt_tokens": conversation.tokens_held,
        "question_tokens": asked.question_tokens,
        "new_tokens": len(asked.tokens),
        "prefill_s": round(conversation.context_prefill_s, 4),
        "time_to_first_token_s": round(asked.time_to_first_token_s, 4),
        "decode_ms_per_token": round(asked.decode_ms_per_token, 3),
        "kv_bytes_full": asked.kv_bytes_held,
        "kv_bytes_attended_mean": round(asked.kv_bytes_read_per_step),
    }


def row_for(config: RunConfig, run: str, item: Prepared, measured: dict) -> dict:
    example = item.example
    head = {
        "run": run,
        "config": config.key(),
        "task": config.task,
        "example_task": example["task"],
        "method": config.method,
        "provider": PROVIDERS.get(config.method, BUILT_IN),  # the package behind the name (plugins may replace one)
        "params": config.params,
        "length": config.length,
        "seed": config.seed,
        "task_options": config.fields()["task_options"],
        "model": config.model,
        "chat": config.chat,
        "prompt_form": item.prompt_form,
        "dtype": config.dtype,
        "id": example["id"],
    }
    if "source_id" in example:
        head["source_id"] = example["source_id"]
    if "turn" in measured:  # one row per turn of a conversation
        head["conversation"], head["id"] = example["id"], f"{example['id']}/turn{measured['turn']}"
    return {**head, **measured, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
