"""The EAGLE-3 draft head: one decoder layer that reads the target's own hidden states.

Architecture (as SpecForge's ``LlamaForCausalLMEagle3`` and vLLM ``speculators``' ``Eagle3`` lay
it out, so their checkpoints load into it by name, ``layouts.py``):

* ``fc``: ``[3 * target_hidden] -> [hidden]``, fusing the target's hidden states after three of
  its layers (``HeadConfig.aux_layers``, in ``output_hidden_states`` numbering) into one feature
  per token;
* ``midlayer``: a Llama decoder layer whose attention reads ``[norm(embed(next token)),
  hidden_norm(feature)]`` (``2 * hidden`` wide) and whose residual stream starts from the feature;
* ``norm`` and ``lm_head``: logits over a reduced *draft vocabulary* of ``draft_vocab_size``
  tokens; draft id ``d`` is target id ``d + d2t[d]``; ``t2d[t]`` says whether target id ``t`` has one.

The head has no embedding table of its own: it embeds tokens with the target's input embeddings
(handed to it by the caller), so it adds no vocabulary-sized matrix besides ``lm_head``.

Pairing: the head's input at position ``t`` is the feature of token ``t`` (the target's hidden
states there, or, while drafting, the head's own output at ``t - 1``) with the embedding of token
``t + 1``; its output there predicts token ``t + 2``. Keys and values are cached per position, so
drafting ``k`` tokens after a verification costs one head step for the newly committed tokens and
``k - 1`` one-column steps.

Only the math lives here; the cache is :class:`HeadCache`, drafting is ``generator.py``,
training is ``specdec/training/``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class HeadConfig:
    """What shapes a head and what target it fits."""

    hidden_size: int  # the head's own width (the target's, in every published head)
    target_hidden_size: int  # the width of the target hidden states fused by ``fc``
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (``t2d``'s length)
    draft_vocab_size: int  # the head's own output vocabulary (``lm_head``'s rows)
    aux_layers: tuple[int, ...]  # target hidden states fused, ``output_hidden_states`` indices
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target_model_type: str = "llama"
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        if len(self.aux_layers) != 3:
            raise ValueError(f"an EAGLE-3 head fuses three target hidden states, got aux_layers={self.aux_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None,
                   intermediate_size: int | None = None) -> "HeadConfig":
        """A head shaped like one of ``target_config``'s layers (as published heads are), reading
        the target after layers ``aux_layers`` (default: EAGLE-3's choice, early, middle, late:
        the outputs of layers 1, n/2 - 1 and n - 4, i.e. hidden states 2, n/2 and n - 3)."""
        text = getattr(target_config, "text_config", None) or target_config
        layers = text.num_hidden_layers
        if aux_layers is None:  # small test models: three distinct layers' outputs, never the final norm's
            aux_layers = (2, layers // 2, layers - 3) if layers >= 8 else (1, max(1, layers // 2), max(1, layers - 1))
        heads = text.num_attention_heads
        return cls(hidden_size=text.hidden_size, target_hidden_size=text.hidden_size,
                   intermediate_size=intermediate_size or _intermediate_size(text), num_attention_heads=heads,
                   num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   vocab_size=text.vocab_size, draft_vocab_size=draft_vocab_size, aux_layers=tuple(aux_layers),
                   rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5), rope_theta=_rope_theta(text),
                   max_position_embeddings=getattr(text, "max_position_embeddings", 8192),
                   target_model_type=getattr(text, "model_type", "llama"),
                   rope_scaling=_rope_scaling(text))


def _intermediate_size(config) -> int:
    """The width of a target layer's MLP, by any of its configs' names (GPT-2's ``n_inner``, None for
    4x, and OPT's ``ffn_dim`` too)."""
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return 4 * config.hidden_size


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    return dict(params) if isinstance(params, dict) else {}


def _rope_theta(config) -> float:
    return float(_rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _rope_scaling(config) -> dict | None:
    params = _rope_parameters(config) or dict(getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    """See the module docstring. Parameter names follow SpecForge's checkpoints."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # identity until set_vocab
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.t2d[: c.draft_vocab_size] = True
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.inv_freq = _scaled_inv_freq(inv, c)  # float32 always: not a buffer, so .to(dtype) leaves it

    # -- vocabulary -----------------------------------------------------------------------------
    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Make the draft vocabulary ``target_ids`` (``[draft_vocab]`` distinct target ids, sorted)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"a draft vocabulary needs {self.config.draft_vocab_size} distinct ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> the target's ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    # -- the forward, in parts (drafting and training assemble the attention differently) ------
    def fuse(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """The target's hidden states at ``aux_layers`` (each ``[B, T, target_hidden]``) -> ``[B, T, hidden]``."""
        return self.fc(torch.cat(hidden, dim=-1))

    def project(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        """``features [B, T, H]``, ``embeds [B, T, H]`` (of each position's next token),
        ``positions [B, T]`` -> (queries ``[B, heads, T, d]``, keys and values ``[B, kv_heads, T, d]``,
        both rotated; the residual ``features``)."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)  # [B, T, 2H]
        attn = layer.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary(positions, x.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``attended [B, heads, T, d]`` (attention's output), ``residual [B, T, H]`` -> the head's
        hidden state ``[B, T, H]`` (what the next draft step takes as its feature)."""
        layer = self.midlayer
        b, _, t, _ = attended.shape
        h = residual + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` -> ``[B, T, draft_vocab]``."""
        return self.lm_head(self.norm(hidden))

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` -> cos, sin ``[B, 1, T, d]``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[..., None] * self.inv_freq  # [B, T, d/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.config.head_dim)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention with grouped key/value heads: ``q [B, h, T, d]``, ``k, v [B, g, S, d]``,
    ``visible [B, T, S]`` bool -> ``[B, h, T, d]``."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def _scaled_inv_freq(inv: torch.Tensor, c: HeadConfig) -> torch.Tensor:
    """Llama 3's rope scaling (the only kind besides none that published heads use); another
    kind is refused, naming it."""
    scaling = c.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"an EAGLE-3 head with rope scaling {kind!r} is not supported (none or 'llama3')")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / low, old / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, mid, scaled)


class HeadCache:
    """Keys and values of a head, one slot per token position, for ``rows`` rows: slot ``p`` of
    row b holds position ``p``'s entry (a committed pair, or a draft's until the next step
    overwrites it). A query at position ``p`` attends to slots ``0..p`` (every one of them
    written in this step or before with what is committed there)."""

    def __init__(self, head: Eagle3Head, rows: int, capacity: int, dtype: torch.dtype, device):
        c = head.config
        self.keys = torch.zeros(rows, c.num_key_value_heads, capacity, c.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        more = max(needed, 2 * self.capacity) - self.capacity
        pad = self.keys.new_zeros(self.keys.shape[0], self.keys.shape[1], more, self.keys.shape[3])
        self.keys, self.values = torch.cat([self.keys, pad], 2), torch.cat([self.values, pad.clone()], 2)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``positions [B, T]`` (slots), ``k, v [B, g, T, d]``."""
        self.grow(int(positions.max()) + 1)
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys.scatter_(2, index, k.to(self.keys.dtype))
        self.values.scatter_(2, index, v.to(self.values.dtype))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys, self.values = self.keys[rows], self.values[rows]


def step(head: Eagle3Head, cache: HeadCache, features: torch.Tensor, embeds: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """One head forward over ``T`` columns per row at ``positions [B, T]`` (slots written into
    ``cache``; a column whose position repeats an earlier one's, as padding does, writes the same
    slot and is filler) -> the head's hidden states ``[B, T, H]``."""
    q, k, v = head.project(features, embeds, positions)
    cache.write(positions, k, v)
    slots = torch.arange(cache.capacity, device=positions.device)
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return head.finish(attend(q, cache.keys, cache.values, visible), features)
