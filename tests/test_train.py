"""train.py: features, the loss through the frozen head, the loop, the CLI, and training that works end to end."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dflash
from conftest import (
    MASK,
    T_LAYERS,
    H,
    assert_same_tokens,
    forward_with_capture,
    fresh_drafter,
    hf_greedy,
    run_train_cli,
    target_config,
)
from dflash import DFlashError
from dflash_reference import loading
from dflash_reference.training import distill, objective, train


def test_batched_capture_equals_one_sequence_at_a_time(llama_data):
    """The padded batch pass gives each sequence's features at its real positions exactly as a pass
    over that sequence alone (the context the drafter sees at inference), its labels the target's
    argmax, and its teacher states what the LM head turns into the target's own logits there."""
    _, target, sequences = llama_data
    ids, lengths = objective.pad_sequences(sequences[:5])
    layer_ids = [1, 2, 4]
    # (Bt, N, n·H), (Bt, N), (Bt, N, H)
    features, labels, teacher = distill.capture_features(target, ids, lengths, layer_ids, torch.float32,
                                                       with_teacher=True)
    assert features.shape == (5, int(lengths.max()), 3 * H) and teacher.shape == (5, int(lengths.max()), H)
    head = target.get_output_embeddings()
    for b, seq in enumerate(sequences[:5]):
        n = len(seq.ids)
        with torch.no_grad():
            logits, alone = forward_with_capture(target, seq.ids, layer_ids)
            teacher_logits = head(teacher[b, 1:n])                                     # (n-1, V)
        torch.testing.assert_close(features[b, :n], alone, rtol=1e-5, atol=1e-5)
        # the target's own label of position p is its argmax at p - 1: the greedy text itself here
        assert labels[b, 1:n].tolist() == logits[:-1].argmax(-1).tolist()
        assert labels[b, seq.prompt_len:n].tolist() == seq.ids[seq.prompt_len:].tolist()
        assert labels[b, 0] == objective.IGNORE and (labels[b, n:] == objective.IGNORE).all()
        # the teacher at p is the target's state at p - 1: its logits there, zeros where there is no label
        torch.testing.assert_close(teacher_logits, logits[:-1], rtol=1e-5, atol=1e-5)
        assert not teacher[b, 0].any() and not teacher[b, n:].any()
    assert distill.capture_features(target, ids, lengths, layer_ids, torch.float32)[2] is None


def test_time_budget_refits_the_schedule():
    """At the measured pace the plan shrinks to what fits the budget, warm-up with it; a faster pace
    later lets it grow back, never past the planned steps; a run over budget stops where it is; the
    seconds spent capturing features do not count as the pace of a step."""
    class Bar:
        total = 1000
    plan = {"planned": 1000, "total": 1000, "warmup": 40}
    train.fit_to_budget(plan, 25, 5.0, train.TrainConfig(time_budget=60.0), Bar)
    assert (plan["total"], plan["warmup"], Bar.total) == (300, 12, 300)  # 25 + 55 s at 0.2 s per step
    train.fit_to_budget(plan, 100, 10.0, train.TrainConfig(time_budget=60.0), Bar)
    assert (plan["total"], plan["warmup"]) == (600, 24)                   # 100 + 50 s at 0.1 s per step
    train.fit_to_budget(plan, 100, 1.0, train.TrainConfig(time_budget=60.0), Bar)
    assert plan["total"] == 1000                                          # the plan caps it
    train.fit_to_budget(plan, 100, 70.0, train.TrainConfig(time_budget=60.0), Bar)
    assert plan["total"] == 100                                           # over already: stop here
    plan = {"planned": 5000, "total": 5000, "warmup": 200}
    train.fit_to_budget(plan, 25, 45.0, train.TrainConfig(time_budget=150.0), Bar, overhead=40.0)
    assert plan["total"] == 25 + 525                                      # 0.2 s per step once the capture is left out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_loss_waits_for_its_own_step_only():
    """A queued step's loss (train.StepLoss) is read back once its own kernels are done, while about a
    second of GPU work queued after it still runs (the stream is still busy when the value arrives); a
    plain .item() waits for that work too."""
    loss = torch.full((), 3.0, device="cuda") * 2
    pending = train.StepLoss(loss)
    torch.cuda._sleep(2_000_000_000)                                               # ~1 s at the H200's clock
    assert pending.item() == 6.0
    assert not torch.cuda.current_stream().query()                                 # the sleep still runs
    assert loss.item() == 6.0
    assert torch.cuda.current_stream().query()


def test_cached_features_train_exactly_like_a_target_pass_per_step(llama_data):
    """Training on features captured once (whole set, or shards of a few sequences) gives the same
    loss, step by step, as running the frozen target on every step's batch (float64)."""
    path, _, sequences = llama_data
    target = loading.load_target(str(path), torch.float64, "cpu")
    runs = {}
    for name, store, cache_tokens in [("live", distill.LiveFeatures, None), ("cached", distill.CachedFeatures, None),
                                      ("sharded", distill.CachedFeatures, 120)]:
        _, drafter = fresh_drafter(target)
        drafter.double()
        cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=cache_tokens)
        runs[name] = [h["loss"] for h in train.train(target, drafter, sequences[:16], [], cfg, progress=False,
                                                     store=store)]
    assert len(runs["live"]) == 8 and runs["live"][-1] < runs["live"][0]
    assert runs["cached"] == pytest.approx(runs["live"], rel=1e-10)
    assert len(train.shards(list(range(16)), sequences[:16], 120)) > 2
    _, drafter = fresh_drafter(target)
    cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=120)
    live_sharded = [h["loss"] for h in train.train(target, drafter.double(), sequences[:16], [], cfg, progress=False,
                                                   store=distill.LiveFeatures)]
    assert runs["sharded"] == pytest.approx(live_sharded, rel=1e-10)


def test_distillation_trains_alike_from_the_cache_and_a_target_pass(llama_data):
    """Logit distillation (cfg.soft_labels) trains on teacher states cached with the features exactly as
    on a target pass per step (float64); its loss is the KL to the target's distribution, not the
    cross-entropy to its argmax, and it falls."""
    path, _, sequences = llama_data
    target = loading.load_target(str(path), torch.float64, "cpu")
    runs = {}
    for name, store, cache_tokens, soft in [("live", distill.LiveFeatures, None, True),
                                            ("cached", distill.CachedFeatures, None, True),
                                            ("hard", distill.CachedFeatures, None, False)]:
        _, drafter = fresh_drafter(target)
        cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=cache_tokens,
                                soft_labels=soft)
        runs[name] = [h["loss"] for h in train.train(target, drafter.double(), sequences[:16], [], cfg, progress=False,
                                                     store=store)]
    assert len(runs["live"]) == 8 and runs["live"][-1] < runs["live"][0]
    assert runs["cached"] == pytest.approx(runs["live"], rel=1e-10)
    # the first step's batch and drafter are the same: near-uniform drafts are closer to the target's
    # distribution than to its argmax
    assert runs["live"][0] < runs["hard"][0] - 0.1


def test_an_epoch_starts_with_the_shard_still_cached(llama_data, monkeypatch):
    """With features in two shards, every epoch after the first begins with the shard the one before
    ended on, whose features are still held: 3 epochs capture 4 times, not 6. Each epoch still trains
    every sequence once, and the losses are those of a target pass per step (float64)."""
    path, _, sequences = llama_data
    target = loading.load_target(str(path), torch.float64, "cpu")
    sequences = sequences[:16]
    assert len(train.shards(list(range(16)), sequences, 300, 4)) == 2
    captured, trained = [], []
    capturing = lambda store: lambda target, seqs, *args: captured.append(len(seqs)) or store(target, seqs, *args)
    real_blocks = objective.make_blocks
    monkeypatch.setattr(train, "make_blocks", lambda seqs, *args, **kwargs: trained.extend(map(id, seqs))
                        or real_blocks(seqs, *args, **kwargs))
    losses = {}
    for name, store in [("cached", distill.CachedFeatures), ("live", distill.LiveFeatures)]:
        _, drafter = fresh_drafter(target)
        cfg = train.TrainConfig(epochs=3, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=300)
        captured.clear(), trained.clear()
        losses[name] = [h["loss"] for h in train.train(target, drafter.double(), sequences, [], cfg, progress=False,
                                                       store=capturing(store))]
        assert len(captured) == 4 and sum(captured) == 32, captured
        assert len(losses[name]) == 12 and [sorted(trained[16 * e:16 * (e + 1)]) for e in range(3)] == \
            [sorted(map(id, sequences))] * 3
    assert losses["cached"] == pytest.approx(losses["live"], rel=1e-10)
    order, cached = [5, 2, 9, 0, 7, 1, 3, 8, 4, 6], [1, 4, 6, 0]
    runs = train.epoch_shards(order, cached, [objective.Sequence(torch.zeros(10, dtype=torch.long), 1)] * 10, 40, 2)
    assert runs == [[0, 1, 4, 6], [5, 2, 9, 7], [3, 8]] and train.epoch_shards(order, [], [], None) == [order]


def test_each_heldout_estimate_sees_the_weights_of_its_own_step(llama_data, monkeypatch):
    """On CUDA train reads a step's loss back only once the next step is queued, so that the host never
    waits for the step it has just queued (here on CPU, the same path). A held-out estimate still comes
    before the next step: the one at step s walks the drafter after exactly s optimizer steps, and every
    step has its loss and pace."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target)
    assert train.reads_back_late(torch.device("cuda")) and not train.reads_back_late(torch.device("cpu"))
    monkeypatch.setattr(train, "reads_back_late", lambda device: True)
    steps_taken, real_step = [0], torch.optim.AdamW.step

    def counting_step(self, *args, **kwargs):
        steps_taken[0] += 1
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    monkeypatch.setattr(train, "heldout_entry", lambda *args: {"heldout_tau": float(steps_taken[0])})
    cfg = train.TrainConfig(epochs=3, batch_size=4, anchors=6, lr=3e-3, eval_every=4)
    history = train.train(target, drafter, sequences[:20], sequences[-4:], cfg, progress=False)
    assert [h["step"] for h in history] == list(range(1, 16))
    assert {h["step"]: h["heldout_tau"] for h in history if "heldout_tau" in h} == {4: 4.0, 8: 8.0, 12: 12.0, 15: 15.0}
    assert all(math.isfinite(h["loss"]) and h["blocks_per_s"] > 0 for h in history)


def test_feature_shards_hold_whole_batches():
    """Feature shards stay within their token budget and hold whole batches, so that only an epoch's last
    batch is short; a batch over the budget still makes a shard of its own; no budget is one shard."""
    sequences = [objective.Sequence(torch.zeros(n, dtype=torch.long), 1) for n in [30, 10, 25, 40, 5, 50, 20, 15, 35, 45, 12]]
    order = [3, 0, 7, 10, 1, 5, 9, 2, 8, 4, 6]
    runs = train.shards(order, sequences, 150, batch_size=3)   # batches of 85, 72, 105 and 25 tokens
    assert runs == [[3, 0, 7], [10, 1, 5], [9, 2, 8, 4, 6]]
    assert all(sum(len(sequences[i].ids) for i in run) <= 150 for run in runs)
    # a sequence at a time, the same budget cuts inside a batch: 107 + 50 > 150
    assert [len(run) for run in train.shards(order, sequences, 150)] == [5, 3, 3]
    # a batch over the budget (105 of 100) is a shard of its own
    assert train.shards(order, sequences, 100, batch_size=3) == [[3, 0, 7], [10, 1, 5], [9, 2, 8], [4, 6]]
    assert train.shards(order, sequences, None, batch_size=3) == [order]


def test_a_batch_without_a_labelled_block_is_skipped(llama_data):
    """A batch whose responses are all one token long has no block to learn from: training takes no
    step on it (no 0/0 loss that would turn the weights to NaN) and goes on with the next batch."""
    path, target, sequences = llama_data
    stubs = [objective.Sequence(s.ids[:s.prompt_len + 1], s.prompt_len) for s in sequences[4:8]]   # 1-token answers
    _, drafter = fresh_drafter(target)
    cfg = train.TrainConfig(epochs=1, batch_size=1, anchors=6, lr=3e-3, eval_every=100)
    history = train.train(target, drafter, sequences[:4] + stubs, [], cfg, progress=False)
    assert len(history) == 8   # the planned steps, all on the four real answers
    assert all(math.isfinite(h["loss"]) and h["blocks"] > 0 for h in history)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_padded_shapes_train_exactly_like_unpadded(llama_data):
    """Rounding each step's context length and block count up (pad_shapes: zero features and IGNORE
    labels past the ends, unlabelled blocks at anchor 0) gives the same loss step by step (float64),
    and the history counts only the real blocks."""
    path, _, sequences = llama_data
    target = loading.load_target(str(path), torch.float64, "cpu")
    runs, blocks = {}, {}
    for pad in [(1, 1), (16, 7)]:
        _, drafter = fresh_drafter(target)
        cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, pad_shapes=pad)
        history = train.train(target, drafter.double(), sequences[:16], [], cfg, progress=False)
        runs[pad], blocks[pad] = [h["loss"] for h in history], [h["blocks"] for h in history]
    assert runs[(16, 7)] == pytest.approx(runs[(1, 1)], rel=1e-10) and runs[(1, 1)][-1] < runs[(1, 1)][0]
    assert blocks[(16, 7)] == blocks[(1, 1)] and any(b % 7 for b in blocks[(1, 1)])   # padding happened, uncounted
    g = torch.Generator().manual_seed(0)
    padded = objective.make_blocks(sequences[:3], 5, 6, 95, g, pad_to=8)
    assert len(padded.anchors) % 8 == 0 and (padded.labels[15:] == objective.IGNORE).all()
    uneven = objective.make_blocks(sequences[:3], 5, 6, 95, anchor_lists=[[2, 3, 4, 5], [2], [2, 3]], pad_to=8)
    assert uneven.sequence.tolist() == [0, 0, 0, 0, 1, 2, 2, 1] and uneven.anchors[7] == 0   # to the fewest first
    assert uneven.sequence.bincount().max() == 4   # the packed forward's longest run did not grow
    features, labels, teacher = objective.pad_positions(torch.ones(2, 10, 4), torch.zeros(2, 10, dtype=torch.long),
                                                    torch.ones(2, 10, 3), 16)
    assert features.shape == (2, 16, 4) and features[:, 10:].eq(0).all() and labels[:, 10:].eq(objective.IGNORE).all()
    assert teacher.shape == (2, 16, 3) and teacher[:, 10:].eq(0).all() and teacher[:, :10].eq(1).all()
    assert objective.pad_positions(torch.ones(2, 10, 4), torch.zeros(2, 10, dtype=torch.long), None, 16)[2] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_training_follows_eager_on_cuda(llama_data):
    """train --compile (the drafter's forward through inductor, dynamic shapes) on CUDA: the same
    steps as eager under the same bf16 autocast, loss for loss within bf16 rounding, lowering the
    loss; the compiled module saves the checkpoint's own parameter names."""
    path, _, sequences = llama_data
    target = loading.load_target(str(path), torch.float32, "cuda")
    runs = {}
    for compiled in (False, True):
        _, drafter = fresh_drafter(target, num_layers=2)
        cfg = train.TrainConfig(epochs=3, batch_size=4, anchors=6, lr=3e-3, eval_every=100, compile=compiled)
        runs[compiled] = [h["loss"] for h in train.train(target, drafter, sequences[:16], [], cfg, progress=False)]
    names = set(loading.checkpoint_tensors(drafter, {"architectures": ["DFlashDraftModel"]}))   # the compiled one's
    assert len(runs[True]) == 12 and runs[True][-1] < runs[True][0]
    assert runs[True] == pytest.approx(runs[False], rel=3e-2)
    assert not any("_orig_mod" in name for name in names)


def test_heldout_split_keeps_every_answer_to_a_heldout_prompt_out_of_training():
    """The held-out set is the greedy answers to the last prompts answered greedily; the sampled
    answers to those prompts do not train either."""
    seqs = [objective.Sequence(torch.arange(k + 3), 1) for k in range(6)]
    meta = {"prompt_indices": [10, 11, 12, 10, 11, 12], "temperatures": [0.0, 0.0, 0.0, 0.8, 0.8, 0.8]}
    training, heldout, held = train.heldout_split(seqs, meta, 2)
    assert held == [11, 12] and heldout == [seqs[1], seqs[2]] and training == [seqs[0], seqs[3]]
    with pytest.raises(DFlashError, match=r"--heldout = 3 must be in 0\.\.2"):
        train.heldout_split(seqs, meta, 3)
    sampled = {"prompt_indices": [10, 11, 12], "temperatures": [0.8] * 3}   # only sampled answers: none to hold out
    assert train.heldout_split(seqs[3:], sampled, 0) == (seqs[3:], [], [])
    with pytest.raises(DFlashError, match=r"--heldout = 1 must be in 0\.\.0 \(x has 0 greedy answers\)"):
        train.heldout_split(seqs[3:], sampled, 1, "x")


def test_heldout_tokens_cut_each_answer_after_its_prompt():
    """`--heldout-tokens N` walks each held-out answer's first N response tokens: the prompt stays
    whole, a shorter answer stays as it is."""
    seqs = [objective.Sequence(torch.arange(10), 3), objective.Sequence(torch.arange(5), 4)]
    cut = train.first_response_tokens(seqs, 4)
    assert [q.ids.tolist() for q in cut] == [list(range(7)), list(range(5))]
    assert [q.prompt_len for q in cut] == [3, 4]


def replay_matches_generate(target, drafter, sequences) -> set[int]:
    """The held-out estimate replays decoding: its rounds on the target's greedy text are exactly
    generate's rounds that draft a full block. Returns the accepted counts seen."""
    K = drafter.config.block_size - 1
    replayed = train.heldout_rounds(target, drafter, sequences)
    for seq, walked in zip(sequences, replayed):
        response = seq.ids[seq.prompt_len:].tolist()   # + 1: a round's bonus may fall just past the text
        gen = dflash.generate(target, drafter, seq.ids[:seq.prompt_len].tolist(), len(response) + 1)
        assert gen.tokens[:len(response)] == response
        assert walked == [r["accepted"] for r in gen.rounds if len(r["draft"]) == K]
    tau, acceptance = train.estimate_acceptance(target, drafter, sequences)
    accepted = [L for walked in replayed for L in walked]
    assert tau == pytest.approx(1 + sum(accepted) / len(accepted))
    assert acceptance == pytest.approx([sum(L > k for L in accepted) / len(accepted) for k in range(K)])
    return set(accepted)


def test_training_lowers_loss_and_saves_a_lossless_zlab_drafter(llama_data, tmp_path):
    """A few steps lower the loss on fixed blocks, leave the target untouched, and write a z-lab
    checkpoint that loading.load_drafter loads and dflash.generate decodes with, equal to HF greedy."""
    _, target, sequences = llama_data
    raw, drafter = fresh_drafter(target)
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    fixed = objective.make_blocks(sequences, 8, 4, MASK)
    weights = objective.position_weights(4, 2.0)

    def fixed_loss():
        with torch.no_grad():
            features, _, _ = distill.capture_features(target, fixed.ids, fixed.lengths, drafter.config.target_layer_ids,
                                                    torch.float32, with_labels=False)
            return objective.block_loss(target, train.draft_hidden(target, drafter, fixed, features), fixed.labels,
                                    weights).item()

    before = fixed_loss()
    history = train.train(target, drafter, sequences, sequences[-4:],
                          train.TrainConfig(epochs=4, batch_size=4, anchors=8, lr=3e-3, eval_every=12), progress=False)
    after = fixed_loss()
    assert after < 0.5 * before, (before, after)        # observed 22.1 -> 5.3
    assert len(history) == 24 and all("heldout_tau" in h for h in history[11::12])
    assert all(torch.equal(v, frozen[k]) for k, v in target.state_dict().items())
    seen = replay_matches_generate(target, drafter, sequences[:8])
    assert 0 in seen and len(seen) >= 2, seen           # rounds of different lengths were walked

    loading.save_drafter(drafter, raw, tmp_path / "d", torch.float32)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert set(config) >= {"architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
                           "rope_theta", "layer_types", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size"}
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert set(config["dflash_config"]) == {"block_size", "mask_token_id", "target_layer_ids"}
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == dflash.default_layer_ids(T_LAYERS, 3)
    assert config["num_target_layers"] == T_LAYERS and set(config["layer_types"]) == {"full_attention"}
    loaded = loading.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, drafter.state_dict()[name], rtol=0, atol=0)
    for seq in sequences[:4]:
        prompt = seq.ids[:seq.prompt_len].tolist()
        assert_same_tokens(dflash.generate(target, loaded, prompt, 20).tokens, hf_greedy(target, prompt, 20))


def cycles_and_target():
    """A tiny Llama trained for a few seconds to continue 3 token cycles that share tokens, so
    that the next token depends on the last two (a drafter must read its context)."""
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(0)
    while True:   # draw until every pair of consecutive tokens occurs once, so it fixes the next token
        cycles = [(8 + torch.randperm(16, generator=g)[:10]).tolist() for _ in range(3)]
        pairs = [(c[i - 1], c[i]) for c in cycles for i in range(10)]
        if len(set(pairs)) == len(pairs):
            break
    assert len({t for c in cycles for t in c}) <= 16              # while the last token alone does not

    def rotation(c, start, length):
        return [c[(start + i) % 10] for i in range(length)]

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config("llama"))
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for _ in range(150):
        picks = torch.randint(0, 3, (32,), generator=g).tolist()
        starts = torch.randint(0, 10, (32,), generator=g).tolist()
        ids = torch.tensor([rotation(cycles[p], s, 24) for p, s in zip(picks, starts)])
        loss = target(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return cycles, rotation, target.eval().requires_grad_(False)


def test_trained_drafter_accepts_several_tokens_per_round():
    """On a target whose greedy text is predictable, a drafter trained for a few seconds drafts
    most of each block: τ from dflash.generate on unseen prompt lengths well above 1."""
    cycles, rotation, target = cycles_and_target()
    prompts = [rotation(c, s, 5) for c in cycles for s in range(10)]
    sequences = distill.distill_ids(target, prompts, 30, pad_id=0)
    follows = [seq.ids[seq.prompt_len:].tolist() == rotation(cycles[i // 10], i % 10 + 5, 30)
               for i, seq in enumerate(sequences)]
    assert sum(follows) >= 27, "the tiny target did not learn its cycles"
    raw, drafter = fresh_drafter(target, block_size=4, num_layers=2)
    history = train.train(target, drafter, sequences, sequences[::7],
                          train.TrainConfig(epochs=20, batch_size=4, anchors=16, lr=3e-3, eval_every=40),
                          progress=False)
    held_out = [rotation(c, s, 7) for c in cycles for s in (1, 4, 8)]
    taus = [dflash.generate(target, drafter, p, 24).tau for p in held_out]
    assert sum(taus) / len(taus) >= 3.0, taus          # observed 3.83 (4 is the most a round can give)
    assert history[-1]["heldout_tau"] >= 3.0            # observed 4.0
    assert replay_matches_generate(target, drafter, sequences[::3]) == {3}


def test_new_drafter_config_follows_target(llama_data):
    """A new drafter takes the target's hidden size, head shape and RoPE base, and 5 captured layers
    where the target has room (fewer for a shallow one)."""
    _, target, _ = llama_data
    raw = train.new_drafter_config(target, 2, 16, MASK, train.default_num_features(T_LAYERS))
    assert raw["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (H, 4, 2, 8)
    assert raw["rope_theta"] == train.target_rope_theta(target.config)
    assert train.default_num_features(36) == 5


def test_train_cli_writes_a_loadable_drafter(llama_data, tmp_path):
    """`dflash-train train` end to end on a tiny target writes a drafter that loads. With two data files and
    `--heldout 4 2` each file holds out the greedy answers to its last prompts, and no answer to a
    held-out prompt of either file trains; the second file's held-out τ is in the history too."""
    path, target, sequences = llama_data
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    distill.save_sequences(tmp_path / "code.pt", sequences[:5] + sequences[22:23], {"prompt_indices": list(range(6)),
                                                                                 "source": "code"})
    result = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"),
                           str(tmp_path / "code.pt"), "--out", str(tmp_path / "d"), "--block-size", "4", "--layers",
                           "1", "--mask-token-id", str(MASK), "--max-steps", "3", "--heldout", "4", "2", "--device",
                           "cpu", "--save-dtype", "float32")
    assert result.returncode == 0, result.stderr
    code = str(tmp_path / "code.pt")
    # data.pt: 24 less its 4 held out, less sequences[4], whose prompt code.pt holds out; code.pt: 6 less
    # its held-out sequences[4] and sequences[22] (held out by data.pt as well)
    assert f"23 training sequences, 4 held out, 2 from {code}" in result.stderr
    assert f"--data {code}: left out 2 of its answers, whose prompts are held out" in result.stderr
    assert f"--data {tmp_path / 'data.pt'}: left out 1 more of its answers, whose prompts a later file holds out" \
        in result.stderr
    log = json.loads((tmp_path / "d" / "training.json").read_text())
    assert len(log["history"]) == 3 and log["heldout_sharegpt_indices"] == list(range(20, 24))
    assert log["heldout_more_indices"] == {code: [4, 5]}
    assert log["data"]["training_sequences"] == 23
    assert [(m["source"], m["sequences"]) for m in log["data"]["more_data"]] == [("code", 4)]
    last = log["history"][-1]["heldout_more"][code]
    assert last["tau"] >= 1 and len(last["acceptance"]) == 3
    assert f", {last['tau']:.2f} on {code} -> " in result.stderr
    assert log["at_init"] is None
    loading.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu")
    again = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out",
                          str(tmp_path / "d2"), "--init", str(tmp_path / "d"), "--max-steps", "1", "--heldout", "4",
                          "--device", "cpu", "--save-dtype", "float32", "--soft-labels")
    assert again.returncode == 0, again.stderr
    log2 = json.loads((tmp_path / "d2" / "training.json").read_text())
    assert log2["train_config"]["soft_labels"] and log2["history"][0]["loss"] > 0
    at_init = log2["at_init"]
    assert f"held-out τ {at_init['heldout_tau']:.2f} before training" in again.stderr
    # d2 starts from d, saved in float32: before training it walks the held-out answers as d did last
    assert at_init["heldout_tau"] == pytest.approx(log["history"][-1]["heldout_tau"], rel=1e-6)
    assert len(at_init["heldout_acceptance"]) == 3
    # only the second file holds out: its τ alone, before and after, and no heldout_tau
    only = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"), code, "--out",
                         str(tmp_path / "d3"), "--init", str(tmp_path / "d"), "--max-steps", "1", "--heldout", "0", "2",
                         "--device", "cpu", "--save-dtype", "float32")
    assert only.returncode == 0, only.stderr
    log3 = json.loads((tmp_path / "d3" / "training.json").read_text())
    assert "heldout_tau" not in log3["at_init"] and "heldout_tau" not in log3["history"][-1]
    assert log3["at_init"]["heldout_more"][code]["tau"] == pytest.approx(last["tau"], rel=1e-6)
    assert f"held-out τ {log3['at_init']['heldout_more'][code]['tau']:.2f} on {code} before training" in only.stderr
    assert f"held-out τ {log3['history'][-1]['heldout_more'][code]['tau']:.2f} on {code} -> " in only.stderr
    # --heldout-tokens 6: the held-out answers are walked over their first 6 response tokens only
    cut = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out",
                        str(tmp_path / "d4"), "--init", str(tmp_path / "d"), "--max-steps", "1", "--heldout", "4",
                        "--heldout-tokens", "6", "--device", "cpu", "--save-dtype", "float32")
    assert cut.returncode == 0, cut.stderr
    d = loading.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu")
    want, _ = train.estimate_acceptance(target, d, train.first_response_tokens(sequences[20:24], 6))
    log4 = json.loads((tmp_path / "d4" / "training.json").read_text())
    assert log4["at_init"]["heldout_tau"] == pytest.approx(want, rel=1e-6)
    data = str(tmp_path / "data.pt")
    full = sum(len(q.ids) - q.prompt_len for q in sequences[20:24])
    assert json.loads((tmp_path / "d2" / "training.json").read_text())["heldout_response_tokens"] == {data: full}
    assert log4["heldout_response_tokens"] == {data: 4 * 6} and full > 4 * 6


def test_grown_drafter_starts_where_its_checkpoint_stands(llama_data, tmp_path):
    """`train --init d --layers 3` appends two layers to a trained 1-layer drafter. They start at zero
    output, so the grown drafter's block hidden states equal d's exactly; it then trains (its new
    output projections move) and is saved as a 3-layer checkpoint that loads. Fewer layers are refused."""
    path, target, sequences = llama_data
    raw, drafter = fresh_drafter(target)
    train.train(target, drafter, sequences[:20], [], train.TrainConfig(epochs=1, batch_size=4, anchors=8, lr=3e-3),
                progress=False)
    bigger, bigger_raw = train.grown(target, drafter, raw, 3)
    assert len(bigger.layers) == 3 and bigger_raw["num_hidden_layers"] == 3 and raw["num_hidden_layers"] == 1
    assert bigger_raw["layer_types"] == ["full_attention"] * 3
    blocks = objective.make_blocks(sequences[:6], 8, 4, MASK, torch.Generator().manual_seed(0))
    features, _, _ = distill.capture_features(target, blocks.ids, blocks.lengths, drafter.config.target_layer_ids,
                                            torch.float32, with_labels=False)
    with torch.no_grad():
        before = train.draft_hidden(target, drafter, blocks, features)                 # (M, B, H)
        after = train.draft_hidden(target, bigger, blocks, features)
    assert torch.equal(before, after)
    assert any(not torch.equal(a, b) for a, b in zip(bigger.layers[1].parameters(), bigger.layers[2].parameters()))

    loading.save_drafter(drafter, raw, tmp_path / "d", torch.float32)
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    common = ["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--init", str(tmp_path / "d"),
              "--heldout", "4", "--device", "cpu", "--save-dtype", "float32"]
    result = run_train_cli(*common, "--out", str(tmp_path / "d3"), "--layers", "3", "--max-steps", "2", "--lr", "3e-2")
    assert result.returncode == 0, result.stderr
    assert "1 layers grown to 3; the new ones start at zero output" in result.stderr
    log = json.loads((tmp_path / "d3" / "training.json").read_text())
    assert log["grown_from_layers"] == 1 and log["args"]["layers"] == 3 and len(log["history"]) == 2
    same = run_train_cli(*common, "--out", str(tmp_path / "d1"), "--max-steps", "1")
    assert same.returncode == 0, same.stderr
    # the grown drafter walks the held-out answers as d does before training: its new layers add nothing
    assert log["at_init"]["heldout_tau"] == json.loads((tmp_path / "d1" / "training.json").read_text())["at_init"][
        "heldout_tau"]
    d3 = loading.load_drafter(str(tmp_path / "d3"), target, torch.float32, "cpu")
    assert d3.config.num_layers == 3 and d3.layers[2].mlp.down_proj.weight.abs().max() > 0   # it trained
    fewer = run_train_cli(*common, "--out", str(tmp_path / "d0"), "--layers", "0", "--max-steps", "1")
    assert fewer.returncode != 0 and "--layers = 0: the --init drafter has 1 layers, and layers are only added" \
        in fewer.stderr and "Traceback" not in fewer.stderr


def test_dflash2_made_from_a_dflash_drafter_drafts_as_it_did_then_trains(llama_data, tmp_path):
    """`train --init d --dflash2` makes a trained DFlash drafter DFlash2: its convolutions start as the identity
    and its selector's pair term at zero, so it drafts round for round what d drafts (the same held-out τ
    before training). It then trains both parts; its held-out estimate replays generate's rounds through the
    selector's walk; it is saved in the released DFlash2 format and decodes losslessly. DFlash2 sizes without
    --dflash2, or against a DFlash2 checkpoint's own, end in one line."""
    path, target, sequences = llama_data
    raw, drafter = fresh_drafter(target)
    train.train(target, drafter, sequences[:20], [], train.TrainConfig(epochs=2, batch_size=4, anchors=8, lr=3e-3),
                progress=False)
    sizes = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    made, made_raw = train.as_dflash2(target, drafter, raw, sizes)
    assert made_raw["architectures"] == ["DFlash2DraftModel"] and raw["architectures"] == ["DFlashDraftModel"]
    for seq in sequences[20:24]:
        prompt = seq.ids[:seq.prompt_len].tolist()
        assert dflash.generate(target, made, prompt, 12).rounds == dflash.generate(target, drafter, prompt, 12).rounds
    loading.save_drafter(drafter, raw, tmp_path / "d", torch.float32)
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    common = ["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--heldout", "4", "--device", "cpu",
              "--save-dtype", "float32"]
    flags = ["--dflash2", "--selector-rank", "6", "--selector-top-k", "5", "--conv-group-size", "8"]
    result = run_train_cli(*common, "--init", str(tmp_path / "d"), "--out", str(tmp_path / "d2"), *flags,
                           "--epochs", "2", "--max-steps", "6", "--lr", "1e-2")
    assert result.returncode == 0, result.stderr
    assert "made DFlash2 (conv_kernel_size 2, conv_group_size 8, selector_rank 6, selector_top_k 5)" in result.stderr
    same = run_train_cli(*common, "--init", str(tmp_path / "d"), "--out", str(tmp_path / "d1"), "--max-steps", "1")
    assert same.returncode == 0, same.stderr
    log = json.loads((tmp_path / "d2" / "training.json").read_text())
    assert log["at_init"]["heldout_tau"] == json.loads((tmp_path / "d1" / "training.json").read_text())["at_init"][
        "heldout_tau"]
    assert len(log["history"]) == 6 and all(h["blocks_per_s"] > 0 and h["tflops"] > 0 for h in log["history"])
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"].items() >= sizes.items()
    tensors = load_file(tmp_path / "d2" / "model.safetensors")
    assert tensors["candidate_selector.successor_codebook"].abs().max() > 0                 # the selector trained
    assert tensors["layers.0.attention_conv.kernel_projection.weight"].abs().max() > 0      # and the convolutions
    trained = loading.load_drafter(str(tmp_path / "d2"), target, torch.float32, "cpu")
    assert trained.candidate_selector is not None
    replay_matches_generate(target, trained, sequences[20:24])   # generate equals the target's greedy text too
    alone = run_train_cli(*common, "--init", str(tmp_path / "d"), "--out", str(tmp_path / "x"), "--selector-rank", "6",
                          "--max-steps", "1")
    assert alone.returncode != 0 and "--selector-rank sizes a DFlash2 drafter: add --dflash2" in alone.stderr
    other = run_train_cli(*common, "--init", str(tmp_path / "d2"), "--out", str(tmp_path / "x"), "--selector-rank", "8",
                          "--max-steps", "1")
    assert other.returncode != 0 and "--selector-rank = 8 but the --init drafter's is 6" in other.stderr
    assert "Traceback" not in alone.stderr + other.stderr


def test_save_drafter_killed_midway_leaves_the_old_drafter_whole(llama_data, tmp_path, monkeypatch):
    """A save killed while it writes (Ctrl-C, a machine taken back) leaves the drafter that was there, its
    config with its own weights, and no half-written file in their place."""
    import safetensors.torch
    target = llama_data[1]
    raw4, drafter4 = fresh_drafter(target, block_size=4)
    raw6, drafter6 = fresh_drafter(target, block_size=6)
    loading.save_drafter(drafter4, raw4, tmp_path / "d", torch.float32)
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}

    def killed(tensors, path):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        loading.save_drafter(drafter6, raw6, tmp_path / "d", torch.float32)
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir() if p.suffix != ".part"} == before
    assert loading.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu").config.block_size == 4


def test_training_that_diverges_stops_at_the_first_non_finite_loss(llama_data, tmp_path):
    """A loss that turns NaN or infinite ends training with one message at that step, rather than train
    on and save NaN weights over the drafter; through the CLI the --out of the last held-out estimate
    stays as it was saved."""
    path, target, sequences = llama_data
    _, drafter = fresh_drafter(target, block_size=4, num_layers=1)
    with pytest.raises(DFlashError, match=r"training diverged: the loss is nan at step 2 \(lr inf\)"):
        train.train(target, drafter, sequences[:-4], sequences[-4:], train.TrainConfig(
            batch_size=4, anchors=8, lr=math.inf, warmup=0.0, eval_every=100, max_steps=5), progress=False)


def test_ctrl_c_during_a_heldout_estimate_keeps_the_steps(llama_data, monkeypatch):
    """A Ctrl-C while a held-out estimate runs ends training there: every step taken is in the history,
    the last marked interrupted and without an estimate, and the estimate is not run again on the way out."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target, block_size=4, num_layers=1)
    real_entry, calls = train.heldout_entry, []

    def estimate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_entry(*args, **kwargs)

    monkeypatch.setattr(train, "heldout_entry", estimate)
    history = train.train(target, drafter, sequences[:-4], sequences[-4:], train.TrainConfig(
        batch_size=4, anchors=8, eval_every=2, max_steps=6), progress=False)
    assert [h["step"] for h in history] == [1, 2, 3, 4] and len(calls) == 2
    assert "heldout_tau" in history[1] and "heldout_tau" not in history[3] and history[3]["interrupted"]


def test_a_spent_time_budget_ends_the_run_with_an_estimate(llama_data):
    """A step that ends past --time-budget ends the run there, however early, and that last step still
    gets its held-out estimate."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target, block_size=4, num_layers=1)
    history = train.train(target, drafter, sequences[:-4], sequences[-4:], train.TrainConfig(
        batch_size=4, anchors=8, eval_every=100, max_steps=10, time_budget=1e-3), progress=False)
    assert len(history) == 1 and "heldout_tau" in history[-1]


def test_train_saves_the_drafter_at_each_heldout_estimate(llama_data, tmp_path, monkeypatch):
    """While `dflash-train train` runs, --out holds the drafter as of its latest held-out estimate, with a
    training.json whose history ends there (`snapshot` true), so that a run cut short keeps that point:
    after step 2's estimate the saved weights are the live drafter's, and the run's end replaces them."""
    path, target, sequences = llama_data
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    out, seen = tmp_path / "d", []
    real_train = train.train

    def watched(target_, drafter, *args, on_estimate, **kwargs):
        def check(history):
            on_estimate(history)
            log = json.loads((out / "training.json").read_text())
            saved = load_file(out / "model.safetensors")
            live = loading.checkpoint_tensors(drafter, {"architectures": ["DFlashDraftModel"]})
            seen.append((len(log["history"]), log["snapshot"], log["history"][-1]["heldout_tau"],
                         saved.keys() == live.keys() and all(torch.equal(saved[k], live[k].detach()) for k in saved),
                         saved))
        return real_train(target_, drafter, *args, on_estimate=check, **kwargs)

    monkeypatch.setattr(train, "train", watched)
    train.main(["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out", str(out),
                "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK), "--max-steps", "5",
                "--eval-every", "2", "--heldout", "4", "--device", "cpu", "--save-dtype", "float32"])
    log = json.loads((out / "training.json").read_text())
    assert [s[:2] for s in seen] == [(2, True), (4, True)] and all(s[3] for s in seen)
    assert [h["heldout_tau"] for h in log["history"] if "heldout_tau" in h][:2] == [s[2] for s in seen]
    assert len(log["history"]) == 5 and log["snapshot"] is False and "heldout_tau" in log["history"][-1]
    assert not list(out.glob("*.part"))
    final = load_file(out / "model.safetensors")   # step 5 trained on past the last snapshot
    assert any(not torch.equal(final[k], seen[-1][4][k]) for k in final)


def test_a_snapshot_killed_midway_leaves_the_last_snapshot_whole(llama_data, tmp_path, monkeypatch):
    """A snapshot of `dflash-train train` that dies while it writes (a full disk, a machine taken back) leaves
    the one before it whole: the weights in --out are the ones its training.json's history ends at."""
    path, target, sequences = llama_data
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    out, snapshots, real_write_text = tmp_path / "d", [], Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == "training.json.part":
            weights = out / "model.safetensors.part"   # this snapshot's weights, moved or not yet
            snapshots.append(load_file(weights if weights.exists() else out / "model.safetensors"))
            if len(snapshots) == 2:
                raise OSError("No space left on device")
        return real_write_text(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(OSError, match="No space left"):
        train.main(["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out", str(out),
                    "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK), "--max-steps", "5",
                    "--eval-every", "2", "--heldout", "4", "--device", "cpu", "--save-dtype", "float32"])
    log = json.loads((out / "training.json").read_text())
    saved = load_file(out / "model.safetensors")
    assert len(log["history"]) == 2 and log["snapshot"] is True
    assert all(torch.equal(saved[k], snapshots[0][k]) for k in saved)          # step 2's weights, with step 2's log
    assert any(not torch.equal(saved[k], snapshots[1][k]) for k in saved)      # not step 4's, which trained on


def test_train_notes_data_distilled_from_another_target(llama_data, tmp_path, capsys):
    """`train` says when a --data file holds another target's answers (its meta names another dir), and
    stays quiet for the --target's dir written another way."""
    path, target, sequences = llama_data
    for name, made_by in (("other", "/elsewhere/another-target"), ("same", f"{path}/")):
        distill.save_sequences(tmp_path / f"{name}.pt", sequences, {"prompt_indices": list(range(len(sequences))),
                                                                  "target": made_by})
        train.main(["train", "--target", str(path), "--data", str(tmp_path / f"{name}.pt"), "--out",
                    str(tmp_path / f"d-{name}"), "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK),
                    "--max-steps", "1", "--heldout", "4", "--device", "cpu"])
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --data")]
        assert notes == ([f"note: --data {tmp_path / 'other.pt'} holds the answers of '/elsewhere/another-target', "
                          f"the --target is '{path}'"] if name == "other" else [])


def test_two_ranks_reach_the_weights_one_rank_reaches(catalog_paths, tmp_path):
    """torchrun with 2 ranks (gloo, CPU) and the same global batch and seed takes one rank's steps: each rank its
    half of every batch, the anchors drawn alike, the gradients summed; the saved weights and the losses agree
    within float32 rounding, and rank 0 alone writes the drafter."""
    import os
    import subprocess
    import sys
    from safetensors.torch import load_file
    args = ["train", "--target", catalog_paths["l"], "--data", catalog_paths["data"], "--block-size", "4", "--layers",
            "1", "--mask-token-id", str(MASK), "--max-steps", "3", "--batch-size", "4", "--anchors", "6",
            "--heldout", "2", "--eval-every", "100", "--device", "cpu", "--save-dtype", "float32", "--seed", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train.main([*args, "--out", str(tmp_path / "one")])
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dflash_reference.training.train", *args, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)
    losses = [[h["loss"] for h in json.loads((tmp_path / run / "training.json").read_text())["history"]]
              for run in ("one", "two")]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert two.stderr.count("trained 3 steps") == 1                                  # rank 0 speaks
