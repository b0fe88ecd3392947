"""The certificate of a per-head window cache: at every step, a rigorous bound on the softmax mass each
query head dropped, checked against a tolerance, and what happens when it is exceeded.

What is **guaranteed** (for every step, batch row, query head, with no assumption on the inputs). Query
``i`` at its own position ``o`` (head ``h``: slope ``m``, window ``w``, ``k`` sink keys) attends to the keys
at distances ``<= w`` and the sinks; it drops the keys at distances ``d in [w + 1, o - k]``. Each dropped
logit is ``s = scale q . k_j <= scale ||q_i|| E`` (Cauchy-Schwarz), ``E`` the largest norm of any key the
KV head has held in this row (evicted keys included; the cache keeps this running maximum), so the dropped
mass ``Z_D = sum_dropped e^{s - m d} <= e^{scale ||q_i|| E} T``, ``T = sum_{d=w+1}^{o-k} e^{-m d}`` (a
geometric series, closed form). The kept mass ``Z_W = e^{lse}`` is computed exactly by the step itself. So

    delta_i = Z_D / (Z_W + Z_D) <= B_i = U / (Z_W + U),   U = e^{scale ||q_i|| E} T

and the output error against exact ALiBi over every past key is ``|T* - T^w| <= B_i (max_j v_jc - min_j v_jc)``
per value column ``c`` (``window_error_bound``'s identity ``T* - T^w = delta (T^D - T^w)``), with the value
range of every value the KV head has held (also kept). ``B_i`` is never below the true dropped mass; it is
tighter than :func:`poslsh.theory.window_error_bound` because ``Z_W`` is measured, not bounded.

What is **estimated**: the windows themselves. :func:`certified_window` takes them from
:func:`poslsh.theory.smallest_window` at an assumed logit range ``R``; if the inputs' logits spread wider
than ``R``, a step's ``B_i`` can pass ``tol``, and the policy decides:

* ``"raise"``: a ``ValueError`` naming the layer, head, position and bound (the cache refuses further steps);
* ``"warn"``: a :class:`CertificateWarning` (once per head and cache) and the step's output as computed;
  every exceedance is counted in the stats;
* ``"widen"``: when ``B_i`` passes ``widen_at * tol`` the head's window grows by half (the keys it still
  holds stay; up to ``cap`` keys), so later queries keep more keys before the tolerance is reached; a
  step that still passes ``tol`` warns as ``"warn"`` does, and at the cap the head stays there and warns.
  Until the widened ring refills, the keys it evicted before are dropped too: the bound counts them (its
  window is the one the held keys reach, :meth:`~poslsh.decoding.HeadWindows.effective_windows`), and the
  head widens again only once refilled.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

__all__ = ["Certificate", "CertificateWarning", "POLICIES", "certify_step", "certified_window"]

POLICIES = ("widen", "warn", "raise")


class CertificateWarning(UserWarning):
    """A step of a certified window cache dropped more softmax mass than its tolerance allows."""


@dataclass(frozen=True)
class Certificate:
    """What a per-head window cache checks at every step (see the module docstring).

    Attributes:
        tol: the tolerance on the dropped softmax mass of every query head (``0 < tol < 1``).
        policy: ``"widen"``, ``"warn"`` or ``"raise"``: what a step over ``tol`` does.
        cap: the most keys one head may keep (its window ``<= cap``); None: no cap. A window above the cap
            is refused in one line under ``"raise"`` and ``"widen"``, cut to the cap with a warning under
            ``"warn"``.
        widen_at: ``"widen"`` grows a head's window once its bound passes ``widen_at * tol``.
    """

    tol: float
    policy: str = "warn"
    cap: Optional[int] = None
    widen_at: float = 0.5

    def __post_init__(self):
        if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not 0 < self.tol < 1:
            raise ValueError(f"tol: the tolerance on the dropped mass must be a number in (0, 1), got {self.tol!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.cap is not None and (isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 0):
            raise ValueError(f"cap: the most keys a head keeps must be an int >= 0 or None, got {self.cap!r}")
        if not 0 < self.widen_at <= 1:
            raise ValueError(f"widen_at: must be in (0, 1], got {self.widen_at!r}")

    def check_windows(self, windows: List[int], where: str = "window") -> List[int]:
        """The windows the cache starts with: refused above the cap (``"raise"``, ``"widen"``) or cut to it
        with a warning (``"warn"``)."""
        if self.cap is None or max(windows, default=0) <= self.cap:
            return list(windows)
        h = max(range(len(windows)), key=lambda i: windows[i])
        if self.policy != "warn":
            raise ValueError(f"{where}: head {h} needs a window of {windows[h]} keys, more than cap={self.cap}: raise "
                             "the cap, loosen tol, or take policy='warn' (the window is cut, the certificate then warns)")
        warnings.warn(f"{where}: windows above cap={self.cap} are cut to it (head {h} wanted {windows[h]}); the "
                      "certificate warns where that drops more than tol", CertificateWarning, stacklevel=3)
        return [min(w, self.cap) for w in windows]

    def widened(self, w: int) -> int:
        """The window ``"widen"`` moves a head to from ``w`` (by half, at least one key; at most ``cap``)."""
        new = max(w + 1, math.ceil(1.5 * w))
        return new if self.cap is None else min(new, self.cap)


def _log_tail(slopes: Tensor, first: Tensor, count: Tensor) -> Tensor:
    """``log sum_{d=first}^{first+count-1} e^{-m d}`` (``-inf`` where ``count <= 0``), broadcast, float64."""
    m, a, c = slopes.to(torch.float64), first.to(torch.float64), count.to(torch.float64)
    pos = m > 0
    ms = torch.where(pos, m, torch.ones_like(m))
    geo = -ms * a + torch.log(-torch.expm1(-ms * c.clamp(min=1))) - torch.log(-torch.expm1(-ms))
    flat = torch.log(c.clamp(min=1))
    out = torch.where(pos, geo, flat)
    return torch.where(c > 0, out, torch.full_like(out, -math.inf))


def dropped_mass_bound(lse: Tensor, q_norm: Tensor, key_norm: Tensor, slopes: Tensor, windows: Tensor,
                       own: Tensor, sinks: int, scale: float) -> Tensor:
    """The bound ``B`` on the dropped softmax mass of each query (module docstring), float64.

    Args:
        lse: ``[..., Hq, nq]`` log of the kept mass (window and sinks), ``-inf`` for a query with no key.
        q_norm: ``[..., Hq, nq]`` the queries' norms; key_norm: ``[..., Hq, 1]`` the largest key norm its KV
            head has held.
        slopes: ``[Hq, 1]`` the heads' slopes; windows: ``[Hq, 1]`` or ``[Hq, nq]`` the windows of the queries
            (the keys a head holds: :meth:`~poslsh.decoding.HeadWindows.effective_windows`).
        own: ``[..., 1, nq]`` each query's own position (tokens before it in its row).
        sinks: keys kept at the first positions of each row.
    """
    count = own - sinks - windows                              # dropped distances w + 1 .. own - sinks
    log_u = float(scale) * q_norm.to(torch.float64) * key_norm.to(torch.float64) + _log_tail(slopes, windows + 1,
                                                                                             count)
    bound = torch.sigmoid(log_u - lse.to(torch.float64))       # U / (Z_W + U)
    return torch.where(count > 0, bound, torch.zeros_like(bound))


def certified_window(tol: float, logit_range, *, slopes):
    """The :class:`~poslsh.AlibiWindow` of :func:`poslsh.theory.smallest_window` at ``tol`` for the
    ALiBi ``slopes`` ``[H]`` and an assumed ``logit_range``: the windows a :class:`Certificate` with the
    same ``tol`` starts from."""
    from ..window.kind import make_window
    from ..window.theory import smallest_window

    m = make_window(slopes).slopes                     # checked: finite, >= 0
    return make_window(m, smallest_window(tol, 1.0 / m, logit_range))


def certify_step(store, q: Tensor, lse: Tensor, p0: int, scale: float) -> None:
    """Bound the step's dropped mass for every row, head and query (``store``: a
    :class:`~poslsh.decoding.HeadWindows` after the step) and apply the policy."""
    cert, nq = store.certificate, q.shape[2]
    own = store._own(p0, nq)
    slopes = store.slopes.to(store.device)[:, None]
    win = store.effective_windows(p0, nq)                                 # [Hq, nq]
    kn = store.key_norm.repeat_interleave(store.r, 1)[..., None]
    bound = dropped_mass_bound(lse, q.to(torch.float64).norm(dim=-1), kn, slopes, win, own, store.sinks, scale)
    bound = bound.masked_fill(own < 0, 0)
    vr = (store.v_hi - store.v_lo).clamp(min=0).nan_to_num(0).repeat_interleave(store.r, 1)   # [B, Hq, dv]
    store.last_bound, store.last_error_bound = bound, bound[..., None] * vr[:, :, None]
    store.stats["steps"] += 1
    per_head = bound.amax((0, 2)).tolist()
    store.stats["worst"] = max(store.stats["worst"], max(per_head))
    over = [h for h, b in enumerate(per_head) if b > cert.tol]
    for h in over:
        store.stats["exceeded"][h] += 1
    if over and cert.policy == "raise":
        h = over[0]
        store.failed = (f"certificate: head {h} dropped up to {per_head[h]:.3g} of its softmax mass at position "
                       f"{p0 + nq - 1}, above tol={cert.tol:g} (window {store.win[h]})")
        raise ValueError(f"{store.name}: {store.failed}: take a larger window (a larger logit_range), "
                         "policy='widen', or a larger tol")
    for h in over:
        if h not in store._warned:
            store._warned.add(h)
            warnings.warn(f"{store.name}: certificate: head {h} dropped up to {per_head[h]:.3g} of its softmax "
                          f"mass at position {p0 + nq - 1}, above tol={cert.tol:g} (window {store.win[h]}); "
                          "counted in stats['exceeded']", CertificateWarning, stacklevel=4)
    if cert.policy == "widen":
        refilling = (win[:, -1] < torch.tensor(store.win, device=store.device)).tolist()    # widened, not refilled
        grow = [h for h, b in enumerate(per_head) if b > cert.widen_at * cert.tol and not refilling[h]]
        changed = False
        for h in grow:
            new = cert.widened(store.win[h])
            if new > store.win[h]:
                store.win[h], changed = new, True
                store.stats["widened"][h] += 1
            elif ("cap", h) not in store._warned:
                store._warned.add(("cap", h))
                warnings.warn(f"{store.name}: certificate: head {h} is at cap={cert.cap} keys and its bound "
                              f"{per_head[h]:.3g} passes {cert.widen_at:g} x tol; it cannot widen further",
                              CertificateWarning, stacklevel=4)
        if changed:
            old = list(store.cap)
            store._caps()
            for j, (a, b) in enumerate(zip(old, store.cap)):       # a ring that grows refills from here
                if b > a:
                    store.held_from[j] = max(store.held_from[j], store.total - a)
            store._layout([min(c, max(a, store.total + 1)) for a, c in zip(store.alloc, store.cap)])
