// f16 and bf16 as 16-bit patterns in the low bits of a u32, converted by hand: WGSL has no bf16,
// its f16 needs SHADER_F16, and pack2x16float leaves overflow and rounding to the
// implementation; these give the bits of the `half` crate (round to nearest even, overflow to
// infinity) on every adapter.

fn f16_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1Fu;
    let m = h & 0x3FFu;
    if (e == 0u) {
        // Zero or subnormal: m * 2^-24, exact in f32.
        let v = f32(m) * 5.9604645e-8;
        return select(v, -v, sign != 0u);
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7F800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

fn f32_to_f16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let e = i32((b >> 23u) & 0xFFu);
    let m = b & 0x7FFFFFu;
    if (e == 255) {
        return sign | select(0x7C00u, 0x7E00u, m != 0u);
    }
    let he = e - 112;
    if (he >= 31) {
        return sign | 0x7C00u;
    }
    if (he <= 0) {
        if (he < -10) {
            return sign;
        }
        // Subnormal: the 24-bit significand shifted to units of 2^-24, rounded to even.
        let full = m | 0x800000u;
        let shift = u32(14 - he);
        var r = full >> shift;
        let rem = full & ((1u << shift) - 1u);
        let halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (r & 1u) == 1u)) {
            r = r + 1u;
        }
        return sign | r;
    }
    // A carry out of the mantissa bumps the exponent, up to infinity: both are right.
    var r = (u32(he) << 10u) | (m >> 13u);
    let rem = m & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u) == 1u)) {
        r = r + 1u;
    }
    return sign | r;
}

fn bf16_to_f32(h: u32) -> f32 {
    return bitcast<f32>(h << 16u);
}

fn f32_to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        // NaN stays NaN (quiet bit set) instead of rounding into infinity.
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7FFFu + ((b >> 16u) & 1u)) >> 16u;
}
