#!/usr/bin/env python3
"""Fits the float64 polynomials of the two GELUs on the CPU (shaders/src/ops/math.rs).

The CPU computes every GELU value in f64 and rounds once to f32, so that its error is f32
rounding alone (unbiased, within about half an ulp) rather than an approximation's error, which
leans one way over whole ranges of x and shows in a model's gradients summed over thousands of
positions. These fits are accurate to ~1e-11 or better, far below f32's 6e-8.

Near zero (|x| <= B, B = GELU_NEAR = 2) each GELU is x P(x), P(x) - 0.5 odd (the exact one:
P = Phi, the standard normal CDF; the tanh form: P = (1 + tanh(c (x + a x^3))) / 2). With
u = x^2 and w = 2u / B^2 - 1 in [-1, 1]:
  P(x)             = 0.5 + x S(u),  S(u) = (P(x) - 0.5) / x
  P(x) + x P'(x)   = 0.5 + x G(u),  G(u) = S(u) + P'(x)
Past the bound the exact GELU needs erfc(z), z = |x| / sqrt 2 > sqrt 2, as Numerical Recipes'
form refitted: erfc(z) = t exp(-z^2 + Q(t)), t = 1 / (1 + z / 2), for z up to 27 (beyond, x Phi(x)
is x or 0 in f32); the tanh form's far side is a sigmoid through an f64 exp, no fit.

Least squares on Chebyshev nodes against mpmath at 40 digits (weighted for relative error where
the function has no zero), converted to powers of the mapped variable and printed lowest degree
first, with each fit's worst error on a fine grid in f64.

Needs numpy and mpmath: python3 -m pip install numpy mpmath
"""
import mpmath as mp
import numpy as np

mp.mp.dps = 40
B = 2.0
U = B * B
C, A = mp.sqrt(2 / mp.pi), mp.mpf("0.044715")


def fit(f, lo, hi, degree, relative=True, n=800):
    """Coefficients in w = 2 (v - lo) / (hi - lo) - 1 and the worst error on a fine grid."""
    nodes = np.array([lo + (hi - lo) / 2 * (1 - np.cos(np.pi * (i + 0.5) / n)) for i in range(n)])
    ys = np.array([float(f(mp.mpf(v))) for v in nodes])
    cheb = np.polynomial.chebyshev.Chebyshev.fit(
        nodes, ys, degree, domain=[lo, hi], w=1 / np.abs(ys) if relative else None
    )
    coef = np.polynomial.chebyshev.cheb2poly(cheb.coef)
    vs = np.linspace(lo, hi, 3001)
    ws = (vs - lo) * (2 / (hi - lo)) - 1
    acc = np.full_like(ws, coef[-1])
    for c in coef[-2::-1]:
        acc = acc * ws + c
    want = np.array([float(f(mp.mpf(v))) for v in vs])
    err = np.abs(acc - want)
    return coef, np.max(err / np.abs(want) if relative else err)


def near(cdf, pdf):
    def s_of(u):
        x = mp.sqrt(u)
        return (cdf(x) - mp.mpf(0.5)) / x if u > 0 else mp.diff(cdf, 0)

    return s_of, lambda u: s_of(u) + pdf(mp.sqrt(u))


def tanh_cdf(x):
    return (1 + mp.tanh(C * (x + A * x**3))) / 2


def show(name, coef, err, what):
    print(f"{name} (degree {len(coef) - 1}): worst {what} error {err:.2e}")
    print("  [" + ", ".join(repr(float(c)) for c in coef) + "]")


for gelu, (cdf, pdf), degrees in [
    ("exact", (mp.ncdf, mp.npdf), (10, 11)),
    ("tanh", (tanh_cdf, lambda x: mp.diff(tanh_cdf, x)), (11, 12)),
]:
    for name, f, degree in zip(("S", "G"), near(cdf, pdf), degrees):
        coef, err = fit(f, 0, U, degree)
        show(f"{gelu} GELU near zero, {name}", coef, err, "relative")

t_lo, t_hi = 1 / (1 + 27 / 2), float(1 / (1 + mp.sqrt(2) / 2))
coef, err = fit(lambda t: mp.log(mp.erfc(2 * (1 / t - 1)) / t) + (2 * (1 / t - 1)) ** 2, t_lo, t_hi, 12, relative=False)
print(f"erfc's Q: t in [{t_lo!r}, {t_hi!r}]")
show("erfc's Q", coef, err, "absolute")
