"""Attention weights in float64 from the papers' formulas, for the tests (nothing of favor_jax is used).

``log_weights`` gives log A [B, H, Lq, Lk] (A normalised over the keys a row may see; −inf where A is 0,
NaN in a row with a negative weight) and the row's term scale S [B, H, Lq]: the largest magnitude of the
log-domain terms summed for its pairs (Σ_d|q_d k_d|/√d for softmax, Σ_d|x_d y_d| for Taylor, |log φ(q)_f| +
|log φ(k)_f| for exponential features; for trigonometric ones also the conditioning M/|Σ_f cos| of their
sum, which cancels; for ReLU the conditioning of ωx, Σ_f (Σ_d|ω_fd x_d|)·relu(ω_f y)/Σ_f relu(ω_f x)relu(ω_f y)
and its mirror). float32 evaluates such a term to about eps·S, so a log weight
computed in float32 can be trusted to a few eps·(1 + S), and no better.
"""

import numpy as np
from scipy.special import logsumexp

EXPONENTIAL = ("positive", "hyperbolic", "optimal_positive", "saderf", "elu_plus_one", "hedgehog")


def _scaled(z):
  return np.asarray(z, np.float64) * z.shape[-1] ** -0.25


def _project(z, w):
  w = np.asarray(w, np.float64)
  return np.einsum("...hd,hmd->...hm", z, w) if w.ndim == 3 else np.einsum("...d,md->...m", z, w)


def _oprf_a(rho):
  return (1 - 2 * rho - np.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16


def _favor_pp_statistic(x, y):
  """ρ = mean over all pairs of ‖x_i + y_j‖²/d, by brute force over the pairs [B, H]."""
  pairs = x[:, :, None] + y[:, None, :]  # [B, Lq, Lk, H, D]
  return np.mean(np.sum(pairs * pairs, -1), axis=(1, 2)) / x.shape[-1]


def _saderf_statistic(x, y):
  """Ψ_l = (mean_j y_jl² / mean_i x_il²)^{1/4} (with the library's floor for an all-zero coordinate)."""
  mx, my = (x * x).mean(1), (y * y).mean(1)
  floor = 1e-8 * np.mean(mx + my, -1, keepdims=True) + 1e-30
  return 0.25 * (np.log(my + floor) - np.log(mx + floor))


def _log_features(name, q, k, w, statistic):
  """(log φ(q), log φ(k)) [B, L, H, F] of an exponential kernel."""
  d = q.shape[-1]
  if name == "elu_plus_one":
    f = lambda z: np.where(z > 0, np.log1p(np.maximum(z, 0)), z)
    return f(np.asarray(q, np.float64)), f(np.asarray(k, np.float64))
  if name == "hedgehog":
    def f(z):
      wz = _project(np.asarray(z, np.float64), w)
      return np.concatenate([wz - logsumexp(wz, -1, keepdims=True), -wz - logsumexp(-wz, -1, keepdims=True)], -1)
    return f(q), f(k)
  x, y = _scaled(q), _scaled(k)
  m = w.shape[-2]
  if name in ("positive", "hyperbolic"):
    def f(z):
      wz = _project(z, w)
      if name == "hyperbolic":
        wz = np.concatenate([wz, -wz], -1)
      return wz - 0.5 * np.sum(z * z, -1, keepdims=True) - 0.5 * np.log(m * (2 if name == "hyperbolic" else 1))
    return f(x), f(y)
  rho = None if statistic is None or name == "saderf" else np.asarray(statistic, np.float64)
  if name == "saderf":
    given = None if statistic is None else np.asarray(statistic, np.float64)
    psi = np.exp(_saderf_statistic(x, y) if given is None else given[..., :d])[:, None]
    x, y = x * psi, y / psi
    rho = None if given is None else given[..., d]
  rho = _favor_pp_statistic(x, y) if rho is None else rho
  a = _oprf_a(rho)[:, None, :, None]  # [B, 1, H, 1]
  w_sq = np.sum(np.asarray(w, np.float64) ** 2, -1)
  f = lambda z: (np.sqrt(1 - 4 * a) * _project(z, w) - 0.5 * np.sum(z * z, -1, keepdims=True)
                 + 0.25 * d * np.log1p(-4 * a) + a * w_sq - 0.5 * np.log(m))
  return f(x), f(y)


def log_pair_weights(name, q, k, w=None, statistic=None):
  """(log κ̂(q_i, k_j) [B, H, Lq, Lk], term scale [B, H, Lq, Lk]) in float64. ``statistic``: a data-dependent
  kernel's, given (FAVOR++: ρ [B, H]; FAVOR#: [B, H, D+1], log Ψ then ρ); default: the paper's, from q and k."""
  head_major = lambda a: np.moveaxis(a, 2, 1)  # [B, L, H, F] -> [B, H, L, F]
  if name == "softmax":
    q, k = (head_major(np.asarray(z, np.float64)) for z in (q, k))
    prod = q[:, :, :, None] * k[:, :, None] / np.sqrt(q.shape[-1])
    return prod.sum(-1), np.abs(prod).sum(-1)
  if name == "taylor":
    x, y = _scaled(q), _scaled(k)
    if w is not None:
      x, y = _project(x, w), _project(y, w)
    prod = head_major(x)[:, :, :, None] * head_major(y)[:, :, None]
    t = prod.sum(-1)
    return np.log(1 + t + t * t / 2), np.abs(prod).sum(-1)
  if name == "relu":
    wx, wy = (head_major(_project(_scaled(z), w)) for z in (q, k))
    a, b = np.maximum(wx, 0), np.maximum(wy, 0)
    ax, by = (head_major(np.einsum("...hd,md->...hm", np.abs(_scaled(z)), np.abs(np.asarray(w, np.float64))))
              for z in (q, k))  # Σ_d|ω_fd x_d|: float32's ωx is that times eps off
    pair = np.einsum("bhqf,bhkf->bhqk", a, b)
    with np.errstate(divide="ignore", invalid="ignore"):
      size = (np.einsum("bhqf,bhkf->bhqk", ax, b) + np.einsum("bhqf,bhkf->bhqk", a, by)) / pair
      return np.log(pair / w.shape[-2]), np.abs(np.log(pair / w.shape[-2])) + size
  if name == "trigonometric":
    x, y = _scaled(q), _scaled(k)
    m = w.shape[-2]
    wx, wy = head_major(_project(x, w)), head_major(_project(y, w))
    norms = lambda z: head_major(0.5 * np.sum(z * z, -1))
    log_scale = norms(x)[..., :, None] + norms(y)[..., None, :] - np.log(m)
    cosines = np.cos(wx[..., :, None, :] - wy[..., None, :, :]).sum(-1)  # sin·sin + cos·cos
    # The sum over features cancels: Σ|terms| / |Σ terms| = M / |Σ cos| adds that many eps to the log.
    size = np.abs(log_scale) + np.abs(wx).max(-1)[..., None] + np.abs(wy).max(-1)[..., None, :] + m / np.abs(cosines)
    with np.errstate(divide="ignore", invalid="ignore"):
      return log_scale + np.log(cosines), size
  else:
    lq, lk = _log_features(name, q, k, w, statistic)
  terms = head_major(lq)[:, :, :, None] + head_major(lk)[:, :, None]
  size = np.abs(head_major(lq))[:, :, :, None] + np.abs(head_major(lk))[:, :, None]
  with np.errstate(invalid="ignore"):
    return logsumexp(terms, axis=-1), np.max(np.where(np.isfinite(size), size, 0), axis=-1)


def log_weights(name, q, k, w=None, *, causal=False, key_mask=None, statistic=None):
  """(log A [B, H, Lq, Lk] normalised over the keys each row may see, row term scale S [B, H, Lq])."""
  log_w, size = log_pair_weights(name, q, k, w, statistic)
  allowed = np.ones(log_w.shape[-2:], bool)
  if causal:
    allowed = np.tril(allowed)
  allowed = np.broadcast_to(allowed, log_w.shape)
  if key_mask is not None:
    allowed = allowed & np.asarray(key_mask)[:, None, None, :]
  log_w = np.where(allowed, log_w, -np.inf)
  with np.errstate(invalid="ignore", divide="ignore"):
    total = logsumexp(log_w, -1, keepdims=True)
    out = np.where(np.isfinite(total), log_w - np.where(np.isfinite(total), total, 0), -np.inf)
  out = np.where(np.any(np.isnan(log_w), axis=-1, keepdims=True), np.nan, out)  # a negative weight: no log
  return out, np.max(np.where(allowed, size, 0), axis=-1)
