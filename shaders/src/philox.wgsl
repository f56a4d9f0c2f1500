// Philox 4x32-10, bit-identical to wgpipe_tensor::rng::philox4x32 (Random123's constants).
// WGSL has no 64-bit integers, so the 32x32 -> 64 product is built from 16-bit halves.

const PHILOX_M0: u32 = 0xD2511F53u;
const PHILOX_M1: u32 = 0xCD9E8D57u;
const PHILOX_W0: u32 = 0x9E3779B9u;
const PHILOX_W1: u32 = 0xBB67AE85u;

// (high, low) words of the 64-bit product a * b.
fn mulhilo(a: u32, b: u32) -> vec2<u32> {
    let al = a & 0xffffu;
    let ah = a >> 16u;
    let bl = b & 0xffffu;
    let bh = b >> 16u;
    let ll = al * bl;
    let lh = al * bh;
    let hl = ah * bl;
    let hh = ah * bh;
    let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
    let hi = hh + (lh >> 16u) + (hl >> 16u) + (mid >> 16u);
    return vec2<u32>(hi, a * b);
}

fn philox4x32(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var r = 0u; r < 10u; r = r + 1u) {
        let p0 = mulhilo(PHILOX_M0, c.x);
        let p1 = mulhilo(PHILOX_M1, c.z);
        c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
        k = k + vec2<u32>(PHILOX_W0, PHILOX_W1);
    }
    return c;
}

// A random word to a float in [0, 1) from its top 24 bits (exact in f32).
fn u32_to_unit(u: u32) -> f32 {
    return f32(u >> 8u) * (1.0 / 16777216.0);
}
