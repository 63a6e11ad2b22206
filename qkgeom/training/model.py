"""A readable pre-LN GPT with named hook sites on queries, keys, scores and the pattern.

Shapes: B batch, T tokens, D d_model, H heads, E d_head (D = H * E), V vocab.
Attention weights are stored as W_Q, W_K, W_V of shape (D, H*E) and W_O of shape (H*E, D),
so q = x @ W_Q; head h reads columns h*E:(h+1)*E, i.e. W_Q^h of shape (D, E) as in MISSION.md.

Two attention paths share the same weights: the fused kernel (``scaled_dot_product_attention``)
for training, and an explicit softmax path (``explicit=True``) whose every intermediate passes
a :class:`HookPoint`, for probing. Tests check both give the same logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qkgeom import solves as S
from qkgeom.config import ModelConfig


class HookPoint(nn.Module):
    """Identity module marking a named site; forward hooks read or replace its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H, E = cfg.d_model, cfg.n_heads, cfg.d_head
        self.n_heads, self.d_head = H, E
        self.W_Q = nn.Parameter(torch.empty(D, H * E))
        self.W_K = nn.Parameter(torch.empty(D, H * E))
        self.W_V = nn.Parameter(torch.empty(D, H * E))
        self.W_O = nn.Parameter(torch.empty(H * E, D))
        self.hook_q = HookPoint()  # (B, H, T, E)
        self.hook_k = HookPoint()  # (B, H, T, E)
        self.hook_scores = HookPoint()  # (B, H, T, T), pre-mask scaled logits
        self.hook_pattern = HookPoint()  # (B, H, T, T), rows sum to 1
        self.register_buffer("mask", torch.ones(cfg.n_ctx, cfg.n_ctx, dtype=torch.bool).tril(), persistent=False)

    def heads(self, w: torch.Tensor) -> torch.Tensor:
        """(D, H*E) -> (H, D, E): W^h for every head."""
        return w.view(w.shape[0], self.n_heads, self.d_head).permute(1, 0, 2)

    def forward(self, x: torch.Tensor, explicit: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        H, E = self.n_heads, self.d_head

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(B, T, H, E).transpose(1, 2)  # (B, T, H*E) -> (B, H, T, E)

        q = self.hook_q(split(x @ self.W_Q))
        k = self.hook_k(split(x @ self.W_K))
        v = split(x @ self.W_V)
        if explicit:
            scores = self.hook_scores(q @ k.transpose(-1, -2) / math.sqrt(E))  # (B, H, T, T)
            scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
            pattern = self.hook_pattern(scores.softmax(-1))
            z = pattern @ v
        else:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, E)
        return z.transpose(1, 2).reshape(B, T, H * E) @ self.W_O


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_hidden, bias=False)
        self.proj = nn.Linear(cfg.d_hidden, cfg.d_model, bias=False)
        self.hook_attn_in = HookPoint()  # (B, T, D): the LayerNorm'd x_t that W_Q and W_K read

    def forward(self, x: torch.Tensor, explicit: bool = False) -> torch.Tensor:
        x = x + self.attn(self.hook_attn_in(self.ln1(x)), explicit)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 initialisation from `seed`, then the configured energy-matched Q/K init."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)  # residual writes scaled as in GPT-2

        def normal_(p: torch.Tensor, s: float) -> None:
            p.copy_(torch.randn(p.shape, generator=g) * s)

        normal_(self.wte.weight, std)
        normal_(self.wpe.weight, std)
        for b in self.blocks:
            normal_(b.attn.W_V, std)
            normal_(b.attn.W_O, resid_std)
            normal_(b.fc.weight, std)
            normal_(b.proj.weight, resid_std)
            w_q, w_k = init_qk(self.cfg, g)
            b.attn.W_Q.copy_(w_q)
            b.attn.W_K.copy_(w_k)

    def forward(self, idx: torch.Tensor, explicit: bool = False) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V). `explicit` selects the hooked softmax path."""
        T = idx.shape[1]
        if T > self.cfg.n_ctx:
            raise ValueError(f"sequence length {T} exceeds n_ctx={self.cfg.n_ctx}")
        x = self.wte(idx) + self.wpe.weight[:T]
        for b in self.blocks:
            x = b(x, explicit)
        return self.ln_f(x) @ self.wte.weight.T  # tied embeddings

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, explicit: bool = False) -> torch.Tensor:
        logits = self(idx, explicit)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def init_qk(cfg: ModelConfig, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """W_Q, W_K of shape (D, H*E) for the configured initialisation, energy-matched per head.

    Every head's W_Q^h and W_K^h is rescaled to the Frobenius norm init_std * sqrt(D * E), the
    expected norm of an i.i.d. N(0, init_std^2) matrix, so the kinds differ only in geometry:

    - independent: W_Q^h, W_K^h i.i.d. Gaussian.
    - orthogonal:  W_Q^h = P_q R_q S_q V_q^T, W_K^h = P_k R_k S_k V_k^T, with [P_q P_k] an
      orthonormal D x 2E basis, R random E x E rotations, and S, V the singular values and right
      singular vectors of two i.i.d. D x E Gaussians. So (W_Q^h)^T W_K^h = 0 (queries and keys
      read orthogonal subspaces) while each W^h has exactly the singular-value distribution of
      an independent Gaussian head: the relation of Q and K is the only difference. (P_q A with
      a square Gaussian A would give a much less even spectrum: weight PR ~16 vs ~25 of 32.)
    - tied:        W_K^h = W_Q^h (W_Q W_K^T symmetric PSD).
    - anti_tied:   W_K^h = -W_Q^h.
    """
    D, H, E = cfg.d_model, cfg.n_heads, cfg.d_head
    target = cfg.init_std * math.sqrt(D * E)

    def scaled(w: torch.Tensor) -> torch.Tensor:  # (H, D, E), each head to the target norm
        return w * (target / w.flatten(1).norm(dim=1)).view(H, 1, 1)

    if cfg.qk_init == "orthogonal":
        basis, _ = S.qr(torch.randn(H, D, 2 * E, generator=g, dtype=torch.float64))

        def gaussian_head_in(p: torch.Tensor) -> torch.Tensor:  # p (H, D, E) orthonormal columns
            _, s, vh = S.svd(torch.randn(H, D, E, generator=g, dtype=torch.float64), full_matrices=False)
            rot, _ = S.qr(torch.randn(H, E, E, generator=g, dtype=torch.float64))
            return p @ rot @ (s.unsqueeze(-1) * vh)  # (H, D, E) with the Gaussian's singular values

        w_q, w_k = scaled(gaussian_head_in(basis[:, :, :E])), scaled(gaussian_head_in(basis[:, :, E:]))
    else:
        w_q = scaled(torch.randn(H, D, E, generator=g, dtype=torch.float64))
        if cfg.qk_init == "independent":
            w_k = scaled(torch.randn(H, D, E, generator=g, dtype=torch.float64))
        elif cfg.qk_init == "tied":
            w_k = w_q.clone()
        elif cfg.qk_init == "anti_tied":
            w_k = -w_q
        else:
            raise ValueError(f"unknown qk_init {cfg.qk_init!r}")

    def merge(w: torch.Tensor) -> torch.Tensor:
        return w.permute(1, 0, 2).reshape(D, H * E).float()  # (H, D, E) -> (D, H*E)

    return merge(w_q), merge(w_k)
