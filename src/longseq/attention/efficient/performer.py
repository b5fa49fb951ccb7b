"""Performer / FAVOR+ (Choromanski et al. 2021): positive orthogonal random features, O(L m D).

Softmax kernel (``kernel=softmax``): with ``x`` = q or k times ``D^(-1/4)`` (together the single 1/sqrt(D)),
``phi(x) = m^(-1/2) exp(W x - |x|^2 / 2 - c)``, so ``E[phi(q) . phi(k)] ~ exp(q . k / sqrt(D))``.
Constant factors cancel in the normalization: a query's features are ``softmax_f(w_f . x)`` (its
per-query factor dropped), plus ``eps`` relative to their mean ``1/m``; a key's features are
``exp(w . x - |x|^2/2)`` divided by one detached constant per (batch, head), computed as a unit part
``exp(w . x - a)`` (``a`` the key's max projection) times a per-key scale that ``prefix_sums`` applies on
the values (see ``key_features``). ``eps`` is added to the query features only: a per-key ``eps`` would
not cancel and would let a later key's max leak into earlier causal outputs.
ReLU kernel (``kernel=relu``, the "generalized attention" of the paper): ``phi(x) = relu(W x) + eps``.
``W`` ``(m, D)`` is shared by all heads; with ``orthogonal=true`` it stacks ``D x D`` blocks made
orthogonal by QR of Gaussian matrices, rows rescaled to chi(D)-distributed norms (``row_norms=chi``,
the norms of Gaussian rows) or to sqrt(D) (``row_norms=fixed``).

Output ``D^-1 phi(Q) [phi(K)^T V]``, normalized per query (all features are strictly positive, so rows of
``attention_matrix`` sum to 1); never the ``(B, H, L, m, D)`` tensor. No explicit weights in the fast path,
so ``dropout`` is not applied. The maps are written once, in ``RandomFeatures`` (with their hand-written
vector-Jacobian products, every pass in place on the fresh projection). Causal: the maps run inside
``prefix_sums.causal_kernel_attention``'s tiles, so the ``(L, m)`` features never exist whole (backward
recomputes them per tile), and the per-(batch, head) key constant is the running maximum of the key log
scales. Why tiled: fresh ``(L, m)`` tensors page-faulted on first touch and a loop of small GEMMs dominated the
untiled version (measured: docs/cpu_engine_measurements.md, *performer*).

Randomness: ``W`` is a buffer drawn from ``(seed, draws)``; in training, every ``redraw_interval``
forward calls (counted in the ``calls`` buffer, training only) the next draw replaces it. ``W``, ``calls``
and ``draws`` are in the state dict, so a checkpoint round trip restores the same features and redraw
schedule. ``redraw_interval=0`` never redraws.
"""

from __future__ import annotations

import math

import torch

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.ops.prefix_sums import (
    KernelFeatures,
    KernelSumsState,
    causal_kernel_attention,
    kernel_attention,
    kernel_step,
    kernel_weights,
    key_features,
    query_features,
)
from longseq.attention.registry import register_attention

KERNELS = ("softmax", "relu")
ROW_NORMS = ("chi", "fixed")


def random_features(
    n_features: int, dim: int, generator: torch.Generator, orthogonal: bool = True, row_norms: str = "chi"
) -> torch.Tensor:
    """``(n_features, dim)`` fp64 Gaussian projection; orthogonal blocks + chi/fixed row norms if asked."""
    if not orthogonal:
        return torch.randn(n_features, dim, generator=generator, dtype=torch.float64)
    gaussian = torch.randn(math.ceil(n_features / dim), dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # batched over the D x D blocks
    # sign-fix so the columns are uniformly distributed (Householder QR fixes the signs of diag(R),
    # which would bias every feature direction and hence the kernel estimate)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    w = q.transpose(-1, -2).reshape(-1, dim)[:n_features]  # unit rows, orthogonal within a block
    if row_norms == "chi":
        norms = torch.randn(n_features, dim, generator=generator, dtype=torch.float64).norm(dim=-1)
    else:
        norms = torch.full((n_features,), math.sqrt(dim), dtype=torch.float64)
    return w * norms.unsqueeze(-1)


class RandomFeatures(KernelFeatures):
    """The FAVOR+ feature maps (see the module docstring) of ``projection`` W ``(m, D)``, eps included.

    Holds ``W D^(-1/4)`` (a copy: a redraw between forward and backward cannot change it). softmax kernel:
    queries ``softmax_f(w_f . x) + eps / m``, keys ``exp(w . x - a)`` with log scale ``a - |x|^2 / 2`` (``a`` the
    key's max projection, a constant for autograd: it cancels between the two); relu kernel:
    ``relu(w . x) + eps`` for both.
    """

    def __init__(self, projection: torch.Tensor, kernel: str, eps: float) -> None:
        n_features, dim = projection.shape
        self.weight, self.kernel = projection * dim**-0.25, kernel
        self.eps = eps / n_features if kernel == "softmax" else eps  # softmax: relative to the mean 1/m
        self.input_scale = dim**-0.5  # |x|^2 = |k|^2 / sqrt(D)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to(x.dtype).T

    def _back_project(self, grad_projected: torch.Tensor) -> torch.Tensor:
        return grad_projected @ self.weight.to(grad_projected.dtype)

    # in place throughout: the projection is a fresh buffer, and on CPU every fresh (L, m) tensor costs
    # page faults
    def query(self, q: torch.Tensor) -> torch.Tensor:
        projected = self._project(q)
        if self.kernel == "relu":
            return projected.relu_().add_(self.eps)
        projected -= projected.amax(-1, keepdim=True)
        projected.exp_()
        return projected.div_(projected.sum(-1, keepdim=True)).add_(self.eps)

    def query_grad(self, q: torch.Tensor, phi: torch.Tensor, grad_phi: torch.Tensor) -> torch.Tensor:
        if self.kernel == "relu":
            return self._back_project(grad_phi * (phi > self.eps))
        softmax = phi - self.eps
        grad_projected = grad_phi * softmax
        grad_projected -= softmax.mul_(grad_projected.sum(-1, keepdim=True))
        return self._back_project(grad_projected)

    def key(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        projected = self._project(k)
        if self.kernel == "relu":
            return projected.relu_().add_(self.eps), None
        row_max = projected.amax(-1, keepdim=True)
        log_scale = row_max - 0.5 * self.input_scale * (k * k).sum(-1, keepdim=True)
        return projected.sub_(row_max).exp_(), log_scale

    def key_grad(self, k, phi, grad_phi, grad_log_scale) -> torch.Tensor:
        if self.kernel == "relu":
            return self._back_project(grad_phi * (phi > self.eps))
        grad_k = self._back_project(grad_phi * phi)
        if grad_log_scale is not None:
            grad_k -= self.input_scale * grad_log_scale * k
        return grad_k


@register_attention("performer")
class PerformerAttention(Attention):
    """FAVOR+ random-feature attention (see the module docstring).

    Args:
        n_features: m, number of random features (lucidrains default d ln d; LRA/xformers 256).
        kernel: ``softmax`` (positive random features) or ``relu`` (generalized attention).
        orthogonal: orthogonal random features (FAVOR+) instead of i.i.d. Gaussian rows.
        row_norms: ``chi`` (Gaussian-like norms) or ``fixed`` (sqrt(D)); only with ``orthogonal``.
        redraw_interval: redraw W every this many training forward calls (0 = never).
        feature_eps: added to query features relative to their mean (softmax) / to all features (relu), for positivity; None = 1e-4 (softmax) / 1e-3 (relu, as in LRA).
        chunk_size: causal prefix-sum chunk length.
        seed: seeds every draw of W.
    """

    def __init__(
        self,
        *,
        causal: bool,
        head_dim: int | None = None,
        n_features: int = 256,
        kernel: str = "softmax",
        orthogonal: bool = True,
        row_norms: str = "chi",
        redraw_interval: int = 1000,
        feature_eps: float | None = None,
        chunk_size: int = 64,
        seed: int = 0,
        **common,
    ) -> None:
        if kernel not in KERNELS:
            raise AttentionConfigError(f"attention.kernel must be one of {KERNELS}, got {kernel!r}")
        if row_norms not in ROW_NORMS:
            raise AttentionConfigError(f"attention.row_norms must be one of {ROW_NORMS}, got {row_norms!r}")
        if not isinstance(n_features, int) or n_features < 1:
            raise AttentionConfigError(f"attention.n_features must be a positive integer, got {n_features!r}")
        if not isinstance(redraw_interval, int) or redraw_interval < 0:
            raise AttentionConfigError(f"attention.redraw_interval must be an integer >= 0, got {redraw_interval!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise AttentionConfigError(f"attention.chunk_size must be a positive integer, got {chunk_size!r}")
        if head_dim is None:
            raise AttentionConfigError("attention 'performer' needs head_dim (model.d_model / model.n_heads) to draw its features")
        super().__init__(causal=causal, head_dim=head_dim, **common)
        self.n_features, self.kernel, self.orthogonal, self.row_norms = n_features, kernel, bool(orthogonal), row_norms
        self.redraw_interval, self.chunk_size, self.seed = redraw_interval, chunk_size, int(seed)
        self.feature_eps = float(feature_eps if feature_eps is not None else (1e-4 if kernel == "softmax" else 1e-3))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))
        self.register_buffer("projection", self._draw(0).to(torch.get_default_dtype()))
        # host copies of ``calls`` and ``draws``, so the redraw schedule never reads a buffer on the device (a sync
        # per step on a GPU, a host round trip in XLA's graph); ``_load_from_state_dict`` refreshes them
        self._host_calls, self._host_draws = 0, 0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._host_calls = int(state_dict.get(prefix + "calls", self._host_calls))
        self._host_draws = int(state_dict.get(prefix + "draws", self._host_draws))

    def _draw(self, index: int) -> torch.Tensor:
        """Draw number ``index`` of W ``(m, D)``, fp64, a pure function of ``(seed, index)``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return random_features(self.n_features, self.head_dim, g, self.orthogonal, self.row_norms)

    @torch.no_grad()
    def redraw(self) -> None:
        """Replace W by the next draw."""
        self.draws += 1
        self._host_draws += 1
        self.projection.copy_(self._draw(self._host_draws).to(self.projection))

    def feature_map(self) -> RandomFeatures:
        """The feature maps of the current draw of W."""
        return RandomFeatures(self.projection, self.kernel, self.feature_eps)

    def query_features(self, q: torch.Tensor) -> torch.Tensor:
        """Features ``(B, H, L, m)`` of unscaled queries ``(B, H, L, D)``, eps included (softmax kernel:
        ``softmax_f(w_f . x) + eps / m``: the softmax is ``exp(w . x - |x|^2/2)`` times a per-query factor,
        which cancels in the normalization)."""
        return query_features(self.feature_map(), q)

    def key_features(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features of unscaled keys as ``(unit (B, H, L, m), scale (B, H, L, 1) or None)``.

        softmax kernel: ``phi = exp(w . x - |x|^2/2 - c) = exp(w . x - a) * exp(a - |x|^2/2 - c)`` with
        ``a`` the key's max projection (so ``unit <= 1``) and ``c`` one detached constant per (batch, head)
        making the largest scale 1 (it cancels, also when causal). The per-key scale is applied on the
        values by ``prefix_sums`` (cheaper than a pass over ``(L, m)``), and the ``|x|^2/2`` gradient flows
        through it. No eps on keys: it would not cancel and would let a later key's max leak into earlier
        causal outputs.
        """
        unit, log_scale = self.key_log_features(k)
        if log_scale is None:
            return unit, None
        return unit, torch.exp(log_scale - log_scale.detach().amax(-2, keepdim=True))

    def key_log_features(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``key_features`` before the per-(batch, head) constant: ``(unit, log scale (B, H, L, 1))`` (softmax
        kernel; ``(features, None)`` for relu). Decoding and the causal forward divide by a running maximum."""
        return key_features(self.feature_map(), k)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.training and self.redraw_interval > 0:
            if self._host_calls > 0 and self._host_calls % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1
            self._host_calls += 1
        if self.causal:
            return causal_kernel_attention(q, k, v, self.chunk_size, features=self.feature_map())
        phi_q, (phi_k, key_scale) = self.query_features(q), self.key_features(k)
        return kernel_attention(phi_q, phi_k, v, key_scale=key_scale)

    # -- incremental decoding: the running sums of the causal prefix, O(m D) per step ---------------------
    supports_decoding = True

    def init_decoding_state(self, batch_size: int, max_len: int, device, dtype) -> KernelSumsState:
        return KernelSumsState(batch_size, max_len, device, dtype)

    def step(self, state: KernelSumsState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        phi_k, log_scale = self.key_log_features(k)
        return kernel_step(state, self.query_features(q), phi_k, v, log_key_scale=log_scale)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        phi_k, key_scale = self.key_features(k)
        return kernel_weights(self.query_features(q), phi_k, self.causal, key_scale=key_scale)

    def extra_repr(self) -> str:
        return (f"name={self.name}, causal={self.causal}, kernel={self.kernel}, n_features={self.n_features}, "
                f"redraw_interval={self.redraw_interval}")
