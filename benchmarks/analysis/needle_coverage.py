"""What a selection keeps of the needle after prefill (issue 30, item 4): per layer and KV head, whether `refreshkv`'s
partial cache C_p holds the needle's tokens, and how much of C_p the question at the prompt's end takes.

    python benchmarks/analysis/needle_coverage.py --model smollm2-135m --length 4096 --task niah_single_2 --examples 5

For each example (RULER, built as the sweeps build it) and each pooling, one prefill at K = `--budget-ratio` x the
prompt; then, over all layers and KV heads: the share holding every token of the needle's value, the share holding
at least one, and the mean share of C_p's K slots spent on the question (the tokens from the prompt's last
"What" on: the question, the chat template's end, the answer prefix). Prints a table; the rows by layer with
`--by-layer`.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from refreshkv import PolicyCache, load_model, make_policy, with_cache
from refreshkv.eval.examples import uses_chat
from refreshkv.eval.tasks.base import encode_user_turn
from refreshkv.eval.tasks.ruler import RulerTask

POOLINGS = ("centered", "span")


def token_range(offsets, start: int, end: int) -> list[int]:
    """Token positions whose characters overlap [start, end)."""
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]


def prompt_tokens(tokenizer, example, chat: bool):
    """(ids, needle positions, first question position) of an example, tokenized as the runner does."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": example["prompt"]}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = (tokenizer.bos_token or "") + example["prompt"]
    text += example.get("answer_prefix", "")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    if ids != encode_user_turn(tokenizer, example["prompt"], example.get("answer_prefix", ""), chat):
        raise SystemExit("error: the offsets' tokenization differs from the runner's; this model is not supported")
    value = example["reference"][0] if isinstance(example["reference"], list) else example["reference"]
    found = text.find(value)
    if found < 0:
        raise SystemExit(f"error: the needle {value!r} is not in the prompt")
    question = text.rfind("What")
    needle = token_range(encoded["offset_mapping"], found, found + len(value))
    first_question = token_range(encoded["offset_mapping"], question, question + 1)[0]
    return torch.tensor([ids]), needle, first_question


def coverage(model, tokenizer, ids, needle, first_question, pooling: str, ratio: float):
    """Per layer: (share of KV heads with the whole needle, with part of it, mean share of C_p on the question)."""
    budget = max(1, int(ids.shape[1] * ratio))
    cache = PolicyCache(make_policy("refreshkv", budget=budget, pooling=pooling), model, 1, tokenizer=tokenizer)
    with torch.no_grad():
        model(ids, **with_cache(model, cache), use_cache=True)
    needle = torch.tensor(needle)
    rows = []
    for layer in cache.layers:
        state = layer.state
        if state is None or getattr(state, "partial", None) is None:
            continue
        positions = state.partial.store.positions[0]  # (Hkv, slots)
        held = (positions.unsqueeze(-1) == needle).any(1)  # (Hkv, needle tokens)
        on_question = (positions >= first_question).float().sum(-1) / budget
        rows.append((held.all(-1).float().mean().item(), held.any(-1).float().mean().item(), on_question.mean().item()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--examples", type=int, default=5)
    parser.add_argument("--budget-ratio", type=float, default=0.125)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--by-layer", action="store_true")
    args = parser.parse_args()
    if not 0 < args.budget_ratio < 1:
        raise SystemExit(f"error: --budget-ratio must be in (0, 1), got {args.budget_ratio}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    args.chat = uses_chat(tokenizer, args.chat)  # a base model (no template) gets RULER's base form, as in the sweeps
    examples = RulerTask(args.task).build(tokenizer, args.length, args.examples, seed=0, chat=args.chat)
    results = {pooling: [] for pooling in POOLINGS}
    for example in examples:
        ids, needle, first_question = prompt_tokens(tokenizer, example, args.chat)
        for pooling in POOLINGS:
            results[pooling].append(coverage(model, tokenizer, ids, needle, first_question, pooling, args.budget_ratio))
    print(
        f"{args.model}, ruler/{args.task}, {args.length} tokens, K = {args.budget_ratio:g} L, {len(examples)} examples"
    )
    print("| pooling | layer-heads holding the whole needle | holding part of it | C_p share on the question |")
    print("|---|---|---|---|")
    for pooling, per_example in results.items():
        flat = [row for rows in per_example for row in rows]
        whole, part, question = (statistics.mean(column) for column in zip(*flat))
        print(f"| {pooling} | {whole:.2f} | {part:.2f} | {question:.3f} |")
    if args.by_layer:
        for pooling, per_example in results.items():
            print(f"\n{pooling}, by layer (whole needle, part, question share):")
            for index, layer_rows in enumerate(zip(*per_example)):
                means = [statistics.mean(column) for column in zip(*layer_rows)]
                print(f"  layer {index:2d}: {means[0]:.2f} {means[1]:.2f} {means[2]:.3f}")


if __name__ == "__main__":
    main()
