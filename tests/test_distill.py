"""distill.py: batched self-distillation, the prompts, and the distilled data files."""
import json
import re
import textwrap
from unittest import mock

import pytest
import torch

from dflash import DFlashError
from conftest import MASK, MAX_POS, VOCAB, assert_same_tokens, hf_greedy, run_train_cli, write_target
from dflash_reference import loading, scripts
from dflash_reference.training import distill, objective, prompt_sources, train


def test_distill_checks_the_length_against_the_positions_before_its_buffers(llama_data, tmp_path, monkeypatch, capsys):
    """distill refuses --max-prompt-tokens + --max-new-tokens past the target's positions, naming both flags,
    before it makes a decoder's buffers (sized by that sum: a large one ran out of memory first)."""
    path, target, _ = llama_data
    monkeypatch.setattr(loading, "load_target_and_tokenizer", lambda p, dtype, device: (target, None))
    monkeypatch.setattr(distill, "BatchDecoder", lambda *a, **k: pytest.fail("buffers made before the check"))
    with pytest.raises(SystemExit) as exit:
        scripts.run(train.main, argv=["distill", "--target", str(path), "--out", str(tmp_path / "a.pt"),
                                         "--device", "cpu", "--max-new-tokens", "40000"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --max-prompt-tokens + --max-new-tokens = 256 + 40000 exceeds the target's max_position_embeddings "
        f"{MAX_POS}")


def test_damaged_data_and_prompt_files_end_in_one_line(llama_data, tmp_path):
    """A distilled data file whose parts disagree, or tokens another target's vocabulary holds, and a prompt
    file with other than strings, are refused naming the file and what is wrong, not by a traceback or by
    training on part of it."""
    import lzma
    path, target, sequences = llama_data
    good = tmp_path / "good.pt"
    distill.save_sequences(good, sequences, {"prompt_indices": list(range(len(sequences)))})
    data = torch.load(good, weights_only=True)
    broken = {"short prompt_lengths": dict(data, prompt_lengths=data["prompt_lengths"][:5]),
              "lengths that miss tokens": dict(data, lengths=data["lengths"] - 1),
              "prompt past its sequence": dict(data, prompt_lengths=data["lengths"] + 1),
              "short prompt_indices": dict(data, meta={"prompt_indices": [0, 1]})}
    messages = {"short prompt_lengths": f"24 lengths but 5 prompt_lengths",
                "lengths that miss tokens": "lengths sum to",
                "prompt past its sequence": "a prompt length is negative or longer than its sequence",
                "short prompt_indices": "meta['prompt_indices'] has 2 entries for 24 sequences"}
    for name, value in broken.items():
        torch.save(value, tmp_path / "bad.pt")
        with pytest.raises(DFlashError, match=re.escape(messages[name])):
            distill.load_sequences(tmp_path / "bad.pt")
    other = [objective.Sequence(torch.cat([q.ids, torch.tensor([VOCAB + 3])]), q.prompt_len) for q in sequences]
    distill.save_sequences(tmp_path / "other.pt", other, {"prompt_indices": list(range(len(other)))})
    result = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "other.pt"), "--out",
                           str(tmp_path / "d"), "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK),
                           "--max-steps", "1", "--heldout", "4", "--device", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"error: --data {tmp_path / 'other.pt'}: token {VOCAB + 3} is "
                                                      f"outside the target's vocabulary 0..{VOCAB - 1} (answers of "
                                                      f"another target?)")
    (tmp_path / "p.json.xz").write_bytes(lzma.compress(json.dumps({"prompts": ["hi", 3], "indices": [0, 1]}).encode()))
    with pytest.raises(DFlashError, match="prompts must be strings, indices and max_prompt_tokens integers"):
        prompt_sources.read_prompt_file(tmp_path / "p.json.xz")


def test_distill_batches_equal_single_greedy(llama_data, monkeypatch):
    """Left-padded batched greedy answers equal each prompt's own greedy decode, even where the
    target's generation_config asks for penalties; a stop token ends the response right after
    its first occurrence."""
    _, target, sequences = llama_data
    for seq in sequences[:6]:
        prompt = seq.ids[:seq.prompt_len].tolist()
        assert_same_tokens(seq.ids[seq.prompt_len:].tolist(), hf_greedy(target, prompt, 20))
    monkeypatch.setattr(target.generation_config, "repetition_penalty", 5.0)
    monkeypatch.setattr(target.generation_config, "no_repeat_ngram_size", 2)
    again = distill.distill_ids(target, [s.ids[:s.prompt_len].tolist() for s in sequences[:6]], 20, pad_id=0)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(again, sequences))
    prompt = sequences[0].ids[:sequences[0].prompt_len].tolist()
    response = sequences[0].ids[sequences[0].prompt_len:].tolist()
    stop = response[3]
    (stopped,) = distill.distill_ids(target, [prompt], 20, pad_id=0, stop_ids={stop})
    assert stopped.ids[stopped.prompt_len:].tolist() == response[:response.index(stop) + 1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_decoder_equals_hf_greedy_prompt_by_prompt(tmp_path, family):
    """More prompts than rows, of different lengths, decoded with continuous batching (a row that ends
    takes the next prompt, prefilled two at a time, every 4 steps) give each prompt exactly HF's own
    greedy decode of it alone, float64, in the prompts' order; a stop token ends a row right after
    its first occurrence, and its row goes on to the next prompt."""
    target = loading.load_target(str(write_target(tmp_path / family, family)), torch.float64, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 1, 33, 5)]
    decoder = distill.BatchDecoder(target, batch_size=3, capacity=120)
    decoder.REFILL_EVERY, decoder.REFILL_ROWS = 4, 2
    refills = []
    with mock.patch.object(decoder, "refill", wraps=decoder.refill) as refill:
        got = decoder.generate(prompts, 60)
        refills = [len(call.args[0]) for call in refill.call_args_list]
    for prompt, response in zip(prompts, got):
        assert_same_tokens(response, hf_greedy(target, prompt, 60))
    assert refills[0] == 3 and sum(refills) == len(prompts)                       # rows were refilled
    stop = got[2][7]
    heard = []   # answers reported as their rows end, before the call returns
    stopped = decoder.generate(prompts, 60, stop_ids={stop}, on_answers=heard.append)
    assert sum(heard) == len(prompts) and len(heard) > 1
    for response, full in zip(stopped, got):
        assert response == (full[:full.index(stop) + 1] if stop in full else full)
    assert any(len(r) < 60 for r in stopped) and any(len(r) == 60 for r in stopped)
    assert decoder.lengths.tolist() == [0, 0, 0] and decoder.ended.all()          # every row waits at slot 0
    with pytest.raises(DFlashError, match="exceeds capacity 120"):
        decoder.generate(prompts, 81)
    with pytest.raises(DFlashError, match="an empty prompt"):
        decoder.generate([[5], []], 4)
    wide = distill.BatchDecoder(target, batch_size=1, capacity=MAX_POS + 8)   # room past the model's positions
    with pytest.raises(DFlashError, match=rf"prompt 40 \+ {MAX_POS - 39} new tokens exceeds the target's "
                                          rf"max_position_embeddings {MAX_POS}"):
        wide.generate([prompts[2]], MAX_POS - 39)


def test_batch_decoder_samples_from_the_target_distribution(llama_data):
    """At temperature T each row's token is a draw from softmax(logits / T): over 3,000 rows with
    the same prompt the frequencies match the target's distribution, and a seed reproduces them."""
    _, target, sequences = llama_data
    prompt = sequences[0].ids[:sequences[0].prompt_len].tolist()
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1].double()  # (V,)
    decoder = distill.BatchDecoder(target, batch_size=3000, capacity=16)
    for temperature in (1.0, 0.6):
        drawn = [r[0] for r in decoder.generate([prompt] * 3000, 1, temperature=temperature, seed=1)]
        frequencies = torch.bincount(torch.tensor(drawn), minlength=VOCAB).double() / 3000
        total_variation = 0.5 * (frequencies - (logits / temperature).softmax(-1)).abs().sum()
        assert total_variation < 0.08, (temperature, total_variation)              # observed 0.04-0.05
        assert drawn == [r[0] for r in decoder.generate([prompt] * 3000, 1, temperature=temperature, seed=1)]
    assert [r[0] for r in decoder.generate([prompt] * 4, 1)] == [int(logits.argmax())] * 4


def test_batch_decoder_compiled_layers_trace_once_and_equal_eager(tmp_path):
    """The layer function and head that BatchDecoder compiles on CUDA trace with fullgraph=True through
    AOTAutograd, as inductor would take them: one trace serves all 6 layers, one the head (the prefill
    runs eagerly); greedy and sampled tokens equal the eager decoder's exactly (float32)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    target = loading.load_target(str(write_target(tmp_path / "llama", "llama")), torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 1, 33)]
    eager, traced = (distill.BatchDecoder(target, batch_size=8, capacity=120) for _ in range(2))
    assert not eager.compiled                                                      # CPU: eager by default
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    traced.compile(backend=counter)
    assert traced.generate(prompts, 60) == eager.generate(prompts, 60)
    assert counter.frame_count == 2 and traced.compiled                            # not one per layer
    assert traced.generate(prompts, 30, temperature=0.8, seed=2) == eager.generate(prompts, 30, temperature=0.8, seed=2)


def test_batch_decoder_runs_eagerly_where_the_compile_fails(tmp_path, capsys):
    """A backend that fails leaves the decoder eager, with a message, and the same tokens."""
    def broken(gm, example_inputs):
        raise RuntimeError("no backend here")
    target = loading.load_target(str(write_target(tmp_path / "qwen3", "qwen3")), torch.float32, "cpu")
    prompts = [[5, 6, 7], [8, 9]]
    eager, failing = (distill.BatchDecoder(target, batch_size=2, capacity=40) for _ in range(2))
    torch._dynamo.reset()
    failing.compile(backend=broken)
    assert failing.generate(prompts, 20) == eager.generate(prompts, 20) and not failing.compiled
    assert "BatchDecoder: the step cannot be compiled (BackendCompilerFailed" in capsys.readouterr().err


def test_training_prompts_leave_out_the_evaluation_sets(monkeypatch):
    """A ShareGPT turn that is an MT-Bench or HumanEval prompt, even re-spaced or re-cased, is left
    out of the training prompts; the others keep their indices."""
    class Tok:
        chat_template = "x"
    monkeypatch.setattr(loading, "encode_chat", lambda tokenizer, text: text.split())
    monkeypatch.setattr(loading, "read_sharegpt", lambda all_turns=False: ["keep me", "  Write A  POEM ", "too " * 9, "and me"])
    prompts, indices = prompt_sources.sharegpt_prompts(Tok(), None, 5, set(), True, {prompt_sources.normalized("write a poem")})
    assert (prompts, indices) == (["keep me", "and me"], [0, 3])


def test_code_prompts_are_stdlib_stubs_without_the_evaluation_sets(tmp_path):
    """Every public function or method with a real docstring becomes a HumanEval-shaped stub (def line
    and docstring, dedented, no body); test packages, private names, bare functions, unparsable files,
    repeated stubs, too-long prompts and functions named as an evaluation prompt's are left out."""
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('def probe():\n    """A test helper that must not be seen."""\n')
    (tmp_path / "bad.py").write_text("def broken(:\n")
    (tmp_path / "mod.py").write_text(textwrap.dedent('''\
        def area(width, height):
            """Return the area of a width by height rectangle."""
            return width * height

        def _private(x):
            """A private helper, documented but private."""

        def bare(x):
            return x

        def short(x):
            """Too short."""

        class Box:
            @property
            def volume(self) -> float:
                """The volume of the box, in cubic units.

                >>> Box().volume
                1.0
                """
                return 1.0

        def has_close_elements(numbers, threshold):
            """Named as a HumanEval problem, so left out."""
        '''))
    (tmp_path / "zcopy.py").write_text('def area(width, height):\n    """Return the area of a width by height '
                                       'rectangle."""\n    return 0\n')
    functions = prompt_sources.stdlib_functions(tmp_path)
    assert [name for name, _ in functions] == ["area", "volume", "has_close_elements", "area"]
    assert functions[1][1] == ('def volume(self) -> float:\n    """The volume of the box, in cubic units.\n\n'
                               '    >>> Box().volume\n    1.0\n    """\n')
    class Tok:
        chat_template = "x"
    stub_lines = lambda tokenizer, text: text.splitlines()
    humaneval_like = "Complete the following Python function:\n```python\ndef has_close_elements(numbers, t):\n```"
    excluded = {prompt_sources.normalized(loading.CODE_PROMPT.format(functions[1][1]))}   # as if an evaluation prompt
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loading, "encode_chat", stub_lines)
        prompts, indices = prompt_sources.code_prompts(Tok(), 10, functions, set(), prompt_sources.defined_names(humaneval_like))
        assert indices == [0, 1] and prompts[0] == loading.CODE_PROMPT.format(functions[0][1])
        assert prompts[0].startswith("Complete the following Python function:\n```python\ndef area(")
        assert prompt_sources.code_prompts(Tok(), 10, functions, excluded, set())[1] == [0, 2]
        assert prompt_sources.code_prompts(Tok(), 6, functions, set(), set())[1] == [0, 2]   # volume's prompt is 9 lines


def test_self_prompts_keep_only_ended_new_turns_far_from_the_evaluation_sets():
    """`prompts --source self` keeps a sampled user turn only if it ended with a stop token, is not empty
    or a repeat (case and spacing folded), shares no 8 words in a row with an evaluation prompt,
    defines no HumanEval function and fits; it samples from the template's user prefix, round by
    round with the seed moving on, until it has enough, and reports what it left out and why. Ctrl-C
    keeps the turns judged before it and says so."""
    class Tok:   # one id per character; the template is S|U:<text>$ and then A: for the answer
        chat_template = "x"
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
            return "S|U:" + messages[0]["content"] + "$" + ("A:" if add_generation_prompt else "")
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))
    evaluation = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."
    turns = ["Plan a trip$", " plan a  TRIP$", " $", "no stop token",
             "Compose an engaging travel blog post about a recent trip to Mars.$",
             "Fix def has_close_elements(xs): pass$", "x" * 60 + "$", "Sum a list$",
             "A$", "B$", "C$", "D$"]
    calls = []
    class Decoder:
        def generate(self, prompts, max_new_tokens, stop_ids, temperature, seed):
            calls.append((prompts, max_new_tokens, stop_ids, temperature, seed))
            return [Tok().encode(t) for t in turns[4 * (len(calls) - 1):4 * len(calls)]]
    prompts, indices, report = prompt_sources.self_prompts(Decoder(), Tok(), 4, 60, 0.9, 10, {ord("$")}, [evaluation],
                                                  {"has_close_elements"}, round_size=4)
    assert prompts == ["Plan a trip", "Sum a list", "A", "B"] and indices == [0, 7, 8, 9]
    assert report == {"sampled": 12, "left_out": {"no end": 1, "empty": 1, "repeated": 1,
                                                  "near an evaluation prompt": 1, "defines a HumanEval name": 1,
                                                  "too long": 1}, "interrupted": False}
    prefix, room = Tok().encode("S|U:"), 60 - len("S|U:$A:")
    assert calls == [([prefix] * 4, room, {ord("$")}, 0.9, seed) for seed in (10, 11, 12)]
    calls.clear()   # an evaluation prompt of fewer than 8 words is left out where it matches exactly
    assert prompt_sources.self_prompts(Decoder(), Tok(), 1, 60, 0.9, 0, {ord("$")}, ["plan a trip"], set(), 4) == (
        [], [], {"sampled": 4, "left_out": {"no end": 1, "empty": 1, "repeated": 0, "near an evaluation prompt": 2,
                                             "defines a HumanEval name": 0, "too long": 0}, "interrupted": False})

    class Stopped(Decoder):   # Ctrl-C during the second round: the first round's judged turns are kept
        def generate(self, *args):
            if calls:
                raise KeyboardInterrupt
            return super().generate(*args)
    calls.clear()
    assert prompt_sources.self_prompts(Stopped(), Tok(), 4, 60, 0.9, 10, {ord("$")}, [evaluation], set(), 4) == (
        ["Plan a trip"], [0], {"sampled": 4, "left_out": {"no end": 1, "empty": 1, "repeated": 1,
                                                          "near an evaluation prompt": 0, "defines a HumanEval name": 0,
                                                          "too long": 0}, "interrupted": True})


@pytest.mark.package
def test_self_prompts_from_smollm2_are_its_own_user_turns(tmp_path):
    """With the real target on CPU, `prompts --source self` samples user turns after SmolLM2's own
    system turn and writes a prompt file that says how many it sampled and what it left out."""
    target_dir = loading.ensure_smollm2()
    tokenizer = loading.load_tokenizer(str(target_dir))
    prefix = tokenizer.decode(prompt_sources.user_prefix(tokenizer))
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_start|>user\n")
    assert loading.encode_chat(tokenizer, "Hi")[:len(prompt_sources.user_prefix(tokenizer))] == prompt_sources.user_prefix(tokenizer)
    result = run_train_cli("prompts", "--source", "self", "--target", str(target_dir), "--out",
                           str(tmp_path / "self.json.xz"), "--num-prompts", "3", "--batch-size", "4",
                           "--max-prompt-tokens", "96", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    prompts, indices, meta = prompt_sources.read_prompt_file(tmp_path / "self.json.xz")
    assert len(prompts) == 3 and len(set(indices)) == 3 and all(p.strip() == p and p for p in prompts)
    sampling = meta["sampling"]
    assert sampling["sampled"] >= 3 + sum(sampling["left_out"].values()) and max(indices) < sampling["sampled"]
    assert f"sampled {sampling['sampled']} turns for 3 prompts" in result.stderr
    assert not {prompt_sources.normalized(p) for p in prompts} & prompt_sources.evaluation_prompts()
    assert all(len(loading.encode_chat(tokenizer, p)) <= 96 for p in prompts)


@pytest.mark.package
def test_interrupted_self_prompts_write_what_they_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `prompts --source self` writes the turns kept so far, marked interrupted in the file,
    and exits 130; with none kept, or over an existing --out, it writes nothing and says so."""
    out = tmp_path / "self.json.xz"
    left_out = {"no end": 2, "empty": 0, "repeated": 0, "near an evaluation prompt": 0,
                "defines a HumanEval name": 0, "too long": 0}
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: object())
    for kept in ([], ["Plan a trip"], ["Plan a trip"]):
        monkeypatch.setattr(prompt_sources, "sampled_prompts", lambda args, tokenizer, batch_decoder: (
            kept, list(range(len(kept))), {"sampled": 3, "left_out": left_out, "interrupted": True}))
        with pytest.raises(SystemExit) as exit:
            train.main(["prompts", "--source", "self", "--target", str(tmp_path), "--out", str(out)])
        assert exit.value.code == 130
        err = capsys.readouterr().err
        assert "interrupted: sampled 3 turns for " + f"{len(kept)} prompts; left out: 2 no end" in err
        if kept and "nothing written" not in err:
            prompts, indices, meta = prompt_sources.read_prompt_file(out)
            assert prompts == kept and meta["sampling"]["interrupted"] is True
            out.write_bytes(b"a finished file")   # the next interrupted run leaves it as it was
        elif kept:
            assert f"nothing written: {out} exists and is left as it was" in err
            assert out.read_bytes() == b"a finished file"
        else:
            assert "nothing written" in err and not out.exists()


@pytest.mark.package
def test_prompts_that_keep_nothing_write_nothing(tmp_path):
    """`prompts` with a --max-prompt-tokens no stub fits (SmolLM2's chat template alone is longer) ends in
    one line and writes no file."""
    out = tmp_path / "none.json.xz"
    result = run_train_cli("prompts", "--source", "stdlib", "--target", str(loading.ensure_smollm2()), "--out",
                           str(out), "--max-prompt-tokens", "8")
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().splitlines()[-1] == "error: --source stdlib: no prompt fits --max-prompt-tokens " \
                                                      "= 8 (chat template included); nothing written"


@pytest.mark.package
def test_code_prompts_from_this_stdlib_leave_out_humaneval():
    """The standard library's stubs, as `dflash-train prompts --source stdlib` makes them, share no prompt
    with MT-Bench or HumanEval and pose no function that a HumanEval prompt defines."""
    humaneval = loading.read_humaneval()
    names = set().union(*map(prompt_sources.defined_names, humaneval))
    assert all(map(prompt_sources.defined_names, humaneval)) and "has_close_elements" in names   # 161 names: some repeat
    class Tok:
        chat_template = "x"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loading, "encode_chat", lambda tokenizer, text: [0])
        prompts, _ = prompt_sources.code_prompts(Tok(), 1, prompt_sources.stdlib_functions(), prompt_sources.evaluation_prompts(), names)
    assert len(prompts) > 3000
    assert not {prompt_sources.normalized(p) for p in prompts} & prompt_sources.evaluation_prompts()
    assert not any(f"def {name}(" in p for p in prompts for name in names)   # by text, not by defined_names


def test_prompts_from_a_file_keep_the_ones_that_fit_and_no_evaluation_prompt(llama_data, tmp_path, monkeypatch):
    """`prompts --source file`: one prompt a line (blank lines skipped) or a JSON list of strings; a prompt
    over --max-prompt-tokens or equal to an evaluation prompt (normalized) is left out, the others keep
    their places among the file's prompts; --num-prompts keeps the first N of those."""
    path = llama_data[0]
    lines = ["Tell me a story.", "", "  write a poem  ", "word " * 20, "Sum two numbers.", "And one more."]
    (tmp_path / "mine.txt").write_text("\n".join(lines))
    (tmp_path / "mine.json").write_text(json.dumps([line for line in lines if line]))

    class Tok:
        chat_template = "x"
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: Tok())
    monkeypatch.setattr(loading, "encode_chat", lambda tokenizer, text: text.split())
    monkeypatch.setattr(prompt_sources, "evaluation_prompts", lambda: {prompt_sources.normalized("Write a POEM")})
    for name in ("mine.txt", "mine.json"):
        out = tmp_path / f"{name}.xz"
        train.main(["prompts", "--source", "file", "--file", str(tmp_path / name), "--target", str(path),
                    "--out", str(out), "--max-prompt-tokens", "8"])
        prompts, got, meta = prompt_sources.read_prompt_file(out)
        indices = [0, 3, 4]   # among the file's five prompts
        assert prompts == ["Tell me a story.", "Sum two numbers.", "And one more."] and got == indices
        train.main(["prompts", "--source", "file", "--file", str(tmp_path / name), "--target", str(path),
                    "--out", str(out), "--max-prompt-tokens", "8", "--num-prompts", "2"])
        assert prompt_sources.read_prompt_file(out)[:2] == (prompts[:2], indices[:2])
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(DFlashError, match="must hold a JSON list of strings"):
        prompt_sources.text_prompts(tmp_path / "bad.json")


def test_prompt_file_round_trips_and_a_bad_one_is_named(tmp_path):
    prompt_sources.write_prompt_file(tmp_path / "p.json.xz", ["a", "b"], [3, 7], {"max_prompt_tokens": 256})
    assert prompt_sources.read_prompt_file(tmp_path / "p.json.xz") == (["a", "b"], [3, 7], {"max_prompt_tokens": 256})
    (tmp_path / "bad.json.xz").write_text("{}")
    with pytest.raises(DFlashError, match=r"prompt file: .*bad\.json\.xz is not xz-compressed JSON"):
        prompt_sources.read_prompt_file(tmp_path / "bad.json.xz")
    with pytest.raises(DFlashError, match="not found"):
        prompt_sources.read_prompt_file(tmp_path / "none.json.xz")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_decoder_on_cuda_with_graphs(tmp_path, family):
    """On CUDA the decode step is one captured graph per temperature, its rows refilled between
    replays: in fp32 the graphed rows equal HF greedy
    prompt by prompt; sampled rows replay with new draws every step and reproduce for one seed."""
    target = loading.load_target(str(write_target(tmp_path / family, family)), torch.float32, "cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 1, 33)]
    decoder = distill.BatchDecoder(target, batch_size=4, capacity=120)
    decoder.REFILL_EVERY = 8
    got = decoder.generate(prompts, 60)
    assert list(decoder.graphs) == [0.0]                                           # one graph per temperature
    for prompt, response in zip(prompts, got):
        assert_same_tokens(response, hf_greedy(target, prompt, 60))
    sampled = decoder.generate(prompts, 60, temperature=1.0, seed=3)
    assert sampled == decoder.generate(prompts, 60, temperature=1.0, seed=3) and sampled != got
    assert len({tuple(r) for r in decoder.generate([prompts[0]] * 8, 20, temperature=1.0, seed=4)}) > 1


def test_sequences_round_trip_compactly(llama_data, tmp_path):
    """Distilled sequences save as uint16 token ids and load back equal; a missing file is named."""
    _, _, sequences = llama_data
    distill.save_sequences(tmp_path / "d.pt", sequences, {"source": "test"})
    loaded, meta = distill.load_sequences(tmp_path / "d.pt")
    assert meta == {"source": "test"}
    assert all(torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len for a, b in zip(loaded, sequences))
    assert torch.load(tmp_path / "d.pt", weights_only=True)["tokens"].dtype == torch.uint16
    with pytest.raises(DFlashError, match=r"distilled data: .*nowhere\.pt not found"):
        distill.load_sequences(tmp_path / "nowhere.pt")


@pytest.mark.package
def test_distill_refuses_a_skip_past_the_prompts(tmp_path):
    """`distill --skip-prompts` past the end of the prompts is one line naming the flag, not an empty run."""
    prompt_sources.write_prompt_file(tmp_path / "p.json.xz", ["Hi", "Hello"], [0, 1], {"source": "two prompts",
                                                                             "max_prompt_tokens": 256})
    result = run_train_cli("distill", "--target", str(loading.ensure_smollm2()), "--prompts",
                           str(tmp_path / "p.json.xz"), "--out", str(tmp_path / "d.pt"), "--skip-prompts", "2",
                           "--device", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().endswith("error: --skip-prompts = 2 leaves no prompts (2 in two prompts)")
    assert not (tmp_path / "d.pt").exists()


@pytest.mark.package
def test_distill_resume_refuses_answers_from_another_source(tmp_path, capsys):
    """`distill --resume` keeps going only on the answers of the same prompts and target: answers made from
    another prompt file, whose indices would match, are refused with one line rather than taken as done."""
    for name, texts in (("a", ["Hi", "Hello"]), ("b", ["Name a colour.", "Count to three."])):
        prompt_sources.write_prompt_file(tmp_path / f"{name}.json.xz", texts, [0, 1], {"source": f"prompts {name}",
                                                                             "max_prompt_tokens": 256})
    common = ["--target", str(loading.ensure_smollm2()), "--out", str(tmp_path / "d.pt"), "--max-new-tokens", "4",
              "--device", "cpu"]
    train.main(["distill", "--prompts", str(tmp_path / "a.json.xz"), *common])
    capsys.readouterr()
    with pytest.raises(SystemExit) as again:
        scripts.run(train.main, argv=["distill", "--prompts", str(tmp_path / "b.json.xz"), "--resume", *common])
    assert again.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --resume: {tmp_path / 'd.pt'} has source = prompts a, this run prompts b")
    assert len(distill.load_sequences(tmp_path / "d.pt")[0]) == 2
    slash = [a + "/" if a == str(loading.ensure_smollm2()) else a for a in common]   # the same dir, written otherwise
    train.main(["distill", "--prompts", str(tmp_path / "a.json.xz"), "--temperatures", "0", "0.8", "--resume", *slash])
    assert len(distill.load_sequences(tmp_path / "d.pt")[0]) == 4   # the two greedy answers kept, two sampled added


def test_distill_imports_an_engines_answers_and_resumes(catalog_paths, tmp_path, capsys):
    """`distill --answers` takes a serving engine's answers as token ids (lines of prompt and response ids), keeps
    each answer's key and temperature, resumes by key, refuses a line it cannot read in one error line, and the
    file trains (the target's features and labels by teacher forcing, as for distill's own answers)."""
    answers = tmp_path / "answers.jsonl"
    rows = [{"custom_id": "a", "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7, 8, 9], "temperature": 0},
            {"custom_id": "b", "prompt_ids": [8, 9], "response_ids": [10, 11, 12, 13, 14], "temperature": 0.7}]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "engine.pt"
    train.main(["distill", "--target", catalog_paths["l"], "--answers", str(answers), "--out", str(out)])
    sequences, meta = distill.load_sequences(out)
    assert [s.ids.tolist() for s in sequences] == [[1, 2, 3, 4, 5, 6, 7, 8, 9], [8, 9, 10, 11, 12, 13, 14]]
    assert [s.prompt_len for s in sequences] == [3, 2] and meta["temperatures"] == [0, 0.7]
    assert meta["engine_keys"] == ["a", "b"] and meta["complete"]
    answers.write_text(answers.read_text() + json.dumps({"custom_id": "c", "prompt_ids": [3, 4],
                                                         "response_ids": [5, 6, 7, 8], "temperature": 0}) + "\n")
    train.main(["distill", "--target", catalog_paths["l"], "--answers", str(answers), "--out", str(out), "--resume"])
    sequences, meta = distill.load_sequences(out)
    assert meta["engine_keys"] == ["a", "b", "c"] and len(sequences) == 3
    train.main(["train", "--target", catalog_paths["l"], "--data", str(out), "--out", str(tmp_path / "d"),
                "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK), "--max-steps", "1", "--heldout",
                "1", "--device", "cpu"])
    assert (tmp_path / "d" / "model.safetensors").is_file()
    (tmp_path / "bad.jsonl").write_text('{"custom_id": "x", "response": {"body": {}}}\n')
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        scripts.run(train.main, argv=["distill", "--target", catalog_paths["l"], "--answers",
                                      str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "x.pt")])
    assert exit.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --answers {tmp_path / 'bad.jsonl'}: line 1 is neither an answer with its prompt nor a batch output "
        "line (custom_id, response.body.choices)")


@pytest.mark.package
def test_distill_imports_an_openai_batch_run_through_the_chat_template(tmp_path):
    """An OpenAI-compatible batch run's output, its prompts from the batch input by custom_id: each prompt through
    the target's chat template, each answer's text tokenized with the stop token after it where it stopped (not
    where it ran out of length); without --requests the prompts are missing, said in one line."""
    target_dir = loading.ensure_smollm2()
    tokenizer = loading.load_tokenizer(str(target_dir))
    messages = [[{"role": "user", "content": "Name a color."}], [{"role": "user", "content": "Count to three."}]]
    requests = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "smollm2", "messages": m, "temperature": 0}} for i, m in enumerate(messages)]
    outputs = [{"id": "x", "custom_id": "r1", "response": {"status_code": 200, "body": {"choices": [
                   {"index": 0, "message": {"role": "assistant", "content": "One, two, three"},
                    "finish_reason": "length"}]}}, "error": None},
               {"id": "y", "custom_id": "r0", "response": {"status_code": 200, "body": {"choices": [
                   {"index": 0, "message": {"role": "assistant", "content": "Blue."}, "finish_reason": "stop"}]}},
                "error": None}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in outputs))
    train.main(["distill", "--target", str(target_dir), "--answers", str(tmp_path / "out.jsonl"), "--requests",
                str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "d.pt")])
    sequences, meta = distill.load_sequences(tmp_path / "d.pt")
    assert meta["engine_keys"] == ["r1", "r0"] and meta["temperatures"] == [0, 0]
    for seq, m, text, stopped in zip(sequences, messages[::-1], ["One, two, three", "Blue."], [False, True]):
        prompt = tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)
        assert seq.ids[:seq.prompt_len].tolist() == prompt
        answer = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if stopped else [])
        assert seq.ids[seq.prompt_len:].tolist() == answer
    with pytest.raises(DFlashError, match=r"line 1 has no prompt \(give the batch's input as --requests\)"):
        train.main(["distill", "--target", str(target_dir), "--answers", str(tmp_path / "out.jsonl"), "--out",
                    str(tmp_path / "e.pt")])
