#!/usr/bin/env python3
"""Fits the polynomials of `gelu_near`, `gelu_grad_near`, `gelu_tanh_near` and
`gelu_tanh_grad_near` (shaders/src/ops/math.rs).

Each GELU is x P(x) with P(x) - 0.5 odd (the exact one: P = Phi, the standard normal CDF; the
tanh form: P = (1 + tanh(c (x + a x^3))) / 2). On |x| <= B (B = GELU_NEAR = 2), with u = x^2
and w = 2u / B^2 - 1 in [-1, 1]:
  P(x)             = 0.5 + x S(u),  S(u) = (P(x) - 0.5) / x
  P(x) + x P'(x)   = 0.5 + x G(u),  G(u) = S(u) + P'(x)
S and G are fitted in w (least squares on Chebyshev nodes, weighted for relative error, against
mpmath at 30 digits), converted to powers of w, rounded to f32 and printed lowest degree first
(the Rust code's Horner chains read them from the end). Prints each fit's worst relative error
with f32 arithmetic (without fused multiply-adds: a bound on what the Rust code, which fuses
them, gets).

Needs numpy and mpmath: python3 -m pip install numpy mpmath
"""
import mpmath as mp
import numpy as np

mp.mp.dps = 30
B = 2.0
U = B * B
C, A = mp.sqrt(2 / mp.pi), mp.mpf("0.044715")


def tanh_cdf(x):
    return (1 + mp.tanh(C * (x + A * x**3))) / 2


def tanh_pdf(x):
    return mp.diff(tanh_cdf, x)


def fits(cdf, pdf):
    def s_of(u):
        x = mp.sqrt(u)
        return (cdf(x) - mp.mpf(0.5)) / x if u > 0 else mp.diff(cdf, 0)

    def g_of(u):
        return s_of(u) + pdf(mp.sqrt(u))

    return s_of, g_of


nodes = np.array([U / 2 * (1 - np.cos(np.pi * (i + 0.5) / 600)) for i in range(600)])
for gelu, (cdf, pdf), degrees in [
    ("exact", (mp.ncdf, mp.npdf), (7, 8)),
    ("tanh", (tanh_cdf, tanh_pdf), (8, 9)),
]:
    for name, f, degree in zip(("S", "G"), fits(cdf, pdf), degrees):
        ys = np.array([float(f(mp.mpf(u))) for u in nodes])
        fit = np.polynomial.chebyshev.Chebyshev.fit(
            nodes, ys, degree, domain=[0, U], w=1 / np.abs(ys)
        )
        coef = np.polynomial.chebyshev.cheb2poly(fit.coef).astype(np.float32)
        u = np.linspace(0, U, 1001)
        w = (u * (2 / U) - 1).astype(np.float32)
        acc = np.float32(coef[-1])
        for c in coef[-2::-1]:
            acc = (acc * w + c).astype(np.float32)
        want = np.array([float(f(mp.mpf(v))) for v in u])
        worst = np.max(np.abs(acc.astype(np.float64) - want) / np.abs(want))
        print(f"{gelu} GELU, {name} of degree {degree}: worst relative error in f32 {worst:.2e}")
        print(f"  w^0..w^{degree}:", ", ".join(str(c) for c in coef))
