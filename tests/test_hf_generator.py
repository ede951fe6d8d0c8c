"""The hf generator on the tiny model: batching, n samples, seeds, stop strings and token ids."""

from vrl.config import SamplingConfig
from vrl.generate.hf import HFGenerator
from vrl.generate.tiny import build_model, build_tokenizer
from vrl.types import Task

TASKS = [Task(id=f"t{i}", prompt=f"prompt number {i}: ") for i in range(5)]


def generator(**sampling):
    return HFGenerator(build_model(), build_tokenizer(), SamplingConfig(**sampling))


def test_n_samples_per_task_in_task_order_and_batches_stream():
    g = generator(max_new_tokens=6, batch_size=2)
    batches = list(g.stream(TASKS, n=3, variant=7, seed=1))
    assert [len(b) for b in batches] == [6, 6, 3]
    flat = [c for b in batches for c in b]
    assert [(c.task_id, c.sample) for c in flat] == [(t.id, s) for t in TASKS for s in range(3)]
    assert all(c.variant == 7 and 1 <= c.completion_tokens <= 6 for c in flat)
    tok = build_tokenizer()
    for c, t in zip(flat[::3], TASKS):
        assert tok.decode(c.prompt_token_ids) == t.prompt  # left padding removed
        assert c.prompt_tokens == len(c.prompt_token_ids)


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic():
    g = generator(max_new_tokens=8, temperature=1.0)
    a, b = g.generate(TASKS, n=2, seed=5), g.generate(TASKS, n=2, seed=5)
    assert [c.text for c in a] == [c.text for c in b]
    assert [c.text for c in a] != [c.text for c in g.generate(TASKS, n=2, seed=6)]
    greedy = generator(max_new_tokens=8, temperature=0.0)
    x = greedy.generate(TASKS[:2], n=2)
    assert x[0].text == x[1].text  # greedy: both samples equal


def test_stop_strings_cut_text_and_token_ids():
    g = generator(max_new_tokens=40, temperature=1.0)
    free = g.generate(TASKS, seed=3)
    # pick a character that appears mid-completion and use it as the stop string
    stop = next(c.text[len(c.text) // 2] for c in free if len(c.text) > 4 and c.text[len(c.text) // 2].isprintable())
    stopped = generator(max_new_tokens=40, temperature=1.0, stop=[stop]).generate(TASKS, seed=3)
    tok = build_tokenizer()
    hit = [c for c in stopped if c.finish_reason == "stop" and c.text.endswith(stop)]
    assert hit, "the stop string should end at least one completion"
    for c in hit:
        assert c.text.count(stop) == 1
        assert tok.decode(c.token_ids) == c.text  # ids end with the stop string, nothing after
        assert c.completion_tokens == len(c.token_ids)


def test_length_finish_reason():
    c = generator(max_new_tokens=3).generate(TASKS[:1], seed=0)[0]
    assert c.finish_reason in ("length", "stop")
    if c.finish_reason == "length":
        assert c.completion_tokens == 3
