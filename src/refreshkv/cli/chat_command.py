"""`refreshkv chat`: questions about one document, answered from one prefilled cache (runtime/conversation.py).

Interactive by default (a `> ` prompt with line editing and history; an empty line is ignored, Ctrl-C or Ctrl-D
ends the conversation); `--questions FILE` (one question per line) runs without a prompt and writes one JSONL row
per turn and method (`--out`, default standard output; a new file, made before the model loads, so that a path that
exists, is a link or cannot be created is refused first).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..runtime.output_files import new_text_file
from ..runtime.prepare import check_runtime, load_checked
from .options import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    method_options,
    read_prompt,
)


def read_questions(path: Path) -> list[str]:
    """The non-empty lines of a UTF-8 file; refused in one line if unreadable or without any question."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except IsADirectoryError:
        raise ValueError(
            f"questions file '{path}' is a directory; give a UTF-8 text file, one question a line"
        ) from None
    except FileNotFoundError:
        raise ValueError(f"questions file '{path}' does not exist") from None
    except (UnicodeDecodeError, OSError) as error:
        raise ValueError(f"questions file '{path}' cannot be read as UTF-8 text ({error})") from None
    questions = [line.strip() for line in lines if line.strip()]
    if not questions:
        raise ValueError(f"questions file '{path}' holds no question (one per line)")
    return questions


def interactive_questions():
    """Lines typed at a `> ` prompt, with line editing and history, until Ctrl-D or Ctrl-C."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line.strip():
            yield line.strip()


def register(app, user_errors) -> None:
    """Add `chat` to the CLI app; `user_errors` turns ValueErrors into one line and exit code 2."""

    @app.command("chat")
    @user_errors
    @method_options("budget", "budget_ratio", "preset", "param")
    def chat_command(
        prompt_file: Annotated[Path, typer.Option(help="UTF-8 file holding the document the questions are about.")],
        method: Annotated[
            list[str], typer.Option("--method", help="KV method (repeatable: every method answers every question).")
        ] = ["refreshkv"],
        params: Optional[dict] = None,  # the method options (`method_options`)
        questions: Annotated[
            Optional[Path], typer.Option(help="Ask these questions (one per line) instead of prompting.")
        ] = None,
        out: Annotated[Optional[Path], typer.Option(help="With --questions: write the JSONL rows here.")] = None,
        max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer at most.")] = 64,
        question_aware: Annotated[
            bool, typer.Option(help="Prefill the first question with the document (default: the document alone).")
        ] = False,
        drop_answers: Annotated[
            bool, typer.Option(help="Forget each answer before the next question (methods that can forget).")
        ] = False,
        model: ModelOpt = None,
        dtype: DtypeOpt = "float32",
        device: DeviceOpt = "cpu",
    ):
        """Ask questions about a document, answered from one prefilled cache per method (no re-prefill per turn)."""
        from ..core.policy import METHODS, accepted_parameters, make_policy
        from ..runtime.conversation import Conversation, TurnFormat, check_can_forget
        from ..runtime.generate import check_length

        params = params or {}
        for name in method:
            make_policy(name)  # an unknown name: one line naming the methods
            if method.count(name) > 1:
                raise ValueError(f"--method {name} is given {method.count(name)} times; give each method once")
        unused = sorted(k for k in params if not any(k in accepted_parameters(METHODS[name]) for name in method))
        if unused:
            raise ValueError(f"no method of {', '.join(method)} takes {', '.join(unused)}")
        policies = [
            make_policy(name, **{k: v for k, v in params.items() if k in accepted_parameters(METHODS[name])})
            for name in method
        ]
        if str(prompt_file) == "-" and questions is None:
            raise ValueError(
                "--prompt-file - reads the document from standard input: give the questions in --questions"
            )
        if drop_answers:
            for policy in policies:
                check_can_forget(policy)
        document = read_prompt(None, prompt_file, what="document")
        asked = read_questions(questions) if questions is not None else None
        if out is not None and asked is None:
            raise ValueError("--out writes the rows of a --questions run; give --questions FILE too")
        runtime = check_runtime(dtype, device)
        # the rows' file is made before the model loads: a path that cannot take it is refused first
        with new_text_file(out, "--out") if out is not None else contextlib.nullcontext(sys.stdout) as sink:
            lm, tokenizer, _ = load_checked(model, runtime, policies)
            form = TurnFormat(tokenizer)
            context = form.context(document).to(lm.device)
            check_length(lm, context.shape[1], max_new_tokens)  # before minutes of prefill
            print(f"prefilling the document ({context.shape[1]} tokens) for {', '.join(method)} ...", file=sys.stderr)
            if question_aware:
                conversations = [
                    Conversation(lm, context, p, question_aware=True, keep_answers=not drop_answers) for p in policies
                ]
            else:
                conversations = Conversation.several(lm, context, policies, keep_answers=not drop_answers)
            for number, question in enumerate(asked or interactive_questions(), 1):
                for name, conversation in zip(method, conversations):
                    previous = conversation.turns[-1].tokens if conversation.turns else []
                    ids = form.question(question, first=number == 1, after=previous).to(lm.device)
                    turn = conversation.ask(ids, max_new_tokens)
                    answer = tokenizer.decode(turn.tokens, skip_special_tokens=True).strip()
                    if asked is None:
                        print(
                            f"[{name}] {answer}\n    ({turn.time_to_first_token_s:.2f} s to the first token, "
                            f"{turn.decode_ms_per_token:.1f} ms/token, KV {turn.kv_bytes_held / 2**20:.1f} MB held, "
                            f"{turn.kv_bytes_read_per_step / 2**20:.1f} MB read/step)",
                            flush=True,
                        )
                        continue
                    row = {
                        "turn": number,
                        "method": name,
                        "question": question,
                        "answer": answer,
                        "new_tokens": len(turn.tokens),
                        "question_tokens": turn.question_tokens,
                        "time_to_first_token_s": round(turn.time_to_first_token_s, 4),
                        "context_prefill_s": round(conversation.context_prefill_s, 4),
                        "decode_ms_per_token": round(turn.decode_ms_per_token, 3),
                        "kv_bytes_held": turn.kv_bytes_held,
                        "kv_bytes_read_per_step": round(turn.kv_bytes_read_per_step),
                    }
                    print(json.dumps(row), file=sink, flush=True)
