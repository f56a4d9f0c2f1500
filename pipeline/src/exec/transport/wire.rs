//! The byte format of everything crossing a process boundary: the payload first (a tensor's
//! values as raw little-endian bytes, or a control message's bytes), then a header (kind,
//! step, link, micro-batch, finiteness, dtype, shape, payload length), then the header's
//! length and a magic. Kept in 4-byte words ([`Frame`]): a received f32 tensor is the first
//! words of its frame, taken as the tensor's storage without a copy, and a sent one is the
//! vector its values were read into, with the header appended.
//!
//! The header is what keeps messages apart when the transport itself does not (MPI tags are
//! few and a peer can run ahead by a step after a failure): a receiver checks the step and the
//! link of every message it takes, so a late message of another step is an error rather than
//! a silently wrong activation.

use half::{bf16, f16};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::schedule::Link;

/// Last bytes of every message: "wgp" and the format version.
const MAGIC: [u8; 4] = *b"wgp2";

/// What a message carries. Activations and gradients travel on different links already; the
/// kind is repeated so that a control message can never be read as a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgKind {
    Activation = 0,
    Gradient = 1,
    /// Stop the step: a peer failed (the payload is its error, as UTF-8 text).
    Abort = 2,
    /// A rank's outcome of a step, for every other rank (a binary record).
    Status = 3,
    /// Values for a collective (a gradient all-reduce across replicas, a gather).
    Reduce = 4,
    /// Each stage's squared gradient norm, for clipping (f64 values).
    Norm = 5,
    /// The gradients of tied copies, for the ranks holding other copies of the same groups.
    Tied = 6,
    /// "Still here": a communication thread's heartbeat (empty text).
    Beat = 7,
    /// "Done": a communication thread that stops, and will send nothing more (empty text).
    Bye = 8,
}

impl MsgKind {
    /// Kinds whose payload is UTF-8 text.
    fn is_text(self) -> bool {
        matches!(self, MsgKind::Abort | MsgKind::Beat | MsgKind::Bye)
    }

    /// Kinds whose payload is values of the header's shape and dtype (the others carry text or
    /// a binary record).
    fn carries_values(self) -> bool {
        !self.is_text() && !matches!(self, MsgKind::Status | MsgKind::Norm)
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
    #[error("not a wgpipe message (last bytes {0:?}, expected {MAGIC:?})")]
    BadMagic([u8; 4]),
    #[error("unknown {what} code {code} in a message header")]
    BadCode { what: &'static str, code: u8 },
    #[error("message with {got} payload bytes, but a {shape:?} {dtype:?} tensor needs {want}")]
    Length {
        shape: Vec<usize>,
        dtype: WireDtype,
        got: usize,
        want: usize,
    },
}

/// Bytes of the header before the shape: kind, dtype, finite, ndim, step, from, to, grad,
/// three zeros (so that a header is whole words), micro-batch, skip (0 for the chain, id + 1
/// for a skip link), payload bytes.
const FIXED: usize = 1 + 1 + 1 + 1 + 8 + 4 + 4 + 1 + 3 + 4 + 4 + 8;
/// Bytes after the header: its length (u32) and the magic.
const TAIL: usize = 4 + 4;

/// A message in 4-byte words: `len` bytes of payload, padding to a word, header, tail.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    words: Vec<f32>,
    len: usize,
}

impl Frame {
    /// A frame of `len` bytes written by `fill`, which is given where they go and must write
    /// all of them (a receive into it): no zeroing first, which for a large message costs as
    /// much as a copy of it.
    ///
    /// # Safety
    /// `fill` must initialize the `len` bytes at the pointer it is given.
    pub unsafe fn received(len: usize, fill: impl FnOnce(*mut u8)) -> Frame {
        Frame::received_with_room(len, 0, fill)
    }

    /// [`Frame::received`] with room for `room` more words: a tensor's values received
    /// apart, which their frame's tail then joins ([`Frame::join`]) without a copy.
    ///
    /// # Safety
    /// `fill` must initialize the `len` bytes at the pointer it is given.
    pub unsafe fn received_with_room(len: usize, room: usize, fill: impl FnOnce(*mut u8)) -> Frame {
        let words = len.div_ceil(4);
        let mut v: Vec<f32> = Vec::with_capacity(words + room);
        let at = v.as_mut_ptr();
        if !len.is_multiple_of(4) {
            // The last word's bytes past `len` are not written by `fill`.
            at.add(words - 1).write(0.0);
        }
        fill(at.cast::<u8>());
        v.set_len(words);
        Frame { words: v, len }
    }

    /// A tensor's values received apart (this frame, [`Outgoing::Split`]'s first message) and
    /// then the rest of their message (`tail`): the frame the whole message would have been.
    pub fn join(mut self, tail: Frame) -> Frame {
        self.words.truncate(self.len.div_ceil(4));
        self.words.extend_from_slice(&tail.words);
        let len = self.words.len() * 4;
        Frame {
            words: self.words,
            len,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// Its words, to hand to a non-blocking send (which owns them until it completes).
    pub fn into_words(self) -> (Vec<f32>, usize) {
        (self.words, self.len)
    }

    /// A frame of `payload` (`len` bytes of it, in words) and `header`, which must say `len`.
    fn seal(mut words: Vec<f32>, len: usize, header: &Header) -> Frame {
        words.truncate(len.div_ceil(4));
        words.extend(Frame::tail(header, len).words);
        let len = words.len() * 4;
        Frame { words, len }
    }

    /// What follows `len` bytes of payload (padded to a word) in a frame: the header, which
    /// must say `len`, its length and the magic, in whole words.
    fn tail(header: &Header, len: usize) -> Frame {
        let mut tail = Vec::with_capacity(FIXED + 8 * header.shape.len() + TAIL + 3);
        header_bytes(header, len, &mut tail);
        let n = tail.len() + TAIL;
        tail.extend_from_slice(&(n as u32).to_le_bytes());
        tail.extend_from_slice(&MAGIC);
        // Padding before the header, so that the frame ends on a word (the payload before it
        // is padded to a word already).
        let mut bytes = vec![0u8; tail.len().div_ceil(4) * 4 - tail.len()];
        bytes.extend_from_slice(&tail);
        let words: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let len = words.len() * 4;
        Frame { words, len }
    }

    /// A frame of raw payload bytes.
    fn of_bytes(payload: &[u8], header: &Header) -> Frame {
        let mut words = vec![0.0f32; payload.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<f32, u8>(&mut words)[..payload.len()].copy_from_slice(payload);
        Frame::seal(words, payload.len(), header)
    }
}

fn header_bytes(header: &Header, payload: usize, out: &mut Vec<u8>) {
    out.push(header.kind as u8);
    out.push(header.dtype as u8);
    out.push(header.finite as u8);
    out.push(header.shape.len() as u8);
    out.extend_from_slice(&header.step.to_le_bytes());
    out.extend_from_slice(&(header.link.from as u32).to_le_bytes());
    out.extend_from_slice(&(header.link.to as u32).to_le_bytes());
    out.push(header.link.grad as u8);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&(header.micro_batch as u32).to_le_bytes());
    let skip = header.link.skip.map_or(0, |id| id as u32 + 1);
    out.extend_from_slice(&skip.to_le_bytes());
    out.extend_from_slice(&(payload as u64).to_le_bytes());
    for &d in &header.shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
}

/// `values` in place as little-endian f32 words (nothing to do on a little-endian host).
fn to_le_words(values: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for v in values {
            *v = f32::from_bits(v.to_bits().to_le());
        }
    }
}

/// `values` in `dtype` as the payload words of a frame, and its length in bytes. f32 values
/// keep their vector (no copy); halves are narrowed (exactly, for values read back from a
/// half tensor) two to a word.
fn payload_of(mut values: Vec<f32>, dtype: WireDtype) -> (Vec<f32>, usize) {
    let n = values.len();
    match dtype {
        WireDtype::F32 => {
            to_le_words(&mut values);
            (values, 4 * n)
        }
        WireDtype::F16 | WireDtype::BF16 => {
            let mut words = vec![0.0f32; n.div_ceil(2)];
            let out: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                let bits = if dtype == WireDtype::F16 {
                    f16::from_f32(v).to_le_bytes()
                } else {
                    bf16::from_f32(v).to_le_bytes()
                };
                c.copy_from_slice(&bits);
            }
            (words, 2 * n)
        }
    }
}

/// Encodes `header` and `values` (read back to host memory by the caller) as one message. The
/// shape written is `header.shape`; `values.len()` must match it.
pub fn encode(header: &Header, values: Vec<f32>) -> Frame {
    debug_assert_eq!(values.len(), header.shape.iter().product::<usize>());
    let (words, len) = payload_of(values, header.dtype);
    Frame::seal(words, len, header)
}

/// An abort message: the failing peer's error, for every peer of a step.
pub fn encode_abort(step: u64, why: &str) -> Frame {
    encode_text(MsgKind::Abort, step, why)
}

/// A header of `kind` for `step` naming device `device` at both ends of its link.
fn control_header(kind: MsgKind, step: u64, device: usize, shape: Vec<usize>) -> Header {
    Header {
        kind,
        step,
        link: Link {
            from: device,
            to: device,
            grad: kind.carries_values(),
            skip: None,
        },
        micro_batch: 0,
        finite: true,
        dtype: WireDtype::F32,
        shape,
    }
}

/// A message of a text kind ([`MsgKind::Abort`], [`MsgKind::Beat`], [`MsgKind::Bye`]) carrying
/// `text`.
pub fn encode_text(kind: MsgKind, step: u64, text: &str) -> Frame {
    debug_assert!(kind.is_text());
    encode_bytes(kind, step, text.as_bytes())
}

/// A message of `kind` for `step` carrying raw `bytes` (a status, a norm: see
/// [`crate::exec::comm`]'s binary records).
pub fn encode_bytes(kind: MsgKind, step: u64, bytes: &[u8]) -> Frame {
    Frame::of_bytes(bytes, &control_header(kind, step, 0, vec![]))
}

/// A message of `kind` (a collective's: [`MsgKind::Reduce`], [`MsgKind::Tied`]) for `step`
/// carrying flat `values` from device `device` (its link names that device at both ends).
pub fn encode_values(kind: MsgKind, step: u64, device: usize, values: Vec<f32>) -> Frame {
    let header = control_header(kind, step, device, vec![values.len()]);
    encode(&header, values)
}

/// The header of a message, and where its payload ends.
fn read_header(bytes: &[u8]) -> Result<(Header, usize), WireError> {
    let truncated = |want: usize| WireError::Truncated {
        got: bytes.len(),
        want,
    };
    if bytes.len() < FIXED + TAIL {
        return Err(truncated(FIXED + TAIL));
    }
    let end = bytes.len();
    let magic: [u8; 4] = bytes[end - 4..].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let n = u32::from_le_bytes(bytes[end - 8..end - 4].try_into().expect("4 bytes")) as usize;
    if n < FIXED + TAIL || n > end {
        return Err(truncated(n.max(FIXED + TAIL)));
    }
    let h = &bytes[end - n..end - TAIL];
    let u32_at = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    let kind = match h[0] {
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
    let dtype = match h[1] {
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
    let ndim = h[3] as usize;
    if h.len() != FIXED + 8 * ndim {
        return Err(truncated(end - h.len() + FIXED + 8 * ndim));
    }
    let payload = u64_at(32) as usize;
    let shape: Vec<usize> = (0..ndim).map(|i| u64_at(FIXED + 8 * i) as usize).collect();
    if payload > end - n {
        return Err(truncated(payload + n));
    }
    let header = Header {
        kind,
        dtype,
        finite: h[2] != 0,
        step: u64_at(4),
        link: Link {
            from: u32_at(12) as usize,
            to: u32_at(16) as usize,
            grad: h[20] != 0,
            skip: u32_at(28).checked_sub(1).map(|id| id as usize),
        },
        micro_batch: u32_at(24) as usize,
        shape,
    };
    if kind.carries_values() {
        let want = header.shape.iter().product::<usize>() * dtype.size();
        if payload != want {
            return Err(WireError::Length {
                shape: header.shape,
                dtype,
                got: payload,
                want,
            });
        }
    }
    Ok((header, payload))
}

/// Reads a message's header, and its values widened to f32 (a copy: see [`decode_frame`]).
pub fn decode(bytes: &[u8]) -> Result<(Header, Vec<f32>), WireError> {
    let (header, payload) = read_header(bytes)?;
    let body = &bytes[..payload];
    let values = match header.dtype {
        WireDtype::F32 => body
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        WireDtype::F16 => body
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
            .collect(),
        WireDtype::BF16 => body
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
            .collect(),
    };
    Ok((header, values))
}

/// [`decode`] of a whole frame, taking its words: an f32 message's values are the frame's
/// first words, kept without a copy.
pub fn decode_frame(frame: Frame) -> Result<(Header, Vec<f32>), WireError> {
    let (header, payload) = read_header(frame.bytes())?;
    if header.dtype != WireDtype::F32 || !header.kind.carries_values() {
        return decode(frame.bytes());
    }
    let mut words = frame.words;
    words.truncate(payload / 4);
    to_le_words(&mut words);
    Ok((header, words))
}

/// The kind, step and link of a message, without reading its values.
pub fn peek(bytes: &[u8]) -> Result<(MsgKind, u64, Link), WireError> {
    let (h, _) = read_header(bytes)?;
    Ok((h.kind, h.step, h.link))
}

/// The payload of a message as raw bytes (a status, a norm; empty when unreadable).
pub fn payload_of_message(bytes: &[u8]) -> &[u8] {
    match read_header(bytes) {
        Ok((_, n)) => &bytes[..n],
        Err(_) => &[],
    }
}

/// The text of an abort or other text message (empty for other kinds).
pub fn text_of(bytes: &[u8]) -> String {
    String::from_utf8_lossy(payload_of_message(bytes)).into_owned()
}

/// The words a header of an `ndim`-dimensional tensor adds to a frame: the room its values'
/// vector is read into with, so that sealing does not copy the values again.
fn header_room(ndim: usize) -> usize {
    (FIXED + 8 * ndim + TAIL).div_ceil(4) + 1
}

/// Payloads from this size on leave as [`Outgoing::Split`] when they can: below it, one message
/// with a copy costs less than two.
pub const SPLIT_FROM: usize = 64 << 10;

/// The words kept free after a tensor's values received apart, for their tail: the tail of up
/// to 8 dimensions fits without moving the values.
pub const TAIL_ROOM: usize = (FIXED + 8 * 8 + TAIL).div_ceil(4);

/// A tensor message as it leaves.
pub enum Outgoing {
    /// The whole message in one frame.
    Whole(Frame),
    /// The tensor's values sent straight from its storage (no copy: the sender keeps the
    /// tensor until the send completes), then the rest of its frame: header, length, magic.
    /// Sent back to back to one destination, the receiver joins them ([`Frame::join`]) into
    /// the frame [`Outgoing::Whole`] would have carried.
    Split { values: Tensor, tail: Frame },
}

impl Outgoing {
    /// The frame a receiver ends up with (what the loopback transport and the tests check):
    /// a split message is received as MPI receives it, into room for its tail, then joined.
    pub fn received(self) -> Frame {
        match self {
            Outgoing::Whole(frame) => frame,
            Outgoing::Split { values, tail } => {
                let bytes = values
                    .host_bytes()
                    .expect("a split tensor lies in host memory");
                // SAFETY: the copy writes all `bytes.len()` bytes.
                let frame = unsafe {
                    Frame::received_with_room(bytes.len(), TAIL_ROOM, |at| {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len())
                    })
                };
                frame.join(tail)
            }
        }
    }
}

/// A tensor as a message, in its own dtype: a host tensor whose values lie contiguous (and
/// are [`SPLIT_FROM`] bytes or more) leaves without a copy as [`Outgoing::Split`]; any other is
/// read back to host memory (from any device) into the vector that becomes the frame.
pub fn encode_tensor(
    kind: MsgKind,
    step: u64,
    link: Link,
    micro_batch: usize,
    finite: bool,
    tensor: &Tensor,
) -> wgpipe_tensor::Result<Outgoing> {
    let header = Header {
        kind,
        step,
        link,
        micro_batch,
        finite,
        dtype: WireDtype::of(tensor.dtype()),
        shape: tensor.shape().to_vec(),
    };
    // The wire is little-endian: a big-endian host's values are converted on the way (a copy).
    if let Some(bytes) = tensor
        .host_bytes()
        .filter(|_| cfg!(target_endian = "little"))
    {
        if bytes.len() >= SPLIT_FROM {
            return Ok(Outgoing::Split {
                values: tensor.clone(),
                tail: Frame::tail(&header, bytes.len()),
            });
        }
    }
    let room = header_room(header.shape.len());
    Ok(Outgoing::Whole(encode(
        &header,
        tensor.to_vec_reserving(room)?,
    )))
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
        let frame = encode(&h, values.to_vec());
        let bytes = frame.bytes();
        assert_eq!(bytes.len(), 24 + FIXED + 16 + TAIL);
        assert_eq!(bytes.len() % 4, 0, "a frame is whole words");
        // The values first: 1.0f32 little-endian, then -0.0.
        assert_eq!(&bytes[0..8], &[0, 0, 0x80, 0x3f, 0, 0, 0, 0x80]);
        assert_eq!(&bytes[bytes.len() - 4..], b"wgp2");
        let (got, v) = decode(bytes).unwrap();
        assert_eq!(got, h);
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&v), bits(&values));
        // Taking the frame's words gives the same values without a copy.
        let (got, v) = decode_frame(frame.clone()).unwrap();
        assert_eq!(got, h);
        assert_eq!(bits(&v), bits(&values));
    }

    /// A sent tensor's values are read once, into the vector that becomes the frame (the header
    /// is appended in the room left for it); a received frame's words become the values.
    #[test]
    fn an_f32_tensor_is_copied_once_on_the_way_out_and_never_on_the_way_in() {
        let t = Tensor::rand_normal(&[64, 1024], 0.0, 1.0, 3, &Device::cpu()).unwrap();
        let h = header(WireDtype::F32, vec![64, 1024]);
        // What encode_tensor does: the values read with room for the header.
        let values = t.to_vec_reserving(header_room(2)).unwrap();
        let read_at = values.as_ptr();
        let frame = encode(&h, values);
        assert_eq!(
            frame.words.as_ptr(),
            read_at,
            "sealing reallocated the values"
        );
        let (got, v) = decode_frame(frame).unwrap();
        assert_eq!(v.as_ptr(), read_at, "the received values were copied");
        let back = tensor_of(&got, v).unwrap();
        assert_eq!(back.to_vec().unwrap(), t.to_vec().unwrap());
    }

    /// A large host tensor leaves as its storage's own bytes (no copy) and a tail; joined, the
    /// receiver holds exactly the frame of the one-message path (the reference: `encode` of
    /// the values read back), for f32 and for halves of an odd count, whole tensors and views
    /// at an offset. Small and strided tensors leave whole.
    #[test]
    fn large_host_tensors_leave_uncopied_and_join_into_the_same_frame() {
        let link = Link {
            from: 2,
            to: 3,
            grad: true,
            skip: Some(1),
        };
        let big = Tensor::rand_normal(&[3, 12001], 0.0, 1.0, 7, &Device::cpu()).unwrap();
        let small = Tensor::rand_normal(&[4, 5], 0.0, 1.0, 8, &Device::cpu()).unwrap();
        let cases = [
            (big.clone(), true),
            (big.narrow(0, 1, 2).unwrap(), true),
            (big.to_dtype(DType::F16).unwrap(), true),
            (big.to_dtype(DType::BF16).unwrap(), true),
            (small.clone(), false),
            (big.t().unwrap(), false),
        ];
        for (t, split) in cases {
            let what = format!("{:?} {:?}", t.shape(), t.dtype());
            let sent = encode_tensor(MsgKind::Gradient, 9, link, 4, false, &t).unwrap();
            match &sent {
                Outgoing::Split { values, tail } => {
                    assert!(split, "{what} was split");
                    assert_eq!(
                        values.host_bytes().unwrap().as_ptr(),
                        t.host_bytes().unwrap().as_ptr(),
                        "{what}: the values were copied"
                    );
                    assert_eq!(tail.len % 4, 0);
                }
                Outgoing::Whole(_) => assert!(!split, "{what} was not split"),
            }
            let header = Header {
                kind: MsgKind::Gradient,
                step: 9,
                link,
                micro_batch: 4,
                finite: false,
                dtype: WireDtype::of(t.dtype()),
                shape: t.shape().to_vec(),
            };
            let reference = encode(&header, t.to_vec().unwrap());
            let got = sent.received();
            assert_eq!(got.bytes(), reference.bytes(), "{what}");
            let (h, v) = decode_frame(got).unwrap();
            assert_eq!(h, header);
            let back = tensor_of(&h, v).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_vec().unwrap().iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&back), bits(&t), "{what}");
        }
    }

    #[test]
    fn f16_halves_the_bytes_and_rounds_to_nearest() {
        let values = [1.0f32, 0.1, -65504.0];
        let h = header(WireDtype::F16, vec![3]);
        let frame = encode(&h, values.to_vec());
        // 6 payload bytes, 2 of padding to the next word, then the header.
        assert_eq!(frame.bytes().len(), 8 + FIXED + 8 + TAIL);
        let (_, v) = decode_frame(frame).unwrap();
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
            let frame = encode_tensor(MsgKind::Activation, 1, link, 0, true, &t)
                .unwrap()
                .received();
            assert_eq!(
                frame.bytes().len(),
                6 * dtype.size_of() + FIXED + 16 + TAIL,
                "{dtype:?}"
            );
            let (h, v) = decode_frame(frame).unwrap();
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
        let frame = encode(&h, vec![1.0, 2.0, 3.0, 4.0]);
        let bytes = frame.bytes().to_vec();
        let end = bytes.len();
        let header_at = end - (FIXED + 8 + TAIL);
        assert!(matches!(
            decode(&bytes[end - 10..]),
            Err(WireError::Truncated { got: 10, .. })
        ));
        // The payload cut short: the header (at the end) says 16 bytes.
        assert!(matches!(
            decode(&bytes[4..]),
            Err(WireError::Truncated { .. })
        ));
        // A header whose shape disagrees with its payload.
        let mut bad = bytes.clone();
        bad[header_at + FIXED] = 5;
        assert!(matches!(
            decode(&bad),
            Err(WireError::Length {
                want: 20,
                got: 16,
                ..
            })
        ));
        let mut bad = bytes.clone();
        bad[end - 1] = b'x';
        assert!(matches!(decode(&bad), Err(WireError::BadMagic(_))));
        let mut bad = bytes;
        bad[header_at] = 9;
        let e = decode(&bad).unwrap_err();
        assert_eq!(e.to_string(), "unknown kind code 9 in a message header");
    }

    /// A frame received without zeroing holds what was written, and zeros past an odd length
    /// (bytes of its last word that nobody wrote).
    #[test]
    fn a_received_frame_holds_what_was_written_and_zeros_past_an_odd_length() {
        let fill = |src: &[u8]| {
            let src = src.to_vec();
            // SAFETY: the closure writes all `src.len()` bytes.
            unsafe {
                Frame::received(src.len(), |at| {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), at, src.len())
                })
            }
        };
        let sent = encode_abort(3, "rank 2 failed");
        let got = fill(sent.bytes());
        assert_eq!(got.bytes(), sent.bytes());
        assert_eq!(text_of(got.bytes()), "rank 2 failed");
        let odd = fill(&[1, 2, 3, 4, 5]);
        assert_eq!(odd.bytes(), &[1, 2, 3, 4, 5]);
        let words: &[u8] = bytemuck::cast_slice(&odd.words);
        assert_eq!(&words[5..8], &[0, 0, 0]);
    }

    #[test]
    fn abort_carries_its_text_and_step() {
        let frame = encode_abort(5, "rank 1: stage 2 failed");
        let (h, _) = decode(frame.bytes()).unwrap();
        assert_eq!((h.kind, h.step), (MsgKind::Abort, 5));
        assert_eq!(text_of(frame.bytes()), "rank 1: stage 2 failed");
        let record = [1u8, 2, 3, 4, 5];
        let frame = encode_bytes(MsgKind::Status, 6, &record);
        assert_eq!(payload_of_message(frame.bytes()), &record);
    }
}
