"""Run configurations over their examples, appending one row per example to a results file (results_file.py).

The configurations of one example share one prefill (`generate_many`); rows are appended once the group's decodes are
done, so a run killed in between runs that example's group again. What a row holds: rows.py; what a run is and its
checks: config.py; its examples: examples.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from ..core.policy import make_policy
from ..runtime.conversation import Conversation, TurnFormat
from ..runtime.generate import generate_many
from .config import RunConfig, find_task, task_kind
from .distributed import Launch, my_share
from .examples import Prepared, prepare
from .perplexity import teacher_forced, teacher_forced_many
from .recovery import probe_for, recovery_score
from .results_file import ResultsFile, is_number, short_hash
from .rows import FULL_FIDELITY, forced_fields, generation_fields, is_full, row_for, turn_fields
from .tasks.ppl import PerplexityTask


def run_examples(model, tokenizer, configs: list[RunConfig], item: Prepared, fidelity: bool = True) -> list[dict]:
    """The measured part of each configuration's row (everything but the identifying fields) on one example.

    The configurations differ only in method and parameters: one prefill serves them all (`generate_many`).
    """
    import torch

    task = find_task(configs[0].task)
    kind = task_kind(task)
    example = item.example
    if kind == "recovery":
        return [recovery_row(model, config, item) for config in configs]
    policies = [make_policy(config.method, **config.params) for config in configs]
    if kind == "conversation":
        return conversation_rows(model, tokenizer, configs, policies, item, task)
    if kind == "generation":
        ids = torch.tensor([item.input_ids], device=model.device)
        # Fidelity: every method but full is also fed full's answer from the same prefill; full runs unseen when
        # the group does not hold it (`reference`).
        at = next((i for i, config in enumerate(configs) if is_full(config)), None)
        order = ([] if at is None else [at]) + [i for i in range(len(configs)) if i != at]
        reference = [make_policy("full")] if fidelity and at is None else []
        methods = reference + [policies[i] for i in order]
        outs = generate_many(
            model,
            ids,
            methods=methods,
            max_new_tokens=example["max_new_tokens"],
            fidelity=fidelity and len(methods) > 1,
        )[len(reference) :]
        outs = [out for _, out in sorted(zip(order, outs), key=lambda pair: pair[0])]
        for out in outs:
            out.prefill_shared_by -= len(reference)
        rows = []
        for config, out in zip(configs, outs):
            prediction = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
            score = float(task.score(prediction, example))
            to_full = (FULL_FIDELITY if is_full(config) else out.fidelity) if fidelity else None
            rows.append(generation_fields(item, out, prediction, score, to_full))
        return rows
    forced = teacher_forced_many(model, item.input_ids, example["target_start"], policies)
    return [{**forced_fields(example, one), "score": PerplexityTask.score_losses(one.losses)} for one in forced]


def conversation_rows(model, tokenizer, configs, policies, item: Prepared, task) -> list[list[dict]]:
    """Per configuration, one row per turn: the context prefilled once for all (question-agnostic), then every
    turn's question appended and its answer decoded, in every configuration's own conversation."""
    import torch

    form = TurnFormat(tokenizer, item.prompt_form == "chat")
    context = torch.tensor([item.input_ids], device=model.device)
    conversations = Conversation.several(model, context, policies)
    rows = [[] for _ in configs]
    turns = item.example["turns"]
    for number, turn in enumerate(turns, 1):
        for per_config, conversation in zip(rows, conversations):
            previous = conversation.turns[-1].tokens if conversation.turns else []
            ids = form.question(turn["question"], number == 1, previous, turn["answer_prefix"]).to(model.device)
            asked = conversation.ask(ids, turn["max_new_tokens"])
            prediction = tokenizer.decode(asked.tokens, skip_special_tokens=True)
            per_config.append(
                turn_fields(number, turns, prediction, task.score_turn(prediction, turn), conversation, asked)
            )
    return rows


def recovery_row(model, config: RunConfig, item: Prepared) -> dict:
    policy = probe_for(config.length, config.task_options)
    forced = teacher_forced(model, item.input_ids, item.example["target_start"], policy)
    result = policy.result(forced.cache)
    return {**forced_fields(item.example, forced), "recovery": result, "score": recovery_score(result)}


@dataclasses.dataclass
class Job:
    config: RunConfig
    items: list[Prepared]


def prompt_key(config: RunConfig, item: Prepared) -> str:
    """The same for every configuration that runs this example's prompt (they differ in method and parameters)."""
    return short_hash([{**config.fields(), "method": None, "params": None}, item.example["id"]])


def example_groups(todo: list[tuple[RunConfig, Prepared]], share_prefill: int | None) -> list[list]:
    """(configuration, example) pairs grouped by prompt, at most `share_prefill` per group (None: no limit), in order
    of first appearance."""
    groups: dict[str, list] = {}
    for config, item in todo:
        groups.setdefault(prompt_key(config, item), []).append((config, item))
    size = share_prefill or len(todo) or 1
    return [group[i : i + size] for group in groups.values() for i in range(0, len(group), size)]


def run_jobs(
    model,
    tokenizer,
    jobs: list[Job],
    results: ResultsFile,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
    share_prefill: int | None = None,
    launch: Launch = Launch(),
    fidelity: bool = True,
) -> dict:
    """Run every (configuration, example) not yet in `results`; returns counts {done_before, ran}.

    The configurations of one example share one prefill (at most `share_prefill` of them, None: all; their caches
    are held together, so memory grows with the group). Rows are appended once the group's decodes are done: a
    run killed in between runs that example's group again. Under a data-parallel launch this process runs only its
    share of the examples (eval/distributed.py).
    """
    from tqdm.auto import tqdm

    if share_prefill is not None and not (is_number(share_prefill, integer=True) and share_prefill >= 1):
        raise ValueError(f"share_prefill must be an integer >= 1, got {share_prefill!r}")
    rows = [(job.config, item) for job in jobs for item in job.items]
    left = [(config, item) for config, item in rows if (config.key(), item.example["id"]) not in results.done]
    # The prompts with work left are dealt out in turn, so that every rank gets its share of what remains (ranks
    # read the same rows done before any of them runs: the command checks that they agree).
    prompts: dict[str, int] = {}
    todo = [
        (config, item)
        for config, item in left
        if my_share(prompts.setdefault(prompt_key(config, item), len(prompts)), launch)
    ]
    desc = f"rank {launch.rank}" if launch.is_distributed else "eval"
    with tqdm(total=len(todo), desc=desc, unit="ex", disable=not progress) as bar:
        for group in example_groups(todo, share_prefill):
            configs = [config for config, _ in group]
            item = group[0][1]
            bar.set_postfix_str(f"{configs[0].task} L={configs[0].length} x{len(configs)} methods", refresh=False)
            for config, measured in zip(configs, run_examples(model, tokenizer, configs, item, fidelity)):
                written = [
                    row_for(config, results.run, item, m)
                    for m in (measured if isinstance(measured, list) else [measured])
                ]
                results.append(*written)  # a conversation's turns in one write: a kill keeps all or none
                for row in written if on_row is not None else ():
                    on_row(row)
                bar.update()
    return {"done_before": len(rows) - len(left), "ran": len(todo)}


def run_eval(
    model,
    tokenizer,
    config: RunConfig,
    num_examples: int,
    out: str | os.PathLike | ResultsFile,
    progress: bool = True,
    fidelity: bool = True,
) -> dict:
    """`refreshkv eval`: one configuration; the file's `run` is the configuration key. `fidelity`: each example's
    rows also compare the method with `full` on full's answer (a second, teacher-forced cache; runtime/fidelity.py)."""
    if not isinstance(num_examples, int) or num_examples < 1:
        raise ValueError(f"num_examples must be a positive integer, got {num_examples!r}")
    config.validate(model)
    # opened before any work (refusing a foreign, busy or unwritable file); the command opens it before loading
    results = out if isinstance(out, ResultsFile) else ResultsFile(out, run=config.key())
    with results:
        items = prepare(model, tokenizer, config, num_examples)
        return run_jobs(model, tokenizer, [Job(config, items)], results, progress, fidelity=fidelity)
