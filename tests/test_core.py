"""The core engine on tiny random models: equivalence with `full`, schedules, batching, selection, bad input."""

import pytest
import torch
from conftest import random_prompt, tiny_model

from refreshkv import PolicyCache, PolicyError, generate, make_policy
from refreshkv.core import native_attention, native_library
from refreshkv.core.attention_math import aggregate_group, pool, ranked, selection_scores, top_k
from refreshkv.engine.cache_argument import with_cache

NEW = 24


def assert_same_generation(a, b, atol=1e-4):
    assert a.tokens == b.tokens
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_full_matches_plain_transformers(family):
    model = tiny_model(family)
    ids = random_prompt(50)
    ours = generate(model, ids, method="full", max_new_tokens=NEW, eos_token_id=[])
    model.set_attn_implementation("sdpa")
    reference = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.tokens[0] == reference[0, 50:].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "params",
    [
        {"budget": 50 + NEW},  # budget covers every token: nothing is ever left out
        {"budget": 4, "stride": 1},  # a full step at every step
        {"budget": 50 + NEW, "stride": 3, "kernel": 1, "aggregation": "mean"},
    ],
)
def test_refreshkv_equals_full(family, params):
    model = tiny_model(family)
    ids = random_prompt(50)
    full = generate(model, ids, method="full", max_new_tokens=NEW, return_logits=True, eos_token_id=[])
    refresh = generate(
        model, ids, method="refreshkv", max_new_tokens=NEW, return_logits=True, eos_token_id=[], **params
    )
    assert_same_generation(full, refresh)


def test_small_budget_changes_the_output_and_reads_less(llama):
    ids = random_prompt(200)
    full = generate(llama, ids, method="full", max_new_tokens=NEW, return_logits=True, eos_token_id=[])
    small = generate(llama, ids, method="refreshkv", budget=8, max_new_tokens=NEW, return_logits=True, eos_token_id=[])
    assert any((x - y).abs().max() > 1e-3 for x, y in zip(full.logits, small.logits))
    assert small.stats()["kv_bytes_attended_mean"] < full.stats()["kv_bytes_attended_mean"] / 5


def test_dynamic_threshold_below_minus_one_never_refreshes(llama):
    result = generate(
        llama,
        random_prompt(60),
        method="refreshkv",
        budget=8,
        threshold=-1.0,
        qc_stride=2,
        max_new_tokens=NEW,
        eos_token_id=[],
    )
    assert result.cache.full_step_fraction() == 0.0
    assert result.cache.stats.per_layer() == [0.0] * 3


# threshold 1 refreshes at every QC step; with these tokens, window 1 and no carry, layer 0 too (a token written twice
# gives layer 0 its pre-RoPE query again: cosine 1, not below)
EVERY_CHECK = {
    "method": "refreshkv",
    "threshold": 1.0,
    "qc_stride": 5,
    "max_new_tokens": NEW,
    "eos_token_id": [],
    "window": 1,
    "carry": 0.0,
}


def test_dynamic_threshold_one_refreshes_at_every_qc_step(llama):
    result = generate(llama, random_prompt(60), budget=8, **EVERY_CHECK)
    steps = result.cache.step
    assert steps == NEW - 1
    assert result.cache.stats.per_layer() == [float(steps // EVERY_CHECK["qc_stride"])] * 3


def test_the_answer_anchor_skips_a_questions_first_full_step(llama):
    """anchor="answer": a question's first query check attends partially and keeps the answer's query as the
    anchor; the later checks compare with it (threshold 1: each of them refreshes, as with the papers' anchor)."""
    qc, ids = EVERY_CHECK["qc_stride"], random_prompt(60)
    answer = generate(llama, ids, budget=8, anchor="answer", **EVERY_CHECK)
    first, *mixed = answer.cache.stats.per_layer()
    assert mixed == [float(answer.cache.step // qc - 1)] * 2
    assert first <= answer.cache.step // qc - 1  # layer 0's query is its token's alone: a repeated token did not drift
    first_check = generate(
        llama, ids, method="refreshkv", budget=8, qc_stride=qc, max_new_tokens=qc + 1, eos_token_id=[], anchor="answer"
    )
    assert first_check.cache.full_step_fraction() == 0.0
    assert all(layer.state.anchor is not None for layer in first_check.cache.layers)


def test_fixed_stride_full_step_fraction(llama):
    result = generate(
        llama, random_prompt(60), method="recycled", budget=8, stride=4, max_new_tokens=21, eos_token_id=[]
    )
    assert result.cache.full_step_fraction() == pytest.approx((20 // 4) / 20)


def test_partial_cache_after_prefill_is_pooled_top_k(llama, monkeypatch):
    """C_p after the prompt = the top-K of the last token's max-pooled, group-max attention, per KV head."""
    from refreshkv.methods.refreshkv import policy as method

    seen = []
    original = method.attention_probs

    def spy(query, keys, *args, **kwargs):
        seen.append((query.clone(), keys.clone()))
        return original(query, keys, *args, **kwargs)

    monkeypatch.setattr(method, "attention_probs", spy)
    cache = PolicyCache(
        make_policy("refreshkv", budget=10, pooling="centered", window=1), llama.config, max_new_tokens=1
    )
    with torch.no_grad():
        llama(random_prompt(64), **with_cache(llama, cache))
    query, keys = seen[0]  # layer 0: query (1, 4, 1, 16), keys (1, 2, 64, 16)
    assert query.shape == (1, 4, 1, 16)
    probs = (query @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) * 16**-0.5).softmax(-1)
    pooled = torch.nn.functional.max_pool1d(probs[:, :, 0], kernel_size=7, stride=1, padding=3)
    scores = pooled.view(1, 2, 2, 64).amax(dim=2)
    # Ties (frequent after pooling) go to the earlier position.
    ranked = [sorted(range(64), key=lambda i: (-float(row[i]), i))[:10] for row in scores[0]]
    expected = torch.tensor([sorted(r) for r in ranked])[None]
    positions = cache.layers[0].state.partial.store.positions
    assert torch.equal(positions[..., :10], expected)
    assert (positions[..., 10:] == -1).all()  # the one free slot for the next token


def test_partial_step_evicts_the_lowest_scored_recycled_token(llama):
    ids = random_prompt(64)
    papers = make_policy("refreshkv", budget=10, threshold=-1.0, keep_decoded=False)  # C_p of K + 1 slots
    cache = PolicyCache(papers, llama, max_new_tokens=4)
    with torch.no_grad():
        logits = llama(ids, **with_cache(llama, cache)).logits[:, -1:]
        state = cache.layers[1].state
        before = {
            int(p): float(s) for p, s in zip(state.partial.store.positions[0, 0], state.partial.scores[0, 0]) if p >= 0
        }
        for step in range(2):
            token = logits.argmax(-1)
            logits = llama(token, **with_cache(llama, cache), position_ids=torch.tensor([[64 + step]])).logits
    after = set(state.partial.store.positions[0, 0].tolist())
    lowest = min(before, key=before.get)
    # First step fills the free slot, second evicts the lowest-scored recycled token; both new tokens stay.
    assert after == (set(before) - {lowest}) | {64, 65}


def test_keep_decoded_holds_the_answer_beside_the_selection(llama):
    """keep_decoded (the default): no selected token is evicted for a decoded one, and C_p reads grow with them; a refresh selects
    K tokens before the answer and keeps the answer so far (threshold 1: every layer refreshes at each QC step)."""
    ids, steps = random_prompt(64), NEW - 1
    never = {"method": "refreshkv", "budget": 10, "threshold": -1.0, "max_new_tokens": NEW, "eos_token_id": []}
    kept, evicting = generate(llama, ids, **never), generate(llama, ids, keep_decoded=False, **never)
    answer = set(range(64, 64 + steps))
    for layer in kept.cache.layers:
        held = set(layer.state.partial.store.positions[0, 0].tolist()) - {-1}
        assert answer <= held and len(held - answer) == 10
    first = evicting.cache.layers[1].state.partial.store.positions[0, 0]
    assert int((first >= 0).sum()) == 11  # the papers' C_p: K tokens and the newest
    assert kept.stats()["kv_bytes_attended_mean"] > evicting.stats()["kv_bytes_attended_mean"]
    qc = EVERY_CHECK["qc_stride"]
    refreshed = generate(llama, ids, budget=10, keep_decoded=True, **EVERY_CHECK)
    assert refreshed.cache.stats.per_layer()[1:] == [float(steps // qc)] * 2
    for layer in refreshed.cache.layers[1:]:
        positions = layer.state.partial.store.positions[0]
        assert ((positions >= 64).sum(-1) == steps).all()  # the answer, the full steps' own tokens too
        assert (((positions >= 0) & (positions < 64)).sum(-1) == 10).all()


@pytest.mark.parametrize(
    "method, params",
    [
        ("full", {}),
        ("refreshkv", {"budget": 12, "qc_stride": 2}),  # rows disagree at 6 layer-steps: the C attends to one alone
        ("refreshkv", {"budget": 12, "qc_stride": 3, "carry": 1.0}),  # refreshed rows carry C_p before the step
        ("recycled", {"budget": 12, "stride": 3}),
    ],
)
def test_batch_equals_rows(llama, method, params, monkeypatch):
    attended = []  # refreshkv: the C's full step for the rows that refresh alone, where the rows disagree
    original = native_attention.attend_rows

    def attend_rows(*args):
        attended.append((len(args) > 5 and args[5] is not None, original(*args)))  # (for some rows, result)
        return attended[-1][1]

    monkeypatch.setattr(native_attention, "attend_rows", attend_rows)
    rows = [random_prompt(40, seed=3)[0], random_prompt(25, seed=4)[0]]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 40 - len(row) :] = row
        mask[i, 40 - len(row) :] = 1
    batched = generate(
        llama, ids, mask, method=method, max_new_tokens=NEW, return_logits=True, eos_token_id=[], **params
    )
    if method == "refreshkv" and native_library._compiler() is not None:
        assert any(some_rows and result is not None for some_rows, result in attended)
    full_per_layer = []
    for i, row in enumerate(rows):
        alone = generate(
            llama, row[None], method=method, max_new_tokens=NEW, return_logits=True, eos_token_id=[], **params
        )
        assert batched.tokens[i] == alone.tokens[0]
        for x, y in zip(batched.logits, alone.logits):
            torch.testing.assert_close(x[i], y[0], atol=1e-4, rtol=0)
        full_per_layer.append(alone.cache.stats.per_layer())
    # rows on different schedules record the share of rows that attended fully (a tensor, read here)
    assert batched.cache.stats.per_layer() == pytest.approx([sum(c) / 2 for c in zip(*full_per_layer)])


def test_model_generate_accepts_the_cache(llama):
    ids = random_prompt(50)
    ours = generate(llama, ids, method="refreshkv", budget=10, qc_stride=4, max_new_tokens=NEW, eos_token_id=[])
    cache = PolicyCache(make_policy("refreshkv", budget=10, qc_stride=4), llama, max_new_tokens=NEW)
    theirs = llama.generate(
        ids, **with_cache(llama, cache), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert theirs[0, 50:].tolist() == ours.tokens[0]


def test_sampling_is_reproducible_with_a_seed(llama):
    ids = random_prompt(30)
    runs = [
        generate(
            llama,
            ids,
            method="refreshkv",
            budget=8,
            do_sample=True,
            top_p=0.9,
            top_k=20,
            temperature=0.8,
            seed=7,
            max_new_tokens=12,
            eos_token_id=[],
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_stops_at_end_of_sequence(llama):
    ids = random_prompt(30)
    free = generate(llama, ids, method="full", max_new_tokens=10, eos_token_id=[]).tokens[0]
    stopped = generate(llama, ids, method="full", max_new_tokens=10, eos_token_id=free[3]).tokens[0]
    assert stopped == free[: free.index(free[3]) + 1]


def test_pool_and_aggregation_on_hand_made_scores():
    scores = torch.tensor([0.0, 0.1, 0.9, 0.0, 0.0, 0.0, 0.3])
    assert pool(scores, 3).tolist() == pytest.approx([0.1, 0.9, 0.9, 0.9, 0.0, 0.3, 0.3])
    group = torch.tensor([[[[0.1, 0.5, 0.2], [0.4, 0.1, 0.3]]]])  # (B=1, Hkv=1, G=2, n=3)
    assert aggregate_group(group, "max").flatten().tolist() == pytest.approx([0.4, 0.5, 0.3])
    assert aggregate_group(group, "mean").flatten().tolist() == pytest.approx([0.25, 0.3, 0.25])
    assert aggregate_group(group, "first").flatten().tolist() == pytest.approx([0.1, 0.5, 0.2])
    # Pooled per query head, then aggregated; max and first commute with pooling (so they are aggregated first),
    # mean does not (aggregated first it would give 0.3 everywhere)
    for how, expected in (("max", [0.5, 0.5, 0.5]), ("first", [0.5, 0.5, 0.5]), ("mean", [0.45, 0.45, 0.4])):
        assert selection_scores(group.unsqueeze(3), 3, how).flatten().tolist() == pytest.approx(expected)
    # Two queries in the window (B=1, Hkv=1, G=1, w=2, n=10): averaged, pooled, then top-4 with ties to the earlier.
    window = torch.tensor(
        [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0]]
    ).view(1, 1, 1, 2, 10)
    kept = top_k(selection_scores(window, kernel=3, how="max"), 4)
    assert kept.tolist() == [[[0, 1, 2, 7]]]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"budget": 0}, "budget must be an integer >= 1"),
        ({"budget": True}, "budget must be an integer >= 1"),
        ({"budget": "8"}, "budget must be an integer >= 1"),
        ({"budget_ratio": 1.5}, "budget_ratio must be a number in (0, 1]"),
        ({"budget_ratio": 0.0}, "budget_ratio must be a number in (0, 1]"),
        ({"budget_ratio": "abc"}, "budget_ratio must be a number in (0, 1]"),
        ({"budget_ratio": True}, "budget_ratio must be a number in (0, 1]"),
        ({"stride": 0}, "stride must be an integer >= 1"),
        ({"qc_stride": 0}, "qc_stride must be an integer >= 1"),
        ({"threshold": "high"}, "threshold must be a cosine similarity in [-1, 1]"),
        ({"threshold": float("nan")}, "threshold must be a cosine similarity in [-1, 1]"),
        ({"threshold": 5}, "threshold must be a cosine similarity in [-1, 1]"),
        ({"carry": -0.5}, "carry must be a share in [0, 1], got -0.5"),
        ({"question_floor": -1}, "question_floor must be a finite number >= 0, got -1"),
        ({"question_floor": float("inf")}, "question_floor must be a finite number >= 0, got inf"),
        ({"question_floor": "all"}, "question_floor must be a finite number >= 0, got 'all'"),
        ({"keep_decoded": 1}, "keep_decoded must be true or false, got 1"),
        ({"aggregation": "median"}, "choose from: max, mean, first"),
        ({"kernel": 4}, "kernel must be an odd integer"),
        ({"stride": 5, "threshold": 0.9}, "excludes qc_stride and threshold"),
        ({"budget": 4, "budget_ratio": 0.1}, "either budget or budget_ratio"),
        ({"sinks": 4}, "has no parameter sinks"),
    ],
)
def test_bad_parameters(params, message):
    with pytest.raises(PolicyError, match=None) as error:
        make_policy("refreshkv", **params)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_generation_settings_as_one_object_or_as_keywords():
    """`generate` and `generate_many` take their settings as one `GenerationSettings` or as keywords (which override
    it); `generate`'s other keywords are the method's parameters."""
    from refreshkv import GenerationSettings, generate_many

    model, ids = tiny_model(), random_prompt(40)
    settings = GenerationSettings(max_new_tokens=5, eos_token_id=[], return_logits=True)
    by_keywords = generate(model, ids, method="h2o", budget=8, max_new_tokens=5, eos_token_id=[], return_logits=True)
    by_object = generate(model, ids, method="h2o", budget=8, settings=settings)
    assert_same_generation(by_keywords, by_object, atol=0)
    overridden = generate_many(model, ids, methods=["full"], settings=settings, max_new_tokens=3)[0]
    assert len(overridden.tokens[0]) == 3 and settings.max_new_tokens == 5  # the object is not changed
    with pytest.raises(ValueError, match="temperature apply only when sampling"):
        GenerationSettings(temperature=0.5)
    with pytest.raises(TypeError, match=r"unknown setting budget; the settings: .* make_policy\(name, budget=...\)"):
        generate_many(model, ids, methods=["h2o"], budget=8)  # a method's parameter belongs to its method


def test_one_budget_rule_for_methods_training_and_the_recovery_task():
    """K from budget or budget_ratio is resolved by one function (core/policy.py `resolve_budget`), whose ratio is in
    (0, 1] for methods, `refreshkv train` and the recovery task alike."""
    from refreshkv.core.policy import resolve_budget
    from refreshkv.eval.recovery import resolve_k
    from refreshkv.train.run import TrainConfig

    assert [resolve_budget(1000), resolve_budget(1000, budget=7), resolve_budget(3, budget_ratio=0.1)] == [125, 7, 1]
    assert resolve_budget(1000, budget_ratio=1.0) == 1000
    for ratio in (0.25, 1.0):
        assert make_policy("snapkv", budget_ratio=ratio).budget_for(1000) == resolve_budget(1000, budget_ratio=ratio)
        assert resolve_k(1000, None, ratio) == resolve_budget(1000, budget_ratio=ratio)
    config = TrainConfig(data=["x"], model="m", prefix_length=1000, suffix_length=10, budget_ratio=0.25)
    assert config.pattern().budget == resolve_budget(1000, budget_ratio=0.25)
    with pytest.raises(PolicyError, match=r"^budget_ratio must be a number in \(0, 1\], got 1.5$"):
        resolve_budget(1000, budget_ratio=1.5)
    with pytest.raises(ValueError, match=r"^task 'recovery': budget_ratio must be a number in \(0, 1\], got 0$"):
        resolve_k(1000, None, 0)
    with pytest.raises(ValueError, match=r"^--budget-ratio must be a number in \(0, 1\], got 1.5$"):
        TrainConfig(data=["x"], model="m", budget_ratio=1.5)
    # a ratio of 1 is a budget the pattern refuses in its own words: K must be below L
    with pytest.raises(ValueError, match=r"budget K \(1000\) must be below the prefix length L \(1000\)"):
        TrainConfig(data=["x"], model="m", prefix_length=1000, suffix_length=10, budget_ratio=1.0)


def test_unknown_method_names_the_choices():
    with pytest.raises(PolicyError, match="unknown method 'nope'; choose from: .*full.*refreshkv"):
        make_policy("nope")


def test_prompt_longer_than_context_is_refused(llama):
    with pytest.raises(ValueError, match="exceeds the model's context of 1024"):
        generate(llama, random_prompt(1020), method="full", max_new_tokens=10)


def test_a_window_longer_than_the_prompt_takes_the_whole_prompt(llama):
    """The default window (32) over a 5-token prompt selects at prefill as a window of 5 does."""
    held = []
    for window in (5, 32):
        cache = PolicyCache(make_policy("refreshkv", budget=2, window=window, pooling="centered"), llama, 3)
        with torch.no_grad():
            llama(random_prompt(5), **with_cache(llama, cache))
        held.append(cache.layers[1].state.partial.store.positions.clone())
    assert torch.equal(held[0], held[1])


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("carry, kept", [(0.0, [2, 3]), (0.4, [2, 3]), (0.5, [1, 2]), (1.0, [1, 2])])
def test_a_refresh_keeps_a_held_token_whose_carried_score_still_ranks(monkeypatch, native, carry, kept):
    """K = 2 of 6 tokens. The first selection keeps 1 (0.9) and 4 (0.05); the refresh's query scores 2 at 0.5, 3 at
    0.4 and 1 at 0: token 1 stays where carry x 0.9 beats 0.4. A decoded token in C_p carries nothing."""
    from types import SimpleNamespace

    from refreshkv.core.selection import APPENDED, SelectionState
    from refreshkv.methods.refreshkv import RefreshKV

    monkeypatch.setenv("REFRESHKV_NATIVE", native)
    keys, values = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    layer = SimpleNamespace(
        state=SimpleNamespace(
            partial=SelectionState.empty_like(keys, 3), question_positions=None, question_scores=None
        ),
        prompt_spans=None,
        budget=2,
        model_type="llama",
    )
    method = RefreshKV(budget=2, kernel=1, pooling="centered", carry=carry)
    probs = torch.tensor([[0.0, 0.9, 0.0, 0.0, 0.05, 0.05], [0.0, 0.0, 0.5, 0.4, 0.0, 0.1]]).view(2, 1, 1, 1, 1, 6)
    method.selection_rule(layer).refresh(layer, probs[0], None, (keys, values))
    partial = layer.state.partial
    assert partial.store.positions[0, 0, :2].tolist() == [1, 4]
    partial.store.positions[0, 0, 2], partial.scores[0, 0, 2] = 5, APPENDED + 3  # token 5, decoded
    method.selection_rule(layer).refresh(layer, probs[1], None, (keys, values))
    assert partial.store.positions[0, 0, :2].tolist() == kept
    assert partial.scores[0, 0, :2].tolist() == pytest.approx(
        [max(0.5 if i == 2 else 0.4 if i == 3 else 0.0, carry * 0.9 if i == 1 else 0) for i in kept]
    )


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("floor, kept", [(0.0, [3, 2]), (0.5, [1, 2])])
def test_the_question_floor_keeps_a_question_token_through_refreshes_that_carry_would_let_go(
    monkeypatch, native, floor, kept
):
    """K = 2 of 6 tokens. The question's window keeps 1 (0.9) and 4 (0.05). Two refreshes score 2 at 0.5, 3 at 0.4 and
    1 at 0: carry 0.5 keeps token 1 through the first (0.45) and lets it go at the second (0.225 < 0.4); a question
    floor of 0.5 holds it at 0.45 through every refresh. A token kept keeps its slot (2 in the second), a new one
    takes the slot freed (3 in the first)."""
    from types import SimpleNamespace

    from refreshkv.core.selection import SelectionState
    from refreshkv.methods.refreshkv import RefreshKV

    monkeypatch.setenv("REFRESHKV_NATIVE", native)
    keys, values = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    state = SimpleNamespace(partial=SelectionState.empty_like(keys, 3), question_positions=None, question_scores=None)
    layer = SimpleNamespace(state=state, prompt_spans=None, budget=2, model_type="llama")
    method = RefreshKV(budget=2, kernel=1, pooling="centered", carry=0.5, question_floor=floor)
    probs = torch.tensor([[0.0, 0.9, 0.0, 0.0, 0.05, 0.05], [0.0, 0.0, 0.5, 0.4, 0.0, 0.1]]).view(2, 1, 1, 1, 1, 6)
    method.selection_rule(layer).select_for_question(layer, probs[0], None, (keys, values))
    assert state.partial.store.positions[0, 0, :2].tolist() == [1, 4]
    method.selection_rule(layer).refresh(layer, probs[1], None, (keys, values))
    assert state.partial.store.positions[0, 0, :2].tolist() == [1, 2]  # both: carry alone still holds 0.45
    method.selection_rule(layer).refresh(layer, probs[1], None, (keys, values))
    assert state.partial.store.positions[0, 0, :2].tolist() == kept
    if floor:
        assert state.question_positions[0, 0, :2].tolist() == [1, 4]  # the question's selection, left as it was


def test_each_question_sets_the_floor_anew(llama):
    """The prompt's window selection is the floor; a conversation's next turn (a block of new tokens) selects afresh
    and replaces it, so that a refresh keeps what the latest question asked for."""
    cache = PolicyCache(make_policy("refreshkv", budget=6, question_floor=1.0), llama, 4)
    with torch.no_grad():
        llama(random_prompt(40), **with_cache(llama, cache))
        state = cache.layers[1].state
        first = state.question_positions.clone()
        assert torch.equal(first, state.partial.store.positions) and torch.equal(
            state.question_scores, state.partial.scores
        )
        turn = random_prompt(12, seed=5)
        llama(turn, position_ids=torch.arange(40, 52)[None], **with_cache(llama, cache))
    assert torch.equal(state.question_positions, state.partial.store.positions)
    assert not torch.equal(state.question_positions, first)


@pytest.mark.parametrize("method", ["snapkv", "streamingllm", "h2o", "refreekv"])
def test_stores_grow_when_more_tokens_come_than_announced(llama, method):
    """A cache told to expect 2 new tokens still keeps every token its method keeps (nothing evicted early)."""
    ids = random_prompt(40)
    params = {"threshold": 0.0} if method == "refreekv" else {"budget": 100}
    if method == "snapkv":
        params["window"] = 4
    full = generate(llama, ids, method="full", max_new_tokens=NEW, eos_token_id=[])
    cache = PolicyCache(make_policy(method, **params), llama, max_new_tokens=2)
    tokens = llama.generate(
        ids, **with_cache(llama, cache), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert tokens[0, 40:].tolist() == full.tokens[0]
    assert cache.layers[0].state.store.slots > 42


def test_top_k_breaks_ties_toward_earlier_positions():
    scores = torch.tensor([[[0.5, 0.5, float("-inf"), 0.5, 0.9, 0.0, -0.0]]])
    assert top_k(scores, 3).tolist() == [[[0, 1, 4]]]
    assert top_k(scores, 6).tolist() == [[[0, 1, 3, 4, 5, 6]]]  # -0.0 ties with 0.0; -inf comes last
    assert top_k(scores, 7).tolist() == [[[0, 1, 2, 3, 4, 5, 6]]]
    strided = torch.zeros(1, 1, 14)
    strided[..., ::2] = scores
    transposed = torch.cat([scores, scores]).transpose(0, 2)  # (7, 1, 2): positions along dim 0
    assert top_k(strided[..., ::2], 3).tolist() == [[[0, 1, 4]]]
    assert top_k(transposed.transpose(0, 2), 3).tolist() == [[[0, 1, 4]], [[0, 1, 4]]]


def test_ranked_orders_negative_scores_and_puts_excluded_positions_after_minus_infinity():
    scores = torch.tensor([[-3.0, -1e-45, float("-inf"), -2.0, float("inf"), -0.0]])
    valid = torch.tensor([[True, True, True, True, False, True]])
    assert ranked(scores, 6, valid=valid).tolist() == [[5, 1, 3, 0, 2, 4]]


def load_plugins(monkeypatch, plugins: dict[tuple[str, str], object]):
    """Load fake installed entry points: {(entry name, distribution): what loading it gives (a callable raises)}."""
    from importlib.metadata import EntryPoint

    import refreshkv.methods as methods

    entries = [
        EntryPoint(name, f"{package}.mod:Cls", methods.ENTRY_POINT_GROUP)._for(type("D", (), {"name": package})())
        for name, package in plugins
    ]

    def load(entry):
        loaded = plugins[entry.name, entry.dist.name]
        return loaded if isinstance(loaded, type) else loaded()

    monkeypatch.setattr(EntryPoint, "load", load)
    monkeypatch.setattr(methods, "entry_points", lambda group: entries)
    methods.load_methods()


@pytest.fixture
def registry():
    """The registry as it was, restored after the test."""
    from refreshkv.core.policy import METHODS, PROVIDERS

    saved = dict(METHODS), dict(PROVIDERS)
    yield METHODS, PROVIDERS
    METHODS.clear(), METHODS.update(saved[0])
    PROVIDERS.clear(), PROVIDERS.update(saved[1])


def test_methods_from_other_packages_are_registered_through_entry_points(monkeypatch, registry, caplog):
    import dataclasses

    methods, providers = registry

    @dataclasses.dataclass
    class Plugin(type(make_policy("full"))):
        name = "plugin-method"

    def broken():
        raise ImportError("No module named 'no_such_module_here'")

    load_plugins(monkeypatch, {("plugin-method", "somepkg"): Plugin, ("broken", "brokenpkg"): broken})
    assert methods["plugin-method"] is Plugin and providers["plugin-method"] == "somepkg"
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "warning: refreshkv: method plugin 'broken' of package brokenpkg failed to load: No module named "
        "'no_such_module_here'"
    )


@pytest.mark.parametrize("replaces", [False, True])
def test_a_plugin_never_replaces_full(monkeypatch, registry, caplog, replaces):
    """A 16-token StreamingLLM named `full`, with or without `replaces`, is left out with one warning line."""
    import dataclasses

    methods, providers = registry
    shadow = dataclasses.dataclass(
        type("Shadow", (type(make_policy("streamingllm")),), {"name": "full", "replaces": replaces})
    )
    load_plugins(monkeypatch, {("full", "shadowpkg"): shadow})
    assert methods["full"].__module__ == "refreshkv.methods.full" and providers["full"] == "refreshkv"
    [line] = [r.getMessage() for r in caplog.records]
    assert "package shadowpkg was not registered" in line and "cannot be replaced" in line


def test_a_plugin_replaces_a_built_in_only_when_it_says_so(monkeypatch, registry, caplog):
    import dataclasses

    methods, providers = registry
    base = type(make_policy("snapkv"))
    silent = dataclasses.dataclass(type("Silent", (base,), {"name": "snapkv"}))
    load_plugins(monkeypatch, {("snapkv", "otherpkg"): silent})
    assert methods["snapkv"] is base and "must set `replaces = True`" in caplog.records[0].getMessage()
    declared = dataclasses.dataclass(type("Declared", (base,), {"name": "snapkv", "replaces": True}))
    load_plugins(monkeypatch, {("snapkv", "otherpkg"): declared})
    assert methods["snapkv"] is declared and providers["snapkv"] == "otherpkg"


def test_pre_rope_query_undoes_the_rotary_embedding(llama):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from refreshkv.core.rope import inverse_frequencies, unrotate

    rotary = llama.model.rotary_emb
    query = torch.randn(2, 4, 1, 16)
    positions = torch.tensor([[7], [300]])
    cos, sin = rotary(query, positions)
    rotated, _ = apply_rotary_pos_emb(query, query, cos, sin)
    restored = unrotate(rotated[:, :, -1].mean(1), positions[:, 0], inverse_frequencies(llama))
    torch.testing.assert_close(restored, query[:, :, -1].mean(1), atol=1e-5, rtol=1e-5)
    assert torch.equal(inverse_frequencies(llama.config), inverse_frequencies(llama))  # plain RoPE from the config


def test_the_window_anchor_is_the_mean_of_the_window_queries_before_rope(llama):
    """anchor="window": one pre-RoPE query, rotated at each of the window's positions, averages back to itself; a
    row's left pads are left out of the mean; the papers' anchor is the last token's query alone."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from refreshkv.core.rope import inverse_frequencies

    window, newest = 6, torch.tensor([40, 3])  # the second row: 2 left pads in the window
    before = torch.randn(2, 4, 1, 16).expand(2, 4, window, 16).clone()
    before[1, :, :2] = 100.0  # the pads' queries: any weight on them moves the mean
    positions = newest[:, None] - torch.arange(window - 1, -1, -1)
    cos, sin = llama.model.rotary_emb(before, positions)
    rotated, _ = apply_rotary_pos_emb(before, before, cos, sin)
    layer = SimpleNamespace(
        rope_inv_freq=inverse_frequencies(llama), positions=lambda device: newest, mean_over_heads=lambda q: q.mean(1)
    )
    anchored = make_policy("refreshkv", anchor="window", window=window).question_anchor(layer, rotated)
    torch.testing.assert_close(anchored, before[:, :, -1].mean(1), atol=1e-5, rtol=1e-5)
    last = make_policy("refreshkv").question_anchor(layer, rotated)
    torch.testing.assert_close(last, before[:, :, -1].mean(1), atol=1e-5, rtol=1e-5)
    rotated[:, :, 0] += 1.0  # the window's first query: seen by the window anchor of row 0 only
    assert not torch.allclose(
        make_policy("refreshkv", anchor="window", window=window).question_anchor(layer, rotated)[0], anchored[0]
    )
    torch.testing.assert_close(make_policy("refreshkv").question_anchor(layer, rotated), last)
    with pytest.raises(PolicyError, match="before RoPE"):
        make_policy("refreshkv", anchor="window", query="post_rope")
    with pytest.raises(PolicyError, match="anchor"):
        make_policy("refreshkv", anchor="first")


def test_threshold_default_follows_the_model_family(llama, qwen2):
    from refreshkv.methods.refreshkv import default_threshold

    assert default_threshold(PolicyCache(make_policy("full"), llama).model_type) == 0.85
    assert default_threshold(PolicyCache(make_policy("full"), qwen2).model_type) == 0.95
    assert default_threshold(PolicyCache(make_policy("full"), tiny_model("gemma3", layers=2)).model_type) == 0.9
    from refreshkv import METHODS

    shown = METHODS["refreshkv"].parameters()
    assert (
        shown["qc_stride"] == 10
        and "0.95 for qwen2" in shown["threshold"]
        and "0.9 for gemma3_text" in shown["threshold"]
    )


def test_question_floor_default_follows_the_model_family(llama):
    """Issue 47: the question's selection weighs 4x at a refresh unless given; Gemma 3 keeps 1."""
    from refreshkv import METHODS

    gemma = tiny_model("gemma3", layers=2)
    for model, family_floor in ((llama, 4.0), (gemma, 1.0)):
        for policy, floor in (
            (make_policy("refreshkv"), family_floor),
            (make_policy("refreshkv", question_floor=2), 2),
        ):
            cache = PolicyCache(policy, model)
            assert [policy.floor_share(layer) for layer in cache.layers] == [floor] * len(cache.layers)
    assert "1.0 for gemma3_text, 4.0 otherwise" == METHODS["refreshkv"].parameters()["question_floor"]
    assert METHODS["recycled"].parameters()["question_floor"] == 0.0


def test_gather_tokens_equals_gather_on_store_slices_and_any_layout():
    from refreshkv.core.kvstore import gather_tokens

    buffer = torch.randn(2, 3, 60, 8)  # a store's preallocated buffer; views of its filled part are not contiguous
    index = torch.randint(0, 45, (2, 3, 7), generator=torch.Generator().manual_seed(0))
    views = [
        buffer[:, :, :50],
        buffer[:, :, 5:55],
        buffer[1:, :, :50],
        torch.randn(2, 50, 3, 8).transpose(1, 2),
        torch.randn(1, 3, 50, 8).expand(2, -1, -1, -1),
    ]
    expected = [view.gather(2, index[: view.shape[0]].unsqueeze(-1).expand(-1, -1, -1, 8)) for view in views]
    for view, wanted in zip(views, expected):
        assert torch.equal(gather_tokens(index[: view.shape[0]], view)[0], wanted)
    # several tensors in one call share a flat index only where they lie alike
    together = gather_tokens(index, views[0], views[1], views[3], views[4])
    for got, wanted in zip(together, [expected[0], expected[1], expected[3], expected[4]]):
        assert torch.equal(got, wanted)


def test_checking_for_the_end_every_n_steps_returns_the_same_tokens(llama):
    ids = torch.cat([random_prompt(30, seed=5), random_prompt(30, seed=6)])
    free = generate(llama, ids, method="recycled", budget=8, stride=3, max_new_tokens=NEW, eos_token_id=[])
    eos = next(t for t in free.tokens[0] if t in free.tokens[1])  # a token both rows produce
    ends = [row.index(eos) for row in free.tokens]  # the step at which each row ends
    every_step = generate(llama, ids, method="recycled", budget=8, stride=3, max_new_tokens=NEW, eos_token_id=eos)
    every_7 = generate(
        llama, ids, method="recycled", budget=8, stride=3, max_new_tokens=NEW, eos_token_id=eos, eos_check_every=7
    )
    assert every_step.tokens == every_7.tokens == [row[: end + 1] for row, end in zip(free.tokens, ends)]
    assert every_step.decode_steps == max(ends)  # no forward after the step at which the last row ends
    assert every_7.decode_steps == min(-(-(max(ends) + 1) // 7) * 7 - 1, NEW - 1)  # the next multiple of 7 steps
    assert len(every_7.step_s) == every_7.decode_steps
    with pytest.raises(ValueError, match="eos_check_every must be an integer >= 1, got 0"):
        generate(llama, ids, method="full", max_new_tokens=4, eos_check_every=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_store_put_writes_the_token_bit_for_bit_into_the_chosen_slots_only(dtype):
    from refreshkv.core.kvstore import SlotStore

    store = SlotStore(torch.zeros(2, 3, 5, 4, dtype=dtype), 6)
    keys = torch.randn(2, 1, 3, 4).to(dtype).transpose(1, 2)  # (B, H, 1, D) not contiguous, as attention gives it
    values = torch.randn(2, 3, 1, 4).to(dtype)
    slot = torch.tensor([[0, 5, 2], [3, 3, 1]])
    store.put(slot, keys, values, position=7)
    for row in range(2):
        for head in range(3):
            chosen = slot[row, head].item()
            others = [i for i in range(6) if i != chosen]
            assert torch.equal(store.keys[row, head, chosen], keys[row, head, 0])
            assert torch.equal(store.values[row, head, chosen], values[row, head, 0])
            assert store.positions[row, head, chosen] == 7 and (store.positions[row, head, others] == -1).all()
            assert not store.keys[row, head, others].any() and not store.values[row, head, others].any()


@pytest.mark.parametrize("batch, length, masked", [(1, 1024, False), (2, 1500, True)])
def test_one_query_over_many_keys_is_computed_explicitly_and_equals_sdpa(batch, length, masked, monkeypatch):
    import torch.nn.functional as F

    from refreshkv.core import attention_math

    generator = torch.Generator().manual_seed(0)
    query, keys, values = (
        torch.randn(batch, heads, n, 16, generator=generator) for heads, n in ((6, 1), (2, length), (2, length))
    )
    valid = torch.rand(batch, 2, length, generator=generator) > 0.3 if masked else None
    mask = None if valid is None else valid.view(batch, 2, 1, length).repeat_interleave(3, dim=1)
    wanted = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    def refused(*args, **kwargs):
        raise AssertionError("SDPA called")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refused)
    got = attention_math.decode_attention(query, keys, values, 16**-0.5, valid)
    assert torch.allclose(got, wanted, atol=1e-6)
    with pytest.raises(AssertionError, match="SDPA called"):  # fewer keys: SDPA, faster there
        attention_math.decode_attention(query, keys[:, :, :1023], values[:, :, :1023], 16**-0.5)


def test_the_gpu_decode_over_unpacked_heads_equals_the_packed_one():
    """`grouped_decode` (the GPU's one-query path, run here on the CPU) against SDPA over packed rows: query head h
    belongs to KV head h // group, and so does its row of a per-KV-head mask."""
    from refreshkv.core import attention_math

    generator = torch.Generator().manual_seed(1)
    query, keys, values = (torch.randn(2, h, n, 16, generator=generator) for h, n in ((6, 1), (2, 300), (2, 300)))
    per_kv_head = torch.rand(2, 2, 1, 300, generator=generator) > 0.3
    per_row = torch.rand(2, 1, 1, 300, generator=generator) > 0.3
    for mask in (None, per_kv_head, per_row):
        packed = torch.nn.functional.scaled_dot_product_attention(
            attention_math.pack_queries(query, 2), keys, values, attn_mask=mask, scale=0.3
        )
        got = attention_math.grouped_decode(query, keys, values, 0.3, mask)
        assert got.shape == (2, 1, 6, 16)
        assert torch.allclose(got, attention_math.unpack_output(packed, 6), atol=1e-6)


def test_the_unpacked_heads_are_taken_off_the_cpu_for_many_keys(monkeypatch):
    """The rule of `decode_attention` on a device other than the CPU (the meta device stands in for a GPU): one
    query over the cut or more, with or without a mask; not below it, not two queries, not on the CPU."""
    from refreshkv.core import attention_math

    calls, cut = [], attention_math.GROUPED_DECODE_FROM

    def grouped(query, keys, values, scaling, mask):
        calls.append((keys.shape[2], mask is not None))
        return query

    monkeypatch.setattr(attention_math, "grouped_decode", grouped)
    for device, n, masked, q_len in (
        ("meta", cut, False, 1),
        ("meta", cut - 1, False, 1),
        ("meta", cut, True, 1),
        ("meta", cut, False, 2),
        ("cpu", cut, False, 1),
    ):
        query, keys, values = (
            torch.zeros(1, h, length, 8, device=device) for h, length in ((6, q_len), (2, n), (2, n))
        )
        valid = torch.ones(1, n, dtype=torch.bool, device=device) if masked else None
        attention_math.decode_attention(query, keys, values, 0.3, valid)
    assert calls == [(cut, False), (cut, True)]


def test_a_preset_gives_its_values_and_parameters_beside_it_override_them():
    from refreshkv.core.policy import METHODS

    paper = make_policy("refreshkv", preset="paper", kernel=15)
    assert (paper.kernel, paper.pooling, paper.window, paper.carry, paper.aggregation) == (15, "centered", 1, 0, "max")
    assert paper.question_floor == 0
    defaults = make_policy("refreshkv"), make_policy("recycled")
    # issue 47: the question's floor is the model family's unless given (4; Gemma 3 1)
    assert [(p.window, p.carry, p.question_floor, p.keep_decoded) for p in defaults] == [
        (32, 0.5, None, True),
        (32, 0.0, 0.0, False),
    ]
    assert not paper.keep_decoded and not make_policy("recycled", preset="paper").keep_decoded
    assert make_policy("snapkv", preset="paper").window == 1 and make_policy("snapkv").window == 32
    assert make_policy("recycled", preset="paper").stride == 10  # recycled's own schedule stays
    for name, cls in METHODS.items():  # every preset builds; a preset of one method is not another's
        for preset in cls.presets:
            make_policy(name, preset=preset)
    with pytest.raises(PolicyError, match="^method 'h2o' has no preset 'paper'; its presets: none$"):
        make_policy("h2o", preset="paper")  # its defaults are its paper's: no pooling, kernel or window to choose


def test_a_full_step_of_the_papers_selection_selects_as_a_prompt_of_those_tokens_would(llama):
    """Without carry, the C_p that a full step at step S rebuilds is the one a prompt ending in the same S decoded
    tokens gets at its prefill with a window of 1 (the same keys, the same query)."""
    ids, stride = random_prompt(80), 6
    params = dict(budget=12, stride=stride, window=1, carry=0.0, pooling="centered")
    decoded = generate(llama, ids, method="recycled", max_new_tokens=stride + 1, eos_token_id=[], **params)
    refreshed = decoded.cache.layers[1].state.partial.store.positions[..., :12]
    longer = torch.cat([ids, torch.tensor([decoded.tokens[0][:stride]])], dim=1)  # the prompt and S written tokens
    cache = PolicyCache(make_policy("recycled", **params), llama, max_new_tokens=1)
    with torch.no_grad():
        llama(longer, **with_cache(llama, cache))
    at_prefill = cache.layers[1].state.partial.store.positions[..., :12]
    assert torch.equal(refreshed.sort(-1).values, at_prefill.sort(-1).values)


def test_the_window_mean_leaves_out_a_padded_rows_pad_queries():
    from refreshkv.core.attention_math import window_mean

    probs = torch.rand(2, 1, 2, 4, 6)
    queries_valid = torch.tensor([[True] * 4, [False, False, True, True]])
    averaged = window_mean(probs, queries_valid)
    torch.testing.assert_close(averaged[0], probs[0].mean(dim=2))
    torch.testing.assert_close(averaged[1], probs[1, :, :, 2:].mean(dim=2))
    assert torch.equal(window_mean(probs[:, :, :, :1], queries_valid[:, :1]), probs[:, :, :, 0])
