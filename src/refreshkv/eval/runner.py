"""Run one configuration (task x method x parameters x length x seed) over examples, appending to a JSONL file.

One row per example, written as one whole line with a single `write` on a file opened in append mode, then fsync'd:
a run killed at any moment loses at most the example in flight. Rows are keyed by `config` (a hash of the
configuration, see `RunConfig.key`) and the example `id`; re-running skips the keys already in the file.

Every row also carries `run`, the identity of what wrote the file (`refreshkv eval`: the configuration key;
`refreshkv sweep`: the sweep's key). A file whose rows have another `run` is refused before anything is written.

Torn last line: a row counts only once its newline is written. A final line without a newline (a write cut short,
e.g. by a full disk or a crash of the machine) is ignored when reading and cut off before the next row is appended,
so the example is simply run again. A complete line that is not a JSON object is an error naming file and line.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import inspect
import json
import math
import os
import sys
import time
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

from ..core.policy import BUILT_IN, PROVIDERS, make_policy
from ..measure.budget_report import budget_report
from ..runtime.conversation import Conversation, TurnFormat
from ..runtime.generate import check_length, generate_many
from ..runtime.models import DEFAULT_MODEL, NAMED_MODELS
from ..runtime.output_files import refuse_link
from .distributed import Launch, my_share
from .perplexity import teacher_forced, teacher_forced_many
from .recovery import RecoveryTask, probe_for, recovery_score
from .tasks import TASKS, get_task
from .tasks.base import encode_user_turn
from .tasks.multi_turn import MultiTurnTask
from .tasks.ppl import PerplexityTask

EMBEDDED_MODEL = NAMED_MODELS[DEFAULT_MODEL].identity
EXTRA_TASKS = {"recovery": RecoveryTask()}
TEACHER_FORCED = ("ppl", "recovery")


class ResultsError(ValueError):
    """A results file that cannot be read or does not belong to this run (one line: file, line, what)."""


def all_tasks() -> dict:
    return {**TASKS, **EXTRA_TASKS}


def find_task(name: str):
    if name in EXTRA_TASKS:
        return EXTRA_TASKS[name]
    try:
        return get_task(name)
    except ValueError:
        raise ValueError(f"unknown task '{name}'; choose from: {', '.join(all_tasks())}") from None


def task_kind(task) -> str:
    if isinstance(task, RecoveryTask):
        return "recovery"
    if isinstance(task, PerplexityTask):
        return "ppl"
    if isinstance(task, MultiTurnTask):
        return "conversation"
    return "generation"


def check_task_options(name: str, options: dict) -> None:
    task = find_task(name)
    fixed = {"self", "tokenizer", "length", "num_examples", "seed", "chat"}  # chat: from the run, see `prepare`
    allowed = [p for p in inspect.signature(task.build).parameters if p not in fixed]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"task '{name}' has no option {', '.join(unknown)}; its options: {', '.join(allowed) or 'none'}"
        )
    hints = typing.get_type_hints(task.build)
    for option, value in options.items():
        kinds = typing.get_args(hints.get(option)) or (hints.get(option),)
        expected = next((kind for kind in (int, float) if kind in kinds), None)
        if expected is None or (value is None and type(None) in kinds):
            continue
        if not (is_number(value, integer=expected is int) and math.isfinite(value)):
            raise ValueError(
                f"task '{name}': option {option} must be {'an integer' if expected is int else 'a number'}, "
                f"got {value!r}"
            )
    check_values = getattr(task, "check_options", None)  # a task's own rules for its values (ppl: target_tokens)
    if check_values is not None:
        check_values(options)


def is_number(value, integer: bool = False) -> bool:
    """An int (or, unless `integer`, a float), but not a bool: JSON, YAML and true/false on the command line."""
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


def model_identity(path: str | os.PathLike | None) -> str:
    """What rows record as the model: a named model's identity (the default's when None), or the resolved path."""
    named = (
        NAMED_MODELS[DEFAULT_MODEL if path is None else str(path)]
        if path is None or str(path) in NAMED_MODELS
        else None
    )
    return named.identity if named else str(Path(path).resolve())


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def short_hash(value) -> str:
    return hashlib.sha256(canonical(value).encode()).hexdigest()[:16]


def check_budget_at_length(policy, length: int) -> None:
    """The method's budget at `length` tokens, checked before any model loads: one the method can use (`budget_for`
    refuses, e.g., a budget_ratio whose K cannot hold snapkv's window; prompts have at most `length` tokens, so what
    is refused here would be on every example), and below the length: a budget of `length` tokens or more keeps
    every token, and the row would be `full`'s under another name (a frontier point that measures nothing)."""
    policy.budget_for(length)
    budget = getattr(policy, "budget", None)
    if budget is not None and budget >= length:
        raise ValueError(
            f"method {policy.name}: budget {budget} is not below the length {length} (it would keep every token, "
            "as full does); give a smaller budget or a budget_ratio"
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What determines a row's result (the number of examples does not: more examples extend a run)."""

    task: str
    method: str
    length: int
    seed: int = 0
    params: dict = dataclasses.field(default_factory=dict)
    task_options: dict = dataclasses.field(default_factory=dict)
    model: str = EMBEDDED_MODEL
    chat: bool = True
    dtype: str = "float32"

    def __post_init__(self):
        # a task whose options name outside state (ppl: files) pins it, so that the key identifies what was run
        resolve = getattr(all_tasks().get(self.task), "resolve_options", None)
        if resolve is not None:
            object.__setattr__(self, "task_options", resolve(self.task_options))

    def fields(self) -> dict:
        """What the key and the rows record (a task may record its options without machine-specific parts)."""
        record = getattr(all_tasks().get(self.task), "recorded_options", None)
        fields = dataclasses.asdict(self)
        return fields if record is None else {**fields, "task_options": record(self.task_options)}

    def key(self) -> str:
        return short_hash(self.fields())

    def label(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.task} {self.method}{f'({params})' if params else ''} L={self.length}"

    def validate(self, model=None) -> None:
        """Everything that can be checked without the tokenizer: task, options, method, parameters, length."""
        task = find_task(self.task)
        check_task_options(self.task, self.task_options)
        check_budget_at_length(make_policy(self.method, **self.params), self.length)
        if task_kind(task) == "recovery" and self.method != "full":
            raise ValueError(f"task 'recovery' measures attention under 'full', got method '{self.method}'")
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 1:
            raise ValueError(f"length must be a positive integer, got {self.length!r}")
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if limit is not None and self.length >= limit:
            raise ValueError(f"length {self.length} exceeds the model's context of {limit} tokens")


# ---- examples --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prepared:
    example: dict
    input_ids: list[int]
    prompt_form: str = "chat"  # "chat": the model's chat template; "base": the task's text and answer prefix


def uses_chat(tokenizer, requested: bool) -> bool:
    """Prompts are chat-templated when the run asks for it and the model has a template; a base model (no
    template, e.g. Gemma 3 270M) gets the task's base form, as RULER prompts base models."""
    return requested and getattr(tokenizer, "chat_template", None) is not None


def encode_prompt(tokenizer, example: dict, chat: bool) -> list[int]:
    """The chat-templated user message (or the raw prompt) followed by the example's answer prefix."""
    return encode_user_turn(tokenizer, example["prompt"], example.get("answer_prefix", "") or "", chat)


def prepare(model, tokenizer, config: RunConfig, num_examples: int) -> list[Prepared]:
    """Build and encode the examples, checking that every one fits the model, before anything is run."""
    config.validate(model)
    task = find_task(config.task)
    options = dict(config.task_options)
    chat = uses_chat(tokenizer, config.chat)
    if "chat" in inspect.signature(task.build).parameters:  # its length budget counts the chat template
        options["chat"] = chat
    examples = task.build(tokenizer, config.length, num_examples, config.seed, **options)
    prepared = []
    for example in examples:
        if task_kind(task) == "generation":
            ids = encode_prompt(tokenizer, example, chat)
            check_length(model, len(ids), example["max_new_tokens"])
        elif task_kind(task) == "conversation":
            form = TurnFormat(tokenizer, chat)
            ids = form.context(example["prompt"])[0].tolist()
            total = len(ids) + sum(
                form.question(turn["question"], i == 0, answer_prefix=turn["answer_prefix"]).shape[1]
                + turn["max_new_tokens"]
                + 1
                for i, turn in enumerate(example["turns"])
            )
            limit = model.config.max_position_embeddings
            if total > limit:
                raise ValueError(
                    f"task '{config.task}': a conversation of {total} tokens (context, questions and "
                    f"answers) exceeds the model's context of {limit} tokens; give a smaller length"
                )
        else:
            ids = list(example["input_ids"])
            check_length(model, example["target_start"], len(ids) - example["target_start"])  # as `generate` checks
        prepared.append(Prepared(example, ids, "chat" if chat else "base"))
    return prepared


# ---- running one example ---------------------------------------------------------------------------------------


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
            rows.append(
                {
                    "prediction": prediction,
                    "reference": example["reference"],
                    "score": float(task.score(prediction, example)),
                    "prompt_tokens": len(item.input_ids),
                    "new_tokens": len(out.tokens[0]),
                    **timing_fields(out),
                    **cache_fields(out.cache),
                    **((FULL_FIDELITY if is_full(config) else out.fidelity) if fidelity else {}),
                }
            )
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
                {
                    "turn": number,
                    "turns": len(turns),
                    "prediction": prediction,
                    "reference": turn["reference"],
                    "score": task.score_turn(prediction, turn),
                    "prompt_tokens": conversation.tokens_held,
                    "question_tokens": asked.question_tokens,
                    "new_tokens": len(asked.tokens),
                    "prefill_s": round(conversation.context_prefill_s, 4),
                    "time_to_first_token_s": round(asked.time_to_first_token_s, 4),
                    "decode_ms_per_token": round(asked.decode_ms_per_token, 3),
                    "kv_bytes_full": asked.kv_bytes_held,
                    "kv_bytes_attended_mean": round(asked.kv_bytes_read_per_step),
                }
            )
    return rows


FULL_FIDELITY = {"kl_to_full": 0.0, "top1_agreement": 1.0, "first_divergence": None}  # full against itself


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


def recovery_row(model, config: RunConfig, item: Prepared) -> dict:
    policy = probe_for(config.length, config.task_options)
    forced = teacher_forced(model, item.input_ids, item.example["target_start"], policy)
    result = policy.result(forced.cache)
    return {**forced_fields(item.example, forced), "recovery": result, "score": recovery_score(result)}


# ---- the results file ------------------------------------------------------------------------------------------

REQUIRED = ("run", "config", "id")


def read_results(
    path: str | os.PathLike, required: Iterable[str] = REQUIRED, warn: bool = True, numbers: Iterable[str] = ()
):
    """(rows, bytes of complete lines, whether a torn last line was found). Malformed rows raise ResultsError.

    `numbers`: fields that must hold a number (or null) where a row has them.
    """
    path = Path(path)
    if not path.exists():
        return [], 0, False
    if not path.is_file():
        raise ResultsError(f"{path} is not a file")
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    torn = bool(data[end:].strip())
    if torn:
        _refuse_a_complete_non_row(path, data[end:], data[:end].count(b"\n") + 1)
    rows = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ResultsError(f"{path}:{number}: malformed JSONL row ({error})") from None
        if not isinstance(row, dict):
            raise ResultsError(f"{path}:{number}: malformed JSONL row (not a JSON object)")
        missing = [name for name in required if name not in row]
        if missing:
            raise ResultsError(f"{path}:{number}: row lacks the field(s) {', '.join(missing)}")
        for name in numbers:
            if row.get(name) is not None and not is_number(row[name]):
                raise ResultsError(f"{path}:{number}: field {name} must be a number, got {row[name]!r}")
        rows.append(row)
    if torn and warn:
        print(f"warning: {path}:{len(rows) + 1}: ignoring an incomplete last line (a cut-short write)", file=sys.stderr)
    return rows, end, torn


JSON_KINDS = {list: "array", str: "string", bool: "boolean", type(None): "null"}


def _refuse_a_complete_non_row(path: Path, tail: bytes, number: int) -> None:
    """A last line without its newline is a cut-short write, unless it is complete JSON that is no row (a JSON array
    or a pretty-printed object written by something else): that is refused, naming its line."""
    try:
        value = json.loads(tail)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    if not isinstance(value, dict):
        raise ResultsError(
            f"{path}:{number}: malformed JSONL row (a JSON {JSON_KINDS.get(type(value), 'number')}, not an object); a "
            "results file holds one JSON object per line"
        )


def done_key(row: dict) -> tuple:
    """What a row marks done: its configuration and example (a conversation's turns share their example)."""
    return row["config"], row.get("conversation", row["id"])


class ResultsFile:
    """The JSONL output of one run, locked from opening to closing: the rows already done, and whole-line appends.

    The file is opened (created if missing) and locked before it is read, so `done` stays what the file holds until
    `close`: a second run on the same file is refused instead of repeating rows, and the torn tail cut before the
    first append is the one read here. Opening first also refuses an unwritable path before any work is done; a file
    this run created and never wrote to is removed again on close. A symbolic link is refused, never followed
    (runtime/output_files.py).
    """

    def __init__(self, path: str | os.PathLike, run: str):
        self.path = Path(path)
        self.run = run
        self._fd, self._created = self._open_locked()
        try:
            rows, self._end, self._torn = read_results(self.path)
            self.done = self._done_in(self.path, rows)
        except BaseException:
            self.close()
            raise

    def _done_in(self, path: Path, rows: list[dict]) -> set[tuple]:
        """The (config, id) keys of `rows`, refusing a file that holds rows of another run."""
        others = sorted({str(row["run"]) for row in rows if row["run"] != self.run})
        if others:
            raise ResultsError(
                f"{path} holds results of another configuration (run {others[0]}, this run is {self.run}); "
                "choose another output file, nothing was written"
            )
        return {done_key(row) for row in rows}

    def include_done(self, paths: Iterable[Path]) -> None:
        """Count the rows of other files of this run (a sweep's rank files) as done; they are read, never written."""
        for path in paths:
            if path != self.path:
                self.done |= self._done_in(path, read_results(path, warn=False)[0])

    def _open_locked(self) -> tuple[int, bool]:
        """(descriptor holding the lock, whether this run created the file)."""
        refuse_link(self.path, "results file")
        append = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW  # a link made after the check is not followed either
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    fd, created = os.open(self.path, append | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    fd, created = os.open(self.path, append), False
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise ResultsError(f"{self.path} is being written by another run") from None
                if self._is_current(fd):
                    return fd, created
                os.close(fd)  # removed by a run that wrote nothing, between our open and our lock: open it afresh
        except OSError as error:
            raise ResultsError(
                f"cannot write {self.path} ({error.strerror or error}); choose another output file"
            ) from None

    def _is_current(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def append(self, *rows: dict) -> None:
        """Whole lines at the end of the file, in one write (a conversation's turns land together or not at all)."""
        if self._torn:  # cut the torn tail read under this lock, so that the next row starts on its own line
            os.ftruncate(self._fd, self._end)
            self._torn = False
        data = "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows).encode()
        written = os.write(self._fd, data)  # O_APPEND: one write of the whole lines at the end of the file
        if written != len(data):
            raise OSError(f"short write to {self.path} ({written} of {len(data)} bytes)")
        os.fsync(self._fd)
        self.done.update(done_key(row) for row in rows)

    def close(self) -> None:
        if self._fd is None:
            return
        if self._created and os.fstat(self._fd).st_size == 0:
            self.path.unlink(missing_ok=True)  # still locked: a run that failed before its first row leaves no file
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- runs ------------------------------------------------------------------------------------------------------


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
