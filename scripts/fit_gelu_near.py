#!/usr/bin/env python3
"""Fits the polynomials of `gelu_near` and `gelu_grad_near` (shaders/src/ops/math.rs).

On |x| <= B (B = GELU_NEAR = 2), with u = x^2 and w = 2u / B^2 - 1 in [-1, 1]:
  Phi(x)        = 0.5 + x S(u),  S(u) = (Phi(x) - 0.5) / x
  Phi(x) + x phi(x) = 0.5 + x G(u),  G(u) = S(u) + phi(x)
S and G are fitted in w (least squares on Chebyshev nodes, weighted for relative error, against
mpmath's 30-digit ncdf and npdf), converted to powers of w, rounded to f32 and printed highest
degree last, as the Rust code's Horner chains read them (from the end). Prints each fit's
worst relative error with f32 arithmetic (without fused multiply-adds: a bound on what the
Rust code, which fuses them, gets).

Needs numpy and mpmath: python3 -m pip install numpy mpmath
"""
import mpmath as mp
import numpy as np

mp.mp.dps = 30
B = 2.0
U = B * B


def s_of(u):
    x = mp.sqrt(u)
    return (mp.ncdf(x) - mp.mpf(0.5)) / x if u > 0 else 1 / mp.sqrt(2 * mp.pi)


def g_of(u):
    return s_of(u) + mp.npdf(mp.sqrt(u))


nodes = np.array([U / 2 * (1 - np.cos(np.pi * (i + 0.5) / 600)) for i in range(600)])
for name, f, degree in [("S", s_of, 7), ("G", g_of, 8)]:
    ys = np.array([float(f(mp.mpf(u))) for u in nodes])
    fit = np.polynomial.chebyshev.Chebyshev.fit(nodes, ys, degree, domain=[0, U], w=1 / np.abs(ys))
    coef = np.polynomial.chebyshev.cheb2poly(fit.coef).astype(np.float32)
    u = np.linspace(0, U, 1001)
    w = (u * (2 / U) - 1).astype(np.float32)
    acc = np.float32(coef[-1])
    for c in coef[-2::-1]:
        acc = (acc * w + c).astype(np.float32)
    want = np.array([float(f(mp.mpf(v))) for v in u])
    worst = np.max(np.abs(acc.astype(np.float64) - want) / np.abs(want))
    print(f"{name}, degree {degree}: worst relative error in f32 {worst:.2e}")
    print("  coefficients of w^0..w^%d:" % degree, ", ".join(str(c) for c in coef))
