//! The byte format of a tensor crossing a process boundary: a fixed header (step, link,
//! micro-batch, kind, finiteness, dtype, shape) followed by the values as raw little-endian bytes.
//!
//! The header is what keeps messages apart when the transport itself does not (MPI tags are
//! few and a peer can run ahead by a step after a failure): a receiver checks the step and the
//! link of every message it takes, so a late message of another step is an error rather than
//! a silently wrong activation.

use half::{bf16, f16};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::schedule::Link;

/// First bytes of every message: "wgp" and the format version.
const MAGIC: [u8; 4] = *b"wgp1";

/// What a message carries. Activations and gradients travel on different links already; the
/// kind is repeated so that a control message can never be read as a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgKind {
    Activation = 0,
    Gradient = 1,
    /// Stop the step: a peer failed (the payload is its error, as UTF-8 text).
    Abort = 2,
    /// A rank's outcome of a step, for every other rank (the payload is JSON text).
    Status = 3,
    /// Values for a collective (a gradient all-reduce across replicas, a gather).
    Reduce = 4,
    /// Each stage's squared gradient norm, for clipping (JSON text).
    Norm = 5,
    /// The gradients of tied copies, for the ranks holding other copies of the same groups.
    Tied = 6,
    /// "Still here": a communication thread's heartbeat (empty text).
    Beat = 7,
    /// "Done": a communication thread that stops, and will send nothing more (empty text).
    Bye = 8,
}

impl MsgKind {
    /// Kinds whose payload is text after a one-value placeholder.
    fn is_text(self) -> bool {
        matches!(
            self,
            MsgKind::Abort | MsgKind::Status | MsgKind::Norm | MsgKind::Beat | MsgKind::Bye
        )
    }
}

/// Element type on the wire: a tensor's own dtype (a half tensor travels as its 16-bit
/// patterns and arrives as a half tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireDtype {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
}

impl WireDtype {
    pub fn size(self) -> usize {
        self.dtype().size_of()
    }

    /// The tensor dtype this wire dtype carries.
    pub fn dtype(self) -> DType {
        match self {
            WireDtype::F32 => DType::F32,
            WireDtype::F16 => DType::F16,
            WireDtype::BF16 => DType::BF16,
        }
    }

    pub fn of(dtype: DType) -> WireDtype {
        match dtype {
            DType::F32 => WireDtype::F32,
            DType::F16 => WireDtype::F16,
            DType::BF16 => WireDtype::BF16,
        }
    }
}

/// Everything a message says about itself besides its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub kind: MsgKind,
    pub step: u64,
    pub link: Link,
    pub micro_batch: usize,
    /// The tensor and everything it came from held only finite values.
    pub finite: bool,
    pub dtype: WireDtype,
    pub shape: Vec<usize>,
}

/// A message that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message of {got} bytes is shorter than its header says ({want} bytes)")]
    Truncated { got: usize, want: usize },
    #[error("not a wgpipe message (first bytes {0:?}, expected {MAGIC:?})")]
    BadMagic([u8; 4]),
    #[error("unknown {what} code {code} in a message header")]
    BadCode { what: &'static str, code: u8 },
    #[error(
        "message of {got} bytes, but a {shape:?} {dtype:?} tensor after the header needs {want}"
    )]
    Length {
        shape: Vec<usize>,
        dtype: WireDtype,
        got: usize,
        want: usize,
    },
}

/// Bytes of the header before the shape: magic, kind, dtype, finite, ndim, step, from, to,
/// grad, micro-batch, skip (0 for the chain, id + 1 for a skip link).
const FIXED: usize = 4 + 1 + 1 + 1 + 1 + 8 + 4 + 4 + 1 + 4 + 4;

/// Encodes `header` and `values` (read back to host memory by the caller) as one message. The
/// shape written is `header.shape`; `values.len()` must match it.
pub fn encode(header: &Header, values: &[f32]) -> Vec<u8> {
    debug_assert_eq!(values.len(), header.shape.iter().product::<usize>());
    let mut out =
        Vec::with_capacity(FIXED + 8 * header.shape.len() + values.len() * header.dtype.size());
    out.extend_from_slice(&MAGIC);
    out.push(header.kind as u8);
    out.push(header.dtype as u8);
    out.push(header.finite as u8);
    out.push(header.shape.len() as u8);
    out.extend_from_slice(&header.step.to_le_bytes());
    out.extend_from_slice(&(header.link.from as u32).to_le_bytes());
    out.extend_from_slice(&(header.link.to as u32).to_le_bytes());
    out.push(header.link.grad as u8);
    out.extend_from_slice(&(header.micro_batch as u32).to_le_bytes());
    let skip = header.link.skip.map_or(0, |id| id as u32 + 1);
    out.extend_from_slice(&skip.to_le_bytes());
    for &d in &header.shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    match header.dtype {
        WireDtype::F32 => {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        // Values read back from a half tensor are widened exactly, so narrowing them again
        // gives the tensor's own bits.
        WireDtype::F16 => {
            for v in values {
                out.extend_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        WireDtype::BF16 => {
            for v in values {
                out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
    out
}

/// An abort message: the failing peer's error, for every peer of a step.
pub fn encode_abort(step: u64, why: &str) -> Vec<u8> {
    encode_text(MsgKind::Abort, step, why)
}

/// A message of a text kind ([`MsgKind::Abort`], [`MsgKind::Status`]) carrying `text`.
pub fn encode_text(kind: MsgKind, step: u64, text: &str) -> Vec<u8> {
    debug_assert!(kind.is_text());
    let header = Header {
        kind,
        step,
        link: Link {
            from: 0,
            to: 0,
            grad: false,
            skip: None,
        },
        micro_batch: 0,
        finite: true,
        dtype: WireDtype::F32,
        shape: vec![],
    };
    // A scalar placeholder keeps one layout for every kind; the text follows it.
    let mut out = encode(&header, &[0.0]);
    out.extend_from_slice(text.as_bytes());
    out
}

/// A message of `kind` (a collective's: [`MsgKind::Reduce`], [`MsgKind::Tied`]) for `step`
/// carrying flat `values` from device `device` (its link names that device at both ends).
pub fn encode_values(kind: MsgKind, step: u64, device: usize, values: &[f32]) -> Vec<u8> {
    let header = Header {
        kind,
        step,
        link: Link {
            from: device,
            to: device,
            grad: true,
            skip: None,
        },
        micro_batch: 0,
        finite: true,
        dtype: WireDtype::F32,
        shape: vec![values.len()],
    };
    encode(&header, values)
}

/// The fixed part of a header.
struct Fixed {
    kind: MsgKind,
    dtype: WireDtype,
    finite: bool,
    ndim: usize,
    step: u64,
    link: Link,
    micro_batch: usize,
}

fn fixed(bytes: &[u8]) -> Result<Fixed, WireError> {
    if bytes.len() < FIXED {
        return Err(WireError::Truncated {
            got: bytes.len(),
            want: FIXED,
        });
    }
    let magic: [u8; 4] = bytes[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let kind = match bytes[4] {
        0 => MsgKind::Activation,
        1 => MsgKind::Gradient,
        2 => MsgKind::Abort,
        3 => MsgKind::Status,
        4 => MsgKind::Reduce,
        5 => MsgKind::Norm,
        6 => MsgKind::Tied,
        7 => MsgKind::Beat,
        8 => MsgKind::Bye,
        code => return Err(WireError::BadCode { what: "kind", code }),
    };
    let dtype = match bytes[5] {
        0 => WireDtype::F32,
        1 => WireDtype::F16,
        2 => WireDtype::BF16,
        code => {
            return Err(WireError::BadCode {
                what: "dtype",
                code,
            })
        }
    };
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    Ok(Fixed {
        kind,
        dtype,
        finite: bytes[6] != 0,
        ndim: bytes[7] as usize,
        step: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
        link: Link {
            from: u32_at(16) as usize,
            to: u32_at(20) as usize,
            grad: bytes[24] != 0,
            skip: u32_at(29).checked_sub(1).map(|id| id as usize),
        },
        micro_batch: u32_at(25) as usize,
    })
}

/// Reads a message's header, and its values widened to f32.
pub fn decode(bytes: &[u8]) -> Result<(Header, Vec<f32>), WireError> {
    let need = |want: usize| {
        if bytes.len() < want {
            Err(WireError::Truncated {
                got: bytes.len(),
                want,
            })
        } else {
            Ok(())
        }
    };
    let Fixed {
        kind,
        dtype,
        finite,
        ndim,
        step,
        link,
        micro_batch,
    } = fixed(bytes)?;
    need(FIXED + 8 * ndim)?;
    let shape: Vec<usize> = (0..ndim)
        .map(|i| {
            let at = FIXED + 8 * i;
            u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes")) as usize
        })
        .collect();
    let body = &bytes[FIXED + 8 * ndim..];
    let n = if kind.is_text() {
        1
    } else {
        shape.iter().product::<usize>()
    };
    let want = n * dtype.size();
    if body.len() < want || (!kind.is_text() && body.len() != want) {
        return Err(WireError::Length {
            shape,
            dtype,
            got: body.len(),
            want,
        });
    }
    let values = match dtype {
        WireDtype::F32 => body[..want]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        WireDtype::F16 => body[..want]
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
            .collect(),
        WireDtype::BF16 => body[..want]
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
            .collect(),
    };
    let header = Header {
        kind,
        step,
        link,
        micro_batch,
        finite,
        dtype,
        shape,
    };
    Ok((header, values))
}

/// The kind, step and link of a message, without reading its values.
pub fn peek(bytes: &[u8]) -> Result<(MsgKind, u64, Link), WireError> {
    let f = fixed(bytes)?;
    Ok((f.kind, f.step, f.link))
}

/// The text of an abort or status message (empty for other kinds).
pub fn text_of(bytes: &[u8]) -> String {
    let ndim = bytes.get(7).copied().unwrap_or(0) as usize;
    let start = FIXED + 8 * ndim + 4;
    bytes
        .get(start..)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

/// A tensor as one message: read back to host memory (from any device), then encoded in its
/// own dtype.
pub fn encode_tensor(
    kind: MsgKind,
    step: u64,
    link: Link,
    micro_batch: usize,
    finite: bool,
    tensor: &Tensor,
) -> wgpipe_tensor::Result<Vec<u8>> {
    let header = Header {
        kind,
        step,
        link,
        micro_batch,
        finite,
        dtype: WireDtype::of(tensor.dtype()),
        shape: tensor.shape().to_vec(),
    };
    Ok(encode(&header, &tensor.to_vec()?))
}

/// The tensor of a decoded message, in host memory and in the dtype it was sent in (the
/// receiver moves it to its device).
pub fn tensor_of(header: &Header, values: Vec<f32>) -> wgpipe_tensor::Result<Tensor> {
    Tensor::from_vec_in(values, &header.shape, header.dtype.dtype(), &Device::cpu())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(dtype: WireDtype, shape: Vec<usize>) -> Header {
        Header {
            kind: MsgKind::Gradient,
            step: 0x0102_0304_0506_0708,
            link: Link {
                from: 3,
                to: 2,
                grad: true,
                skip: None,
            },
            micro_batch: 17,
            finite: false,
            dtype,
            shape,
        }
    }

    #[test]
    fn f32_round_trip_is_bit_exact_and_little_endian() {
        let values = [1.0f32, -0.0, f32::MIN_POSITIVE, 3.5e-42, f32::NAN, -7.25];
        let h = header(WireDtype::F32, vec![2, 3]);
        let bytes = encode(&h, &values);
        assert_eq!(bytes.len(), FIXED + 16 + 24);
        // The first value's bytes right after the header: 1.0f32 little-endian.
        assert_eq!(&bytes[FIXED + 16..FIXED + 20], &[0, 0, 0x80, 0x3f]);
        let (got, v) = decode(&bytes).unwrap();
        assert_eq!(got, h);
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&v), bits(&values));
    }

    #[test]
    fn f16_halves_the_bytes_and_rounds_to_nearest() {
        let values = [1.0f32, 0.1, -65504.0];
        let h = header(WireDtype::F16, vec![3]);
        let bytes = encode(&h, &values);
        assert_eq!(bytes.len(), FIXED + 8 + 6);
        let (_, v) = decode(&bytes).unwrap();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], f16::from_f32(0.1).to_f32());
        assert!((v[1] - 0.1).abs() < 1e-4);
        assert_eq!(v[2], -65504.0);
    }

    /// Half tensors cross as their 16-bit patterns (half the bytes) and arrive bit-identical,
    /// in their own dtype; overflowed values stay infinite.
    #[test]
    fn half_tensors_travel_as_their_own_bits() {
        let link = Link {
            from: 0,
            to: 1,
            grad: false,
            skip: None,
        };
        let values = vec![1.0f32, 0.1, -3.0e4, 1.0e-6, f32::INFINITY, -0.0];
        for dtype in DType::ALL {
            let t = Tensor::from_vec(values.clone(), &[2, 3], &Device::cpu())
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let bytes = encode_tensor(MsgKind::Activation, 1, link, 0, true, &t).unwrap();
            assert_eq!(bytes.len(), FIXED + 16 + 6 * dtype.size_of(), "{dtype:?}");
            let (h, v) = decode(&bytes).unwrap();
            let back = tensor_of(&h, v).unwrap();
            assert_eq!(back.dtype(), dtype);
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_vec().unwrap().iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&back), bits(&t), "{dtype:?}");
        }
    }

    #[test]
    fn damaged_messages_are_named() {
        let h = header(WireDtype::F32, vec![4]);
        let bytes = encode(&h, &[1.0, 2.0, 3.0, 4.0]);
        assert!(matches!(
            decode(&bytes[..10]),
            Err(WireError::Truncated { got: 10, .. })
        ));
        assert!(matches!(
            decode(&bytes[..bytes.len() - 1]),
            Err(WireError::Length {
                want: 16,
                got: 15,
                ..
            })
        ));
        let mut bad = bytes.clone();
        bad[0] = b'x';
        assert!(matches!(decode(&bad), Err(WireError::BadMagic(_))));
        let mut bad = bytes;
        bad[4] = 9;
        let e = decode(&bad).unwrap_err();
        assert_eq!(e.to_string(), "unknown kind code 9 in a message header");
    }

    #[test]
    fn abort_carries_its_text_and_step() {
        let bytes = encode_abort(5, "rank 1: stage 2 failed");
        let (h, _) = decode(&bytes).unwrap();
        assert_eq!((h.kind, h.step), (MsgKind::Abort, 5));
        assert_eq!(text_of(&bytes), "rank 1: stage 2 failed");
    }
}
