"""How far bfloat16 decoding lands from float32 with each decode-attention path (SDPA's kernel, or the explicit
path of `decode_attention`, which rounds logits and probabilities to bfloat16 as transformers' eager attention
does): the embedded model, `full`, a 4K prompt of the bench's text, 16 steps teacher-forced on float32's greedy
tokens; per step the largest logit difference and KL(float32 || bfloat16) of the next-token distributions.

    python benchmarks/experiments/decode_attention_accuracy.py --threads 2

Question it answered (commit f201b46, AMD EPYC with avx512_bf16): in bfloat16, does the explicit path land farther
from float32 than SDPA's kernel? Answer: no, closer (mean largest logit difference 0.325 against 0.377, mean KL
0.00067 against 0.00102); docs/benchmark.md, "One query over a long cache".
"""

import argparse

import torch

from refreshkv import generate, load_model
from refreshkv.core import attention_math
from refreshkv.measure.bench import bench_prompt

STEPS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference_model, tokenizer = load_model(dtype=torch.float32)
    ids = bench_prompt(tokenizer, args.length)
    reference = generate(reference_model, ids, method="full", max_new_tokens=STEPS, eos_token_id=[], return_logits=True)
    del reference_model
    model, _ = load_model(dtype=torch.bfloat16)
    forced = torch.tensor([reference.tokens[0]])
    print("| bfloat16 decode attention | mean of max abs logit difference | mean KL(float32 || bfloat16) |")
    print("|---|---|---|")
    for name, threshold in (("SDPA", ids.shape[1] + STEPS + 1), ("explicit", 0)):
        attention_math.EXPLICIT_DECODE_FROM = threshold
        out = generate(model, ids, method="full", forced_tokens=forced, return_logits=True)
        differences, divergences = [], []
        for low, high in zip(out.logits[1:], reference.logits[1:]):  # the first logits come from the prefill
            differences.append((low.float() - high).abs().max().item())
            log_low, log_high = low.float().log_softmax(-1), high.log_softmax(-1)
            divergences.append((log_high.exp() * (log_high - log_low)).sum().item())
        print(f"| {name} | {sum(differences) / len(differences):.3f} | {sum(divergences) / len(divergences):.5f} |")


if __name__ == "__main__":
    main()
