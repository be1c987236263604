"""lm-evaluation-harness's model type `refreshkv`: any lm-eval task under any registered KV method.

`--model_args`: `model` (a named model such as `smollm2-135m`, a model folder or a .gguf file: runtime/loading.py),
`method` (any name in the method registry, plugins included; default `full`), `preset` and the method's own
parameters (`budget`, `budget_ratio`, `window`, ...; `make_policy` checks them), `dtype` (float32 or bfloat16),
`threads` (CPU threads), `device`, `target_tokens` (loglikelihood_rolling: the tokens scored under the method per
window, 256 as in ppl) and lm-eval's own `batch_size` / `max_batch_size`.

How each request type meets the method:
- `generate_until`: the context is the prompt (prefilled), the answer is decoded under the method
  (runtime/generate.py), greedy unless the task asks to sample, stopping at the end-of-sequence token or after
  `max_gen_toks`; a stop sequence that is one token also ends the loop, the text is cut at the first stop sequence.
- `loglikelihood` (and multiple choice): the context is prefilled under the method, and the continuation is fed
  one decode step at a time (teacher forcing, eval/perplexity.py), so the method selects or evicts as it does while
  answering. The method's "question" is the end of the context (the last `window` tokens, for methods that observe
  one). Continuations of one context share its prefill (one decode row each).
- `loglikelihood_rolling`: lm-eval's rolling windows of the model's context length; in each, the last
  `target_tokens` tokens are teacher-forced under the method after a prefill of everything before them (ppl's
  window) and the tokens before are scored by an ordinary forward, which is what a method that shares its prefill
  computes (`shares_prefill`: every built-in one; a plugin that computes its own prefill would differ there).

Requests run one context at a time, whatever `batch_size` says: a batch's budget follows its longest prompt
(`BudgetPolicy`), so batching rows of different lengths would change each example's K.
"""

from __future__ import annotations

import math

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from ..core.policy import METHODS, PolicyError, accepted_parameters, check_budget_fits, check_positive, make_policy
from ..eval.perplexity import continuation_losses, plain_losses, teacher_forced
from ..runtime.generate import generate
from ..runtime.loading import load_model
from ..runtime.models import named_context

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# what model_args may hold besides the method's parameters
MODEL_ARGS = (
    "model",
    "method",
    "preset",
    "dtype",
    "threads",
    "device",
    "target_tokens",
    "batch_size",
    "max_batch_size",
)
# generation keywords of lm-eval's tasks that the decode loop honours
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


class ModelArgsError(ValueError):
    """A model argument that cannot be used; the message is one line naming what is allowed."""


def budget_fits(policy, context: int | None) -> None:
    """The package's one budget rule (`check_budget_fits`), as a model argument's error."""
    try:
        check_budget_fits(policy, context)
    except PolicyError as error:
        raise ModelArgsError(str(error)) from None


@register_model("refreshkv")
class RefreshKVLM(TemplateLM):
    max_gen_toks = 256  # lm-eval's default answer length when a task gives none

    def __init__(
        self,
        model: str = "smollm2-135m",
        method: str = "full",
        preset: str | None = None,
        dtype: str = "float32",
        threads: int | None = None,
        device: str | None = None,
        target_tokens: int = 256,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **params,
    ):
        super().__init__()
        self.policy = method_of(method, preset, params)
        if dtype not in DTYPES:
            raise ModelArgsError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        check_positive("threads", threads, allow_none=True)
        check_positive("target_tokens", target_tokens)
        if threads is not None:
            torch.set_num_threads(threads)
        self.target_tokens = target_tokens
        budget_fits(self.policy, named_context(str(model)))  # a named model's context: before it loads
        self.model, self.tokenizer = load_model(str(model), DTYPES[dtype], device_of(device))
        self.max_length = int(self.model.config.max_position_embeddings)
        budget_fits(self.policy, self.max_length)

    # ---- what lm-eval reads of a model ----

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced with: BOS where the tokenizer has one, else EOS (as lm-eval's hf)."""
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's own special tokens unless told otherwise; none for a string that already starts with the
        prefix token's text (a chat-templated prompt)."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tokenizer.decode([self.prefix_token_id]))
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    # ---- the three request types ----

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in tqdm(requests, desc=f"{self.policy.name}: generate_until", disable=disable_tqdm):
            context, gen_kwargs = request.args
            answer = self.answer(context, dict(gen_kwargs))
            self.cache_hook.add_partial("generate_until", request.args, answer)
            answers.append(answer)
        return answers

    def answer(self, context: str, gen_kwargs: dict) -> str:
        """The context prefilled, the answer decoded under the method and cut at the first stop sequence."""
        unknown = sorted(set(gen_kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ModelArgsError(
                f"generation keyword {', '.join(unknown)} is not supported; supported: {', '.join(GENERATION_KEYS)}"
            )
        until = handle_stop_sequences(gen_kwargs.pop("until", None), eos=self.tokenizer.decode([self.eot_token_id]))
        new_tokens = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        sampling = {"do_sample": True, **gen_kwargs} if gen_kwargs.get("do_sample") else {}
        ids = self.tok_encode(context)[-(self.max_length - new_tokens) :]  # left-truncated, as lm-eval's hf
        out = generate(
            self.model,
            torch.tensor([ids], device=self.model.device),
            method=self.policy,
            max_new_tokens=new_tokens,
            eos_token_id=self.stop_ids(until),
            **sampling,
        )
        text = self.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def stop_ids(self, until: list[str]) -> list[int]:
        """The model's end-of-sequence tokens and every stop sequence that is a single token."""
        eos = self.model.generation_config.eos_token_id
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        for stop in until:
            tokens = self.tokenizer.encode(stop, add_special_tokens=False)
            if len(tokens) == 1 and tokens[0] not in ids:
                ids.append(tokens[0])
        return ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        by_context: dict[tuple[int, ...], list[int]] = {}  # context tokens -> the requests that continue it
        for index, (_, context, _) in enumerate(requests):
            by_context.setdefault(tuple(context), []).append(index)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for context, indices in tqdm(
            by_context.items(), desc=f"{self.policy.name}: loglikelihood", disable=disable_tqdm
        ):
            continuations = [requests[i][2] for i in indices]
            longest = max(len(tokens) for tokens in continuations)
            kept = list(context)[-(self.max_length - longest) :]  # left-truncated, as lm-eval's hf
            for index, (losses, greedy) in zip(
                indices, continuation_losses(self.model, kept, continuations, self.policy)
            ):
                results[index] = (-math.fsum(losses), all(greedy))
                self.cache_hook.add_partial("loglikelihood", requests[index][0], results[index])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in tqdm(requests, desc=f"{self.policy.name}: loglikelihood_rolling", disable=disable_tqdm):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            total = math.fsum(self.window_loglikelihood(*make_disjoint_window(w)) for w in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    def window_loglikelihood(self, context: list[int], predicted: list[int]) -> float:
        """Log-likelihood of `predicted` after `context`: its last `target_tokens` tokens under the method after a
        prefill of all before them, the tokens before those by an ordinary forward (a shared prefill's output)."""
        ids = context + predicted
        split = max(len(context), len(ids) - self.target_tokens)
        losses = plain_losses(self.model, ids[:split], len(context)) if split > len(context) else []
        losses += teacher_forced(self.model, ids, split, self.policy).losses
        return -math.fsum(losses)


def method_of(method: str, preset: str | None, params: dict):
    """The method object for model_args; an unknown argument names what model_args and the method accept."""
    if method not in METHODS:
        raise ModelArgsError(f"unknown method '{method}'; choose from: {', '.join(sorted(METHODS))}")
    accepted = accepted_parameters(METHODS[method]) - {"preset"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ModelArgsError(
            f"unknown model_args {', '.join(unknown)}; give {', '.join(MODEL_ARGS)} or a parameter of method "
            f"'{method}': {', '.join(sorted(accepted)) or 'none'}"
        )
    try:
        return make_policy(method, preset=preset, **params)
    except PolicyError as error:
        raise ModelArgsError(str(error)) from None


def device_of(device: str | None) -> str:
    """lm-eval's command line gives `cuda:0` unless told otherwise: the CPU stands in where no GPU is present."""
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
