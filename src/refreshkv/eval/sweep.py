"""`refreshkv sweep config.yaml`: methods x parameter grids x tasks x lengths, into one resumable JSONL file.

Schema (see docs/evaluation.md for an example):

    out: results.jsonl          # required unless --out is given; relative to the YAML file's folder, and inside
                                # it or the working directory (runtime/output_files.py)
    model: null                 # a named model (gemma3-270m), a model directory or .gguf; null = smollm2-135m
    chat: true                  # chat template where the model has one (default true)
    fidelity: true              # rows also compare each method with full on full's answer (default true)
    dtype: float32              # float32 or bfloat16
    seed: 0                     # int or list of ints
    num_examples: 10
    lengths: [2048, 4096]       # int or list
    tasks:                      # names, or {name, options, num_examples}
      - ruler/niah_single_1
      - {name: ppl, options: {paths: [book.txt], target_tokens: 256}, num_examples: 8}
    methods:                    # names, or {name, params, grid}
      - full
      - {name: refreshkv, params: {budget_ratio: 0.125}, grid: {qc_stride: [5, 10]}}

`grid` values are lists; every combination is one configuration (`params` holds the fixed ones). A task's
`num_examples` overrides the sweep's; relative `paths` in task options are read from the YAML file's folder. The
sweep's identity (`run` in every row) hashes everything except `out` and the `num_examples`, so raising them
extends a finished sweep while a changed sweep refuses the old file.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from pathlib import Path

from ..core.policy import METHODS, make_policy
from ..runtime.models import named_model
from ..runtime.output_files import lies_inside
from ..runtime.prepare import DTYPES
from .config import RunConfig, check_budget_at_length, check_task_options, find_task, model_identity
from .distributed import Launch, rank_file, sweep_files
from .recovery import RecoveryTask
from .results_file import short_hash

TOP_KEYS = ("out", "model", "chat", "dtype", "seed", "num_examples", "lengths", "tasks", "methods", "fidelity")


class SweepError(ValueError):
    """An invalid sweep file; one line naming the file and what is wrong."""


@dataclasses.dataclass
class Sweep:
    path: Path
    out: Path | None
    model: str | None
    chat: bool
    dtype: str
    seeds: list[int]
    num_examples: int
    lengths: list[int]
    tasks: list[tuple[str, dict]]
    methods: list[tuple[str, dict]]  # expanded: one entry per parameter combination
    task_examples: dict[str, int] = dataclasses.field(default_factory=dict)  # per-task num_examples, by task_key
    fidelity: bool = True  # generation rows also compare each method with full on full's answer (runtime/fidelity.py)

    def examples_for(self, task: str, options: dict) -> int:
        return self.task_examples.get(task_key(task, options), self.num_examples)

    def counts(self) -> str:
        """The examples each task runs (not part of the identity: more examples extend a sweep)."""
        return ", ".join(f"{task} x{self.examples_for(task, options)}" for task, options in self.tasks)

    def identity(self) -> str:
        # from the configurations' keys: the same sweep from another folder or checkout is the same run
        return "sweep-" + short_hash([config.key() for config in self.configs()])

    def configs(self) -> list[RunConfig]:
        """In run order: length, task, seed outermost, so the examples are built once for all methods."""
        return [
            RunConfig(
                task=task,
                method=method,
                length=length,
                seed=seed,
                params=params,
                task_options=options,
                model=model_identity(self.model),
                chat=self.chat,
                dtype=self.dtype,
            )
            for length in self.lengths
            for task, options in self.tasks
            for seed in self.seeds
            for method, params in self.methods
        ]


def _int_list(value, name: str, where: str, minimum: int) -> list[int]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
        raise SweepError(
            f"{where}: '{name}' must be an integer >= {minimum} or a non-empty list of them, got {value!r}"
        )
    return list(dict.fromkeys(values))  # a repeated value would only run the same configurations again


def _entries(
    value, name: str, where: str, inner: tuple[str, ...], counts: tuple[str, ...] = ()
) -> list[tuple[str, dict]]:
    """Entries as (name, {key: mapping for `inner`, key: int or None for `counts`})."""
    if not isinstance(value, list) or not value:
        raise SweepError(f"{where}: '{name}' must be a non-empty list")
    entries = []
    for i, entry in enumerate(value, 1):
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise SweepError(f"{where}: {name} entry {i} must be a name or a mapping with 'name'")
        unknown = sorted(set(entry) - {"name", *inner, *counts})
        if unknown:
            raise SweepError(
                f"{where}: {name} entry {i} ({entry['name']}) has unknown key(s) {', '.join(unknown)}; "
                f"allowed: name, {', '.join(inner + counts)}"
            )
        for key in inner:
            if entry.get(key) is not None and not isinstance(entry[key], dict):
                raise SweepError(f"{where}: {name} entry {i} ({entry['name']}): '{key}' must be a mapping")
        for key in counts:
            count = entry.get(key)
            if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
                raise SweepError(
                    f"{where}: {name} entry {i} ({entry['name']}): '{key}' must be an integer >= 1, got {count!r}"
                )
        parts = {key: dict(entry.get(key) or {}) for key in inner}
        entries.append((entry["name"], {**parts, **{key: entry.get(key) for key in counts}}))
    return entries


def task_key(task: str, options: dict) -> str:
    """The same for a task's options as written and as a RunConfig pins them (ppl: absolute paths and hashes)."""
    resolve = getattr(find_task(task), "resolve_options", None)
    return short_hash([task, resolve(options) if resolve is not None else options])


def _beside(options: dict, folder: Path) -> dict:
    """Task options with relative file paths (`paths`) taken from the sweep file's folder, like `out` and `model`."""
    if "paths" not in options:
        return options
    paths = options["paths"]
    resolve = lambda p: str(folder / p) if isinstance(p, str) and not Path(p).is_absolute() else p  # noqa: E731
    return {**options, "paths": [resolve(p) for p in paths] if isinstance(paths, list) else resolve(paths)}


MAX_CONFIGURATIONS = 10_000  # a sweep's configurations are all checked and listed before the first row runs


def _unique_keys_loader():
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one silently)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' is given twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeys


def load_sweep(path: str | Path, out: str | Path | None = None, model: str | None = None) -> Sweep:
    """Read and validate a sweep file (every error is one line starting with the file name).

    `out` and `model` (from the command line, relative to the working folder) replace the file's.
    """
    import yaml

    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise SweepError(f"sweep file {path} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_keys_loader())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise SweepError(f"{where}{line}: not valid YAML ({getattr(error, 'problem', None) or error})") from None
    if not isinstance(data, dict):
        raise SweepError(f"{where}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise SweepError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(TOP_KEYS)}")
    for key in ("lengths", "tasks", "methods"):
        if key not in data:
            raise SweepError(f"{where}: missing required key '{key}'")

    out_path = out if out is not None else data.get("out")
    if out_path is None:
        raise SweepError(f"{where}: no output file: set 'out' in the file or pass --out")
    if not isinstance(out_path, (str, Path)):
        raise SweepError(f"{where}: 'out' must be a file path, got {out_path!r}")
    out_path = Path(out_path) if out is not None else path.parent / out_path
    if out is None and not lies_inside(out_path, [path.parent, Path.cwd()]):  # a YAML cannot send rows elsewhere
        raise SweepError(
            f"{where}: 'out' {data['out']} lies outside the sweep file's folder and the working directory; "
            "give --out on the command line to write elsewhere"
        )
    if model is None:
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise SweepError(f"{where}: 'model' must be a path or null, got {model!r}")
        if model is not None and not Path(model).is_absolute() and not named_model(model):
            model = str(path.parent / model)
    chat = data.get("chat", True)
    if not isinstance(chat, bool):
        raise SweepError(f"{where}: 'chat' must be true or false, got {chat!r}")
    fidelity = data.get("fidelity", True)
    if not isinstance(fidelity, bool):
        raise SweepError(f"{where}: 'fidelity' must be true or false, got {fidelity!r}")
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise SweepError(f"{where}: unknown dtype {dtype!r}; choose from: {', '.join(DTYPES)}")
    seeds = _int_list(data.get("seed", 0), "seed", where, 0)
    num_examples = data.get("num_examples", 10)
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples < 1:
        raise SweepError(f"{where}: 'num_examples' must be an integer >= 1, got {num_examples!r}")
    lengths = _int_list(data["lengths"], "lengths", where, 1)

    tasks, task_examples = [], {}
    for name, parts in _entries(data["tasks"], "tasks", where, ("options",), counts=("num_examples",)):
        options = _beside(parts["options"], path.parent)
        try:
            find_task(name)
            check_task_options(name, options)
            if parts["num_examples"] is not None:
                task_examples[task_key(name, options)] = parts["num_examples"]
        except ValueError as error:
            raise SweepError(f"{where}: {error}") from None
        if (name, options) not in tasks:
            tasks.append((name, options))

    methods = []
    entries = _entries(data["methods"], "methods", where, ("params", "grid"))
    for name, parts in entries:
        for key, values in parts["grid"].items():
            if not isinstance(values, list) or not values:
                raise SweepError(f"{where}: method {name}: grid '{key}' must be a non-empty list, got {values!r}")
    size = len(lengths) * len(tasks) * len(seeds) * sum(math.prod(map(len, p["grid"].values())) for _, p in entries)
    if size > MAX_CONFIGURATIONS:
        raise SweepError(
            f"{where}: {size:,} configurations (lengths x tasks x seeds x method grids); at most "
            f"{MAX_CONFIGURATIONS:,} per sweep file: split it or shorten the grids"
        )
    for name, parts in entries:
        grid = parts["grid"]
        overlap = sorted(set(grid) & set(parts["params"]))
        if overlap:
            raise SweepError(f"{where}: method {name}: {', '.join(overlap)} is both in params and grid")
        for combination in itertools.product(*grid.values()):
            params = {**parts["params"], **dict(zip(grid, combination))}
            try:
                policy = make_policy(name, **params)
                for length in lengths:
                    check_budget_at_length(policy, length)
            except ValueError as error:
                raise SweepError(f"{where}: {error}") from None
            if (name, params) not in methods:
                methods.append((name, params))
    if any(isinstance(find_task(t), RecoveryTask) for t, _ in tasks) and any(m != "full" for m, _ in methods):
        raise SweepError(f"{where}: task 'recovery' measures attention under 'full' only; put it in its own sweep")
    return Sweep(
        path, out_path, model, chat, dtype, seeds, num_examples, lengths, tasks, methods, task_examples, fidelity
    )


def open_results(sweep: Sweep, launch: Launch = Launch()):
    """This process's results file (a rank file under a data-parallel launch), knowing the rows of the others."""
    from .results_file import ResultsFile

    results = ResultsFile(rank_file(sweep.out, launch), run=sweep.identity())
    try:
        results.include_done(sweep_files(sweep.out))
    except BaseException:
        results.close()
        raise
    return results


def run_sweep(
    sweep: Sweep,
    model,
    tokenizer,
    progress: bool = True,
    results=None,
    share_prefill: int | None = None,
    launch: Launch = Launch(),
) -> dict:
    """Run (or resume) a sweep with a loaded model; examples are built and checked before anything is run.

    `results`: the sweep's ResultsFile when the caller opened it already (the command does, before loading the model).
    `share_prefill`: at most this many configurations per shared prefill (None: every method of an example).
    """
    from .examples import prepare
    from .runner import Job, run_jobs

    configs = sweep.configs()
    for config in configs:
        config.validate(model)
    alone = sorted({name for name, _ in sweep.methods if not METHODS[name].shares_prefill})
    if alone:
        print(f"note: {', '.join(alone)} compute(s) their own prefill and run alone on each example", file=sys.stderr)
    with results or open_results(sweep, launch) as results:
        built: dict[str, list] = {}
        jobs = []
        for config in configs:
            shared = short_hash([config.task, config.task_options, config.length, config.seed])
            if shared not in built:
                built[shared] = prepare(model, tokenizer, config, sweep.examples_for(config.task, config.task_options))
            jobs.append(Job(config, built[shared]))
        return run_jobs(
            model,
            tokenizer,
            jobs,
            results,
            progress,
            share_prefill=share_prefill,
            launch=launch,
            fidelity=sweep.fidelity,
        )
