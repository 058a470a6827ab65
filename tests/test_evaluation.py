"""evaluation.py: τ, acceptance, speedup and losslessness on the evaluation sets."""
import functools
import json

import pytest

import dflash
from conftest import VOCAB, fresh_drafter
from dflash_reference import evaluation, loading, scripts


@pytest.mark.parametrize("argv, message", [
    (["--impl", "fastpath", "--num-drafts", "-3"], "--num-drafts = -3 must be in 1..3 (the drafter's block_size is 4)"),
    (["--max-new-tokens", "0"], "--max-new-tokens = 0 must be at least 1")])
def test_evaluation_checks_the_request_before_the_data_sets_load(catalog_paths, tmp_path, monkeypatch, capsys,
                                                                 argv, message):
    """evaluation.py refuses a request no prompt could run in one line, before it reads a data set or
    makes --out, with either implementation."""
    monkeypatch.setattr(loading, "load_target_and_tokenizer",
                        lambda path, dtype, device: (loading.load_target(path, dtype, device), None))
    def loaded():
        raise AssertionError("a data set was read")
    monkeypatch.setattr(loading, "EVAL_DATASETS", {name: loaded for name in loading.EVAL_DATASETS})
    with pytest.raises(SystemExit) as exit:
        scripts.run(evaluation.main, argv=["--target", catalog_paths["t"], "--draft", catalog_paths["d"], "--out",
                                              str(tmp_path / "e"), "--device", "cpu", "--max-new-tokens", "8"] + argv)
    assert exit.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == "error: " + message
    assert not (tmp_path / "e").exists()



def test_evaluate_reports_acceptance_and_catches_a_lossy_generate(llama_data, tmp_path):
    """evaluate() gathers τ and per-position acceptance from generate_fn and flags any prompt whose
    tokens differ from the target alone."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target)
    prompts = [s.ids[:s.prompt_len].tolist() for s in sequences[:3]]
    result = evaluation.evaluate(dflash.generate, target, drafter, prompts, 12, progress=False)
    assert result["lossless"] and result["mismatched_prompts"] == []
    assert len(result["acceptance"]) == 3 and all(0 <= a <= 1 for a in result["acceptance"])
    assert 1 <= result["tau"] <= 4 and result["speedup"] > 0

    def lossy(target_, drafter_, ids, max_new_tokens, **kw):
        gen = dflash.generate(target_, drafter_, ids, max_new_tokens, **kw)
        if drafter_ is not None and ids == prompts[1]:
            gen.tokens[5] = (gen.tokens[5] + 1) % VOCAB
        return gen

    short = evaluation.evaluate(functools.partial(dflash.generate, num_drafts=2), target, drafter, prompts, 12,
                           progress=False)
    assert short["num_drafts"] == 2 and len(short["acceptance"]) == 2 and short["lossless"]
    sampled = evaluation.evaluate(dflash.generate, target, drafter, prompts, 12, progress=False,
                             sampling=dflash.Sampling(1.0), seed=1)
    assert sampled["lossless"] is None and sampled["mismatched_prompts"] == []   # other draws than target alone

    one = evaluation.evaluate(dflash.generate, target, drafter, prompts, 1, progress=False)
    assert one["tau"] is None and one["acceptance"] == [None] * 3   # one token each: no round, nothing drafted
    assert evaluation.plot_eval({"one token": one}, tmp_path / "one.png")

    bad = evaluation.evaluate(lossy, target, drafter, prompts, 12, progress=False)
    assert not bad["lossless"] and bad["mismatched_prompts"] == [1]
    assert bad["per_prompt"][1]["first_mismatch"] == 5
    json.dumps(bad)
    assert evaluation.plot_eval({"a": result, "b": bad}, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 10_000


def test_evaluate_speedup_is_a_ratio_of_tokens_per_second(llama_data, monkeypatch):
    """Where DFlash's text and the target alone's differ in length (sampling, bf16 near-ties), the
    speedup is DFlash's tokens/s over the target's, not the ratio of their times: 4 tokens in 1 s
    against 10 in 2 s is 0.8×, though it took half the time."""
    _, target, _ = llama_data
    _, drafter = fresh_drafter(target)
    clock = [0.0]
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: clock[0])

    def fake(target_, drafter_, ids, max_new_tokens, **kw):
        clock[0] += 2.0 if drafter_ is None else 1.0
        n = 10 if drafter_ is None else 4
        return dflash.Generation(tokens=[1] * n, acceptance_lengths=[2] * (n // 2), position_accepted=[1, 0, 0],
                                 position_drafted=[n // 2] * 3)
    result = evaluation.evaluate(fake, target, drafter, [[1, 2], [3, 4, 5]], 12, progress=False,
                                 sampling=dflash.Sampling(1.0))
    assert result["target_seconds"] == 4.0 and result["dflash_seconds"] == 2.0
    assert result["target_tokens_per_s"] == 5.0 and result["dflash_tokens_per_s"] == 4.0
    assert result["speedup"] == pytest.approx(0.8)


def test_training_plot_puts_the_phases_end_to_end():
    """Each phase's line starts where the one before ended, at its at_init τ where it measured one;
    blocks are counted per step, or batch × anchors in histories that did not record them."""
    first = {"args": {"batch_size": 2, "anchors": 5}, "history": [{"loss": 1.0}, {"loss": 0.9, "heldout_tau": 1.5}]}
    second = {"args": {"batch_size": 2, "anchors": 5}, "at_init": {"heldout_tau": 1.4},
              "history": [{"blocks": 7, "heldout_tau": 1.6}, {"blocks": 3}, {"blocks": 4, "heldout_tau": 1.8}]}
    points = evaluation.phase_points({"1": first, "2": second})
    assert points == {"1": [(20, 1.5)], "2": [(20, 1.4), (27, 1.6), (34, 1.8)]}


def test_evaluation_saves_every_prompt_and_an_interrupt_keeps_them(catalog_paths, tmp_path, monkeypatch, capsys):
    """eval.json is written after every prompt, so Ctrl-C (here on the third prompt) ends with exit 130 and
    the file holding the two prompts run, marked interrupted; progress is printed before the warm-up."""
    texts = ["1 2 3", "4 5", "6 7 8 9", "10"]
    monkeypatch.setattr(loading, "load_target_and_tokenizer",
                        lambda path, dtype, device: (loading.load_target(path, dtype, device), None))
    monkeypatch.setattr(loading, "encode_chat", lambda tokenizer, text: [int(t) for t in text.split()])
    monkeypatch.setattr(loading, "EVAL_DATASETS", {"mtbench": lambda: texts, "humaneval": lambda: texts})
    real, calls = dflash.generate, []

    def interrupted(target, drafter, ids, *args, **kwargs):
        calls.append(ids)
        if len(calls) == 2 + 2 * 2 + 1:   # warm-up (2 calls), two prompts (2 calls each), then the third's first
            raise KeyboardInterrupt
        return real(target, drafter, ids, *args, **kwargs)
    monkeypatch.setattr(dflash, "generate", interrupted)
    out = tmp_path / "e"
    with pytest.raises(SystemExit) as exit:
        evaluation.main(["--target", catalog_paths["t"], "--draft", catalog_paths["d"], "--out", str(out),
                         "--device", "cpu", "--max-new-tokens", "8", "--datasets", "mtbench"])
    assert exit.value.code == 130
    report = json.loads((out / "eval.json").read_text())
    assert report["interrupted"] is True and report["datasets"]["mtbench"]["prompts"] == 2
    assert [p["prompt_tokens"] for p in report["datasets"]["mtbench"]["per_prompt"]] == [3, 2]
    err = capsys.readouterr().err
    assert err.index("warming up") < err.index("interrupted:") and "mtbench 2" in err
