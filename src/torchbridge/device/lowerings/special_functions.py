"""Bessel functions of the first and second kind (J0, J1, Y0, Y1), modified Bessel functions of the
second kind (K0, K1 and their exp-scaled forms) and the Airy function Ai.

JAX has no lowering for these, so they are evaluated from their textbook expansions (Abramowitz &
Stegun ch. 9 and 10), always in float64 and rounded to the output dtype at the end:

* small |x|: the convergent power series (for J/Y the alternating series is summed in float64,
  which keeps the cancellation error far below float32 resolution up to the switch point);
* large |x|: Hankel's asymptotic expansions, truncated well before their smallest term;
* K in between: the integral K_v(x) = int_0^inf exp(-x cosh t) cosh(v t) dt by the trapezoidal
  rule, which converges geometrically because the integrand is analytic in a strip.

Special values follow PyTorch's CPU kernels: J/Y/Ai of +-inf are nan, Y and K are -inf/+inf at 0
and nan for negative arguments.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower

_EULER = 0.57721566490153286061
_F64 = jnp.float64


def _prep(a):
    """The argument in float64 (integer and float32 inputs alike) and the dtype to return."""
    return jnp.asarray(a).astype(_F64), ctx().out_dtypes[0]


def _clip(x, lo, hi):
    """`x` forced into [lo, hi] so that the branch not taken by a `where` stays finite."""
    return jnp.clip(jnp.where(jnp.isnan(x), lo, x), lo, hi)


# ---- power series ----------------------------------------------------------------------------------

_SERIES_TERMS = 60


def _series_j_y(x, nu: int):
    """J_nu(x) and Y_nu(x) for 0 < x <= _JY_SWITCH (nu = 0 or 1) from their power series."""
    z = (x * 0.5) ** 2
    half = x * 0.5
    # J: sum (-z)^k / (k! (k+nu)!) * (x/2)^nu
    # Y (A&S 9.1.11): (2/pi) ln(x/2) J - (1/pi) (x/2)^nu sum (psi(k+1) + psi(k+nu+1)) (-z)^k / (k! (k+nu)!)
    #                 - for nu = 1 also (2/pi)/x
    term = jnp.ones_like(x)
    j_sum = term
    psi_k = -_EULER  # psi(k+1)
    psi_kn = -_EULER + (1.0 if nu == 1 else 0.0)  # psi(k+nu+1)
    y_sum = term * (psi_k + psi_kn)
    for k in range(1, _SERIES_TERMS):
        term = term * (-z) / (k * (k + nu))
        psi_k += 1.0 / k
        psi_kn += 1.0 / (k + nu)
        j_sum = j_sum + term
        y_sum = y_sum + term * (psi_k + psi_kn)
    scale = half if nu == 1 else 1.0
    j = j_sum * scale
    y = (2 / math.pi) * jnp.log(half) * j - (1 / math.pi) * scale * y_sum
    if nu == 1:
        y = y - (2 / math.pi) / x
    return j, y


def _series_i_k(x, nu: int):
    """K_nu(x) for 0 < x <= _K_SERIES from its power series (A&S 9.6.11 with 9.6.10 for I)."""
    z = (x * 0.5) ** 2
    half = x * 0.5
    term = jnp.ones_like(x)
    i_sum = term
    psi_k = -_EULER
    psi_kn = -_EULER + (1.0 if nu == 1 else 0.0)
    k_sum = term * (psi_k + psi_kn)
    for k in range(1, _SERIES_TERMS // 2):
        term = term * z / (k * (k + nu))
        psi_k += 1.0 / k
        psi_kn += 1.0 / (k + nu)
        i_sum = i_sum + term
        k_sum = k_sum + term * (psi_k + psi_kn)
    if nu == 0:
        # K0 = -ln(x/2) I0 + (1/2) sum (2 psi(k+1)) z^k / (k!)^2
        return -jnp.log(half) * i_sum + 0.5 * k_sum
    # K1 = 1/x + ln(x/2) I1 - (x/4) sum (psi(k+1) + psi(k+2)) z^k / (k! (k+1)!)
    return 1.0 / x + jnp.log(half) * (half * i_sum) - 0.5 * half * k_sum


# ---- asymptotic expansions ------------------------------------------------------------------------

_ASYMP_TERMS = 30


def _hankel_coeffs(nu: int) -> list[float]:
    """a_k(nu) = prod_{j<=k} (4 nu^2 - (2j-1)^2) / (k! 8^k)."""
    mu = 4.0 * nu * nu
    out = [1.0]
    for k in range(1, _ASYMP_TERMS):
        out.append(out[-1] * (mu - (2 * k - 1) ** 2) / (8.0 * k))
    return out


def _even_odd_series(coeffs, inv):
    """P = c0 - c2 t^2 + c4 t^4 - ..., Q = c1 t - c3 t^3 + ... with t = inv: the two halves of a
    Hankel-type asymptotic expansion."""
    p = jnp.zeros_like(inv)
    q = jnp.zeros_like(inv)
    power = jnp.ones_like(inv)
    for k, c in enumerate(coeffs):
        sign = -1.0 if (k // 2) % 2 else 1.0
        if k % 2 == 0:
            p = p + sign * c * power
        else:
            q = q + sign * c * power
        power = power * inv
    return p, q


def _asymp_j_y(x, nu: int):
    """J_nu, Y_nu for large x > 0 (A&S 9.2.5-9.2.10)."""
    coeffs = _hankel_coeffs(nu)
    inv = 1.0 / x
    p, q = _even_odd_series(coeffs, inv)
    s, c = jnp.sin(x), jnp.cos(x)
    r = 1 / math.sqrt(2)
    if nu == 0:  # chi = x - pi/4
        cos_chi, sin_chi = (c + s) * r, (s - c) * r
    else:  # chi = x - 3 pi/4
        cos_chi, sin_chi = (s - c) * r, -(s + c) * r
    amp = jnp.sqrt(2 / (math.pi * x))
    return amp * (p * cos_chi - q * sin_chi), amp * (p * sin_chi + q * cos_chi)


def _asymp_k_scaled(x, nu: int):
    """exp(x) K_nu(x) for large x (A&S 9.7.2)."""
    coeffs = _hankel_coeffs(nu)
    inv = 1.0 / x
    acc = jnp.zeros_like(x)
    power = jnp.ones_like(x)
    for c in coeffs:
        acc = acc + c * power
        power = power * inv
    return jnp.sqrt(math.pi / (2 * x)) * acc


_K_STEP = 0.05
_K_NODES = 81  # t in [0, 4]


def _quad_k_scaled(x, nu: float):
    """exp(x) K_nu(x) = int_0^inf exp(-x (cosh t - 1)) cosh(nu t) dt for moderate x (>= about 1.5),
    by the trapezoidal rule on [0, 4]; the integrand is below exp(-50) past t = 4 there."""
    t = jnp.arange(_K_NODES, dtype=_F64) * _K_STEP
    w = jnp.full((_K_NODES,), _K_STEP, _F64).at[0].set(_K_STEP / 2)
    cosh_m1 = 2 * jnp.sinh(t / 2) ** 2
    f = jnp.exp(-x[..., None] * cosh_m1) * jnp.cosh(nu * t)
    return jnp.sum(f * w, axis=-1)


# ---- J and Y --------------------------------------------------------------------------------------

_JY_SWITCH = 17.0


def _j_y(a, nu: int):
    x, dt = _prep(a)
    ax = jnp.abs(x)
    small = ax <= _JY_SWITCH
    xs = _clip(ax, 1e-300, _JY_SWITCH)
    xl = _clip(ax, _JY_SWITCH, jnp.inf)
    js, ys = _series_j_y(xs, nu)
    jl, yl = _asymp_j_y(xl, nu)
    j = jnp.where(small, js, jl)
    y = jnp.where(small, ys, yl)
    j = jnp.where(ax == 0, 1.0 if nu == 0 else 0.0, j)
    if nu == 1:
        j = jnp.where(x < 0, -j, j)
        j = jnp.where(x == 0, x, j)  # keeps the sign of zero
    y = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, y))
    nan = jnp.isnan(x) | jnp.isinf(x)
    return jnp.where(nan, jnp.nan, j).astype(dt), jnp.where(nan, jnp.nan, y).astype(dt)


@lower("special_bessel_j0")
def bessel_j0(a):
    return _j_y(a, 0)[0]


@lower("special_bessel_j1")
def bessel_j1(a):
    return _j_y(a, 1)[0]


@lower("special_bessel_y0")
def bessel_y0(a):
    return _j_y(a, 0)[1]


@lower("special_bessel_y1")
def bessel_y1(a):
    return _j_y(a, 1)[1]


# ---- K --------------------------------------------------------------------------------------------

_K_SERIES = 2.0
_K_ASYMP = 25.0


def _k_scaled(x, nu: int):
    """exp(x) K_nu(x) for x > 0 (any value elsewhere)."""
    xs = _clip(x, 1e-300, _K_SERIES)
    xm = _clip(x, _K_SERIES, _K_ASYMP)
    xl = _clip(x, _K_ASYMP, jnp.inf)
    series = _series_i_k(xs, nu) * jnp.exp(xs)
    quad = _quad_k_scaled(xm, float(nu))
    asymp = _asymp_k_scaled(xl, nu)
    return jnp.where(x <= _K_SERIES, series, jnp.where(x <= _K_ASYMP, quad, asymp))


def _k(a, nu: int, scaled: bool):
    x, dt = _prep(a)
    ks = _k_scaled(x, nu)
    out = ks if scaled else ks * jnp.exp(-_clip(x, 0.0, 1e300))
    out = jnp.where(jnp.isposinf(x), 0.0, out)
    out = jnp.where(x == 0, jnp.inf, jnp.where((x < 0) | jnp.isnan(x), jnp.nan, out))
    return out.astype(dt)


@lower("special_modified_bessel_k0")
def modified_bessel_k0(a):
    return _k(a, 0, scaled=False)


@lower("special_modified_bessel_k1")
def modified_bessel_k1(a):
    return _k(a, 1, scaled=False)


@lower("special_scaled_modified_bessel_k0")
def scaled_modified_bessel_k0(x):
    return _k(x, 0, scaled=True)


@lower("special_scaled_modified_bessel_k1")
def scaled_modified_bessel_k1(x):
    return _k(x, 1, scaled=True)


# ---- Airy Ai --------------------------------------------------------------------------------------

_AI0 = 0.355028053887817239260  # Ai(0) = 1 / (3^(2/3) Gamma(2/3))
_AIP0 = 0.258819403792806798405  # -Ai'(0) = 1 / (3^(1/3) Gamma(1/3))
_AIRY_NEG = -7.0  # series on [_AIRY_NEG, _AIRY_POS], asymptotic expansions outside
_AIRY_POS = 6.0
_AIRY_TERMS = 40


def _airy_u(n: int) -> list[float]:
    """u_k = (2k+1)(2k+3)...(6k-1) / (216^k k!) (A&S 10.4.58)."""
    out = [1.0]
    for k in range(1, n):
        out.append(out[-1] * (6 * k - 5) * (6 * k - 3) * (6 * k - 1) / ((2 * k - 1) * 216.0 * k))
    return out


def _airy_series(x):
    """Ai(x) = Ai(0) f(x) + Ai'(0) g(x) (A&S 10.4.2-10.4.3)."""
    x3 = x * x * x
    f_term = jnp.ones_like(x)
    g_term = x
    f, g = f_term, g_term
    for k in range(1, _AIRY_TERMS):
        f_term = f_term * x3 / ((3 * k - 1) * (3 * k))
        g_term = g_term * x3 / ((3 * k) * (3 * k + 1))
        f = f + f_term
        g = g + g_term
    return _AI0 * f - _AIP0 * g


def _airy_pos(x):
    """Ai(x) for large x > 0 (A&S 10.4.59)."""
    zeta = (2.0 / 3.0) * x * jnp.sqrt(x)
    u = _airy_u(12)
    inv = -1.0 / zeta
    acc = jnp.zeros_like(x)
    power = jnp.ones_like(x)
    for c in u:
        acc = acc + c * power
        power = power * inv
    return jnp.exp(-zeta) / (2 * math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(x))) * acc


def _airy_neg(x):
    """Ai(x) for large -x > 0 (A&S 10.4.60)."""
    ax = -x
    zeta = (2.0 / 3.0) * ax * jnp.sqrt(ax)
    u = _airy_u(20)
    inv = 1.0 / zeta
    p, q = _even_odd_series(u, inv)
    # sin(zeta + pi/4), cos(zeta + pi/4)
    s, c = jnp.sin(zeta), jnp.cos(zeta)
    r = 1 / math.sqrt(2)
    sin_t, cos_t = (s + c) * r, (c - s) * r
    return (sin_t * p - cos_t * q) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(ax)))


@lower("special_airy_ai")
def airy_ai(x):
    x, dt = _prep(x)
    mid = _clip(x, _AIRY_NEG, _AIRY_POS)
    hi = _clip(x, _AIRY_POS, 1e300)
    lo = _clip(x, -1e300, _AIRY_NEG)
    out = jnp.where(x > _AIRY_POS, _airy_pos(hi), jnp.where(x < _AIRY_NEG, _airy_neg(lo), _airy_series(mid)))
    out = jnp.where(jnp.isinf(x) | jnp.isnan(x), jnp.nan, out)
    return out.astype(dt)
