//! A rank's outcome of a step (or of its own part of one) as the binary record every other
//! rank reads: its records, loss, non-finite finding and memory counters, or where and why it
//! failed.

use wgpipe_tensor::memory::MemoryStats;

use crate::exec::comm::record::{Reader, Writer};
use crate::exec::worker::NonFiniteAt;

/// A rank's outcome of a step (or of its own part of one), as every rank reads it.
#[derive(Clone, Default)]
pub(super) struct Status {
    pub(super) ok: bool,
    /// Its failure was its own, not a stop because another rank failed.
    pub(super) root: bool,
    pub(super) loss: Option<f32>,
    pub(super) weight: f32,
    /// Its device's actions: start, end, flops, bytes.
    pub(super) records: Vec<(f64, f64, f64, u64)>,
    pub(super) skipped: Option<NonFiniteAt>,
    pub(super) messages: u64,
    pub(super) memory: MemoryStats,
    /// Where and why it failed.
    pub(super) stage: usize,
    pub(super) device: String,
    pub(super) micro_batch: usize,
    pub(super) action: String,
    pub(super) cause: String,
}

impl Status {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(self.ok as u8)
            .u8(self.root as u8)
            .u8(self.loss.is_some() as u8)
            .f64(self.loss.unwrap_or(0.0) as f64)
            .f64(self.weight as f64)
            .u64(self.records.len() as u64);
        for &(start, end, flops, bytes) in &self.records {
            w.f64(start).f64(end).f64(flops).u64(bytes);
        }
        match &self.skipped {
            Some(at) => w
                .u8(1)
                .u64(at.stage as u64)
                .u64(at.micro_batch as u64)
                .str(&at.what),
            None => w.u8(0),
        };
        let m = &self.memory;
        w.u64(self.messages)
            .u64(m.live as u64)
            .u64(m.peak as u64)
            .u8(m.capacity.is_some() as u8)
            .u64(m.capacity.unwrap_or(0) as u64)
            .usizes(&m.live_by_tag)
            .usizes(&m.peak_by_tag)
            .usizes(&m.live_by_dtype)
            .usizes(&m.peak_by_dtype)
            .u64(self.stage as u64)
            .str(&self.device)
            .u64(self.micro_batch as u64)
            .str(&self.action)
            .str(&self.cause);
        w.0
    }

    pub(super) fn decode(bytes: &[u8]) -> std::result::Result<Status, String> {
        fn fixed<const N: usize>(v: Vec<usize>) -> [usize; N] {
            let mut t = [0; N];
            for (a, b) in t.iter_mut().zip(v) {
                *a = b;
            }
            t
        }
        let mut r = Reader::new(bytes);
        let ok = r.u8("outcome")? != 0;
        let root = r.u8("root")? != 0;
        let has_loss = r.u8("loss")? != 0;
        let loss = r.f64("loss")? as f32;
        let weight = r.f64("weight")? as f32;
        let n = r.u64("records")? as usize;
        let mut records = Vec::with_capacity(n.min(1 << 20));
        for _ in 0..n {
            records.push((
                r.f64("record")?,
                r.f64("record")?,
                r.f64("record")?,
                r.u64("record")?,
            ));
        }
        let skipped = if r.u8("skip")? != 0 {
            Some(NonFiniteAt {
                stage: r.u64("skip")? as usize,
                micro_batch: r.u64("skip")? as usize,
                what: r.str("skip")?,
            })
        } else {
            None
        };
        let messages = r.u64("messages")?;
        let live = r.u64("memory")? as usize;
        let peak = r.u64("memory")? as usize;
        let has_capacity = r.u8("memory")? != 0;
        let capacity = r.u64("memory")? as usize;
        let memory = MemoryStats {
            live,
            peak,
            capacity: has_capacity.then_some(capacity),
            live_by_tag: fixed(r.usizes("memory")?),
            peak_by_tag: fixed(r.usizes("memory")?),
            live_by_dtype: fixed(r.usizes("memory")?),
            peak_by_dtype: fixed(r.usizes("memory")?),
        };
        Ok(Status {
            ok,
            root,
            loss: has_loss.then_some(loss),
            weight,
            records,
            skipped,
            messages,
            memory,
            stage: r.u64("failure")? as usize,
            device: r.str("failure")?,
            micro_batch: r.u64("failure")? as usize,
            action: r.str("failure")?,
            cause: r.str("failure")?,
        })
    }
}
