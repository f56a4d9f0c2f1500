//! Memory accounting per device: live and peak bytes, by tag, with an optional capacity.
//!
//! Every storage allocation takes an [`Allocation`] token from its device's tracker and gives the
//! bytes back when dropped. The tag of an allocation comes from the calling thread's current tag
//! (see [`TagGuard`]), so a pipeline stage can label what it allocates without threading a tag
//! through every op.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// What an allocation is for; the pipeline reports peak memory split by these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tag {
    Parameters,
    Gradients,
    OptimizerState,
    Activations,
    Other,
}

impl Tag {
    pub const ALL: [Tag; 5] = [
        Tag::Parameters,
        Tag::Gradients,
        Tag::OptimizerState,
        Tag::Activations,
        Tag::Other,
    ];
    fn index(self) -> usize {
        self as usize
    }
}

thread_local! {
    static CURRENT_TAG: Cell<Tag> = const { Cell::new(Tag::Other) };
}

/// The tag new allocations on this thread get.
pub fn current_tag() -> Tag {
    CURRENT_TAG.with(|t| t.get())
}

/// Sets this thread's allocation tag until dropped (then restores the previous one).
pub struct TagGuard {
    previous: Tag,
}

impl TagGuard {
    pub fn new(tag: Tag) -> Self {
        let previous = CURRENT_TAG.with(|t| t.replace(tag));
        TagGuard { previous }
    }
}

impl Drop for TagGuard {
    fn drop(&mut self) {
        CURRENT_TAG.with(|t| t.set(self.previous));
    }
}

/// Runs `f` with allocations tagged `tag`.
pub fn with_tag<R>(tag: Tag, f: impl FnOnce() -> R) -> R {
    let _g = TagGuard::new(tag);
    f()
}

/// A snapshot of a device's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub live: usize,
    pub peak: usize,
    pub capacity: Option<usize>,
    /// Live bytes per tag, in the order of [`Tag::ALL`].
    pub live_by_tag: [usize; 5],
    /// Peak bytes per tag (each tag's own high-water mark since the last reset).
    pub peak_by_tag: [usize; 5],
    /// Live bytes per element dtype, in the order of [`DType::ALL`] (f32, f16, bf16).
    pub live_by_dtype: [usize; 3],
    /// Peak bytes per dtype (each dtype's own high-water mark since the last reset).
    pub peak_by_dtype: [usize; 3],
}

impl MemoryStats {
    pub fn live_of(&self, tag: Tag) -> usize {
        self.live_by_tag[tag.index()]
    }
    pub fn peak_of(&self, tag: Tag) -> usize {
        self.peak_by_tag[tag.index()]
    }
    pub fn live_of_dtype(&self, dtype: DType) -> usize {
        self.live_by_dtype[dtype_index(dtype)]
    }
    pub fn peak_of_dtype(&self, dtype: DType) -> usize {
        self.peak_by_dtype[dtype_index(dtype)]
    }
}

/// The dtype's slot in the by-dtype counters: its place in [`DType::ALL`], which lists the
/// variants in declaration order.
fn dtype_index(dtype: DType) -> usize {
    dtype as usize
}

#[derive(Default)]
struct Counters {
    live: usize,
    peak: usize,
    live_by_tag: [usize; 5],
    peak_by_tag: [usize; 5],
    live_by_dtype: [usize; 3],
    peak_by_dtype: [usize; 3],
}

/// Live/peak accounting of one device. Cheap to clone (shared).
#[derive(Clone)]
pub struct MemoryTracker {
    inner: Arc<TrackerInner>,
}

struct TrackerInner {
    device_name: String,
    capacity: AtomicUsize, // usize::MAX = unlimited
    counters: Mutex<Counters>,
}

impl MemoryTracker {
    pub fn new(device_name: &str) -> Self {
        MemoryTracker {
            inner: Arc::new(TrackerInner {
                device_name: device_name.to_string(),
                capacity: AtomicUsize::new(usize::MAX),
                counters: Mutex::new(Counters::default()),
            }),
        }
    }

    /// Caps the device's memory; `None` removes the cap. Existing allocations are kept.
    pub fn set_capacity(&self, bytes: Option<usize>) {
        self.inner
            .capacity
            .store(bytes.unwrap_or(usize::MAX), Ordering::SeqCst);
    }

    pub fn capacity(&self) -> Option<usize> {
        match self.inner.capacity.load(Ordering::SeqCst) {
            usize::MAX => None,
            c => Some(c),
        }
    }

    /// Reserves `bytes` of f32 values under the thread's current tag, or fails with
    /// `OutOfMemory`.
    pub fn alloc(&self, bytes: usize) -> Result<Allocation> {
        self.alloc_as(bytes, current_tag(), DType::F32)
    }

    pub fn alloc_tagged(&self, bytes: usize, tag: Tag) -> Result<Allocation> {
        self.alloc_as(bytes, tag, DType::F32)
    }

    /// Reserves `bytes` holding values of `dtype` under `tag` (counted by both).
    pub fn alloc_as(&self, bytes: usize, tag: Tag, dtype: DType) -> Result<Allocation> {
        let cap = self.inner.capacity.load(Ordering::SeqCst);
        let mut c = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if c.live.saturating_add(bytes) > cap {
            return Err(Error::OutOfMemory {
                device: self.inner.device_name.clone(),
                requested: bytes,
                live: c.live,
                capacity: cap,
            });
        }
        c.live += bytes;
        c.peak = c.peak.max(c.live);
        let t = tag.index();
        c.live_by_tag[t] += bytes;
        c.peak_by_tag[t] = c.peak_by_tag[t].max(c.live_by_tag[t]);
        let d = dtype_index(dtype);
        c.live_by_dtype[d] += bytes;
        c.peak_by_dtype[d] = c.peak_by_dtype[d].max(c.live_by_dtype[d]);
        crate::work::count_bytes(bytes as i64);
        Ok(Allocation {
            tracker: self.clone(),
            bytes,
            tag,
            dtype,
        })
    }

    fn free(&self, bytes: usize, tag: Tag, dtype: DType) {
        let mut c = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        c.live -= bytes;
        c.live_by_tag[tag.index()] -= bytes;
        c.live_by_dtype[dtype_index(dtype)] -= bytes;
        crate::work::count_bytes(-(bytes as i64));
    }

    pub fn stats(&self) -> MemoryStats {
        let c = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        MemoryStats {
            live: c.live,
            peak: c.peak,
            capacity: self.capacity(),
            live_by_tag: c.live_by_tag,
            peak_by_tag: c.peak_by_tag,
            live_by_dtype: c.live_by_dtype,
            peak_by_dtype: c.peak_by_dtype,
        }
    }

    /// Resets the peaks to the current live values.
    pub fn reset_peak(&self) {
        let mut c = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        c.peak = c.live;
        c.peak_by_tag = c.live_by_tag;
        c.peak_by_dtype = c.live_by_dtype;
    }
}

/// Bytes held on a device; released on drop.
pub struct Allocation {
    tracker: MemoryTracker,
    bytes: usize,
    tag: Tag,
    dtype: DType,
}

impl Allocation {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn tag(&self) -> Tag {
        self.tag
    }
    /// Moves the bytes to another tag (e.g. a freshly computed tensor becomes a parameter).
    pub fn retag(&mut self, tag: Tag) {
        if tag == self.tag {
            return;
        }
        let mut c = self
            .tracker
            .inner
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        c.live_by_tag[self.tag.index()] -= self.bytes;
        c.live_by_tag[tag.index()] += self.bytes;
        c.peak_by_tag[tag.index()] = c.peak_by_tag[tag.index()].max(c.live_by_tag[tag.index()]);
        self.tag = tag;
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.tracker.free(self.bytes, self.tag, self.dtype);
    }
}

/// The device the tracker accounts for, by name (what errors say).
impl std::fmt::Display for MemoryTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.inner.device_name)
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Allocation({} bytes, {:?}, {})",
            self.bytes, self.tag, self.dtype
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_and_peak_follow_allocations() {
        let m = MemoryTracker::new("t");
        let a = m.alloc(100).unwrap();
        let b = with_tag(Tag::Activations, || m.alloc(50).unwrap());
        assert_eq!(m.stats().live, 150);
        assert_eq!(m.stats().live_of(Tag::Activations), 50);
        drop(a);
        assert_eq!(m.stats().live, 50);
        assert_eq!(m.stats().peak, 150);
        m.reset_peak();
        assert_eq!(m.stats().peak, 50);
        drop(b);
        assert_eq!(m.stats().live, 0);
        assert_eq!(m.stats().peak_of(Tag::Activations), 50);
    }

    #[test]
    fn dtype_slots_follow_dtype_all() {
        for (i, d) in DType::ALL.into_iter().enumerate() {
            assert_eq!(dtype_index(d), i, "{d}");
        }
    }

    #[test]
    fn bytes_are_counted_by_dtype_too() {
        let m = MemoryTracker::new("t");
        let a = m.alloc(400).unwrap();
        let h = m.alloc_as(200, Tag::Activations, DType::F16).unwrap();
        let b = m.alloc_as(60, Tag::Activations, DType::BF16).unwrap();
        let s = m.stats();
        assert_eq!(s.live_by_dtype, [400, 200, 60]);
        assert_eq!(s.live_of(Tag::Activations), 260);
        drop(h);
        let s = m.stats();
        assert_eq!(s.live_of_dtype(DType::F16), 0);
        assert_eq!(s.peak_of_dtype(DType::F16), 200);
        m.reset_peak();
        assert_eq!(m.stats().peak_by_dtype, [400, 0, 60]);
        drop((a, b));
        assert_eq!(m.stats().live_by_dtype, [0, 0, 0]);
    }

    #[test]
    fn capacity_refuses_then_recovers() {
        let m = MemoryTracker::new("sim0");
        m.set_capacity(Some(1000));
        let a = m.alloc(800).unwrap();
        let e = m.alloc(400).unwrap_err();
        assert_eq!(
            e,
            Error::OutOfMemory {
                device: "sim0".into(),
                requested: 400,
                live: 800,
                capacity: 1000
            }
        );
        assert!(e.to_string().contains("sim0") && e.to_string().contains("400"));
        drop(a);
        assert!(m.alloc(400).is_ok());
    }
}
