"""An independent DFlash / DFlash2 port, written from docs/porting.md, docs/checkpoints.md and the
paper's description (the spec's §1-§5 and §9) alone, without reading the reference's source
(dflash.py, fastpath.py or anything under dflash_reference/).

The tests use it to show that the conformance kit catches each mistake in a port that is *not*
dflash.py: `run(case_dir, mistakes={...})` plants the named mistakes (see MISTAKES) and returns the
port's dump of '<stage>.<round>' tensors, which `dflash-conformance check` must then reject; with no
mistakes, in float32, the dump conforms. `serve` runs several requests through one engine (one loaded
pair, one drafter context), one after another or as one ragged batch stepped in lockstep.

The target is a transformers causal LM over a K/V cache that only grows: a rejected draft's slot is
masked out for good, so each row of a batch rolls back on its own.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

MISTAKES = frozenset("""conv_future_row conv_taps_at_source conv_base_halves_swapped conv_pre_skipped
conv_post_skipped conv_post_taps_from_output conv_over_residual selector_predecessor_argmax
selector_bonus_skipped codebooks_swapped rows_before_final_norm rows_shifted_to_anchor
candidates_before_scaling embedding_scale_ignored one_hot_verification no_selector layer_one_off
target_rope state_not_reset acceptance_from_other_row""".split())
RECORDED = 8  # rounds 0 (the prefill) .. 8 are dumped stage by stage


# ----------------------------------------------------------------------------- loading
def _resolve(raw, target_cfg, fc_width):
    """The drafter's settings, each key from dflash_config first, then the top level."""
    dc = raw.get("dflash_config") or {}
    def get(key, default=None):  # a null falls through to the top level, then to the default
        value = dc.get(key) if dc.get(key) is not None else raw.get(key)
        return default if value is None else value
    H, L, heads = raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"]
    types = raw.get("layer_types") or ["full_attention"] * L
    given = [v for v in (raw.get("is_causal"), dc.get("is_causal"), dc.get("causal")) if v is not None]
    rp = raw.get("rope_parameters")
    theta = lambda kind: float(raw["rope_theta"] if not isinstance(rp, dict) else
                               rp["rope_theta"] if "rope_theta" in rp else rp[kind]["rope_theta"])
    ids, T = get("target_layer_ids"), target_cfg.num_hidden_layers
    if ids is None:
        n = fc_width // H
        ids = [T // 2] if n == 1 else [round(1 + i * (T - 4) / (n - 1)) for i in range(n)]
    tp = getattr(target_cfg, "rope_parameters", None) or {}
    return dict(
        H=H, L=L, heads=heads, kv_heads=raw["num_key_value_heads"], eps=raw.get("rms_norm_eps", 1e-6),
        head_dim=raw.get("head_dim") or H // heads, block_size=int(get("block_size")),
        mask_id=int(get("mask_token_id")), ids=sorted(ids), window=raw.get("sliding_window"),
        sliding=[t == "sliding_attention" for t in types],
        causal=[bool(given[0]) if given else t == "sliding_attention" for t in types],
        theta=[theta(t) for t in types],
        target_theta=float(tp.get("rope_theta", getattr(target_cfg, "rope_theta", 10000.0))),
        emb_scale=float(get("input_embedding_scale", 1.0)), out_mult=float(get("output_multiplier", 1.0)),
        softcap=get("final_logit_softcapping"),
        dflash2="DFlash2DraftModel" in (raw.get("architectures") or [])
        or any(k in dc for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
        C=int(get("conv_kernel_size", 2)), g=int(get("conv_group_size", 16)), top_k=int(get("selector_top_k", 16)))


class Pair:
    """The engine's target (a transformers model) and drafter (its settings and weights)."""

    def __init__(self, case_dir, dtype=torch.float32):
        case_dir = Path(case_dir)
        self.target = AutoModelForCausalLM.from_pretrained(case_dir / "target", dtype=dtype).eval()
        raw = json.loads((case_dir / "drafter" / "config.json").read_text())
        self.w = {k: v.to(dtype) for k, v in load_file(str(case_dir / "drafter" / "model.safetensors")).items()}
        self.cfg = _resolve(raw, self.target.config, self.w["fc.weight"].shape[1])
        if self.cfg["dflash2"]:  # the codebooks ship without '.weight': they must have been read
            for k in ("hidden_projection.weight", "predecessor_codebook", "successor_codebook"):
                assert "candidate_selector." + k in self.w, k
        self.embed = self.target.get_input_embeddings().weight
        self.lm_head = self.target.get_output_embeddings().weight


def load_pair(case_dir, dtype=torch.float32):
    return Pair(case_dir, dtype)


# ----------------------------------------------------------------------------- drafter math
def rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, pos, theta):
    """HF's rotate-half RoPE of x (..., T, d) at positions pos (..., T)."""
    d = x.shape[-1]
    ang = pos.double()[..., None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = [torch.cat([f, f], -1).to(x.dtype) for f in (ang.cos(), ang.sin())]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def shift_rows(x, o):
    """y[:, t] = x[:, t − o], zeros outside the block (o < 0 reads later rows)."""
    y, W = torch.zeros_like(x), x.shape[1]
    if o >= 0:
        y[:, o:] = x[:, :W - o]
    else:
        y[:, :W + o] = x[:, -o:]
    return y


class DrafterContext:
    """Per batch row: every layer's context K/V (after k_norm and RoPE) and their positions.
    One object serves every request; reset(row) clears a row for the next request."""

    def __init__(self, L):
        self.L, self.k, self.v, self.pos = L, {}, {}, {}

    def reset(self, row):
        self.k[row], self.v[row] = [None] * self.L, [None] * self.L
        self.pos[row] = torch.zeros(0, dtype=torch.long)

    def append(self, row, layer_kv, pos):
        for l, (k, v) in enumerate(layer_kv):
            self.k[row][l] = k if self.k[row][l] is None else torch.cat([self.k[row][l], k], 1)
            self.v[row][l] = v if self.v[row][l] is None else torch.cat([self.v[row][l], v], 1)
        self.pos[row] = torch.cat([self.pos[row], pos])

    def padded(self, rows, l):
        """The rows' layer-l K/V padded to the longest context, their positions and validity."""
        S = max(len(self.pos[r]) for r in rows)
        K = torch.zeros(len(rows), *self.k[rows[0]][l].shape[:1], S, self.k[rows[0]][l].shape[-1],
                        dtype=self.k[rows[0]][l].dtype)
        V, pos, ok = K.clone(), torch.zeros(len(rows), S, dtype=torch.long), torch.zeros(len(rows), S, dtype=torch.bool)
        for i, r in enumerate(rows):
            s = len(self.pos[r])
            K[i, :, :s], V[i, :, :s], pos[i, :s], ok[i, :s] = self.k[r][l], self.v[r][l], self.pos[r], True
        return K, V, pos, ok


class Drafter:
    def __init__(self, pair, mistakes):
        self.p, self.c, self.w, self.m = pair, pair.cfg, pair.w, mistakes
        self.theta = [self.c["target_theta"] if "target_rope" in mistakes else t for t in self.c["theta"]]

    def lin(self, x, name):
        return x @ self.w[name + ".weight"].T

    def norm(self, x, name):
        return rms_norm(x, self.w[name + ".weight"], self.c["eps"])

    def project(self, features):  # c = hidden_norm(fc(f))
        return self.norm(self.lin(features, "fc"), "hidden_norm")

    def context_kv(self, c, pos):
        """Every layer's context K/V: no input norm (generic drafters), k_norm, RoPE at pos."""
        out, hk, d = [], self.c["kv_heads"], self.c["head_dim"]
        for l in range(self.c["L"]):
            a = f"layers.{l}.self_attn."
            k = self.norm(self.lin(c, a + "k_proj").view(-1, hk, d), a + "k_norm").transpose(0, 1)
            out.append((rope(k, pos, self.theta[l]), self.lin(c, a + "v_proj").view(-1, hk, d).transpose(0, 1)))
        return out

    def conv(self, x, taps, base, valid):
        """Σ_o (base[o, c] + d[t, o, c // g]) · x[t − o, c] over the block's rows, zeros before it."""
        x, taps = x * valid[..., None], taps.repeat_interleave(self.c["g"], dim=-1)  # taps (n, W, C, H)
        out = torch.zeros_like(x)
        for o in range(self.c["C"]):
            d = shift_rows(taps[:, :, o], o) if "conv_taps_at_source" in self.m else taps[:, :, o]
            out = out + (base[o] + d) * shift_rows(x, -o if "conv_future_row" in self.m else o)
        return out

    def sublayer(self, l, kind, x, fn, valid, rec):
        """x + sublayer(norm(x)), with DFlash2's convolutions before and after the sublayer."""
        a = self.norm(x, f"layers.{l}.{'input_layernorm' if kind == 'attn' else 'post_attention_layernorm'}")
        if not self.c["dflash2"]:
            return x + fn(a)
        pre, (n, W, _) = f"layers.{l}.{'attention_conv' if kind == 'attn' else 'mlp_conv'}.", a.shape
        taps = lambda y: self.lin(y, pre + "kernel_projection").view(n, W, 2, self.c["C"], self.c["H"] // self.c["g"])
        base, d = self.w[pre + "base_kernel"], taps(a)
        base = base.flip(0) if "conv_base_halves_swapped" in self.m else base
        src = x if "conv_over_residual" in self.m else a
        a2 = src if "conv_pre_skipped" in self.m else self.conv(src, d[:, :, 0], base[0], valid)
        z = fn(a2)
        d = taps(z) if "conv_post_taps_from_output" in self.m else d
        z2 = z if "conv_post_skipped" in self.m else self.conv(z, d[:, :, 1], base[1], valid)
        rec.append((l, kind, a2, z2))
        return x + z2

    def attention(self, l, a, ctx, rows, qpos, valid):
        c, (n, W, _) = self.c, a.shape
        h, hk, d, pre = c["heads"], c["kv_heads"], c["head_dim"], f"layers.{l}.self_attn."
        heads = lambda name, nh: self.lin(a, pre + name).view(n, W, nh, d)
        q = rope(self.norm(heads("q_proj", h), pre + "q_norm").transpose(1, 2), qpos[:, None], self.theta[l])
        k = rope(self.norm(heads("k_proj", hk), pre + "k_norm").transpose(1, 2), qpos[:, None], self.theta[l])
        cK, cV, cpos, cvalid = ctx.padded(rows, l)
        K, V = torch.cat([cK, k], 2), torch.cat([cV, heads("v_proj", hk).transpose(1, 2)], 2)
        dist = qpos[:, :, None] - torch.cat([cpos, qpos], 1)[:, None, :]  # query − key position
        ok = torch.cat([cvalid, valid], 1)[:, None, :].expand(-1, W, -1).clone()
        if c["causal"][l]:
            ok &= dist >= 0
        if c["sliding"][l]:  # a window over [context | block], on both sides where bidirectional
            ok &= (dist if c["causal"][l] else dist.abs()) < c["window"]
        K, V = K.repeat_interleave(h // hk, 1), V.repeat_interleave(h // hk, 1)
        s = ((q @ K.transpose(-1, -2)) * d ** -0.5).float().masked_fill(~ok[:, None], float("-inf"))
        return self.lin((s.softmax(-1).to(q.dtype) @ V).transpose(1, 2).reshape(n, W, h * d), pre + "o_proj")

    def mlp(self, l, a):
        pre = f"layers.{l}.mlp."
        return self.lin(F.silu(self.lin(a, pre + "gate_proj")) * self.lin(a, pre + "up_proj"), pre + "down_proj")

    def block(self, bonus, starts, widths, ctx, rows):
        """The blocks [bonus, m × (W−1)] at positions start.. (one a row, W ragged): the rows before
        and after the final norm, and each sublayer's (conv_in, conv_out)."""
        n, W = len(rows), max(widths)
        ids = torch.full((n, W), self.c["mask_id"], dtype=torch.long)
        ids[:, 0] = torch.tensor(bonus)
        x = self.p.embed[ids] * (1.0 if "embedding_scale_ignored" in self.m else self.c["emb_scale"])
        qpos = torch.tensor(starts)[:, None] + torch.arange(W)
        valid = torch.arange(W)[None] < torch.tensor(widths)[:, None]
        rec = []
        for l in range(self.c["L"]):
            x = self.sublayer(l, "attn", x, lambda a: self.attention(l, a, ctx, rows, qpos, valid), valid, rec)
            x = self.sublayer(l, "mlp", x, lambda a: self.mlp(l, a), valid, rec)
        return x, self.norm(x, "norm"), rec

    def scale_logits(self, logits):  # × output_multiplier, then s · tanh(l / s)
        logits, s = logits * self.c["out_mult"], self.c["softcap"]
        return s * torch.tanh(logits / s) if s else logits

    def select(self, rows, raw_logits, logits, prev, k, T, u):
        """DFlash2's walk over each row's top_k candidates from the bonus: the drafts, candidates,
        scores and (T > 0) each draft's proposal q on the vocabulary."""
        A, Bc = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        A, Bc = (Bc, A) if "codebooks_swapped" in self.m else (A, Bc)
        unary, cand = (raw_logits if "candidates_before_scaling" in self.m else logits).topk(self.c["top_k"], -1)
        proj = self.lin(rows, "candidate_selector.hidden_projection")
        prev = self.c["mask_id"] if "selector_bonus_skipped" in self.m else prev
        drafts, scores, qs = [], [], []
        for t in range(k):
            if "selector_predecessor_argmax" in self.m:
                prev = int(logits[t].argmax())
            S = unary[t] + (A[prev] * proj[t]) @ Bc[cand[t]].T
            if T > 0:  # drawn by inverse CDF over the candidates in their top-k order
                qc = (S.double() / T).softmax(-1)
                prev = int(cand[t][inverse_cdf(qc, u[t])])
                qs.append(torch.zeros(logits.shape[-1], dtype=torch.float64).index_add(0, cand[t], qc))
            else:
                prev = int(cand[t][S.argmax()])
            drafts.append(prev)
            scores.append(S)
        return drafts, cand[:k], torch.stack(scores) if scores else unary[:0], qs


# ----------------------------------------------------------------------------- sampling
def target_probs(logits, req):
    """p: logits / T, top-k, softmax, top-p (the tokens whose mass before them is below top_p)."""
    x, top_k, top_p = logits.double() / req["temperature"], req.get("top_k") or 0, req.get("top_p", 1.0)
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    p = x.softmax(-1)
    if top_p < 1.0:
        sp, order = p.sort(descending=True, stable=True)
        p = torch.zeros_like(p).scatter(0, order, sp * ((sp.cumsum(0) - sp) < top_p))
    return p / p.sum()


def inverse_cdf(p, u):
    """The first index whose cumulative mass exceeds u times the total."""
    c = p.cumsum(0)
    return min(int((c <= u * c[-1]).sum()), int((p > 0).nonzero()[-1]))


# ----------------------------------------------------------------------------- the engine
class Request:
    """One request's state: its committed tokens (the bonus last), its uniforms (one CPU float64
    generator seeded with its seed; the kit's stored draws replace the generator's) and its dump."""

    def __init__(self, slot, req, B, stored):
        self.slot, self.req, self.stored = slot, req, stored
        self.K = req.get("num_drafts") or B - 1
        self.W = B if req.get("full_block", True) else self.K + 1
        self.T, self.stops = float(req.get("temperature") or 0.0), set(req.get("stop_ids") or [])
        self.gen = torch.Generator().manual_seed(int(req.get("seed") or 0))
        self.prompt, self.tokens, self.done = list(req["prompt_ids"]), [], False
        self.lengths, self.round_drafts, self.dump = [], [], {}

    def uniforms(self, name, n, record):
        u = self.stored.get(name, torch.rand(n, generator=self.gen, dtype=torch.float64)).double()
        if record:
            self.dump[name] = u
        return u

    @property
    def bonus_pos(self):  # the bonus's position: the committed length before it, = the context rows
        return len(self.prompt) + len(self.tokens) - 1

    def commit(self, new):
        for t in new:
            self.tokens.append(t)
            if t in self.stops or len(self.tokens) >= self.req["max_new_tokens"]:
                self.done = True
                return


class Engine:
    def __init__(self, pair, mistakes=frozenset()):
        assert set(mistakes) <= MISTAKES, set(mistakes) - MISTAKES
        self.p, self.m = pair, set(mistakes)
        self.d, self.ctx = Drafter(pair, self.m), DrafterContext(pair.cfg["L"])
        self.ids = [i + 1 if "layer_one_off" in self.m else i for i in pair.cfg["ids"]]

    def target_step(self, toks, pos, valid):
        """The target over new slots (one row per request): logits and the captured layers'
        outputs (the residual stream leaving each, before the final norm)."""
        got = {}
        hooks = [self.p.target.model.layers[i].register_forward_hook(
            lambda mod, args, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in self.ids]
        self.kv_valid = torch.cat([self.kv_valid, valid], 1)
        slots = torch.arange(self.kv_valid.shape[1] - toks.shape[1], self.kv_valid.shape[1])
        try:
            out = self.p.target(input_ids=toks, position_ids=pos, attention_mask=self.kv_valid.long(),
                                cache=self.cache, cache_position=slots, use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        return out.logits.float(), torch.cat([got[i] for i in self.ids], -1)

    def add_context(self, rq, feats, start, r, verified):
        c, pos = self.d.project(feats), torch.arange(start, start + len(feats))
        self.ctx.append(rq.slot, self.d.context_kv(c, pos), pos)
        if r <= RECORDED:
            rq.dump.update({f"features.{r}": verified, f"context.{r}": c,
                            f"ctx_keys.{r}": self.ctx.k[rq.slot][0], f"ctx_values.{r}": self.ctx.v[rq.slot][0]})

    def accept(self, rq, logits, drafts, qs):
        """Greedy: the drafts matching the target's argmax. Sampled: while u·q(d) < p(d)."""
        for i, d in enumerate(drafts):
            if rq.T == 0 and int(logits[i].argmax()) != d or rq.T > 0 and not bool(
                    rq.u[i] * (qs[i][d] if qs else 1.0) < target_probs(logits[i], rq.req)[d]):
                return i
        return len(drafts)

    def next_token(self, rq, logits, drafts, qs, a):
        """Greedy: the argmax after the accepted drafts. Sampled, with the last uniform: at a
        rejection from max(p − q, 0) (q one-hot for an argmax proposal), else from p."""
        if rq.T == 0:
            return int(logits[a].argmax())
        p = target_probs(logits[a], rq.req)
        if a < len(drafts):
            res = (p - (qs[a] if qs else F.one_hot(torch.tensor(drafts[a]), p.shape[0]).double())).clamp(min=0)
            p = res if res.sum() > 0 else p
        return inverse_cdf(p, rq.u[-1])

    def generate(self, requests, stored):
        """The requests as one batch in lockstep (stored[i]: request i's kit uniforms)."""
        rqs = [Request(i, req, self.p.cfg["block_size"], stored[i]) for i, req in enumerate(requests)]
        for rq in rqs:  # batch slot i's context row is reused by the next request in that slot
            if "state_not_reset" not in self.m or rq.slot not in self.ctx.k:
                self.ctx.reset(rq.slot)
        with torch.no_grad():
            self.prefill(rqs)
            r = 1
            while not all(rq.done for rq in rqs):
                self.round(rqs, r)
                r += 1
        for rq in rqs:
            rd = torch.full((len(rq.round_drafts), rq.K), -1, dtype=torch.long)
            for j, ds in enumerate(rq.round_drafts):
                rd[j, :len(ds)] = torch.tensor(ds, dtype=torch.long)
            rq.dump.update(tokens=torch.tensor(rq.tokens), round_drafts=rd, acceptance_lengths=torch.tensor(rq.lengths))
        return [rq.dump for rq in rqs]

    def prefill(self, rqs):
        P = max(len(rq.prompt) for rq in rqs)
        toks, valid = torch.zeros(len(rqs), P, dtype=torch.long), torch.zeros(len(rqs), P, dtype=torch.bool)
        for b, rq in enumerate(rqs):
            toks[b, :len(rq.prompt)], valid[b, :len(rq.prompt)] = torch.tensor(rq.prompt), True
        self.cache, self.kv_valid = DynamicCache(), torch.zeros(len(rqs), 0, dtype=torch.bool)
        logits, feats = self.target_step(toks, torch.arange(P).expand(len(rqs), P), valid)
        for b, rq in enumerate(rqs):
            n = len(rq.prompt)
            rq.u = rq.uniforms("uniforms.0", rq.K + 1, True) if rq.T > 0 else None
            rq.commit([self.next_token(rq, logits[b, n - 1:n], [], [], 0)])
            self.add_context(rq, feats[b, :n], 0, 0, feats[b, :n])

    def draft(self, rq, j, r, pre, normed, convs, bonus):
        """Request rq's drafts from its block rows (batch row j) and its proposals q at T > 0."""
        h = (pre if "rows_before_final_norm" in self.m else normed)[j]
        h = h[:rq.W - 1] if "rows_shifted_to_anchor" in self.m else h[1:rq.W]
        raw = (h @ self.p.lm_head.T).float()
        logits, rec, qs = self.d.scale_logits(raw), r <= RECORDED, []
        drawn = rq.T > 0 and "no_selector" not in self.m and (self.p.cfg["dflash2"] or rq.req.get("drafts") == "sampled")
        u = rq.uniforms(f"draft_uniforms.{r}", rq.K, rec) if drawn else None
        if self.p.cfg["dflash2"] and "no_selector" not in self.m:
            drafts, cand, scores, qs = self.d.select(h, raw, logits, bonus, rq.k, rq.T, u)
            if rec:
                rq.dump.update({f"candidates.{r}": cand, f"selector_scores.{r}": scores})
        elif drawn:  # a DFlash drafter drawing each draft from its own distribution
            qs = [(logits[t].double() / rq.T).softmax(-1) for t in range(rq.k)]
            drafts = [inverse_cdf(qs[t], u[t]) for t in range(rq.k)]
        else:
            drafts = [int(t) for t in logits[:rq.k].argmax(-1)]
        if rec:
            top = logits.topk(5, -1)
            rq.dump.update({f"hidden.{r}": normed[j, :rq.W], f"top5_logits.{r}": top.values,
                            f"top5_ids.{r}": top.indices, f"drafts.{r}": torch.tensor(drafts, dtype=torch.long)})
            for l, kind, a2, z2 in convs:
                rq.dump[f"conv_in.{l}.{kind}.{r}"], rq.dump[f"conv_out.{l}.{kind}.{r}"] = a2[j, :rq.W], z2[j, :rq.W]
        return drafts, [] if "one_hot_verification" in self.m else qs  # [] verifies one-hot

    def round(self, rqs, r):
        live = [rq for rq in rqs if not rq.done]
        for rq in live:
            rq.k = min(rq.K, rq.req["max_new_tokens"] - len(rq.tokens) - 1)
        bonus = [rq.tokens[-1] for rq in live]
        pre, normed, convs = self.d.block(bonus, [rq.bonus_pos for rq in live], [rq.W for rq in live],
                                          self.ctx, [rq.slot for rq in live])
        proposals = [self.draft(rq, j, r, pre, normed, convs, bonus[j]) for j, rq in enumerate(live)]
        for rq in live:
            rq.u = rq.uniforms(f"uniforms.{r}", rq.K + 1, r <= RECORDED) if rq.T > 0 else None
        # verification of [bonus, drafts] for every row of the batch (finished rows: masked fillers)
        Lv = max(rq.k + 1 for rq in live)
        toks, valid = torch.zeros(len(rqs), Lv, dtype=torch.long), torch.zeros(len(rqs), Lv, dtype=torch.bool)
        pos = torch.tensor([rq.bonus_pos for rq in rqs])[:, None] + torch.arange(Lv)
        for j, rq in enumerate(live):
            toks[rq.slot, :rq.k + 1], valid[rq.slot, :rq.k + 1] = torch.tensor([bonus[j]] + proposals[j][0]), True
        logits, feats = self.target_step(toks, pos, valid)
        own = [self.accept(rq, logits[rq.slot], *proposals[j]) for j, rq in enumerate(live)]
        for j, rq in enumerate(live):
            b, (drafts, qs), start = rq.slot, proposals[j], rq.bonus_pos
            a = min(own[(j + 1) % len(live)], rq.k) if "acceptance_from_other_row" in self.m else own[j]
            nxt = self.next_token(rq, logits[b, :rq.k + 1], drafts, qs, a)
            self.kv_valid[b, self.kv_valid.shape[1] - Lv + a + 1:] = False  # the rejected slots, for good
            rq.round_drafts.append(drafts)
            rq.lengths.append(a + 1)
            if r <= RECORDED:
                rq.dump[f"accepted.{r}"] = torch.tensor(a)
            rq.commit(drafts[:a] + [nxt])
            # the bonus and the accepted drafts enter the context (it lags the text by one)
            self.add_context(rq, feats[b, :a + 1], start, r, feats[b, :rq.k + 1])


# ----------------------------------------------------------------------------- entry points
def _stored(case_dir, prefix=""):
    """The kit's stored uniforms of a request (a sampled case's draws), the prefix stripped."""
    with safe_open(str(Path(case_dir) / "expected.safetensors"), "pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys()
                if k.startswith(prefix) and k[len(prefix):].split(".")[0] in ("uniforms", "draft_uniforms")}


def _tensors(dump, prefix=""):
    return {prefix + k: v.detach().clone().contiguous() for k, v in dump.items()}


def run(case_dir, dtype=torch.float32, mistakes=frozenset()):
    """The case's request through this port: a dump of '<stage>.<round>' tensors."""
    case = json.loads((Path(case_dir) / "case.json").read_text())
    return _tensors(Engine(load_pair(case_dir, dtype), mistakes).generate([case["request"]], [_stored(case_dir)])[0])


def serve(case_dir, dtype=torch.float32, mistakes=frozenset(), batched=False):
    """Every request of the case through one engine (one pair, one drafter context), one after
    another or as one ragged batch in lockstep; request i's values under 'request.<i>.'."""
    case = json.loads((Path(case_dir) / "case.json").read_text())
    requests = case.get("requests") or [case["request"]]
    engine = Engine(load_pair(case_dir, dtype), mistakes)
    stored = [_stored(case_dir, f"request.{i}.") for i in range(len(requests))]
    outs = engine.generate(requests, stored) if batched else [
        engine.generate([req], [stored[i]])[0] for i, req in enumerate(requests)]
    return {k: v for i, o in enumerate(outs) for k, v in _tensors(o, f"request.{i}.").items()}


def save(dump, path):
    save_file(_tensors(dump), str(path))


if __name__ == "__main__":  # python tests/docs_port.py [CASE [MISTAKE ...]]: the checker's report
    import subprocess
    import sys
    import tempfile

    name = sys.argv[1] if len(sys.argv) > 1 else "dflash2"
    case_dir = Path(__file__).resolve().parents[1] / "dflash_reference" / "conformance" / "golden" / name
    mistakes = frozenset(sys.argv[2:])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dump.safetensors"
        save(serve(case_dir, mistakes=mistakes) if name == "served" else run(case_dir, mistakes=mistakes), out)
        sys.exit(subprocess.run(["dflash-conformance", "check", str(out), "--case", name]).returncode)
