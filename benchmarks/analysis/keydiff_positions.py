"""Which tokens `keydiff` keeps: the first token (the attention sink) and the newest ones, beside their attention.

Two measures on a public-domain book (data/books, its README: license), fp32, one thread:
- `prompt`: after a prefill of `--length` tokens at K = `--budget`, per layer that runs the method (Gemma's
  sliding-window layers keep their window and are left out): the rank of the first token among keydiff's scores
  (0 = the most distinctive key; kept when below K), the cosine of its key with the anchor beside the median
  token's, whether it is held, the exact attention the first decode step's query heads give it (the largest over
  the heads), and the share of that step's exact attention that the held tokens carry (`refreshkv trace`'s `mass`,
  mean over query heads); the same for the paper's order, the prompt scored block by block (`--block` tokens
  joining the held ones, the anchor the mean of the held and the new keys), on the same keys.
- `decode`: SmolLM2 decodes `--decode` tokens with `compress_every` 64 at K = `--budget` after a prefill of
  `--length`; after the last compression, the share of the 64 tokens decoded just before it that each method holds
  (mean over layers and KV heads), and of the first token.

    OMP_NUM_THREADS=1 python benchmarks/analysis/keydiff_positions.py prompt --model gemma3-270m --length 4096 \
        --budget 512
    OMP_NUM_THREADS=1 python benchmarks/analysis/keydiff_positions.py decode --length 1024 --budget 128 --decode 257
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import refreshkv  # noqa: E402
from refreshkv import make_policy  # noqa: E402
from refreshkv.measure.trace import Trace, TracedCache  # noqa: E402
from refreshkv.methods.keydiff import distinctness  # noqa: E402
from refreshkv.runtime.generate import decode, prefill  # noqa: E402
from refreshkv.runtime.generation_settings import DecodeSettings  # noqa: E402

BOOK = ROOT / "data" / "books" / "austen-emma.txt"
BOOK_OFFSET = 20_000  # characters into the book: past the front matter
EVERY = 64


def book_prompt(tokenizer, length: int) -> torch.Tensor:
    """`length` tokens of the book as plain text, with the tokenizer's own first token (Gemma's <bos>) if it adds
    one."""
    text = BOOK.read_text(encoding="utf-8")[BOOK_OFFSET : BOOK_OFFSET + 8 * length]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :length]
    if ids.shape[1] < length:
        raise SystemExit(f"{BOOK.name} gave {ids.shape[1]} tokens from its offset; need {length}")
    return ids


def held_block_by_block(keys: torch.Tensor, budget: int, block: int) -> set[int]:
    """The paper's order: each block joins the held tokens, and the `budget` most distinctive of them stay."""
    held = torch.arange(0)
    for start in range(0, keys.shape[0], block):
        joined = torch.cat([held, torch.arange(start, min(start + block, keys.shape[0]))])
        held = joined if len(joined) <= budget else joined[distinctness(keys[joined]).topk(budget).indices]
    return set(held.tolist())


def prompt_measure(args) -> None:
    model, tokenizer = refreshkv.load_model(args.model)
    ids = book_prompt(tokenizer, args.length)
    first = tokenizer.convert_ids_to_tokens(ids[0, :1].tolist())[0]
    trace = Trace([0])
    cache = TracedCache(make_policy("keydiff", budget=args.budget), model, 2, trace)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        logits, _ = prefill(model, ids, mask, cache)
        decode(model, cache, logits, mask, 2, DecodeSettings(), torch.tensor([]), None, False, False)
    layers = [layer.layer_idx for layer in cache.method_layers()]
    step = trace.steps[0]
    print(f"{args.model}, {args.length} tokens of {BOOK.name}, K = {args.budget}; first token {first!r}")
    print(
        "| layer | KV head | first token's rank (kept below K) | its cosine with the anchor (median token's) | "
        "held | held, block by block | its exact attention | attention mass held |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for j, index in enumerate(layers):
        keys = trace.keys[index][0, :, : args.length]
        for head in range(keys.shape[0]):
            scores = distinctness(keys[head])
            rank = int((scores > scores[0]).sum())
            blocks = 0 in held_block_by_block(keys[head], args.budget, args.block)
            print(
                f"| {index} | {head} | {rank} of {args.length} | {-float(scores[0]):.2f} "
                f"({-float(scores.median()):.2f}) | {'yes' if rank < args.budget else 'no'} | "
                f"{'yes' if blocks else 'no'} | {step.needle_attention[j]:.2f} | {step.mass[j]:.2f} |"
            )


def decode_measure(args) -> None:
    model, tokenizer = refreshkv.load_model("smollm2-135m")
    ids = book_prompt(tokenizer, args.length)
    names = ["keydiff", "snapkv", "streamingllm"]
    policies = [make_policy(name, budget=args.budget, compress_every=EVERY) for name in names]
    outs = refreshkv.generate_many(model, ids, methods=policies, max_new_tokens=args.decode, eos_token_id=[])
    compressed = args.length + ((args.decode - 1) // EVERY) * EVERY  # the last compression held tokens before it
    print(
        f"smollm2-135m, {args.length} tokens of {BOOK.name}, K = {args.budget}, compress_every {EVERY}, "
        f"{args.decode} decoded"
    )
    print(f"| method | share of the {EVERY} tokens decoded before the last compression held | first token held |")
    print("|---|---|---|")
    for name, out in zip(names, outs):
        newest, first = [], []
        for layer in out.cache.layers:
            kept = layer.state.kept(out.cache.pads)[0]  # (Hkv, slots), -1 empty
            newest.append(float(((kept >= compressed - EVERY) & (kept < compressed)).sum(-1).float().mean()) / EVERY)
            first.append(float((kept == 0).any(-1).float().mean()))
        print(f"| `{name}` | {sum(newest) / len(newest):.2f} | {sum(first) / len(first):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measure", choices=("prompt", "decode"))
    parser.add_argument("--model", default="smollm2-135m", help="prompt: a named model")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=512, help="K")
    parser.add_argument("--block", type=int, default=128, help="prompt: the paper's block size")
    parser.add_argument("--decode", type=int, default=257, help="decode: tokens decoded")
    args = parser.parse_args()
    torch.set_num_threads(1)
    (prompt_measure if args.measure == "prompt" else decode_measure)(args)


if __name__ == "__main__":
    main()
