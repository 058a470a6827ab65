"""The conformance kit (conformance/cases.py, conformance/checker.py): golden stage values for porters, and a checker
that names the stage a port breaks and the mistake behind it, in float32 and bf16, for one request or several."""
import json
import re
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash
from dflash import DFlashError
from conftest import run_cli
from dflash_reference import loading
from dflash_reference.conformance import cases, checker


def test_conformance_kit_regenerates_to_the_committed_files(tmp_path):
    """`conformance/checker.py write` from today's dflash.py gives the committed kit: the same checkpoints and
    requests byte for byte, and stage values the checker passes (so the kit cannot drift from the reference)."""
    cases.write_kit(tmp_path)
    for name in cases.CASES:
        fresh, committed = tmp_path / name, cases.KIT / name
        for part in ("target", "drafter"):
            for file in ("config.json", "model.safetensors"):
                assert (fresh / part / file).read_bytes() == (committed / part / file).read_bytes(), (name, part, file)
        spec = json.loads((fresh / "case.json").read_text())
        assert spec == json.loads((committed / "case.json").read_text())
        outcomes = {f"request.{i}.": o for i, o in enumerate(spec["outcomes"])} if "outcomes" in spec else {"": spec}
        dump = load_file(fresh / "expected.safetensors") | {
            prefix + "acceptance_lengths": torch.tensor(o["acceptance_lengths"]) for prefix, o in outcomes.items()}
        result = checker.check(committed, dump, dtype="float32")
        assert result["first"] is None and "missing" not in result["results"].values(), name


def test_an_interrupted_conformance_write_leaves_the_old_case_whole(tmp_path, monkeypatch):
    """A write stopped after a new seed's models are written (here at the recording, as a Ctrl-C would)
    leaves every file of the case as it was; the next write clears what the stopped one left beside it."""
    import shutil
    shutil.copytree(cases.KIT / "laguna", tmp_path / "laguna")
    files = lambda: {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    before = files()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cases, "record_reference", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cases.write_case(tmp_path, "laguna", cases.CASES["laguna"], seed=7)
    left = {name: data for name, data in files().items() if name.startswith("laguna/")}
    assert left == before
    assert (tmp_path / "laguna.partial" / "target" / "model.safetensors").is_file()   # the new seed's, set aside
    monkeypatch.undo()
    cases.write_case(tmp_path, "laguna", cases.CASES["laguna"], seed=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["laguna"]
    assert json.loads((tmp_path / "laguna" / "case.json").read_text())["seed"] >= 7
    (tmp_path / "laguna" / "my-dump.safetensors").write_bytes(b"mine")   # the case is replaced whole: refused
    with pytest.raises(DFlashError, match=r"laguna holds files a case does not \(my-dump.safetensors\); move them "
                                          r"or give another --kit"):
        cases.write_case(tmp_path, "laguna", cases.CASES["laguna"], seed=7)
    assert (tmp_path / "laguna" / "my-dump.safetensors").read_bytes() == b"mine"


def test_every_case_covers_what_the_kit_promises():
    """Fourteen cases: z-lab full attention, the newer layout with a biting window, and with its causality
    override off, RoPE bases per layer type and the default layer ids, Laguna, K < B-1 at both compute widths, a
    sampled case (temperature, top-p and top-k) whose output is not its greedy decode, DFlash2 with a stage for
    each convolution and the selector's; designed pairs that accept whole blocks: a DFlash one, the same with a
    stop token accepted inside a block, a DFlash2 one whose walk does it, the same sampled (its draws from the
    selector's q) and with its logit and embedding scales set; and several requests served at once. Qwen3, Llama
    and Laguna targets; each request accepts a draft within its recorded rounds; the sampled cases alone record
    uniforms; every case holds each round's drafts; every pair stays small."""
    specs = {n: json.loads((cases.KIT / n / "case.json").read_text()) for n in cases.CASES}
    assert len(specs) == 14
    families = {json.loads((cases.KIT / n / "target" / "config.json").read_text())["model_type"] for n in specs}
    assert families == {"qwen3", "llama", "laguna"}
    single = {n: s for n, s in specs.items() if "request" in s}
    assert {(s["request"]["num_drafts"], s["request"]["full_block"]) for s in single.values()} >= {(3, True), (3, False)}
    sampled = specs["sampled"]["request"]
    assert sampled["temperature"] > 0 and sampled["top_p"] < 1 and sampled["top_k"] > 0
    for name in ("sampled", "dflash2-sampled"):   # draws the uniforms decide:
        target, drafter, spec = cases.load_case(cases.KIT / name)
        tokens = load_file(cases.KIT / name / "expected.safetensors")["tokens"].tolist()
        assert tokens != dflash.generate(target, drafter, spec["request"]["prompt_ids"],
                                         spec["request"]["max_new_tokens"]).tokens, name
        assert len(set(tokens)) >= 4                                               # not its greedy decode
    for name, spec in single.items():
        expected = load_file(cases.KIT / name / "expected.safetensors")
        assert any(int(expected[f"accepted.{r}"]) > 0 for r in range(1, cases.ROUNDS + 1)
                   if f"accepted.{r}" in expected), name
        dflash2 = {"conv_in", "conv_out", "candidates", "selector_scores"}
        drawn = spec["request"]["temperature"] > 0
        stages = set(cases.STAGES) - (set() if name.startswith("dflash2") else dflash2) - \
            (set() if drawn else {"uniforms"}) - (set() if drawn and name.startswith("dflash2") else {"draft_uniforms"})
        assert {cases.stage_of(k) for k in expected} == stages | {"tokens", "round_drafts"}, name
        assert expected["round_drafts"].shape == (len(spec["acceptance_lengths"]), drafter_k(spec, name)), name
        assert sum(p.stat().st_size for p in (cases.KIT / name).rglob("*") if p.is_file()) < 600_000, name
        if name.startswith("dflash2"):   # every convolution of every layer, both sublayers, in and out
            layers = json.loads((cases.KIT / name / "drafter" / "config.json").read_text())["num_hidden_layers"]
            assert {k.rsplit(".", 1)[0] for k in expected if k.startswith("conv_") and k.endswith(".1")} == {
                f"conv_{io}.{l}.{s}" for io in ("in", "out") for l in range(layers) for s in ("attn", "mlp")}
    for name in ("high-acceptance", "dflash2-high-acceptance"):   # whole blocks accepted, in the recorded rounds
        spec, expected = specs[name], load_file(cases.KIT / name / "expected.safetensors")
        K = drafter_k(spec, name)
        accepted = [int(expected[f"accepted.{r}"]) for r in range(1, cases.ROUNDS + 1)
                    if f"accepted.{r}" in expected]
        assert spec["tau"] > 5 and sum(a >= K - 1 for a in accepted) >= 5 and len(set(expected["tokens"].tolist())) == 7
        assert min(accepted) < K - 1, name                                          # and a round that rejects
    stop = specs["stop-in-block"]
    tokens, lengths = load_file(cases.KIT / "stop-in-block" / "expected.safetensors")["tokens"].tolist(), \
        stop["acceptance_lengths"]
    assert tokens[-1] in stop["request"]["stop_ids"] and tokens.count(tokens[-1]) == 1
    assert len(tokens) < stop["request"]["max_new_tokens"] and 1 + sum(lengths) > len(tokens) and lengths[-1] == 8
    both_sides = json.loads((cases.KIT / "zlab-new-bidirectional" / "drafter" / "config.json").read_text())
    assert both_sides["dflash_config"]["causal"] is False and "target_layer_ids" not in both_sides["dflash_config"]
    assert "sliding_attention" in both_sides["layer_types"] and len({
        p["rope_theta"] for p in both_sides["rope_parameters"].values()}) == 2
    window = json.loads((cases.KIT / "zlab-new-window" / "drafter" / "config.json").read_text())
    assert len(specs["zlab-new-window"]["request"]["prompt_ids"]) > window["sliding_window"]
    scaled = json.loads((cases.KIT / "dflash2-scaled" / "drafter" / "config.json").read_text())["dflash_config"]
    assert scaled["input_embedding_scale"] != 1 and scaled["output_multiplier"] != 1 and scaled["final_logit_softcapping"]
    served, expected = specs["served"], load_file(cases.KIT / "served" / "expected.safetensors")
    lengths = [len(r["prompt_ids"]) for r in served["requests"]]
    tokens = [expected[f"request.{i}.tokens"].tolist() for i in range(len(lengths))]
    assert len(set(lengths)) == 3 and any(r.get("stop_ids") and len(t) < r["max_new_tokens"] and t[-1] in r["stop_ids"]
                                          for r, t in zip(served["requests"], tokens))   # one stops early
    mask = json.loads((cases.KIT / "served" / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"]
    assert any(mask in t for t in tokens)                                          # a token a port must not drop
    assert len({o["acceptance_lengths"][0] for o in served["outcomes"]}) > 1      # rows accept differently


def drafter_k(spec: dict, name: str) -> int:   # the case's drafts a round
    raw = json.loads((cases.KIT / name / "drafter" / "config.json").read_text())
    block = raw.get("block_size") or raw["dflash_config"]["block_size"]
    return spec["request"]["num_drafts"] or block - 1


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_fastpath_passes_every_conformance_case(name):
    """The twin's dump (float32, CPU) matches the kit at every stage of every case."""
    result = checker.check(cases.KIT / name, checker.dump_fastpath(cases.KIT / name))
    assert result["first"] is None and set(result["results"].values()) == {"ok"}, checker.report(result)


def patched(patches):
    """A port made by conformance's own replay of a known mistake: its patches, entered before the recorder
    wraps the functions they replace."""
    def run(target, drafter, request):
        with ExitStack() as stack:
            for patch in patches(drafter, target, request):
                stack.enter_context(patch)
            return cases.record_reference(target, drafter, request)[0]
    return run


def shifted_readout(target, drafter, request):
    """A port that reads its drafts from block rows 0..W-2 (next-token style) instead of 1..W-1."""
    def propose(drafter_, ctx, block, target_, count, *sampling):
        hidden = dflash.draft_block(drafter_, ctx, target_.get_input_embeddings()(block))   # (W, H)
        return target_.get_output_embeddings()(hidden[:count]).argmax(-1), None            # (count,)
    with mock.patch.object(dflash, "propose", propose):   # patched first, so the recorder wraps it
        return cases.record_reference(target, drafter, request)[0]


def rejects_after_the_recorded_rounds(target, drafter, request):
    """A port whose verification accepts nothing after the rounds the kit records: its greedy tokens are
    the same, only its acceptance differs."""
    real_verify, calls = dflash.verify, [0]

    def verify(drafts, logits, sampling, uniforms, draft_probs=None):
        calls[0] += 1   # the prefill's, then one a round
        late = calls[0] > cases.ROUNDS + 1
        return real_verify(drafts[:0] if late else drafts, logits[:1] if late else logits, sampling, uniforms,
                           None if late else draft_probs)
    with mock.patch.object(dflash, "verify", verify):   # patched first, so the recorder wraps it
        return cases.record_reference(target, drafter, request)[0]


def with_drafter_change(change):
    def run(target, drafter, request):
        change(drafter)
        return cases.record_reference(target, drafter, request)[0]
    return run


def set_each_layer(**attributes):
    def change(drafter):
        for layer in drafter.layers:
            if layer.window is not None:   # the sliding layers
                for key, value in attributes.items():
                    setattr(layer, key, value)
    return change


def greedy_verifier(accepted_of):
    """A port whose greedy verification counts accepted drafts as accepted_of(drafts, target's argmaxes) does."""
    def verify(drafts, logits, sampling, uniforms, draft_probs=None):
        chosen = logits.argmax(-1)                                                      # (k+1,)
        accepted = accepted_of(drafts, chosen)
        return accepted, int(chosen[accepted])

    def run(target, drafter, request):
        with mock.patch.object(dflash, "verify", verify):   # patched first, so the recorder wraps it
            return cases.record_reference(target, drafter, request)[0]
    return run


BROKEN_VERIFIERS = {   # greedy verifiers that compare wrongly: accepted drafts from (drafts, the target's argmaxes)
    "drafts compared with the wrong rows": lambda d, t: int((d == t[1:]).long().cumprod(0).sum()),
    "matches counted past the first miss": lambda d, t: int((d == t[:-1]).long().sum()),
}


GREEDY_CASES = ["zlab-qwen3", "zlab-new-window", "laguna", "k3-block-width", "k3-drafts-width", "zlab-new-bidirectional",
                "high-acceptance", "stop-in-block", "dflash2-high-acceptance"]


@pytest.mark.parametrize("name", sorted(BROKEN_VERIFIERS))
def test_greedy_cases_fail_a_verifier_that_compares_wrongly(name):
    """A greedy verifier that compares the drafts with the wrong rows is named at verification by every
    greedy case; one that counts matches past the first miss by every one but zlab-qwen3, whose drafts never
    match again after a miss. The designed cases name both in their first round."""
    passed = set()
    for case in GREEDY_CASES:
        target, drafter, spec = cases.load_case(cases.KIT / case)
        result = checker.check(cases.KIT / case, greedy_verifier(BROKEN_VERIFIERS[name])(target, drafter,
                                                                                                   spec["request"]))
        if result["first"] is None:
            passed.add(case)
        else:
            assert result["first"]["stage"] == "accepted", checker.report(result)
            assert result["first"]["key"] == "accepted.1" or cases.CASES[case].get("designed") is None
    assert passed == ({"zlab-qwen3"} if name == "matches counted past the first miss" else set())


def convolution_carried_over(target, drafter, request):
    """A DFlash2 port whose convolution runs the blocks as one stream: a block's first rows see the last
    block's rows, not zeros."""
    real, last = dflash.convolve, {}

    def convolve(x, taps, base, block):
        key = (base.data_ptr(), x.shape[-1], taps.shape[-2])        # each convolution of each layer, its own stream
        before = last.get(key, torch.zeros_like(x))
        last[key] = x
        both = real(torch.cat([before, x]), torch.cat([taps, taps]), base, 2 * block)   # taps of the block's rows
        return both[block:]
    with mock.patch.object(dflash, "convolve", convolve):   # patched first, so the recorder wraps it
        return cases.record_reference(target, drafter, request)[0]


def walk_from_the_mask_token(target, drafter, request):
    """A DFlash2 port that starts the selector's walk from the mask token, not the bonus."""
    real = dflash.CandidateSelector.forward
    with mock.patch.object(dflash.CandidateSelector, "forward",
                           lambda self, h, l, anchor, *rest: real(self, h, l, torch.full_like(anchor, 7), *rest)):
        return cases.record_reference(target, drafter, request)[0]


def codebooks_left_at_init(drafter):
    """A DFlash2 port that reads its codebooks as `.weight` tensors, finds none, and keeps their init."""
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.normal_(generator=torch.Generator().manual_seed(0))


def block_one_late(target, drafter, request):
    """A port whose block rows sit one position late: RoPE at start + 1 … for the block's queries and keys."""
    real = dflash.draft_block

    def draft_block(drafter_, ctx, block_embeds):
        tables = drafter_.rope_tables
        with mock.patch.object(drafter_, "rope_tables", lambda positions, dtype: tables(positions + 1, dtype)):
            return real(drafter_, ctx, block_embeds)
    with mock.patch.object(dflash, "draft_block", draft_block):   # patched first, so the recorder wraps it
        return cases.record_reference(target, drafter, request)[0]


BROKEN_PORTS = {   # pitfall: (case, broken port, the stage the checker must name, a word of its pitfall)
    "DFlash2 convolution carried over blocks": ("dflash2", convolution_carried_over, "conv_in", "carrying the last block"),
    "DFlash2 codebooks left at their init": ("dflash2", with_drafter_change(codebooks_left_at_init), "selector_scores",
                                             "codebooks"),
    "DFlash2 walk seeded with the mask token": ("dflash2", walk_from_the_mask_token, "selector_scores", "seeded"),
    "causal mask over a bidirectional block": ("zlab-qwen3", with_drafter_change(lambda d: [
        setattr(layer, "causal", True) for layer in d.layers]), "hidden", "causal"),
    "block one position late": ("zlab-qwen3", block_one_late, "hidden", "wrong positions"),
    "causality override ignored": ("zlab-new-bidirectional", with_drafter_change(lambda d: [
        setattr(layer, "causal", layer.window is not None) for layer in d.layers]), "hidden", "causality override"),
    "window on one side only": ("zlab-new-bidirectional", patched(lambda d, t, r: [mock.patch.object(
        dflash, "visible_at", checker.one_sided_visible_at)]), "hidden", "one side only"),
    "one RoPE base for every layer": ("zlab-new-bidirectional", patched(checker.rope_base_everywhere(
        lambda d, t: d.config.rope_thetas[0])), "hidden", "RoPE base"),
    "wrong layer index": ("zlab-qwen3", with_drafter_change(
        lambda d: setattr(d.config, "target_layer_ids", [i + 1 for i in d.config.target_layer_ids])),
        "features", "layer index"),
    "bonus hidden state too early": ("zlab-qwen3", patched(checker.bonus_row_early), "context", "too early"),
    "readout shifted by one": ("k3-block-width", shifted_readout, "drafts", "shifted by one"),
    "sliding layer as full attention": ("zlab-new-window", with_drafter_change(set_each_layer(causal=False, window=None)),
                                        "hidden", "full attention"),
    "no window": ("laguna", with_drafter_change(set_each_layer(window=None)), "hidden", "no window"),
    "missing Laguna per-capture norm": ("laguna", with_drafter_change(lambda d: setattr(d, "aux_hidden_norms", None)),
                                        "context", "per-capture norm"),
    "no acceptance after the recorded rounds": ("laguna", rejects_after_the_recorded_rounds, "acceptance_lengths",
                                                "rounds past the recorded ones"),
    "no input norm on the context K/V": ("laguna", with_drafter_change(
        lambda d: [setattr(layer, "context_norm", torch.nn.Identity()) for layer in d.layers]),
        "ctx_keys", "no input norm"),
    "no hidden_norm after fc": ("high-acceptance", with_drafter_change(lambda d: setattr(d, "hidden_norm", torch.nn.Identity())),
                                "context", "hidden_norm"),
}
DIAGNOSES = {   # pitfall: the one known mistake the checker must say reproduces the first difference
    "causal mask over a bidirectional block": "a causal mask over the block",
    "block one position late": "the block one position late",
    "causality override ignored": "the causality override ignored",
    "window on one side only": "the window on one side only",
    "one RoPE base for every layer": "the first layer's RoPE base in every layer",
    "sliding layer as full attention": "a sliding layer as full attention",
    "no window": "no sliding window",
    "missing Laguna per-capture norm": "no per-capture norms",
    "no hidden_norm after fc": "no hidden_norm after fc",
    "bonus hidden state too early": "the bonus's hidden state in the context a round early",
    "wrong layer index": "every capture one target layer deeper",
    "readout shifted by one": "the draft rows read one early",
}


def sampling_port(change):
    """A port whose verification changes the request's sampling (or its rule) as change(verify, drafts,
    logits, sampling, uniforms) does."""
    def run(target, drafter, request):
        real_verify = dflash.verify
        with mock.patch.object(dflash, "verify", lambda *args: change(real_verify, *args[:4])):
            return cases.record_reference(target, drafter, request)[0]
    return run


def draw_from_p(verify, drafts, logits, sampling, uniforms):   # after a rejection, p itself, not the residual
    with mock.patch.object(dflash, "residual", lambda p, q: p):
        return verify(drafts, logits, sampling, uniforms)


SAMPLING_PORTS = {
    "temperature ignored": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(1.0, s.top_p, s.top_k), u),
    "top-p ignored": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(s.temperature, 1.0, s.top_k), u),
    "top-k ignored": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(s.temperature, s.top_p, 0), u),
    "decoded greedily": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(), u),
    "drawn from p, not the residual": draw_from_p,
}


@pytest.mark.parametrize("port", sorted(SAMPLING_PORTS))
def test_the_sampled_case_fails_each_broken_sampling_port(port):
    """The sampled case's draws are not forced: a port that gets any part of the sampling wrong differs
    somewhere, while the same port without the change conforms."""
    target, drafter, spec = cases.load_case(cases.KIT / "sampled")
    result = checker.check(cases.KIT / "sampled",
                               sampling_port(SAMPLING_PORTS[port])(target, drafter, spec["request"]))
    assert result["first"] is not None and "missing" not in result["results"].values(), checker.report(result)
    same = sampling_port(lambda verify, *args: verify(*args))(target, drafter, spec["request"])
    assert checker.check(cases.KIT / "sampled", same)["first"] is None


@pytest.mark.parametrize("pitfall", sorted(BROKEN_PORTS))
def test_checker_names_the_stage_each_pitfall_breaks(pitfall):
    """A dump from a port with each pitfall the engines have met is named at the stage where it first shows,
    with that stage's pitfall text; the same port without the pitfall passes."""
    name, port, stage, word = BROKEN_PORTS[pitfall]
    target, drafter, spec = cases.load_case(cases.KIT / name)
    result = checker.check(cases.KIT / name, port(target, drafter, spec["request"]))
    assert result["first"] is not None and result["first"]["stage"] == stage, checker.report(result)
    assert "missing" not in result["results"].values() and word in result["first"]["pitfall"]
    text = checker.report(result)
    assert f"first difference: {result['first']['key']} ({stage}); usually" in text
    if pitfall in DIAGNOSES:   # the replays name the mistake made (with any that compute the same), among those tried
        found, tried = result["first"]["mistakes"]
        named = [m for m in found if m.startswith(DIAGNOSES[pitfall])]
        assert named and len(found) <= 2, text
        assert f"  {result['first']['key']} is what dflash.py computes with {named[0]}" in text


def stale_drafts_after_the_recorded_rounds(target, drafter, request):
    """A port that, after the recorded rounds, verifies the previous round's drafts, as a graph that reads its
    draft buffer before the draft kernel writes it would: the tokens stay right."""
    real, last = dflash.propose, {}

    def propose(drafter_, ctx, block, target_, count, sampling, uniforms):
        drafts, q = real(drafter_, ctx, block, target_, count, sampling, uniforms)
        stale = last.get("drafts", drafts)[:count] if ctx.length >= threshold else drafts
        last["drafts"] = drafts
        return stale, q
    threshold = len(request["prompt_ids"]) + sum(loading.read_file(
        cases.KIT / "high-acceptance" / "case.json", "case")["acceptance_lengths"][:cases.ROUNDS])
    with mock.patch.object(dflash, "propose", propose):   # patched first, so the recorder wraps it
        return cases.record_reference(target, drafter, request)[0]


def test_round_drafts_name_the_first_round_whose_drafts_differ_after_the_recorded_ones():
    """round_drafts holds every round's drafts: a port that verifies stale drafts after the recorded rounds,
    with every recorded stage and the tokens right, is named at round_drafts with its first round; a dump of
    the whole run's values alone (what a graphed run leaves) conforms when they match."""
    target, drafter, spec = cases.load_case(cases.KIT / "high-acceptance")
    result = checker.check(cases.KIT / "high-acceptance",
                               stale_drafts_after_the_recorded_rounds(target, drafter, spec["request"]))
    assert result["first"]["key"] == "round_drafts" and result["results"]["tokens"] == "ok", checker.report(result)
    assert result["first"]["note"].startswith(f"round {cases.ROUNDS + 1} is the first whose drafts differ")
    assert all(outcome == "ok" for key, outcome in result["results"].items() if key not in cases.WHOLE_RUN)
    full = cases.record_fastpath(target, drafter, spec["request"])
    whole = checker.check(cases.KIT / "high-acceptance", {k: full[k] for k in cases.WHOLE_RUN})
    assert checker.verdict(whole) and whole["compared"] == 3


def test_checker_gives_no_verdict_on_tokens_alone_and_says_how_much_it_compared():
    """A dump of tokens and acceptance lengths alone is given no verdict, even when both match: a drafter
    bug does not change the tokens the target verifies. The report says how much of the case was compared."""
    target, drafter, spec = cases.load_case(cases.KIT / "zlab-qwen3")
    full = cases.record_fastpath(target, drafter, spec["request"])
    result = checker.check(cases.KIT / "zlab-qwen3", {k: full[k] for k in ("tokens", "acceptance_lengths")})
    assert result["first"] is None and not checker.verdict(result)
    text = checker.report(result)
    assert "no verdict: only tokens and acceptance_lengths were compared" in text
    assert f"compared 2 of the case's {result['total']} values" in text and result["total"] > 40
    assert checker.verdict(checker.check(cases.KIT / "zlab-qwen3", full))


def test_a_bf16_dump_is_held_to_the_cases_bf16_bands():
    """A dump of bf16 tensors is checked as bf16: the case's float32 values rounded to bf16 differ at the
    float32 tolerances, conform at the case's bf16 bands (the exact stages still exact), and a case bf16 cannot
    hold is refused in one line naming the ones it can."""
    target, drafter, spec = cases.load_case(cases.KIT / "high-acceptance")
    full = cases.record_fastpath(target, drafter, spec["request"])
    rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.items()}
    assert checker.check(cases.KIT / "high-acceptance", rounded, dtype="float32")["first"] is not None
    result = checker.check(cases.KIT / "high-acceptance", rounded)
    assert result["dtype"] == "bfloat16" and checker.verdict(result) and result["compared"] == result["total"]
    wrong = rounded | {"drafts.1": rounded["drafts.1"].flip(0)}
    assert checker.check(cases.KIT / "high-acceptance", wrong)["first"]["stage"] == "drafts"
    with pytest.raises(DFlashError, match=r"case sampled is float32 only: bf16 moves its choices before any drafter "
                                          r"stage; check a bf16 dump on one of .*high-acceptance"):
        checker.check(cases.KIT / "sampled", rounded)


BF16_CASES = [n for n in cases.CASES if json.loads((cases.KIT / n / "case.json").read_text())["bf16"] is not None]


def reference_dump(case_dir, dtype, port=lambda target, drafter, request: cases.record_reference(
        target, drafter, request)[0]):
    """dflash.py's dump of a case in dtype (CPU): a served case's requests one after another, each prefixed."""
    target, drafter, spec = cases.load_case(case_dir, dtype)
    if "request" in spec:
        return port(target, drafter, spec["request"])
    return {f"request.{i}.{k}": v for i, request in enumerate(spec["requests"])
            for k, v in port(target, drafter, request).items()}


@pytest.mark.parametrize("name", BF16_CASES)
def test_dflash_and_fastpath_in_bf16_conform_on_every_bf16_case(name):
    """dflash.py and fastpath.py computing in bf16 (CPU) conform on every case the kit marks for bf16, each
    held to the case's bands as far as bf16 keeps its choices; the designed cases, whose margins bf16 cannot
    move, whole."""
    for dump in (reference_dump(cases.KIT / name, torch.bfloat16), checker.dump_fastpath(cases.KIT / name, torch.bfloat16)):
        result = checker.check(cases.KIT / name, dump)
        assert result["dtype"] == "bfloat16" and checker.verdict(result), checker.report(result)
        whole = name in ("high-acceptance", "dflash2-high-acceptance", "dflash2-scaled")
        assert result["compared"] == result["total"] if whole else result["compared"] >= 4, checker.report(result)
    assert set(BF16_CASES) >= {"zlab-qwen3", "dflash2", "dflash2-high-acceptance", "dflash2-scaled", "laguna", "served"}


# each known mistake -> a case whose bf16 prefix shows it (and float32 on the same case)
MISTAKE_CASES = {
    "a causal mask over the block": "zlab-qwen3", "the causality override ignored": "zlab-new-bidirectional",
    "no causal mask": "zlab-new-window", "a sliding layer as full attention": "zlab-new-window",
    "the block one position late": "zlab-qwen3", "the block one position early": "zlab-qwen3",
    "positions counted from a clipped window": "zlab-new-window", "no sliding window": "zlab-new-window",
    "the window on one side only": "zlab-new-bidirectional", "the first layer's RoPE base": "zlab-new-bidirectional",
    "the target's RoPE base": "zlab-qwen3", "no final norm": "high-acceptance",
    "the block's embeddings unscaled": "dflash2-scaled", "a convolution's taps reading a later row": "dflash2-high-acceptance",
    "the dynamic taps indexed at the source row": "dflash2-high-acceptance",
    "base_kernel's halves swapped": "dflash2-high-acceptance", "the convolution before": "dflash2-high-acceptance",
    "the convolution after": "dflash2-high-acceptance", "the second convolution's taps": "dflash2-high-acceptance",
    "the convolutions run over the residual": "dflash2-high-acceptance", "every capture one target layer": "zlab-qwen3",
    "no hidden_norm": "zlab-qwen3", "no per-capture norms": "laguna", "the bonus's hidden state": "zlab-qwen3",
    "the draft rows read before the final norm": "high-acceptance", "the draft rows read one early": "high-acceptance",
    "the target's LM head not shared": "zlab-qwen3", "the selector's candidates taken before": "dflash2-scaled",
    "the selector's pair term": "dflash2-high-acceptance", "the walk not seeded": "dflash2-high-acceptance",
    "the predecessor and successor codebooks": "dflash2-high-acceptance",
    "a DFlash2 drafter run without its selector": "dflash2-high-acceptance",
    "DFlash2's drafts verified as if proposed one-hot": "dflash2-sampled", "tokens equal to the mask id": "served",
}


@pytest.mark.parametrize("mistake", sorted(checker.MISTAKES))
def test_each_known_mistake_in_bf16_fails_and_is_named(mistake):
    """dflash.py with each known mistake made, computing in bf16, fails its case and the checker's float32 replays
    name that mistake within the case's bf16 bands (a float32 port with it matches the replay closer still). A
    mistake of the readout leaves the block's rows right, as a port's would: their values are left out of its
    dump (the replay changes them to reach the readout)."""
    name = next(case for start, case in MISTAKE_CASES.items() if mistake.startswith(start))
    made = checker.MISTAKES[mistake]

    def port(target, drafter, request):
        with ExitStack() as patches:
            for patch in made.make(drafter, target, request):
                patches.enter_context(patch)
            values = cases.record_reference(target, drafter, request)[0]
        return {k: v for k, v in values.items() if cases.stage_of(k) in made.stages or
                not (set(made.stages) <= set(checker.READOUT) and cases.stage_of(k) in ("hidden",))}
    result = checker.check(cases.KIT / name, reference_dump(cases.KIT / name, torch.bfloat16, port))
    assert result["dtype"] == "bfloat16" and result["first"] is not None, checker.report(result)
    assert mistake in result["first"]["mistakes"][0], checker.report(result)
    assert sorted(MISTAKE_CASES.values()) and set(MISTAKE_CASES.values()) <= set(BF16_CASES)


def test_checker_points_at_the_capture_and_the_round():
    """A features column that differs is named by its capture and target layer; acceptance lengths that
    part, by their first differing round, whatever their lengths."""
    target, drafter, spec = cases.load_case(cases.KIT / "zlab-qwen3")
    full = cases.record_fastpath(target, drafter, spec["request"])
    H = drafter.config.hidden_size
    features = full["features.0"].clone()
    features[2, H + 3] += 1.0                                                       # capture 1's column 3
    result = checker.check(cases.KIT / "zlab-qwen3", {"features.0": features})
    layer = drafter.config.target_layer_ids[1]
    assert result["first"]["note"] == (f"column {H + 3} is capture 1 of {len(drafter.config.target_layer_ids)}: "
                                       f"the output of target layer {layer} (0-based; HF hidden_states[{layer + 1}]), "
                                       "row 2 its position")
    lengths = full["acceptance_lengths"].tolist()
    changed = torch.tensor(lengths[:4] + [lengths[4] + 1] + lengths[5:] + [1])
    result = checker.check(cases.KIT / "zlab-qwen3", {"acceptance_lengths": changed})
    assert result["first"]["note"] == "round 5 is the first whose acceptance length differs"


def test_checker_lets_near_tied_top5_ids_come_in_either_order():
    """top5_ids are exact, but ranks whose expected logits tie within the logits' tolerance may come in either
    order (sampled, round 4, row 1: ranks 3 and 4 lie 2e-4 apart); ranks further apart may not."""
    target, drafter, spec = cases.load_case(cases.KIT / "sampled")
    dump = cases.record_fastpath(target, drafter, spec["request"])
    expected = load_file(cases.KIT / "sampled" / "expected.safetensors")
    gaps = expected["top5_logits.4"][1, :-1] - expected["top5_logits.4"][1, 1:]
    assert gaps[2] < 1e-3 < min(gaps[0], gaps[1], gaps[3])
    for ranks, conforms in (([2, 3], True), ([0, 1], False)):   # the tied pair with its logits; ids alone
        swapped = dict(dump)
        swapped["top5_ids.4"], swapped["top5_logits.4"] = dump["top5_ids.4"].clone(), dump["top5_logits.4"].clone()
        swapped["top5_ids.4"][1, ranks] = dump["top5_ids.4"][1, ranks[::-1]]
        if conforms:
            swapped["top5_logits.4"][1, ranks] = dump["top5_logits.4"][1, ranks[::-1]]
        result = checker.check(cases.KIT / "sampled", swapped)
        assert (result["first"] is None) == conforms, checker.report(result)
        assert conforms or result["first"]["key"] == "top5_ids.4"


def test_checker_takes_any_subset_and_the_cli_reports_it(tmp_path):
    """A dump of a few stages is checked on those alone (the rest reported missing); the CLI exits 0 when
    they match and 1 when one differs, naming it, or when it holds none of the case's keys (misnamed); an
    unknown case is one error line, exit 2."""
    target, drafter, spec = cases.load_case(cases.KIT / "laguna")
    full = cases.record_fastpath(target, drafter, spec["request"])
    subset = {k: v for k, v in full.items() if k.startswith(("drafts.", "accepted.")) or k == "tokens"}
    save_file(subset, tmp_path / "subset.safetensors")
    good = run_cli("check", str(tmp_path / "subset.safetensors"), "--case", "laguna", script="dflash-conformance")
    assert good.returncode == 0 and "conforms: every stage given matches" in good.stdout
    assert re.search(r"^  features\.0 +missing$", good.stdout, re.M)
    subset["drafts.2"] = subset["drafts.2"].flip(0) if len(subset["drafts.2"]) > 1 else subset["drafts.2"] + 1
    save_file(subset, tmp_path / "bad.safetensors")
    bad = run_cli("check", str(tmp_path / "bad.safetensors"), "--case", "laguna", script="dflash-conformance")
    assert bad.returncode == 1 and "first difference: drafts.2 (drafts); usually the readout" in bad.stdout
    save_file({f"drafts_{k.replace('.', '_')}": v for k, v in subset.items()}, tmp_path / "misnamed.safetensors")
    misnamed = run_cli("check", str(tmp_path / "misnamed.safetensors"), "--case", "laguna", script="dflash-conformance")
    assert misnamed.returncode == 1 and "nothing compared: the dump holds none of the case's keys" in misnamed.stdout
    unknown = run_cli("check", str(tmp_path / "bad.safetensors"), "--case", "nope", script="dflash-conformance")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines()[-1].startswith(
        "error: --case = 'nope' is not in ")


def test_a_graphed_dump_needs_a_greedy_case_and_cuda(tmp_path):
    """`dump-fastpath --graphs` refuses a sampled case (a CUDA generator draws other uniforms) and, without
    CUDA, says so in one line: exit 2, no file written."""
    out = tmp_path / "g.safetensors"
    sampled = run_cli("dump-fastpath", "--graphs", "--case", "sampled", "--out", str(out), script="dflash-conformance")
    assert sampled.returncode == 2 and sampled.stderr.strip().splitlines()[-1] == (
        "error: --graphs: case sampled is sampled, and a CUDA generator draws other uniforms than the kit's CPU one; "
        "give a greedy case")
    if not torch.cuda.is_available():
        greedy = run_cli("dump-fastpath", "--graphs", "--case", "high-acceptance", "--out", str(out),
                         script="dflash-conformance")
        assert greedy.returncode == 2 and greedy.stderr.strip().splitlines()[-1] == (
            "error: --graphs: no CUDA device (the graphs are captured on CUDA only)")
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_fastpath_drafts_what_the_kit_drafts_round_by_round_on_cuda():
    """fastpath.py through its compiled, captured graphs (float32, CUDA) drafts every greedy case's drafts
    round by round, with its acceptance lengths and tokens: the kit's graphed-against-eager comparison. (The
    Laguna case's MoE target routes on the host, so its step runs eagerly and is not graphed.)"""
    for name in cases.CASES:
        spec = json.loads((cases.KIT / name / "case.json").read_text())
        if "request" not in spec or spec["request"]["temperature"] > 0 or cases.CASES[name]["target"] == "laguna":
            continue
        dump = cases.record_graphed(cases.KIT / name, spec["request"])
        result = checker.check(cases.KIT / name, dump, diagnose=False)
        assert checker.verdict(result) and result["compared"] == 3, (name, checker.report(result))


def served_port(state_carried=False, rows_mixed=False):
    """An engine instance serving the served case's requests: one after another through dflash.py, keeping the
    drafter's context from one request to the next (state_carried), or as a batch whose rows each commit the
    next row's acceptance count (rows_mixed: each row's verification takes the next row's a in that round)."""
    def dump(target, drafter, spec):
        out, real_empty, made = {}, dflash.DraftContext.empty, []
        for i, request in enumerate(spec["requests"]):
            real_verify, rounds = dflash.verify, []

            def verify(drafts, logits, sampling, uniforms, draft_probs=None):
                accepted, token = real_verify(drafts, logits, sampling, uniforms, draft_probs)
                rounds.append(accepted)
                if not rows_mixed or len(rounds) == 1:   # the prefill's
                    return accepted, token
                other = spec["outcomes"][(i + 1) % len(spec["requests"])]["acceptance_lengths"]
                a = min(other[len(rounds) - 2] - 1 if len(rounds) - 2 < len(other) else 0, len(drafts))
                return a, int(logits[a].argmax())

            def empty(drafter_, device):
                made.append(made[-1] if made and state_carried else real_empty(drafter_, device))
                return made[-1]
            with mock.patch.object(dflash, "verify", verify), \
                    mock.patch.object(dflash.DraftContext, "empty", staticmethod(empty)):
                values = cases.record_reference(target, drafter, request)[0]
            out |= {f"request.{i}.{k}": v for k, v in values.items()}
        return out
    return dump


def test_the_served_case_catches_state_carried_between_requests_and_rows_mixed_in_a_batch():
    """The served case's requests, each checked against its own batch-1 run: fastpath.py's held Decoder serving
    them one after another conforms; an engine that keeps the drafter's context between requests fails at the
    second request's first round, and one that applies a row's acceptance to another row fails at the first
    round where the rows' acceptances differ; the checker names each serving mistake."""
    kit = cases.KIT / "served"
    assert checker.verdict(checker.check(kit, checker.dump_fastpath(kit)))
    target, drafter, spec = cases.load_case(kit)
    assert checker.verdict(checker.check(kit, served_port()(target, drafter, spec)))
    for port, key, named in ((served_port(state_carried=True), "request.1.", "the drafter's context not cleared"),
                             (served_port(rows_mixed=True), "request.0.accepted.1", "a row's acceptance applied")):
        result = checker.check(kit, port(target, drafter, spec))
        assert result["first"] is not None and result["first"]["key"].startswith(key), checker.report(result)
        if key != "request.0.accepted.1":   # request 0 is always first, so its own replays run there
            assert any(m.startswith(named) for m in result["first"]["mistakes"][0]), checker.report(result)
    mixed = checker.check(kit, {k: v for k, v in served_port(rows_mixed=True)(target, drafter, spec).items()
                                if not k.startswith("request.0.")})
    assert mixed["first"]["key"].startswith("request.1.") or mixed["first"]["key"].startswith("request.2.")
    assert any(m.startswith("a row's acceptance applied") for m in mixed["first"]["mistakes"][0]), checker.report(mixed)


def test_a_difference_says_which_rows_and_columns_and_what_the_pattern_is():
    """A differing stage prints its rows and columns compactly: rows shifted by a position are whole rows; one
    capture's block of features columns is a block of columns; a small drift over everything is rounding."""
    target, drafter, spec = cases.load_case(cases.KIT / "zlab-qwen3")
    full = cases.record_fastpath(target, drafter, spec["request"])
    H, tol = drafter.config.hidden_size, 1e-4
    hidden = full["hidden.1"].clone()
    hidden[3:] = hidden[2:-1].clone()                                               # rows 3.. read one early
    assert checker.spread(hidden, full["hidden.1"], tol).startswith(f"rows 3-7 of 8, columns all {H}, up to ")
    assert "(whole rows: a position, a mask or rows read shifted)" in checker.spread(hidden, full["hidden.1"], tol)
    features = full["features.0"].clone()
    features[:, H:2 * H] *= 1.5                                                     # capture 1 only
    assert checker.spread(features, full["features.0"], tol).startswith(
        f"rows all 6, columns {H}-{2 * H - 1} of {3 * H}, up to ")
    drift = full["hidden.1"] * (1 + 3e-4)
    assert checker.spread(drift, full["hidden.1"], tol).endswith(
        "(rounding beyond the case's band: a reduction, norm or softmax below float32?)")
    result = checker.check(cases.KIT / "zlab-qwen3", full | {"hidden.1": hidden}, diagnose=False)
    assert "DIFFERS at [3, 0]" in checker.report(result) and "; rows 3-7 of 8" in checker.report(result)


def test_the_cli_checks_bf16_dumps_writes_single_cases_and_refuses_float32_only_ones(tmp_path):
    """`check` takes a bf16 dump as bf16 (or --dtype says so); `write --case` rewrites the cases named; a bf16
    dump of a float32-only case is one error line; an unknown case to write, another."""
    target, drafter, spec = cases.load_case(cases.KIT / "dflash2-high-acceptance", torch.bfloat16)
    save_file({k: v.contiguous() for k, v in cases.record_reference(target, drafter, spec["request"])[0].items()},
              tmp_path / "bf16.safetensors")
    good = run_cli("check", str(tmp_path / "bf16.safetensors"), "--case", "dflash2-high-acceptance",
                   script="dflash-conformance")
    assert good.returncode == 0 and "(bf16: the case's bf16 bands)" in good.stdout and "conforms" in good.stdout
    strict = run_cli("check", str(tmp_path / "bf16.safetensors"), "--case", "dflash2-high-acceptance", "--dtype",
                     "float32", script="dflash-conformance")
    assert strict.returncode == 1
    only32 = run_cli("check", str(tmp_path / "bf16.safetensors"), "--case", "sampled", script="dflash-conformance")
    assert only32.returncode == 2 and "case sampled is float32 only" in only32.stderr.strip().splitlines()[-1]
    checker.main(["--kit", str(tmp_path / "kit"), "write", "--case", "high-acceptance"])
    assert sorted(p.name for p in (tmp_path / "kit").iterdir()) == ["high-acceptance"]
    unknown = run_cli("--kit", str(tmp_path / "kit"), "write", "--case", "nope", script="dflash-conformance")
    assert unknown.returncode == 2 and "--case: ['nope'] are not cases" in unknown.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fastpath_in_bf16_on_cuda_conforms_on_every_bf16_case():
    """fastpath.py in bf16 on CUDA, its steps eager through its Triton kernels, conforms on every greedy case the
    kit marks for bf16, held to the bands the CPU runs measured (the sampled one needs the CPU's uniforms)."""
    for name in BF16_CASES:
        spec = json.loads((cases.KIT / name / "case.json").read_text())
        if any(r["temperature"] > 0 for r in spec.get("requests") or [spec["request"]]):
            continue
        result = checker.check(cases.KIT / name, checker.dump_fastpath(cases.KIT / name, torch.bfloat16, "cuda"))
        assert checker.verdict(result), (name, checker.report(result))


def test_the_porting_docs_cost_table_is_the_committed_json():
    """docs/porting.md's table of what the field's porting bugs cost holds the committed costs JSON's figures, a
    row for each bug `costs` runs, each bug one of the checker's known mistakes (or the served one)."""
    costs = json.loads((cases.KIT.parents[2] / "results" / "conformance" / "field-bugs-cpu.json").read_text())
    docs = (cases.KIT.parents[2] / "docs" / "porting.md").read_text()
    assert set(costs["bugs"]) == {"none"} | set(checker.FIELD_BUGS)
    assert all(name is None or name in checker.MISTAKES for name in checker.FIELD_BUGS.values())
    for bug, row in costs["bugs"].items():
        line = next(line for line in docs.splitlines() if line.startswith(f"| {bug} |"))
        assert (f"| {row['tau']:.2f} |" in line) if row["applies"] else "not shown" in line, line


# The independent port's planted mistakes -> a case that shows each, and the checker's name for it
PORT_MISTAKES = {
    "conv_future_row": ("dflash2-high-acceptance", "a convolution's taps reading a later row"),
    "conv_taps_at_source": ("dflash2-high-acceptance", "the dynamic taps indexed at the source row"),
    "conv_base_halves_swapped": ("dflash2-high-acceptance", "base_kernel's halves swapped"),
    "conv_pre_skipped": ("dflash2-high-acceptance", "the convolution before each sublayer skipped"),
    "conv_post_skipped": ("dflash2-high-acceptance", "the convolution after each sublayer skipped"),
    "conv_post_taps_from_output": ("dflash2-high-acceptance", "the second convolution's taps from the sublayer's"),
    "conv_over_residual": ("dflash2-high-acceptance", "the convolutions run over the residual stream"),
    "selector_predecessor_argmax": ("dflash2-high-acceptance", "the selector's pair term with each row's own argmax"),
    "selector_bonus_skipped": ("dflash2-high-acceptance", "the walk not seeded with the bonus"),
    "codebooks_swapped": ("dflash2-high-acceptance", "the predecessor and successor codebooks swapped"),
    "rows_before_final_norm": ("dflash2-high-acceptance", "the draft rows read before the final norm"),
    "rows_shifted_to_anchor": ("dflash2-high-acceptance", "the draft rows read one early"),
    "candidates_before_scaling": ("dflash2-scaled", "the selector's candidates taken before output_multiplier"),
    "embedding_scale_ignored": ("dflash2-scaled", "the block's embeddings unscaled"),
    "one_hot_verification": ("dflash2-sampled", "DFlash2's drafts verified as if proposed one-hot"),
    "no_selector": ("dflash2-high-acceptance", "a DFlash2 drafter run without its selector"),
    "layer_one_off": ("dflash2", "every capture one target layer deeper"),
    "target_rope": ("dflash2", "the target's RoPE base for the drafter's"),
    "state_not_reset": ("served", "the drafter's context not cleared between requests"),
    "acceptance_from_other_row": ("served", "a row's acceptance applied to another row"),
}


def port_dump(name: str, mistakes=frozenset(), dtype=torch.float32, batched=False):
    import docs_port
    if name == "served":
        return docs_port.serve(cases.KIT / name, dtype, frozenset(mistakes), batched=batched)
    return docs_port.run(cases.KIT / name, dtype, frozenset(mistakes))


def test_a_port_written_from_the_docs_conforms_in_float32_and_bf16():
    """tests/docs_port.py, a DFlash/DFlash2 port written from docs/porting.md and the paper without the reference's
    source, conforms on every DFlash and DFlash2 case in float32 (served: one after another and as a batch),
    and computing in bf16 on the designed ones."""
    for name in [n for n in cases.CASES if n != "laguna"]:
        for batched in ((False, True) if name == "served" else (False,)):
            result = checker.check(cases.KIT / name, port_dump(name, batched=batched))
            assert checker.verdict(result), (name, batched, checker.report(result))
    for name in ("high-acceptance", "dflash2-high-acceptance", "dflash2-scaled"):
        result = checker.check(cases.KIT / name, port_dump(name, dtype=torch.bfloat16))
        assert result["dtype"] == "bfloat16" and checker.verdict(result), (name, checker.report(result))


@pytest.mark.parametrize("mistake", sorted(PORT_MISTAKES))
def test_each_mistake_planted_in_a_port_from_the_docs_fails_and_is_named(mistake):
    """Each DFlash2 mistake and each of the field's porting bugs, planted in tests/docs_port.py (not dflash.py),
    fails a case and the checker's replays name it (the convolutions' and the walk's with the port computing in
    bf16, the rest in float32; every mistake in bf16 is held on dflash.py above); the serving mistakes fail the
    served case one after another (state) or as a batch (rows), and are named."""
    name, named = PORT_MISTAKES[mistake]
    dtype = torch.bfloat16 if mistake.startswith(("conv_", "selector_")) else torch.float32   # bf16: a sample
    dump = port_dump(name, {mistake}, dtype, batched=mistake == "acceptance_from_other_row")
    result = checker.check(cases.KIT / name, dump)
    assert result["first"] is not None, (dtype, checker.report(result))
    assert any(m.startswith(named) for m in result["first"]["mistakes"][0]), (dtype, checker.report(result))
